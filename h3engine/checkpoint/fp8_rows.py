"""FP8 with one scale per row: the storage of `--weights fp8` and of converted checkpoints (h3engine.checkpoint.fp8_files).

`quantize_rows(matrix)` maps each row's largest magnitude onto e4m3's largest finite value (448) with an fp32 scale
per row; `dequantize_rows` multiplies back in fp32 (cast to a module's dtype afterwards: the one rounding that
h3engine.memory.homes.dequantize_into makes too, since both multiply in fp32). Rows are independent: a row's values
and scale do not depend on the other rows or their order.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value: a row's largest magnitude is mapped onto it.
FP8_MAX = torch.finfo(FP8_DTYPE).max
# Scale of an all-zero row: any positive value quantizes it to zeros; the smallest normal fp32 keeps it finite.
ZERO_ROW_SCALE = torch.finfo(torch.float32).tiny


def quantize_rows(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """[R, K] -> (e4m3 values [R, K] row-major, fp32 scales [R, 1]) with matrix ~= values * scales."""
    if matrix.dim() != 2:
        raise ValueError(f"quantize_rows expects a 2-D matrix, got shape {list(matrix.shape)}")
    matrix = matrix.contiguous()
    row_amax = torch.linalg.vector_norm(matrix, ord=float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    scales = (row_amax / FP8_MAX).clamp_(min=ZERO_ROW_SCALE)
    # matrix / scales is computed in fp32 (the scales' dtype) and lands within 448 * (1 + 2^-23), which the e4m3
    # conversion rounds to 448 (only values from 480 up would become NaN), so no clamp is needed.
    return (matrix / scales).to(FP8_DTYPE), scales


def dequantize_rows(values: Tensor, scales: Tensor) -> Tensor:
    """Inverse of `quantize_rows` up to its rounding: fp32 values * scales."""
    return values.to(torch.float32) * scales
