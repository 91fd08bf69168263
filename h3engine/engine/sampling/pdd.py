"""A PDD adapter's interval heads at sampling time: the heads a step spans, their blend, and the forward hooks that
put each step's blend in place of the DiT's final video / audio heads (the weights are never written).

The N heads (h3engine.checkpoint.pdd_format) belong to the N intervals of each modality's shifted grid: interval l
runs from sigma_l = shift(1 - l/N) to sigma_{l+1}, shifts 12 video / 3 audio. A step from sigma_i to sigma_{i+1}
spans the intervals [start, stop) between its two grid points and uses sum_l w_l * head_l with w_l = h_l / sum h,
h_l = sigma_l - sigma_{l+1} on that modality's grid: the mean velocity over the step, which the Euler update takes
(aigc-apps/VideoX-Fun `minimax_h3_pdd.py`, `pdd_sampling_plan`, fused as its einsum). An unarmed forward raises.
`check_pdd_request` holds a request to the trained recipe: one PDD adapter at strength 1, shifts 12 / 3, Euler steps
on the grid in blocks of L or 2L intervals (8 or 4 forwards for 32 / 4), no rungs, no step cache.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from h3engine.checkpoint.lora_format import LoraFile
from h3engine.checkpoint.pdd_format import HEAD_PREFIXES, PddAdapterFile, PddHeads
from h3engine.engine.sampling.schedule import Schedule
from h3engine.request.checks import fail
from h3engine.request.model import GenerationRequest

# The shifts the published heads were trained on (the release's schedule: VideoX-Fun builds its grids from them).
PDD_VIDEO_SHIFT = 12.0
PDD_AUDIO_SHIFT = 3.0
# How far (in intervals) a schedule's fp32 sigma may sit from a grid point and still be it.
GRID_TOLERANCE = 1e-3


def grid_sigmas(shift: float, num_intervals: int) -> Tensor:
    """The N + 1 grid points, fp64, from 1 down to 0: shift * b / (1 + (shift - 1) * b) over linspace(1, 0)."""
    base = torch.linspace(1.0, 0.0, num_intervals + 1, dtype=torch.float64)
    return shift * base / (1 + (shift - 1) * base)


def step_spans(sigmas: Tensor, shift: float, num_intervals: int) -> tuple[tuple[int, int], ...]:
    """For each step of a descending sigma grid (one modality's), the intervals [start, stop) of the N-interval grid
    at `shift` that it spans; ValueError naming the first sigma that is no grid point."""
    points = []
    for sigma in sigmas.to(torch.float64).tolist():
        base = sigma / (shift - (shift - 1) * sigma)  # the shift undone: the grid is uniform in this
        position = (1.0 - base) * num_intervals
        index = round(position)
        if abs(position - index) > GRID_TOLERANCE:
            raise ValueError(
                f"sigma {sigma:.6f} is no point of the {num_intervals}-interval grid at shift {shift:g} "
                f"(it sits at interval {position:.3f})"
            )
        points.append(index)
    spans = tuple(zip(points[:-1], points[1:], strict=True))
    if not spans or any(stop <= start for start, stop in spans):
        raise ValueError(f"the steps {spans} do not go down the grid")
    return spans


def interval_weights(shift: float, num_intervals: int, start: int, stop: int) -> Tensor:
    """The blend weights [N] (fp64) of a step spanning [start, stop): each interval's sigma length over the span's."""
    lengths = -grid_sigmas(shift, num_intervals).diff()
    weights = torch.zeros(num_intervals, dtype=torch.float64)
    weights[start:stop] = lengths[start:stop] / lengths[start:stop].sum()
    return weights


def blend_heads(weights: Tensor, weight_bank: Tensor, bias_bank: Tensor) -> tuple[Tensor, Tensor]:
    """One head (weight [out, in], bias [out]) from a bank [N, out, in] / [N, out]: the weights as fp32, summed in
    the bank's fp32 (the reference's einsum)."""
    weights = weights.to(weight_bank.device, torch.float32)
    return torch.einsum("n,noi->oi", weights, weight_bank), torch.einsum("n,no->o", weights, bias_bank)


def schedule_spans(heads: PddHeads, schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """The intervals each step of `schedule` spans, the same on the video and audio grids, each a block of L or 2L
    intervals starting on the block grid (what the heads were trained on); ValueError otherwise."""
    n, block = heads.num_intervals, heads.block_size
    spans = step_spans(schedule.video_sigmas, PDD_VIDEO_SHIFT, n)
    if step_spans(schedule.audio_sigmas, PDD_AUDIO_SHIFT, n) != spans:
        raise ValueError("the video and audio steps span different intervals")
    if spans[0][0] != 0 or spans[-1][1] != n:
        raise ValueError(f"the steps run from interval {spans[0][0]} to {spans[-1][1]}, not over all {n}")
    for start, stop in spans:
        if start % block or stop - start not in (block, 2 * block):
            raise ValueError(
                f"a step spans the intervals [{start}, {stop}); the heads were trained on blocks of {block} or "
                f"{2 * block} starting every {block}"
            )
    return spans


def allowed_steps(heads: PddHeads, recipe: str) -> tuple[int, ...]:
    """The step counts (`num_inference_steps` under `recipe`) whose uniform grid the heads run: N / L forwards, and
    N / 2L when whole (the diffusers recipe counts the terminal grid point too)."""
    sizes = [size for size in (heads.block_size, 2 * heads.block_size) if heads.num_intervals % size == 0]
    return tuple(heads.num_intervals // size + (recipe == "diffusers") for size in sizes)


# --------------------------------------------------------------------------------------------------------------
# The hooks on the DiT's heads
# --------------------------------------------------------------------------------------------------------------


@dataclass
class InstalledHeads:
    """A DiT's installed interval heads: the banks (host fp32), their device and hooks, and the step's blend now
    armed (module -> weight, bias; None: no step armed)."""

    heads: PddHeads
    device: torch.device
    handles: list[RemovableHandle] = field(default_factory=list)
    armed: dict[str, tuple[Tensor, Tensor]] | None = None


_installed: weakref.WeakKeyDictionary[nn.Module, InstalledHeads] = weakref.WeakKeyDictionary()


def install_heads(dit: nn.Module, heads: PddHeads, device: torch.device) -> None:
    """Hook `heads` onto the DiT's final video / audio heads (replacing any installed before)."""
    remove_heads(dit)
    installed = InstalledHeads(heads, device)
    for module in heads.banks:
        linear = dit.get_submodule(module)
        installed.handles.append(linear.register_forward_hook(partial(_blended_output, installed, module)))
    _installed[dit] = installed


