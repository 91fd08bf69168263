"""Writing GGUF weight files like the community's quantized H3 files (for tests and conversions, not for serving).

`write_gguf(path, tensors, types)` quantizes each tensor with gguf-py's numpy quantizers (`gguf.quants.quantize`)
and writes one GGUF file with `gguf.GGUFWriter` (`general.architecture` = `architecture`). `WRITABLE_TYPES` are
the types gguf-py can quantize that ggml's classic files use; the K-quants and IQ types it can only dequantize.
As community files do, a 1-D tensor (norm weights, biases, rope frequencies) stays F32 whatever is asked, and so
does a tensor whose last dim is not whole blocks of the asked type (`stored_type`). Tensor names are written as
given (prefix them with `model.diffusion_model.` for the single-file layout). The file appears whole or not at all
(written beside it, then renamed). `write_gguf_placeholder` writes the header of a file of any size and types,
its data a hole of zeros (planning and layout checks at the released size).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint import gguf_blocks
from h3engine.checkpoint.gguf_files import PLACEHOLDER_KEY

# Types gguf-py 0.19 quantizes in numpy (it also quantizes TQ1_0, TQ2_0 and MXFP4, which H3 files do not use).
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
# The type 1-D tensors and tensors of partial blocks are kept in.
KEPT_TYPE = "F32"


def stored_type(tensor: Tensor, requested: str) -> str:
    """The type `write_gguf` stores `tensor` in when asked for `requested` (a WRITABLE_TYPES name)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if requested not in WRITABLE_TYPES:
        raise ValueError(f"GGUF type {requested!r} cannot be written; writable: {', '.join(WRITABLE_TYPES)}")
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType[requested]]
    if tensor.dim() <= 1 or tensor.shape[-1] % block_size:
        return KEPT_TYPE
    return requested


def write_gguf(
    path: str | Path,
    tensors: Mapping[str, Tensor],
    types: Mapping[str, str] | str,
    architecture: str = "h3",
) -> dict[str, str]:
    """Write `tensors` (floating point, at least 1-D) to the GGUF file `path`, each in `types[name]` (F32 where a
    name is absent) or in `types` when it is one name; returns the type each tensor was stored in."""
    from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = Path(path)
    if not isinstance(types, str) and (unknown := sorted(set(types) - set(tensors))):
        raise ValueError(f"types names tensors not given: {unknown}")
    stored: dict[str, str] = {}
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, architecture)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.dim() == 0:
            raise ValueError(f"tensor {name!r}: only floating-point tensors of 1 or more dims are written")
        requested = types if isinstance(types, str) else types.get(name, KEPT_TYPE)
        stored[name] = stored_type(tensor, requested)
        qtype = GGMLQuantizationType[stored[name]]
        # bf16 and fp16 widen to float32 exactly; gguf-py quantizes from float32.
        values = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(partial, path)
    return stored


def placeholder_type(shape: tuple[int, ...], requested: str) -> str:
    """The type a placeholder stores a tensor of `shape` in when `requested` (any type gguf_blocks reads): 1-D in
    F32; a row of partial blocks of a K-quant in Q8_0 (as community files keep such rows in a 32-block type), and
    F16 when even that does not fit."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(shape) <= 1:
        return KEPT_TYPE
    for kind in (requested, "Q8_0", "F16"):
        block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        if shape[-1] % block_size == 0:
            return kind
    return KEPT_TYPE


def write_gguf_placeholder(
    path: str | Path, shapes: Mapping[str, tuple[int, ...]], requested: str, architecture: str = "h3"
) -> dict[str, str]:
    """A GGUF file of the given tensor shapes in `requested` (see `placeholder_type`) whose data region is a hole
    (a sparse file: every byte reads as zero, a valid block of every type): a real header at the real size, for
    planning memory and checking layouts without writing gigabytes. Returns the type of each tensor."""
    import numpy as np
    from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, architecture)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_string(PLACEHOLDER_KEY, "hole")
    stored: dict[str, str] = {}
    data_bytes = 0
    for name, shape in shapes.items():
        stored[name] = placeholder_type(tuple(shape), requested)
        qtype = GGMLQuantizationType[stored[name]]
        nbytes = gguf_blocks.byte_count(qtype, shape, name)
        byte_shape = (*shape[:-1], nbytes // max(1, math.prod(shape[:-1])))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        data_bytes += GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        header_bytes = GGUFWriter.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
    finally:
        writer.close()
    os.truncate(partial, header_bytes + data_bytes)
    os.replace(partial, path)
    return stored
