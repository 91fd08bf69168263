"""Triton twin of `h3engine.models.kernels.reference.activation.swiglu`: silu(gate) * value from fc1's [S, 2F] output in one pass.

Contract
--------
Same argument and result as the reference. One program per (row, column tile of F); the row stride is free, the
last dim must be unit-stride. The output is a new contiguous [S, F]. Offsets are int64: S * 2F passes 2^31 at the
released size (38,222 x 28,672).

Rounding: silu is torch's CUDA formula, x / (1 + expf(-x)) in fp32 with libdevice expf and IEEE division, rounded
once; the product rounds again. Bit-identical to torch on CUDA except where libdevice's flush-to-zero mode differs
from torch's (subnormal silu results only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import LAUNCH_OPTIONS, SUPPORTED_DTYPES, div_rn, exp, num_warps_for, round_to

# Column tile: 2048 elements divides the released F = 14,336 into 7 tiles exactly.
COLUMN_TILE = 2048


@triton.jit
def _swiglu_kernel(fused_ptr, fused_stride, out_ptr, WIDTH: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * TILE + tl.arange(0, TILE)
    in_row = columns < WIDTH
    dtype = out_ptr.dtype.element_ty
    gate_ptr = fused_ptr + row * fused_stride
    gate = tl.load(gate_ptr + columns, mask=in_row).to(tl.float32)
    value = tl.load(gate_ptr + WIDTH + columns, mask=in_row).to(tl.float32)
    activated = round_to(div_rn(gate, 1.0 + exp(-gate)), dtype)
    tl.store(out_ptr + row * WIDTH + columns, (activated * value).to(dtype), mask=in_row)


def supports_swiglu(fused: Tensor) -> bool:
    return (
        fused.dim() == 2
        and fused.shape[1] % 2 == 0
        and fused.dtype in SUPPORTED_DTYPES
        and (fused.stride(1) == 1 or fused.shape[1] <= 1)
    )


def swiglu(fused: Tensor) -> Tensor:
    """[S, 2F] (gate | value) -> new contiguous [S, F] = silu(gate) * value."""
    sequence_length, doubled_width = fused.shape
    width = doubled_width // 2
    out = torch.empty((sequence_length, width), dtype=fused.dtype, device=fused.device)
    if sequence_length == 0 or width == 0:
        return out
    tile = min(COLUMN_TILE, triton.next_power_of_2(width))
    _swiglu_kernel[(sequence_length, triton.cdiv(width, tile))](
        fused,
        fused.stride(0),
        out,
        WIDTH=width,
        TILE=tile,
        num_warps=num_warps_for(tile),
        **LAUNCH_OPTIONS,
    )
    return out
