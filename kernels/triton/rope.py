"""Triton twin of `h3engine.models.kernels.reference.rope.qk_norm_rope`: QK RMSNorm + partial rotate-half RoPE in one pass.

Contract
--------
Same arguments and results as the reference. One program per (block of rows, block of heads) handles that block
for both query and key, so each row's cos/sin are read once. Inputs may be strided views (e.g. [S, heads*D] GEMM outputs
viewed as [S, heads, D], or slices of a fused QKV output): any row and head strides, unit channel stride. Outputs
are new contiguous [S, heads, D] tensors.

Each channel c < R also loads its rotate-half partner (c + R/2 or c - R/2, an L1 hit) and normalizes it with the
same head's rstd, so the rotation needs no data movement between lanes. Rounding: the RMSNorm output rounds once
(fp32 x * rstd * weight), then `n * cos`, `partner * sin` and their sum each round, as `apply_rope` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import LAUNCH_OPTIONS, SUPPORTED_DTYPES, div_rn, num_warps_for, round_to, rsqrt

# Head dims up to this many channels (a [heads-per-program, D] tile in registers); wider ones use the reference.
MAX_HEAD_DIM = 1024
# Heads per program: the candidates, largest first; `_heads_per_program` picks the one that pads least.
HEAD_BLOCK_CANDIDATES = (8, 4, 2, 1)
# Rows per program (each a [heads-block, D] tile of the query and of the key), and half the warps the shared rule
# gives a tile of this size: at the released shape (38,222 x 56 x 128, 8 heads per program) 2 warps take 0.73 ms
# against 0.89 with 4, bit-identical; more rows per program are slower (benchmarks/ops_kernels.py
# --qk-norm-rope-launches).
ROWS_PER_PROGRAM = 1
WARP_DIVISOR = 2


@triton.jit
def _norm_rope_heads(
    in_ptr,
    row_stride,
    head_stride,
    out_ptr,
    weight_ptr,
    row,
    row_valid,
    heads,
    channels,
    partners,
    signs,
    cos,
    sin,
    eps,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """Normalize and rotate one [heads-block, D] tile of one row; masked lanes are neither read nor written."""
    dtype = out_ptr.dtype.element_ty
    in_tile = (heads < HEADS)[:, None] & (channels < HEAD_DIM)[None, :] & row_valid
    head_base = in_ptr + row * row_stride + heads[:, None].to(tl.int64) * head_stride
    hidden = tl.load(head_base + channels[None, :], mask=in_tile, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + channels, mask=channels < HEAD_DIM, other=0.0).to(tl.float32)

    mean_square = div_rn(tl.sum(hidden * hidden, axis=1), HEAD_DIM * 1.0)
    inverse_rms = rsqrt(mean_square + eps)[:, None]
    normed = round_to(hidden * inverse_rms * weight[None, :], dtype)
    if ROTARY > 0:
        partner = tl.load(head_base + partners[None, :], mask=in_tile, other=0.0).to(tl.float32)
        partner_weight = tl.load(weight_ptr + partners, mask=channels < HEAD_DIM, other=0.0).to(tl.float32)
        partner_normed = round_to(partner * inverse_rms * partner_weight[None, :], dtype)
        # signs is -1 where the partner is the second half: rotate_half negates it (exactly, before rounding).
        rotated = round_to(normed * cos[None, :], dtype) + round_to(
            signs[None, :] * partner_normed * sin[None, :], dtype
        )
        normed = tl.where((channels < ROTARY)[None, :], rotated, normed)
    out_offsets = (row * HEADS + heads[:, None].to(tl.int64)) * HEAD_DIM + channels[None, :]
    tl.store(out_ptr + out_offsets, normed.to(dtype), mask=in_tile)


@triton.jit
def _qk_norm_rope_kernel(
    query_ptr,
    query_row_stride,
    query_head_stride,
    key_ptr,
    key_row_stride,
    key_head_stride,
    query_weight_ptr,
    key_weight_ptr,
    cos_ptr,
    cos_stride,
    sin_ptr,
    sin_stride,
    query_out_ptr,
    key_out_ptr,
    sequence_length,
    eps,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    channels = tl.arange(0, DIM_BLOCK)
    half = ROTARY // 2
    first_half = channels < half
    partners = tl.where(first_half, channels + half, tl.where(channels < ROTARY, channels - half, channels))
    signs = tl.where(first_half, -1.0, 1.0)
    rotary_channel = channels < ROTARY
    # ROW_BLOCK rows per program (unrolled, so their loads are in flight together).
    for offset in tl.static_range(ROW_BLOCK):
        row = tl.program_id(0).to(tl.int64) * ROW_BLOCK + offset
        row_valid = row < sequence_length
        # Channels >= ROTARY keep their normed value: their cos/sin lanes are never read.
        table_lanes = rotary_channel & row_valid
        cos = tl.load(cos_ptr + row * cos_stride + channels, mask=table_lanes, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * sin_stride + channels, mask=table_lanes, other=0.0).to(tl.float32)
        _norm_rope_heads(
            query_ptr,
            query_row_stride,
            query_head_stride,
            query_out_ptr,
            query_weight_ptr,
            row,
            row_valid,
            heads,
            channels,
            partners,
            signs,
            cos,
            sin,
            eps,
            HEADS,
            HEAD_DIM,
            ROTARY,
        )
        _norm_rope_heads(
            key_ptr,
            key_row_stride,
            key_head_stride,
            key_out_ptr,
            key_weight_ptr,
            row,
            row_valid,
            heads,
            channels,
            partners,
            signs,
            cos,
            sin,
            eps,
            HEADS,
            HEAD_DIM,
            ROTARY,
        )


def _heads_per_program(heads: int) -> int:
    """The candidate that pads `heads` least (ties: the larger block, fewer programs)."""
    return min(HEAD_BLOCK_CANDIDATES, key=lambda block: triton.cdiv(heads, block) * block)


def _supports_heads(tensor: Tensor, shape: torch.Size) -> bool:
    return (
        tensor.shape == shape
        and tensor.dtype in SUPPORTED_DTYPES
        and (tensor.stride(2) == 1 or shape[2] == 1)
    )


def supports_qk_norm_rope(
    query: Tensor,
    key: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor | None,
    sin: Tensor | None,
) -> bool:
    if query.dim() != 3 or not 1 <= query.shape[2] <= MAX_HEAD_DIM:
        return False
    sequence_length, _, head_dim = query.shape
    if (cos is None) != (sin is None):
        return False
    tables = () if cos is None else (cos, sin)
    rotary_dim = 0 if cos is None else cos.shape[-1]
    return (
        _supports_heads(query, query.shape)
        and _supports_heads(key, query.shape)
        and all(weight.shape == (head_dim,) and weight.stride(0) == 1 for weight in (q_weight, k_weight))
        and all(
            table.shape == (sequence_length, rotary_dim) and (table.stride(1) == 1 or rotary_dim == 1)
            for table in tables
        )
        and rotary_dim % 2 == 0
        and (cos is None or 2 <= rotary_dim <= head_dim)
        and all(tensor.dtype == query.dtype for tensor in (key, q_weight, k_weight, *tables))
    )


def qk_norm_rope(
    query: Tensor,
    key: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor | None,
    sin: Tensor | None,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(RoPE(RMSNorm(query)), RoPE(RMSNorm(key))) as new contiguous [S, heads, D] tensors.

    `rows_per_program` and `num_warps` (default: from the tile size) only change the launch (for tuning)."""
    sequence_length, heads, head_dim = query.shape
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty_like(query_out)
    if sequence_length == 0 or heads == 0:
        return query_out, key_out
    rotary_dim = 0 if cos is None else cos.shape[-1]
    # Without rotation the table pointers are never read; the query stands in for them.
    cos_table, sin_table = (query, query) if cos is None else (cos, sin)
    head_block = _heads_per_program(heads)
    dim_block = triton.next_power_of_2(head_dim)
    _qk_norm_rope_kernel[(triton.cdiv(sequence_length, rows_per_program), triton.cdiv(heads, head_block))](
        query,
        query.stride(0),
        query.stride(1),
        key,
        key.stride(0),
        key.stride(1),
        q_weight,
        k_weight,
        cos_table,
        cos_table.stride(0),
        sin_table,
        sin_table.stride(0),
        query_out,
        key_out,
        sequence_length,
        eps,
        HEADS=heads,
        HEAD_DIM=head_dim,
        ROTARY=rotary_dim,
        HEAD_BLOCK=head_block,
        DIM_BLOCK=dim_block,
        ROW_BLOCK=rows_per_program,
        num_warps=num_warps or max(1, num_warps_for(head_block * dim_block) // WARP_DIVISOR),
        **LAUNCH_OPTIONS,
    )
    return query_out, key_out
