"""Triton twin of `h3engine.checkpoint.single_file_formats.dequantize_scaled` without rotation: scaled FP8 / INT8.

Contract
--------
`dequantize_scaled(values, scale, out_dtype)` takes a [rows, K] contiguous tensor of int8, float8_e4m3fn or
float8_e5m2 values and its float32 scale (one value: shape [] or [1]; one per row: [rows, 1]; or None) and returns
a new contiguous [rows, K] tensor in `out_dtype` (bf16, fp16, fp32), equal bit for bit to
`dequantize_scaled(values, scale, None, out_dtype)`: each value widened exactly to fp32, times the scale in fp32,
rounded once. A ConvRot form is the caller's: it asks for fp32 here and rotates and rounds after
(h3engine.models.scaled_ops). The bytes are read as uint8 and decoded by bit arithmetic (the interpreter's own fp8
conversions know no inf or NaN); an e4m3fn NaN widens to c10's pattern (sign | 0x7FF00000).

One program per tile of [ROWS, COLUMNS] values, masked at the matrix's edges; a per-row scale is one load per
row. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, LAUNCH_OPTIONS, SUPPORTED_DTYPES, num_warps_for

# Values per program: 8 rows x 512 columns.
ROWS, COLUMNS = 8, 512
# The stored values' dtypes -> the kernel's decoder code.
VALUE_CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@triton.jit
def _fp32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _widened(byte, CODE: tl.constexpr):
    """Stored bytes (uint8) -> their values as fp32, exactly (torch's widening of int8 / e4m3fn / e5m2)."""
    if CODE == 0:
        return byte.to(tl.int8, bitcast=True).to(tl.float32)
    if CODE == 2:  # e5m2: the high byte of an fp16, widened as fp16 is
        return (byte.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    # e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, NaN at S.1111.111, no infinity.
    bits = byte.to(tl.int32)
    sign = (bits & 0x80) << 24
    exponent = (bits >> 3) & 0x0F
    mantissa = bits & 0x07
    normal = _fp32(sign | ((exponent + 120) << 23) | (mantissa << 20))
    subnormal = _fp32(sign | (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True))
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((bits & 0x7F) == 0x7F, _fp32(sign | 0x7FF00000), value)


@triton.jit
def _scaled_kernel(
    values_ptr,
    scale_ptr,
    out_ptr,
    n_rows,
    n_columns,
    CODE: tl.constexpr,
    SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """SCALE: 0 none, 1 one value, 2 one per row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    columns = tl.program_id(1).to(tl.int64) * COLUMNS + tl.arange(0, COLUMNS)[None, :]
    live = (rows < n_rows) & (columns < n_columns)
    offsets = rows * n_columns + columns
    result = _widened(tl.load(values_ptr + offsets, mask=live, other=0), CODE)
    if SCALE == 1:
        result = result * tl.load(scale_ptr)
    elif SCALE == 2:
        result = result * tl.load(scale_ptr + rows, mask=rows < n_rows, other=1.0)
    tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=live)


def _scale_mode(values: Tensor, scale: Tensor | None) -> int | None:
    """0 (no scale), 1 (one value), 2 (one per row), None (a scale this kernel does not read)."""
    if scale is None:
        return 0
    if scale.dtype != torch.float32 or scale.device != values.device or not scale.is_contiguous():
        return None
    if scale.numel() == 1:
        return 1
    return 2 if tuple(scale.shape) in ((values.shape[0], 1), (values.shape[0],)) else None


def supports_dequantize_scaled(values: Tensor, scale: Tensor | None, out_dtype: torch.dtype) -> bool:
    """True for contiguous [rows, K] int8 / float8_e4m3fn / float8_e5m2 `values` on a CUDA device (any device
    under TRITON_INTERPRET=1), a contiguous float32 `scale` beside them (one value or one per row) or none, and a
    float `out_dtype` (bf16, fp16, fp32)."""
    return (
        values.dtype in VALUE_CODES
        and values.dim() == 2
        and values.is_contiguous()
        and (values.device.type == "cuda" or INTERPRETING)
        and out_dtype in SUPPORTED_DTYPES
        and _scale_mode(values, scale) is not None
    )


def dequantize_scaled(values: Tensor, scale: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """Scaled `values` [rows, K] -> new contiguous [rows, K] in `out_dtype`, on values' device (see the contract)."""
    n_rows, n_columns = values.shape
    out = torch.empty((n_rows, n_columns), dtype=out_dtype, device=values.device)
    if out.numel() == 0:
        return out
    mode = _scale_mode(values, scale)
    grid = (triton.cdiv(n_rows, ROWS), triton.cdiv(n_columns, COLUMNS))
    _scaled_kernel[grid](
        values.view(torch.uint8),
        scale if scale is not None else out,
        out,
        n_rows,
        n_columns,
        CODE=VALUE_CODES[values.dtype],
        SCALE=mode,
        ROWS=ROWS,
        COLUMNS=COLUMNS,
        num_warps=num_warps_for(ROWS * COLUMNS),
        **LAUNCH_OPTIONS,
    )
    return out
