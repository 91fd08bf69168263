"""The single call site of scaled FP8 / INT8 dequantization: a Triton kernel where one applies, the torch twin otherwise.

`dequantize` has the arguments and result of `h3engine.checkpoint.single_file_formats.dequantize_scaled` (the twin,
the definition of the scaled forms' values: values widened to float32 times the scale, rotated back by ConvRot's
Hadamard when a group is given, rounded once to the output dtype). NVFP4 (`dequantize_nvfp4`) runs its twin,
h3engine.checkpoint.nvfp4.dequantize_nvfp4, in plain torch on every device. The Triton kernel
(`kernels/triton/scaled_dequant.py`) computes the same float32 products and rounds them once, so both paths are
bit-identical; for a ConvRot form it writes float32 and `rotate_groups` and the one rounding follow here, as in the
twin (the same matmul on the same device). Triton runs for contiguous [rows, K] values on a CUDA device unless
`H3_KERNELS=reference` or `h3engine.models.ops.force_reference()` forces the twin (the switch of the fused ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.single_file_formats import dequantize_scaled, rotate_groups
from h3engine.errors import CheckpointError
from h3engine.models import ops
from h3engine.models.ops import Implementation

try:
    from h3engine.models.kernels.triton import scaled_dequant
except ImportError:  # torch builds without triton always use the twin
    scaled_dequant = None


def implementation(
    values: Tensor, scale: Tensor | None, convrot_group: int | None, out_dtype: torch.dtype
) -> Implementation:
    """Which implementation `dequantize(values, scale, convrot_group, out_dtype)` runs."""
    # ops' switch (H3_KERNELS=reference, force_reference()) is read at call time, as ops reads it.
    if ops._reference_forced or scaled_dequant is None or values.device.type != "cuda":
        return "reference"
    kernel_dtype = torch.float32 if convrot_group is not None else out_dtype
    supported = scaled_dequant.supports_dequantize_scaled(values, scale, kernel_dtype)
    return "triton" if supported else "reference"


def dequantize(
    values: Tensor, scale: Tensor | None, convrot_group: int | None, out_dtype: torch.dtype
) -> Tensor:
    """fp8 / int8 `values` times `scale` (one value, or one per row), rotated back by ConvRot's Hadamard when
    `convrot_group` is given, rounded once to `out_dtype`, on values' device: `dequantize_scaled`'s result."""
    if implementation(values, scale, convrot_group, out_dtype) == "reference":
        return dequantize_scaled(values, scale, convrot_group, out_dtype)
    with torch.cuda.device(values.device):
        if convrot_group is None:
            return scaled_dequant.dequantize_scaled(values, scale, out_dtype)
        products = scaled_dequant.dequantize_scaled(values, scale, torch.float32)
        return rotate_groups(products, convrot_group).to(out_dtype)


NVFP4_BLOCK = nvfp4.BLOCK


def nvfp4_row_bytes(in_features: int, name: str = "") -> int:
    """Bytes of one NVFP4 row: two values a byte (CheckpointError unless the row is whole 16-value blocks)."""
    if in_features % nvfp4.BLOCK:
        raise CheckpointError(
            f"{name}: NVFP4 rows are whole blocks of {nvfp4.BLOCK} values, not {in_features}"
        )
    return in_features // 2


def dequantize_nvfp4(
    packed: Tensor, block_scales: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """NVFP4 bytes uint8 [R, K/2], row-major e4m3 block scales [R, K/16] and the global scale, dequantized on their
    device: e2m1 x block scale x global scale in float32, one rounding to `out_dtype` (the twin itself)."""
    return nvfp4.dequantize_nvfp4(packed, block_scales, global_scale, out_dtype)
