"""The single call site of GGUF block dequantization: a Triton kernel where one applies, the torch twin otherwise.

`dequantize` has the arguments and result of `h3engine.checkpoint.gguf_blocks.dequantize` (the twin, the
definition of every type's values) plus an output dtype: the twin's float32 values rounded once to it. The Triton
kernels (`kernels/triton/gguf_dequant.py`, quantized types) compute the same fp32 values and round them once, so
both paths are bit-identical. Triton runs for contiguous uint8 data on a CUDA device unless `H3_KERNELS=reference`
or `h3engine.models.ops.force_reference()` forces the twins (the switch of the fused ops, shared here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from h3engine.checkpoint import gguf_blocks
from h3engine.models import ops
from h3engine.models.ops import Implementation

try:
    from h3engine.models.kernels.triton import gguf_dequant
except ImportError:  # torch builds without triton always use the twin
    gguf_dequant = None


def implementation(
    raw: Tensor, ggml_type: int, shape: Sequence[int], out_dtype: torch.dtype = torch.float32
) -> Implementation:
    """Which implementation `dequantize(raw, ggml_type, shape, out_dtype=out_dtype)` runs."""
    # ops' switch (H3_KERNELS=reference, force_reference()) is read at call time, as ops reads it.
    if ops._reference_forced or gguf_dequant is None or raw.device.type != "cuda":
        return "reference"
    return "triton" if gguf_dequant.supports_dequantize(raw, ggml_type, shape, out_dtype) else "reference"


def dequantize(
    raw: Tensor,
    ggml_type: int,
    shape: Sequence[int],
    name: str = "",
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The tensor of `shape` in `out_dtype` that GGUF bytes `raw` (uint8) of `ggml_type` hold, on raw's device.
    A type not read here, or a byte count that does not fit `shape`, raises CheckpointError naming `name`."""
    gguf_blocks.byte_count(ggml_type, shape, name)
    if implementation(raw, ggml_type, shape, out_dtype) == "triton":
        with torch.cuda.device(raw.device):
            return gguf_dequant.dequantize(raw, ggml_type, shape, out_dtype)
    return gguf_blocks.dequantize(raw, ggml_type, shape, name).to(out_dtype)


def byte_count(ggml_type: int, shape: Sequence[int], name: str = "") -> int:
    """Bytes a tensor of `shape` takes in `ggml_type` (its last dim whole blocks; CheckpointError naming `name`)."""
    return gguf_blocks.byte_count(ggml_type, shape, name)


def type_name(ggml_type: int) -> str:
    """The ggml name of a type id ('Q4_K')."""
    return gguf_blocks.ggml_type_name(ggml_type)
