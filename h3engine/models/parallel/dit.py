"""The H3 DiT split over a DiT group: tensor parallel (heads, FFN) x Ulysses sequence parallel (packed rows).

`load_dit_shard(weight_files, config, groups, dtype, device)` builds this rank's DiT and reads only its shard of
the checkpoint in either layout (a diffusers one is read as native: h3engine.checkpoint.dit_format);
`parallelize_dit` builds the same module on `meta`, without weights. The module is called exactly like `H3DiT`
(the full packed request on every rank) and returns the full fp32 velocities on every rank, so the sampling loop
runs unchanged and replicated.

Tensor parallelism (`groups.tp`) swaps parallel layers into every attention and FFN, the token refiner's included
(QKV split by heads, fc1's [gate; value] halves split alike, out_proj and fc2 summed over the group); the rest
stays replicated and the model code is untouched. Sequence parallelism: `SequenceParallelDiT`.

Danger: every rank of the DiT group must call forward with identical inputs (the layers' collectives pair up by
call order). bf16 results differ from one process at the bf16 rounding level (partial sums are reduced in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from h3engine.checkpoint.dit_format import as_native_files
from h3engine.checkpoint.dit_keys import native_state_shapes
from h3engine.checkpoint.safetensors_io import DeferredReads, WeightFiles, parked, placed
from h3engine.errors import CheckpointError
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import Attention, PackedLayout, SwiGLU, attention, packed_rows
from h3engine.models.parallel.collectives import all_gather_rows, heads_to_sequence, sequence_to_heads
from h3engine.models.parallel.groups import DiTGroups, GroupMembership
from h3engine.models.parallel.linear import (
    GateValueParallelLinear,
    ParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


@dataclass(frozen=True)
class UlyssesAttention:
    """Attention over the whole packed sequence when each rank holds a contiguous block of its rows."""

    group: GroupMembership
    sequence_length: int

    def __call__(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        # One exchange for q, k and v together: [local_rows, 3, heads, head_dim] -> [S_pad, 3, heads/sp, head_dim].
        stacked = sequence_to_heads(torch.stack((query, key, value), dim=1), self.group)
        padded_length = stacked.shape[0]
        output = attention(*stacked[: self.sequence_length].unbind(dim=1))
        output = F.pad(output, (0, 0, 0, 0, 0, padded_length - self.sequence_length))
        return heads_to_sequence(output, self.group)


@dataclass(frozen=True)
class SequenceShardedLayout:
    """A packed request as one Ulysses rank sees it; built by `SequenceParallelDiT.prepare_layout`.

    `local` drives the unchanged blocks and final layer on this rank's rows (pad rows included). Its
    `video_index` / `audio_index` list every local row: the fp32 heads run on all of them so the gather is
    equal-sized, and `video_index` / `audio_index` here (the request's own) pick the wanted rows afterwards.
    `*_rows` select the request's text/video/audio rows that land on this rank, `*_slots` their local rows.
    """

    local: PackedLayout
    sequence_length: int
    video_index: Tensor
    audio_index: Tensor
    text_index: Tensor
    text_rows: Tensor
    text_slots: Tensor
    video_rows: Tensor
    video_slots: Tensor
    audio_rows: Tensor
    audio_slots: Tensor


def _rows_in_block(sequence_index: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Which entries of a modality's sequence index fall in [start, stop), and their rows inside the block."""
    rows = ((sequence_index >= start) & (sequence_index < stop)).nonzero().squeeze(1)
    return rows, sequence_index.index_select(0, rows) - start


class SequenceParallelDiT(H3DiT):
    """`H3DiT` whose forward runs on this Ulysses rank's block of packed rows.

    The S packed rows are padded to a multiple of sp and rank r holds rows [r*S_pad/sp, (r+1)*S_pad/sp). Everything
    but attention is row-wise, so blocks run on local rows with local RoPE tables and local AdaLN gathers. Around
    attention one all-to-all trades rows for heads (every rank then holds all rows of 1/sp of its heads), attention
    runs, and a second all-to-all trades back. The text refiner (attention among text rows only, a small share of
    S) runs on all text rows on every rank. The fp32 heads run on every local row and the [S_pad, video + audio
    channels] result is gathered once; the wanted rows are picked from it. Only `prepare_layout`, `embed` (which
    rows are local) and `head` (the gather) differ from `H3DiT`.

    Padding rows (at most sp - 1, at the end): after the first all-to-all every rank holds the whole padded sequence
    for its heads, so the pad rows are sliced off before attention, which is the same unmasked call over the same
    real rows as on one process (a key mask would rule out the flash kernels and leave pad queries to attend to
    something). Their attention output is zero; every other op is row-wise, so they never reach a real row (not even
    a non-finite one could). They start as zero rows with AdaLN row 0 and zero RoPE tables.
    """

    def __init__(
        self,
        config: DiTConfig,
        sequence_group: GroupMembership,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config, dtype, device)
        self.sequence_group = sequence_group

    def prepare_layout(self, *request: Tensor) -> SequenceShardedLayout:
        """`H3DiT.prepare_layout` of the whole request (same arguments), then this rank's block of rows, padded."""
        full = super().prepare_layout(*request)
        sequence_length = full.sequence_length
        ranks = self.sequence_group.size
        local_length = -(-sequence_length // ranks)
        start = self.sequence_group.rank * local_length
        stop = start + local_length

        def local_block(per_row: Tensor) -> Tensor:
            padding = [0, 0] * (per_row.dim() - 1) + [0, local_length * ranks - sequence_length]
            return F.pad(per_row, padding)[start:stop]

        every_local_row = torch.arange(local_length, device=full.adaln_index.device)
        text_rows, text_slots = _rows_in_block(full.text_index, start, stop)
        video_rows, video_slots = _rows_in_block(full.video_index, start, stop)
        audio_rows, audio_slots = _rows_in_block(full.audio_index, start, stop)
        local = PackedLayout(
            rope_cos_sin=(local_block(full.rope_cos_sin[0]), local_block(full.rope_cos_sin[1])),
            adaln_index=local_block(full.adaln_index),
            timestep_index=local_block(full.timestep_index),
            video_index=every_local_row,
            audio_index=every_local_row,
            text_index=text_slots,
            attend=UlyssesAttention(self.sequence_group, sequence_length),
        )
        return SequenceShardedLayout(
            local=local,
            sequence_length=sequence_length,
            video_index=full.video_index,
            audio_index=full.audio_index,
            text_index=full.text_index,
            text_rows=text_rows,
            text_slots=text_slots,
            video_rows=video_rows,
            video_slots=video_slots,
            audio_rows=audio_rows,
            audio_slots=audio_slots,
        )

    def embed(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor, layout: SequenceShardedLayout
    ) -> Tensor:
        """This rank's block of the packed sequence. Only its video and audio rows are projected; the refiner attends
        over all text rows, so it runs on all of them (replicated over the Ulysses group) before the local ones are
        kept."""
        video, audio, text = self.project_inputs(
            video_rows.index_select(0, layout.video_rows),
            audio_rows.index_select(0, layout.audio_rows),
            text_states,
        )
        return packed_rows(
            layout.local.sequence_length,
            (text.index_select(0, layout.text_rows), layout.text_slots),
            (video, layout.video_slots),
            (audio, layout.audio_slots),
        )

    def head(
        self, hidden: Tensor, final_tables: tuple[Tensor, Tensor], layout: SequenceShardedLayout
    ) -> tuple[Tensor, Tensor]:
        """The fp32 heads on every local row, gathered once; the request's rows are picked from the result."""
        video_velocity, audio_velocity = super().head(hidden, final_tables, layout.local)
        velocities = all_gather_rows(torch.cat((video_velocity, audio_velocity), dim=1), self.sequence_group)
        video_channels = video_velocity.shape[1]
        return (
            velocities[layout.video_index, :video_channels].contiguous(),
            velocities[layout.audio_index, video_channels:].contiguous(),
        )


def modality_rows(layout: PackedLayout | SequenceShardedLayout) -> tuple[Tensor, Tensor]:
    """(video rows, audio rows) of the hidden sequence this rank's blocks run on: the request's own rows on one
    process, the local slots of those that land on this Ulysses rank (pad and text rows excluded)."""
    if isinstance(layout, SequenceShardedLayout):
        return layout.video_slots, layout.audio_slots
    return layout.video_index, layout.audio_index


def worker_groups(dit: H3DiT) -> tuple[GroupMembership, GroupMembership]:
    """(Ulysses group, tensor-parallel group) of this rank's DiT; a group of one where it has none."""
    sequence = dit.sequence_group if isinstance(dit, SequenceParallelDiT) else GroupMembership.alone()
    tensor = next(
        (module.group for module in dit.modules() if isinstance(module, ParallelLinear)),
        GroupMembership.alone(),
    )
    return sequence, tensor


def _apply_tensor_parallel(model: H3DiT, tp: GroupMembership) -> None:
    """Swap the parallel layers into every attention and FFN (module types from the model, no model edits)."""
    config = model.config
    dtype, device = model.compute_dtype, model.condition_proj.weight.device
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.qkv_proj = QKVParallelLinear(
                config.hidden_size, config.num_heads, config.head_dim, tp, dtype, device
            )
            module.out_proj = RowParallelLinear(config.inner_dim, config.hidden_size, tp, dtype, device)
            module.num_heads = module.qkv_proj.local_heads
        elif isinstance(module, SwiGLU):
            module.fc1 = GateValueParallelLinear(config.hidden_size, 2 * config.ffn_dim, tp, dtype, device)
            module.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, tp, dtype, device)


def parallelize_dit(config: DiTConfig, groups: DiTGroups, dtype: torch.dtype = torch.bfloat16) -> H3DiT:
    """This rank's DiT with its parallel layers in place, on `meta` (fill it with `load_dit_shard`).

    Always `meta`: built on a real device, the full-size layers would be allocated before the swap replaces them.
    With one Ulysses rank the module is a plain `H3DiT` (at world size 1 it computes exactly what `H3DiT` does).
    """
    layout = groups.layout
    if (layout.dit_heads, layout.dit_ffn_dim) != (config.num_heads, config.ffn_dim):
        raise ValueError(
            f"the parallel layout was validated for {layout.dit_heads} heads and FFN width {layout.dit_ffn_dim}, "
            f"but this DiT has {config.num_heads} and {config.ffn_dim} (use ParallelLayout.for_dit)"
        )
    if groups.sp.size > 1:
        model = SequenceParallelDiT(config, groups.sp, dtype, "meta")
    else:
        model = H3DiT(config, dtype, "meta")
    _apply_tensor_parallel(model, groups.tp)
    return model


def load_dit_shard(
    weight_files: WeightFiles,
    config: DiTConfig,
    groups: DiTGroups,
    dtype: torch.dtype,
    device: torch.device | str,
    deferred: DeferredReads | None = None,
) -> H3DiT:
    """Build this rank's DiT and read only its shard of the checkpoint, in either layout (replicated tensors
    whole); the keys `deferred` wants get a parked tensor and a reader of this rank's part instead."""
    weight_files = as_native_files(weight_files, config)
    weight_files.check(native_state_shapes(config))
    model = parallelize_dit(config, groups, dtype)
    sharded = {
        f"{name}.weight": layer for name, layer in model.named_modules() if isinstance(layer, ParallelLinear)
    }
    replicated = {}
    for key, expected in model.state_dict().items():
        if key in sharded:
            continue
        if deferred is not None and deferred.wants(key):
            deferred.add(key, partial(_read_replicated, weight_files, key, "cpu", expected.dtype))
            replicated[key] = parked(expected.shape, expected.dtype)
        else:
            replicated[key] = _read_replicated(weight_files, key, device, expected.dtype)
            if deferred is not None and deferred.remembers(key):
                deferred.add(key, partial(_read_replicated, weight_files, key, "cpu", expected.dtype))
    missing, unexpected = model.load_state_dict(replicated, strict=False, assign=True)
    if set(missing) != set(sharded) or unexpected:
        raise RuntimeError(f"replicated DiT keys do not line up: missing {missing}, unexpected {unexpected}")
    for key, layer in sharded.items():
        layer.load_shard(weight_files, key, device, deferred)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise RuntimeError(f"'{name}' was not loaded")
    return model.eval().requires_grad_(False)


def _read_replicated(
    weight_files: WeightFiles, key: str, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    try:
        return placed(weight_files.tensor(key), device, dtype)
    except CheckpointError:
        raise
    except Exception as error:  # safetensors raises its own error types
        raise CheckpointError(
            f"{weight_files.infos[key].file}: cannot read tensor '{key}' ({error})"
        ) from None