def remove_heads(dit: nn.Module) -> None:
    """Drop the DiT's interval heads: its own heads compute again."""
    installed = _installed.pop(dit, None)
    for handle in installed.handles if installed is not None else []:
        handle.remove()


def installed_heads(dit: nn.Module) -> InstalledHeads | None:
    return _installed.get(dit)


def _blended_output(
    installed: InstalledHeads, module: str, linear: nn.Module, args: tuple[Tensor, ...], output: Tensor
) -> Tensor:
    if installed.armed is None:
        raise RuntimeError(
            f"{module} carries a PDD adapter's interval heads but no step armed them (a forward outside the "
            "denoising loop of h3engine.engine.sampling.denoise_steps)"
        )
    weight, bias = installed.armed[module]
    return F.linear(args[0], weight, bias)


class StepHeads:
    """The blended heads of every step of one request's schedule, on the device; `armed(step)` puts a step's in
    place for the length of a `with` block. Made for a DiT without interval heads, it arms nothing."""

    def __init__(self, dit: nn.Module, schedule: Schedule) -> None:
        self.installed = installed_heads(dit)
        self.blends: list[dict[str, tuple[Tensor, Tensor]]] = []
        if self.installed is None:
            return
        heads, device = self.installed.heads, self.installed.device
        shifts = {"final_layer.video_out": PDD_VIDEO_SHIFT, "final_layer.audio_out": PDD_AUDIO_SHIFT}
        for start, stop in schedule_spans(heads, schedule):
            blend = {}
            for module, (weight_bank, bias_bank) in heads.banks.items():
                weights = interval_weights(shifts[module], heads.num_intervals, start, stop)
                weight, bias = blend_heads(weights, weight_bank, bias_bank)
                blend[module] = (weight.to(device), bias.to(device))
            self.blends.append(blend)

    @contextlib.contextmanager
    def armed(self, step: int) -> Iterator[None]:
        if self.installed is None:
            yield
            return
        self.installed.armed = self.blends[step]
        try:
            yield
        finally:
            self.installed.armed = None


# --------------------------------------------------------------------------------------------------------------
# The request's recipe
# --------------------------------------------------------------------------------------------------------------


def check_pdd_request(
    request: GenerationRequest,
    steps: int,
    rungs: Sequence[int] | None,
    adapters: Sequence[tuple[LoraFile, float]],
) -> None:
    """RequestError naming the field unless a request with a PDD adapter among `adapters` (its `loras` as read, with
    their strengths) runs the trained recipe (see the module docstring); nothing for one without."""
    found = [(index, lora) for index, (lora, _) in enumerate(adapters) if isinstance(lora, PddAdapterFile)]
    if not found:
        return
    index, lora = found[0]
    assert lora.heads is not None
    if len(found) > 1:
        fail(f"loras[{found[1][0]}]", f"{found[1][1].name!r} is a second PDD adapter beside {lora.name!r}")
    if adapters[index][1] != 1:
        fail(
            f"loras[{index}].strength",
            f"{lora.name!r} is a PDD adapter: its interval heads replace the DiT's output heads, so it runs at "
            f"strength 1 only, got {adapters[index][1]:g}",
        )
    for other, (file, _) in enumerate(adapters):
        touched = sorted(set(HEAD_PREFIXES) & {m for layers in file.partitions.values() for m in layers})
        if other != index and touched:
            fail(
                f"loras[{other}]", f"{file.name!r} updates {touched[0]}, which {lora.name!r}'s heads replace"
            )
    if rungs:
        fail("rungs", f"{lora.name!r} is a PDD adapter: it runs Euler steps on its grid, not rungs")
    if request.cache != "off":
        fail(
            "cache",
            f"'{request.cache}' reuses forwards; {lora.name!r} (PDD) needs every one: use cache 'off'",
        )
    for name, value, trained in (
        ("flow_shift", request.flow_shift, PDD_VIDEO_SHIFT),
        ("audio_flow_shift", request.audio_flow_shift, PDD_AUDIO_SHIFT),
    ):
        if value != trained:
            fail(name, f"{lora.name!r} is a PDD adapter trained at flow shifts 12 / 3, got {value:g}")
    try:
        schedule_spans(lora.heads, Schedule.build(steps, recipe=request.recipe))
    except ValueError as error:
        counts = " or ".join(map(str, allowed_steps(lora.heads, request.recipe)))
        fail(
            "steps",
            f"{lora.name!r} is a PDD adapter: use {counts} steps with the {request.recipe} recipe ({error})",
        )
