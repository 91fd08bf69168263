"""Activation chunking of the DiT forward (`H3DiT.activation_chunks`; `set_activation_chunks` in h3engine.models.dit).

With N > 1 chunks the FFN, the final layer's heads and the patch projections run over contiguous row chunks of
ceil(rows / N) rows, attention over min(N, heads) contiguous head groups (as even as possible): a group's q, k, v
come from its rows of the stacked [q; k; v] weight, are normed, rotated and attended alone, and land in its heads of
one [S, heads, head_dim] buffer that `out_proj` reads whole. Each chunk is written into its slice of one output, so
one chunk's temporaries are alive at a time. The ops are the same on fewer rows or heads: elementwise ops, QK-norm +
RoPE, the attention kernel (heads are independent) and the gathers give the same bits; a GEMM over fewer rows or
output columns may pick other kernels that sum in another order (MKL's fp32 GEMM for a few rows or a column slice
that is no multiple of 16; cuBLAS's bf16 GEMMs on an H100 from 4 chunks on, ~1e-3 of the largest velocity at the
released size), and the chunked forward then equals the whole one to that rounding only.

Danger: only row-wise, local work may be chunked. The callers keep the whole-sequence path for a layer that is no
plain nn.Linear (tensor-parallel layers sum over their group per call; FP8 layers), for an attention kernel that
exchanges rows between ranks (Ulysses), and in `SequenceParallelDiT.embed` (its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.models import ops
from h3engine.models.attention import AttentionKernel

# The modules come from h3engine.models.dit_layers (Attention, FinalLayer) and h3engine.models.dit (H3DiT), which call
# in here: they are typed by their base class, and the forward's layout (dit_layers.PackedLayout: row indices, sequence
# length) as Any, so that this module imports nothing of the DiT's.


def set_chunks(dit: nn.Module, chunks: int) -> None:
    """`set_activation_chunks`: `chunks` (an integer >= 1, else ValueError) on every submodule that reads the setting
    (those holding an `activation_chunks` attribute: Attention, SwiGLU, FinalLayer). Allocates nothing."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"activation_chunks must be an integer >= 1, got {chunks!r}")
    for module in dit.modules():
        if "activation_chunks" in vars(module):
            module.activation_chunks = chunks


def row_slices(rows: int, chunks: int) -> list[slice]:
    """[0, rows) as contiguous slices of ceil(rows / chunks) rows, the last one shorter when it does not divide
    (none empty: fewer than `chunks` slices when rows < chunks or the last ones would be)."""
    size = max(1, -(-rows // chunks))
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def head_groups(heads: int, groups: int) -> list[slice]:
    """[0, heads) as min(groups, heads) contiguous slices as even as possible: the first heads % groups one longer."""
    groups = min(groups, heads)
    size, longer = divmod(heads, groups)
    bounds = [0]
    for group in range(groups):
        bounds.append(bounds[-1] + size + (group < longer))
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:], strict=False)]


def plain_linears(*layers: nn.Module) -> bool:
    """Whether every layer is a plain linear: row-wise and local, so calling it per row chunk computes its rows. An
    nn.Linear is, and so is a layer that says so (`ROW_WISE`: h3engine.models.stored_linear.StoredLinear, the same
    F.linear on its dequantized weight, made again per call).

    Tensor-parallel layers (which sum over their group in every call) and FP8 layers (which quantize their input per
    call) are not; their callers do not chunk. A LoRA's forward hook adds update(input) to the output, also row-wise:
    chunked calls add it per chunk."""
    return all(type(layer) is nn.Linear or getattr(layer, "ROW_WISE", False) for layer in layers)


def map_rows(function: Callable[[Tensor], Tensor], rows: Tensor, chunks: int) -> Tensor:
    """`function(rows)` for a row-wise `function` (output row i depends on input row i only), computed over the
    `row_slices` of `rows` and written into one output; with one slice (chunks 1, or a single row) the plain call."""
    slices = row_slices(rows.shape[0], chunks)
    if len(slices) <= 1:
        return function(rows)
    first = function(rows[slices[0]])
    output = first.new_empty((rows.shape[0], *first.shape[1:]))
    output[slices[0]] = first
    del first  # only one chunk's result alive at a time
    for part in slices[1:]:
        output[part] = function(rows[part])
    return output


