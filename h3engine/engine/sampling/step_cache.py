"""Step caching (DBCache) for full-step runs: a forward whose early blocks barely changed skips the middle blocks.

`StepCache(preset, groups)` runs one request's DiT blocks (`H3DiT.forward`'s `blocks_runner`):
the first `first_blocks` blocks always run; the relative L1 difference of their residual (output - input) against
the one saved at the last fully computed forward decides, separately over the video rows and the audio rows, whether
the middle blocks run or are replaced by their residual saved at that forward; the last `last_blocks` blocks always
run. A forward may skip only past `warmup_steps`, below `max_consecutive` skips in a row, and when BOTH modalities
moved less than `threshold` (audio is a small share of the rows and must not be outvoted by the video's). The sums
are all-reduced over the worker group (`ReduceGroups`), so every rank takes the same decision. `StepDecisions` is
the rule alone (its decisions equal cache-dit 1.5.3's DBCache on the same residuals: tests/test_step_cache.py).
TaylorSeer (extrapolating the cached residual) is not implemented: a skip reuses the residual as it was saved.

Danger: "off" never builds a `StepCache` (the pipeline's call is then the one it always was). A skip visits no
middle block, so a streamed DiT's ring restarts at the next block it runs (h3engine.memory.streaming, counted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from h3engine.models.dit_layers import BlockModulation, DiTBlock, PackedLayout, run_blocks
from h3engine.models.parallel.collectives import all_reduce_max, all_reduce_sum
from h3engine.models.parallel.groups import GroupMembership


@dataclass(frozen=True)
class CachePreset:
    """DBCache's knobs, in cache-dit's terms: Fn = first_blocks, Bn = last_blocks, residual_diff_threshold,
    max_warmup_steps, max_continuous_cached_steps (-1: no limit)."""

    name: str
    first_blocks: int
    last_blocks: int
    threshold: float
    warmup_steps: int
    max_consecutive: int


# The request's `cache` values (h3engine.request.model.CACHE_PRESETS, which must name the same ones) -> their knobs.
PRESETS: dict[str, CachePreset] = {
    # The peers' conservative MiniMax-H3 setting, identical in both: SGLang's
    # MINIMAX_H3_HIGH_QUALITY_CACHE_DIT_CONFIG = (4, 0.04, 1) (warm-up steps, threshold, max consecutive cached
    # steps; python/sglang/multimodal_gen/.../minimax_h3/constants.py, SGLang PR #33453; Fn 1, Bn 0 are its
    # defaults, sglang issue #33828; "SSIM 0.931 / PSNR 28.16 dB against quality=lossless" on 4x H200 T2VA) and
    # vLLM-Omni's quality="high" profile (one front compute block, 4 warm-up steps, threshold 0.04, at most one
    # consecutive cached step; vllm-project/vllm-omni PR #5853).
    "high": CachePreset(
        "high", first_blocks=1, last_blocks=0, threshold=0.04, warmup_steps=4, max_consecutive=1
    ),
    # More aggressive: the 8x B300 schedule (4, 0.08, 3) audited in sgl-project/sglang PR #34841 (closed when we
    # read it); on 1x B200 T2VA 768p the same knobs skipped 29 of 49 forwards, 2.23x, SSIM 0.865 / PSNR 26.6 dB
    # (sglang issue #33828).
    "fast": CachePreset(
        "fast", first_blocks=1, last_blocks=0, threshold=0.08, warmup_steps=4, max_consecutive=3
    ),
}


def cache_preset(name: str | CachePreset) -> CachePreset | None:
    """The preset a request's `cache` names; None for "off" (no caching: the plain forward). A `CachePreset` is
    itself (a benchmark's sweep puts one in a prepared request)."""
    if isinstance(name, CachePreset):
        return name
    if name == "off":
        return None
    if name not in PRESETS:
        raise ValueError(f"unknown step-cache preset {name!r} (known: off, {', '.join(PRESETS)})")
    return PRESETS[name]


@dataclass
class StepDecisions:
    """The skip rule alone, one call of `decide` per forward (no tensors). `differences` are the relative L1
    differences of each row group (video, audio) against the reference, or None where none was computed."""

    preset: CachePreset
    step: int = -1
    consecutive: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    differences: list[tuple[float, ...] | None] = field(default_factory=list)

    def eligible(self) -> bool:
        """Start the next forward; whether it may skip at all (past warm-up, under the consecutive limit). The
        differences need computing only when it may (every rank agrees: the counters are the same everywhere)."""
        self.step += 1
        if self.step < self.preset.warmup_steps:
            return False
        return self.preset.max_consecutive < 0 or self.consecutive < self.preset.max_consecutive

    def decide(self, differences: Sequence[float] | None) -> bool:
        """Whether this forward skips: `differences` given (an eligible forward with a reference) and every one of
        them below the threshold (a NaN or infinite one never is)."""
        self.differences.append(None if differences is None else tuple(differences))
        skip = (
            differences is not None
            and len(differences) > 0
            and all(math.isfinite(value) and value < self.preset.threshold for value in differences)
        )
        if skip:
            self.consecutive += 1
            self.skipped_steps.append(self.step)
        else:
            self.consecutive = 0
        return skip

    @property
    def forwards(self) -> int:
        return self.step + 1

    @property
    def skipped(self) -> int:
        return len(self.skipped_steps)

    @property
    def computed(self) -> int:
        return self.forwards - self.skipped


@dataclass(frozen=True)
class ReduceGroups:
    """Where the decision's sums go: summed over the Ulysses group (each rank holds a block of the rows), then the
    maximum over the tensor-parallel group (whose ranks hold the same rows: the maximum of equal values is that
    value, and makes them agree even if they did not). Groups of one do nothing."""

    sequence: GroupMembership = field(default_factory=GroupMembership.alone)
    tensor: GroupMembership = field(default_factory=GroupMembership.alone)


def relative_differences(
    reference: Tensor, current: Tensor, row_groups: Sequence[Tensor], groups: ReduceGroups
) -> tuple[float, ...]:
    """sum |reference - current| / sum |reference| over each row group's rows (all columns), the sums taken in fp32
    per row and all-reduced over `groups`; a group without rows anywhere is left out."""
    # Per-row L1 norms accumulated in fp32 by the reduction itself (no |x| copy); one [S, H] temporary, the difference.
    row_change = torch.linalg.vector_norm(reference - current, ord=1, dim=1, dtype=torch.float32)
    row_size = torch.linalg.vector_norm(reference, ord=1, dim=1, dtype=torch.float32)
    sums = []
    for rows in row_groups:
        count = torch.tensor(float(rows.numel()), device=row_change.device)
        sums += [row_change.index_select(0, rows).sum(), row_size.index_select(0, rows).sum(), count]
    reduced = all_reduce_max(all_reduce_sum(torch.stack(sums), groups.sequence), groups.tensor).tolist()
    differences = []
    for change, size, count in zip(reduced[0::3], reduced[1::3], reduced[2::3], strict=True):
        if count > 0:
            differences.append(change / size if size > 0 else math.inf)
    return tuple(differences)


class StepCache:
    """One request's DBCache over the DiT blocks; pass `run` as `blocks_runner` to every forward of the request.

    `groups`: where the sums are reduced. `use_rows(video_rows, audio_rows)` names this rank's local rows of each
    modality in the hidden sequence the blocks see (h3engine.models.parallel.dit.modality_rows) before the first forward.
    """

    def __init__(self, preset: CachePreset, groups: ReduceGroups | None = None) -> None:
        if preset.first_blocks < 1 or preset.last_blocks < 0:
            raise ValueError(
                f"a step cache runs at least one first block and no negative last ones: {preset}"
            )
        self.preset = preset
        self.decisions = StepDecisions(preset)
        self.row_groups: tuple[Tensor, ...] = ()
        self.groups = groups or ReduceGroups()
        self._reference: Tensor | None = None  # the first blocks' residual at the last computed forward
        self._middle: Tensor | None = None  # the middle blocks' residual at that forward

    def use_rows(self, video_rows: Tensor, audio_rows: Tensor) -> None:
        """The local rows of each modality that the differences are taken over (separately)."""
        self.row_groups = (video_rows, audio_rows)

    def run(
        self,
        blocks: Sequence[DiTBlock],
        modulations: Sequence[BlockModulation],
        hidden: Tensor,
        layout: PackedLayout,
    ) -> Tensor:
        """`run_blocks` with the middle blocks skipped when the rule says so (a forward's whole block chain)."""
        count = len(blocks)
        first = min(self.preset.first_blocks, count)
        last = min(self.preset.last_blocks, count - first)
        middle_stop = count - last
        head = run_blocks(blocks[:first], modulations[:first], hidden, layout)
        residual = head - hidden
        differences = None
        if self.decisions.eligible() and self._reference is not None and middle_stop > first:
            differences = relative_differences(self._reference, residual, self.row_groups, self.groups)
        if self.decisions.decide(differences):
            middle = head + self._middle
        else:
            self._reference = residual
            middle = run_blocks(blocks[first:middle_stop], modulations[first:middle_stop], head, layout)
            self._middle = middle - head
        return run_blocks(blocks[middle_stop:], modulations[middle_stop:], middle, layout)

    def record(self) -> dict[str, object]:
        """What the sidecar says about it: the preset and how many forwards were computed and skipped."""
        return step_cache_record(self.preset.name, self.decisions.computed, self.decisions.skipped)


def step_cache_record(preset: str, computed: int, skipped: int) -> dict[str, object]:
    """The sidecar's `step_cache` entry."""
    return {"preset": preset, "forwards": computed + skipped, "computed": computed, "skipped": skipped}
