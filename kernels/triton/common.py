"""What every Triton kernel here shares: the rounding helper, the fp32 math functions, launch options, limits.

Contract
--------
Kernels compute in fp32 and emulate each rounding of the reference twin with `round_to` (cast to the storage
dtype and back), so elementwise chains are bit-identical to torch's. They launch with `LAUNCH_OPTIONS`: fp
fusion off, because a contracted `a * b + c` (one FMA, one rounding) differs from torch's separate multiply and
add in fp32.

Danger
------
`exp`, `rsqrt` and `div_rn` are CUDA libdevice's (expf, rsqrtf and IEEE division, what torch's CUDA silu and norm
kernels compile to) when compiled, but `tl.math`'s when TRITON_INTERPRET=1 (the interpreter
cannot run libdevice). The choice is made at import, like Triton's own: set TRITON_INTERPRET before importing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The interpreter patches `tl.math` in place, so it must be looked up at call time, inside a jit function.
if INTERPRETING:

    @triton.jit
    def exp(value):
        return tl.exp(value)

    @triton.jit
    def rsqrt(value):
        return tl.math.rsqrt(value)

    @triton.jit
    def div_rn(numerator, denominator):
        return tl.math.div_rn(numerator, denominator)

else:

    @triton.jit
    def exp(value):
        return libdevice.exp(value)

    @triton.jit
    def rsqrt(value):
        return libdevice.rsqrt(value)

    @triton.jit
    def div_rn(numerator, denominator):
        return libdevice.div_rn(numerator, denominator)


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Norm kernels hold a whole row in registers: wider rows fall back to the reference.
MAX_NORM_WIDTH = 16384


@triton.jit
def round_to(value, dtype: tl.constexpr):
    """fp32 `value` rounded to `dtype` and widened again: one torch op's result in that dtype."""
    return value.to(dtype).to(tl.float32)


def rows_of(tensor: torch.Tensor, width: int) -> bool:
    """True for a [N, width] matrix whose rows are unit-stride (any row stride), in a supported dtype."""
    return (
        tensor.dim() == 2
        and tensor.shape[1] == width
        and tensor.dtype in SUPPORTED_DTYPES
        and (tensor.stride(1) == 1 or width == 1)
    )


def num_warps_for(elements_per_program: int) -> int:
    """1 to 16 warps for a program touching this many elements per tensor: about 8 per thread (one 16-byte
    bf16 vector), at most 16 per thread for the widest rows."""
    return max(1, min(16, elements_per_program // 256))