def attention_by_head_groups(
    attn: nn.Module,
    hidden: Tensor,
    rope_cos_sin: tuple[Tensor, Tensor] | None,
    attend: AttentionKernel,
    low_rank_update: Any | None,
) -> Tensor:
    """`Attention.forward` over `head_groups(num_heads, attn.activation_chunks)`, for a plain (row-wise) qkv_proj and
    a kernel that attends each head alone (the local one). `low_rank_update`: the qkv_proj's LoRA update
    (`LowRankUpdate`: `down` [R, in], `up` [3 * inner, R]) or None; its `down @ x` is computed once for all groups."""
    sequence_length = hidden.shape[0]
    output = hidden.new_empty(sequence_length, attn.num_heads, attn.head_dim)
    low_rank = None
    if low_rank_update is not None:
        low_rank = (F.linear(hidden.to(low_rank_update.down.dtype), low_rank_update.down), low_rank_update.up)
    weight = attn.qkv_proj.weight  # once for every group (a stored layer dequantizes it here)
    for heads in head_groups(attn.num_heads, attn.activation_chunks):
        output[:, heads] = attend_head_group(attn, hidden, heads, rope_cos_sin, attend, low_rank, weight)
    return attn.out_proj(output.view(sequence_length, attn.num_heads * attn.head_dim))


def attend_head_group(
    attn: nn.Module,
    hidden: Tensor,
    heads: slice,
    rope_cos_sin: tuple[Tensor, Tensor] | None,
    attend: AttentionKernel,
    low_rank: tuple[Tensor, Tensor] | None,
    weight: Tensor,
) -> Tensor:
    """The attention output [S, len(heads), head_dim] of the heads `heads`: `Attention._project_qkv`'s three GEMMs
    on the group's rows of each of the q, k and v blocks of qkv_proj's `weight` (plus the LoRA's `up` rows of them on
    `low_rank`'s (down @ x, up)), the fused QK-norm + RoPE (its weights are per channel, shared by every head) and
    the kernel."""
    inner, head_dim = attn.num_heads * attn.head_dim, attn.head_dim
    shape = (hidden.shape[0], heads.stop - heads.start, head_dim)

    def projection(block: int) -> Tensor:
        rows = slice(block * inner + heads.start * head_dim, block * inner + heads.stop * head_dim)
        projected = F.linear(hidden, weight[rows])
        if low_rank is not None:
            low, up = low_rank
            # As `LowRankUpdate.chunks`: up's rows on the shared down @ x, cast back to the activations' dtype.
            projected = projected + F.linear(low, up[rows]).to(hidden.dtype)
        return projected.view(shape)

    # Rebinding query and key frees the raw projections once the fused op has made their normed copies.
    query, key, value = (projection(block) for block in range(3))
    cos, sin = rope_cos_sin if rope_cos_sin is not None else (None, None)
    query, key = ops.qk_norm_rope(
        query, key, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin
    )
    return attend(query, key, value)


def fp32_velocities(final_layer: nn.Module, modulated: Tensor, layout: Any) -> tuple[Tensor, Tensor]:
    """`FinalLayer.forward`'s heads: video_out and audio_out on their modality's rows of `modulated`, gathered and cast
    to fp32 (the heads are fp32 islands), over `final_layer.activation_chunks` row chunks of each (1: one call)."""
    chunks = final_layer.activation_chunks
    heads = ((final_layer.video_out, layout.video_index), (final_layer.audio_out, layout.audio_index))
    video, audio = (
        map_rows(lambda rows, linear=linear: linear(modulated[rows].to(torch.float32)), index, chunks)
        for linear, index in heads
    )
    return video, audio


def embed_by_rows(
    dit: nn.Module, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor, layout: Any
) -> Tensor:
    """`H3DiT.embed` with the fp32 patch projections over `dit.activation_chunks` row chunks, each chunk cast into its
    rows of the packed sequence at once: the fp32 [Nv, hidden] projection and its cast copy are never whole."""
    chunks = dit.activation_chunks
    # project_inputs on no video or audio rows: its text path (condition projection, token refiner), defined once.
    _, _, text = dit.project_inputs(video_rows[:0], audio_rows[:0], text_states)
    # As `packed_rows`: zeros in the text's (the compute) dtype, each modality's rows copied in at its positions.
    hidden = text.new_zeros(layout.sequence_length, text.shape[1])
    hidden.index_copy_(0, layout.text_index, text)
    del text
    modalities = (
        (video_rows, layout.video_index, dit.video_patch_proj),
        (audio_rows, layout.audio_index, dit.audio_patch_proj),
    )
    for rows, index, projection in modalities:
        for part in row_slices(rows.shape[0], chunks):
            # One expression: a chunk's fp32 projection is freed once cast, not held while the next one is made.
            hidden.index_copy_(0, index[part], projection(rows[part].to(torch.float32)).to(hidden.dtype))
    return hidden
