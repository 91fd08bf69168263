"""Triton twins of `h3engine.models.kernels.reference.norms`: modulated RMSNorm, gated residual, the two fused, and the video
decoder's fp32 RMSNorm (alone or after its layer-scaled residual) rounded to the GEMM dtype.

Contract
--------
Same arguments and results as the reference (see there). `modulated_rms_norm` and `gated_residual_rms_norm` run
one program per row with the whole row in registers (H <= MAX_NORM_WIDTH): the row is read once, the AdaLN table
rows come from L2. `gated_residual` runs one program per (row, column tile). Rows are unit-stride; row strides
(e.g. the [R, 6, H] AdaLN table's unbound chunks) are free. Outputs are new contiguous tensors.

Rounding: `F.rms_norm` is x * rstd * weight in fp32 with one rounding, then `* scale` rounds, `+ shift` rounds;
the gated residual rounds the product, then the sum. The decoder's ops compute the residual and the norm in fp32
(each op rounding to fp32 as torch's does) and round the normed row once to `out_dtype`. Only rstd can differ
from torch's (summation order of the mean square, libdevice rsqrtf like torch's CUDA kernel), which moves a normed
value by at most one ulp, rarely.

Danger
------
`supports_*` must hold before a launch (`h3engine.models.ops` checks). `rows` is not bounds-checked: an index outside the
tables reads other memory instead of raising like `index_select`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    INDEX_DTYPES,
    LAUNCH_OPTIONS,
    MAX_NORM_WIDTH,
    SUPPORTED_DTYPES,
    div_rn,
    num_warps_for,
    round_to,
    rows_of,
    rsqrt,
)

# Column tile of the standalone gated residual: 2048 elements, eight per thread at 8 warps.
RESIDUAL_TILE = 2048


@triton.jit
def _modulated_rms_norm_kernel(
    hidden_ptr,
    hidden_stride,
    gate_ptr,
    gate_stride,
    update_ptr,
    update_stride,
    new_hidden_ptr,
    weight_ptr,
    scale_ptr,
    scale_stride,
    shift_ptr,
    shift_stride,
    rows_ptr,
    out_ptr,
    eps,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    in_row = columns < WIDTH
    dtype = out_ptr.dtype.element_ty
    table_row = tl.load(rows_ptr + row).to(tl.int64)

    hidden = tl.load(hidden_ptr + row * hidden_stride + columns, mask=in_row, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.load(gate_ptr + table_row * gate_stride + columns, mask=in_row, other=0.0).to(tl.float32)
        update = tl.load(update_ptr + row * update_stride + columns, mask=in_row, other=0.0).to(tl.float32)
        hidden = round_to(hidden + round_to(gate * update, dtype), dtype)
        tl.store(new_hidden_ptr + row * WIDTH + columns, hidden.to(dtype), mask=in_row)

    # Masked lanes hold 0 and add nothing to the sum of squares.
    mean_square = div_rn(tl.sum(hidden * hidden, axis=0), WIDTH * 1.0)
    inverse_rms = rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
    normed = round_to(hidden * inverse_rms * weight, dtype)

    scale = tl.load(scale_ptr + table_row * scale_stride + columns, mask=in_row, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + table_row * shift_stride + columns, mask=in_row, other=0.0).to(tl.float32)
    modulated = round_to(normed * scale, dtype) + shift
    tl.store(out_ptr + row * WIDTH + columns, modulated.to(dtype), mask=in_row)


@triton.jit
def _gated_residual_kernel(
    hidden_ptr,
    hidden_stride,
    gate_ptr,
    gate_stride,
    update_ptr,
    update_stride,
    rows_ptr,
    out_ptr,
    WIDTH: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * TILE + tl.arange(0, TILE)
    in_row = columns < WIDTH
    dtype = out_ptr.dtype.element_ty
    table_row = tl.load(rows_ptr + row).to(tl.int64)
    hidden = tl.load(hidden_ptr + row * hidden_stride + columns, mask=in_row).to(tl.float32)
    gate = tl.load(gate_ptr + table_row * gate_stride + columns, mask=in_row).to(tl.float32)
    update = tl.load(update_ptr + row * update_stride + columns, mask=in_row).to(tl.float32)
    summed = hidden + round_to(gate * update, dtype)
    tl.store(out_ptr + row * WIDTH + columns, summed.to(dtype), mask=in_row)


@triton.jit
def _scaled_residual_rms_norm_kernel(
    hidden_ptr,
    hidden_stride,
    update_ptr,
    update_stride,
    scale_ptr,
    new_hidden_ptr,
    weight_ptr,
    out_ptr,
    eps,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    in_row = columns < WIDTH
    hidden = tl.load(hidden_ptr + row * hidden_stride + columns, mask=in_row, other=0.0).to(tl.float32)
    if RESIDUAL:
        update = tl.load(update_ptr + row * update_stride + columns, mask=in_row, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + columns, mask=in_row, other=0.0)
        hidden = hidden + update * scale
        tl.store(new_hidden_ptr + row * WIDTH + columns, hidden, mask=in_row)

    mean_square = div_rn(tl.sum(hidden * hidden, axis=0), WIDTH * 1.0)
    inverse_rms = rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
    normed = hidden * inverse_rms * weight
    tl.store(out_ptr + row * WIDTH + columns, normed.to(out_ptr.dtype.element_ty), mask=in_row)


def _supports_rows(rows: Tensor, sequence_length: int) -> bool:
    return rows.shape == (sequence_length,) and rows.dtype in INDEX_DTYPES and rows.stride(0) == 1


def supports_modulated_rms_norm(
    hidden: Tensor, weight: Tensor, eps: float, scale_plus_one: Tensor, shift: Tensor, rows: Tensor
) -> bool:
    if hidden.dim() != 2 or not 1 <= hidden.shape[1] <= MAX_NORM_WIDTH:
        return False
    width = hidden.shape[1]
    return (
        rows_of(hidden, width)
        and rows_of(scale_plus_one, width)
        and rows_of(shift, width)
        and weight.shape == (width,)
        and weight.stride(0) == 1
        and all(tensor.dtype == hidden.dtype for tensor in (weight, scale_plus_one, shift))
        and _supports_rows(rows, hidden.shape[0])
    )


def supports_gated_residual(hidden: Tensor, gate: Tensor, rows: Tensor, update: Tensor) -> bool:
    if hidden.dim() != 2:
        return False
    width = hidden.shape[1]
    return (
        rows_of(hidden, width)
        and rows_of(gate, width)
        and rows_of(update, width)
        and update.shape == hidden.shape
        and gate.dtype == update.dtype == hidden.dtype
        and _supports_rows(rows, hidden.shape[0])
    )


def supports_gated_residual_rms_norm(
    hidden: Tensor,
    gate: Tensor,
    rows: Tensor,
    update: Tensor,
    weight: Tensor,
    eps: float,
    scale_plus_one: Tensor,
    shift: Tensor,
) -> bool:
    return supports_gated_residual(hidden, gate, rows, update) and supports_modulated_rms_norm(
        hidden, weight, eps, scale_plus_one, shift, rows
    )


def supports_rms_norm_to(hidden: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> bool:
    if hidden.dim() != 2 or not 1 <= hidden.shape[1] <= MAX_NORM_WIDTH:
        return False
    width = hidden.shape[1]
    return (
        rows_of(hidden, width)
        and weight.shape == (width,)
        and weight.stride(0) == 1
        and weight.dtype in SUPPORTED_DTYPES
        and out_dtype in SUPPORTED_DTYPES
    )


def supports_scaled_residual_rms_norm_to(
    hidden: Tensor, update: Tensor, scale: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> bool:
    # An fp32 stream and fp32 scale make every promotion fp32, whatever the update's dtype.
    return (
        supports_rms_norm_to(hidden, weight, eps, out_dtype)
        and hidden.dtype == scale.dtype == torch.float32
        and rows_of(update, hidden.shape[1])
        and update.shape == hidden.shape
        and scale.shape == (hidden.shape[1],)
        and scale.stride(0) == 1
    )


def _launch_norm(
    hidden: Tensor,
    gate: Tensor,
    update: Tensor,
    new_hidden: Tensor,
    weight: Tensor,
    eps: float,
    scale_plus_one: Tensor,
    shift: Tensor,
    rows: Tensor,
    out: Tensor,
    gated: bool,
) -> None:
    sequence_length, width = hidden.shape
    if sequence_length == 0:
        return
    block = triton.next_power_of_2(width)
    _modulated_rms_norm_kernel[(sequence_length,)](
        hidden,
        hidden.stride(0),
        gate,
        gate.stride(0),
        update,
        update.stride(0),
        new_hidden,
        weight,
        scale_plus_one,
        scale_plus_one.stride(0),
        shift,
        shift.stride(0),
        rows,
        out,
        eps,
        WIDTH=width,
        BLOCK=block,
        GATED=gated,
        num_warps=num_warps_for(block),
        **LAUNCH_OPTIONS,
    )


def modulated_rms_norm(
    hidden: Tensor, weight: Tensor, eps: float, scale_plus_one: Tensor, shift: Tensor, rows: Tensor
) -> Tensor:
    """RMSNorm(hidden) * scale_plus_one[rows] + shift[rows], [S, H] -> new contiguous [S, H]."""
    out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    # The gate/update/new-hidden pointers are unused when GATED is off; any tensor fills the slots.
    _launch_norm(hidden, hidden, hidden, out, weight, eps, scale_plus_one, shift, rows, out, gated=False)
    return out


def gated_residual_rms_norm(
    hidden: Tensor,
    gate: Tensor,
    rows: Tensor,
    update: Tensor,
    weight: Tensor,
    eps: float,
    scale_plus_one: Tensor,
    shift: Tensor,
) -> tuple[Tensor, Tensor]:
    """(hidden + gate[rows] * update, its modulated RMSNorm), reading `hidden` and `update` once."""
    new_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty_like(new_hidden)
    _launch_norm(hidden, gate, update, new_hidden, weight, eps, scale_plus_one, shift, rows, out, gated=True)
    return new_hidden, out


def gated_residual(hidden: Tensor, gate: Tensor, rows: Tensor, update: Tensor) -> Tensor:
    """hidden + gate[rows] * update, [S, H] -> new contiguous [S, H]."""
    sequence_length, width = hidden.shape
    out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    if sequence_length == 0 or width == 0:
        return out
    tile = min(RESIDUAL_TILE, triton.next_power_of_2(width))
    _gated_residual_kernel[(sequence_length, triton.cdiv(width, tile))](
        hidden,
        hidden.stride(0),
        gate,
        gate.stride(0),
        update,
        update.stride(0),
        rows,
        out,
        WIDTH=width,
        TILE=tile,
        num_warps=num_warps_for(tile),
        **LAUNCH_OPTIONS,
    )
    return out


def _launch_scaled_residual_norm(
    hidden: Tensor,
    update: Tensor,
    scale: Tensor,
    new_hidden: Tensor,
    weight: Tensor,
    eps: float,
    out: Tensor,
    residual: bool,
) -> None:
    sequence_length, width = hidden.shape
    if sequence_length == 0:
        return
    block = triton.next_power_of_2(width)
    _scaled_residual_rms_norm_kernel[(sequence_length,)](
        hidden,
        hidden.stride(0),
        update,
        update.stride(0),
        scale,
        new_hidden,
        weight,
        out,
        eps,
        WIDTH=width,
        BLOCK=block,
        RESIDUAL=residual,
        num_warps=num_warps_for(block),
        **LAUNCH_OPTIONS,
    )


def rms_norm_to(hidden: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """fp32 RMSNorm of every row, rounded once to `out_dtype`: [S, H] -> new contiguous [S, H]."""
    out = torch.empty(hidden.shape, dtype=out_dtype, device=hidden.device)
    # The update/scale/new-hidden pointers are unused when RESIDUAL is off; any tensor fills the slots.
    _launch_scaled_residual_norm(hidden, hidden, weight, out, weight, eps, out, residual=False)
    return out


def scaled_residual_rms_norm_to(
    hidden: Tensor, update: Tensor, scale: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(hidden + update * scale in fp32, its RMSNorm rounded to `out_dtype`), reading each input row once."""
    new_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    out = torch.empty(hidden.shape, dtype=out_dtype, device=hidden.device)
    _launch_scaled_residual_norm(hidden, update, scale, new_hidden, weight, eps, out, residual=True)
    return new_hidden, out
