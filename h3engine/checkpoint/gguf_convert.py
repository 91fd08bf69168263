"""A released checkpoint's DiT as a community-style GGUF file (`--dit FILE.gguf` reads it), a tensor at a time.

`convert_dit_to_gguf(layout, paths, out, kind)` writes one partition's DiT (either layout, read as native through
`dit_format.as_native_files`): names `model.diffusion_model.` + native key, QKV rows stacked [q; k; v] as our module
holds them, `rope.inv_freq` left out, `general.architecture` "h3". A linear's 2-D weight is stored in `kind` where its
rows are whole blocks of it, else Q8_0, else F16 (gguf_write.placeholder_type; F32 where a value is beyond fp16's
range); the fp32 islands (what our module holds in fp32 whatever its dtype: FP32_PARAMETER_NAMES, PRUNED_FP32_NAMES,
a pruned form's AdaLN projections), 1-D tensors and anything else in F32. K-quants are ours (gguf_quantize), the rest
gguf-py's. The header is written from the shapes first, then each tensor is read, quantized and appended: the host
holds one tensor at a time. The file is written as `OUT.partial`, renamed once whole (removed on failure).

`convert_checkpoint_to_gguf(source, out, kind)` writes a folder (h3engine.checkpoint.dit_convert: the rest linked,
`gguf_files.json` last, removed on failure) with each partition's DiT as `<partition>-dit-<kind>.gguf`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from h3engine.checkpoint import dit_format, gguf_blocks, gguf_quantize
from h3engine.checkpoint.dit_convert import (
    DiTConversion,
    convert_checkpoint_dits,
    is_fp32_island,
    linear_weight,
    module_tensor,
)
from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.gguf_files import DIFFUSION_MODEL_PREFIX
from h3engine.checkpoint.gguf_write import KEPT_TYPE, placeholder_type
from h3engine.checkpoint.layout import DIT_FILES_JSON, CheckpointLayout, PartitionPaths
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.errors import CheckpointError

ARCHITECTURE = "h3"
GGUF_FILES_JSON = DIT_FILES_JSON  # read back by h3engine.checkpoint.layout.detect_layout
FP16_MAX = 65504.0


# One DiT written as GGUF (its types: GGML type names).
GGUFConversion = DiTConversion


def gguf_file_name(partition: str, kind: str) -> str:
    """`<partition>-dit-<kind>.gguf`, the kind in lower case ('fl2va-dit-q4_k.gguf')."""
    return f"{partition}-dit-{gguf_quantize.ggml_type(kind).name.lower()}.gguf"


def tensor_type(key: str, shape: tuple[int, ...], kind: str, linear: bool, fp32: bool = False) -> str:
    """The type a DiT tensor is stored in when `kind` is asked for: `kind` (or the 32-block / F16 fallback of
    gguf_write.placeholder_type) for a linear layer's 2-D weight, F32 for the rest and for an fp32 island (named,
    or `fp32`: the module holds it in fp32)."""
    if is_fp32_island(key, fp32) or len(shape) != 2 or not linear:
        return KEPT_TYPE
    return placeholder_type(shape, gguf_quantize.ggml_type(kind).name)


def convert_dit_to_gguf(
    layout: CheckpointLayout,
    paths: PartitionPaths,
    out: str | os.PathLike[str],
    kind: str,
    device: str | torch.device = "cpu",
) -> GGUFConversion:
    """Write the DiT of partition `paths` of `layout` to the GGUF file `out` with its linears in `kind` (any type
    gguf_quantize writes: 'q8_0', 'q6_k', 'q4_k', ...); the K-quants compute on `device`."""
    out = Path(out)
    gguf_quantize.ggml_type(kind)  # refuse an unknown kind before reading anything
    if paths.dit_weights is not None:
        raise CheckpointError(f"{paths.dit_weights}: this partition's DiT is already a single file")
    source = dit_source(layout, paths, torch.bfloat16)
    files = dit_format.as_native_files(source.files, source.config)
    with torch.device("meta"):
        module = source.build()  # in bf16: what it holds in fp32 is an island
    keys = sorted(key for key in files.infos if key != ROPE_KEY)
    plan = {key: _planned_type(files, module, key, kind) for key in keys}
    partial = out.with_name(out.name + ".partial")
    errors: dict[str, float] = {}
    try:
        writer = _header(partial, {key: (files.infos[key].shape, plan[key]) for key in keys})
        try:
            for key in keys:
                values = module_tensor(files, source.config, key)
                raw = gguf_quantize.quantize(values.to(device), plan[key])
                errors[key] = _relative_error(raw, plan[key], values)
                writer.write_tensor_data(raw.reshape(-1).numpy())
        finally:
            writer.close()
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        files.close()
        source.files.close()
    before = sum(files.infos[key].nbytes for key in keys)
    return GGUFConversion(out, before, out.stat().st_size, plan, errors)


def _planned_type(files: WeightFiles, module: nn.Module, key: str, kind: str) -> str:
    """`tensor_type` of a key, its module path looked up for a linear layer and its dtype there; an F16 fallback
    holding values beyond fp16's range is stored in F32 instead (read here, before the header: a fallback row is a
    narrow one)."""
    shape = tuple(files.infos[key].shape)
    linear, fp32 = linear_weight(module, key)
    chosen = tensor_type(key, shape, kind, linear, fp32)
    if chosen == "F16" and float(files.tensor(key).float().abs().max()) > FP16_MAX:
        return KEPT_TYPE
    return chosen


def _header(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]):  # noqa: ANN202 (gguf.GGUFWriter)
    """A GGUFWriter on `path` with the header, metadata and tensor records written, ready for the tensor data."""
    from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(path, ARCHITECTURE)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    for key, (shape, type_name) in tensors.items():
        qtype = GGMLQuantizationType[type_name]
        shape = tuple(shape) or (1,)
        nbytes = gguf_blocks.byte_count(qtype, shape, key)
        byte_shape = (*shape[:-1], nbytes // max(1, math.prod(shape[:-1])))
        writer.add_tensor_info(
            DIFFUSION_MODEL_PREFIX + key, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype
        )
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    except BaseException:
        writer.close()
        raise
    return writer


def _relative_error(raw: Tensor, type_name: str, values: Tensor) -> float:
    """RMS error over RMS value of the stored values against `values` (0 for an all-zero tensor stored exactly),
    decoded a few rows at a time (the host holds no float copy of a whole large tensor)."""
    kind = gguf_blocks.GGMLType[type_name]
    width = values.shape[-1] if values.dim() else 1
    rows, raw_rows = (
        values.reshape(-1, width),
        raw.reshape(-1, raw.numel() // max(1, values.numel() // width)),
    )
    step = max(1, gguf_quantize.CHUNK_VALUES // width)
    error = energy = 0.0
    for start in range(0, rows.shape[0], step):
        reference = rows[start : start + step].float()
        stored = gguf_blocks.dequantize(raw_rows[start : start + step], kind, tuple(reference.shape))
        error += float((stored - reference).square().sum(dtype=torch.float64))
        energy += float(reference.square().sum(dtype=torch.float64))
    return math.sqrt(error / energy) if energy > 0 else math.sqrt(error)


def convert_checkpoint_to_gguf(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    kind: str,
    device: str | torch.device = "cpu",
) -> dict[str, GGUFConversion]:
    """Write `source` (a released checkpoint, either layout) into the empty or missing folder `out` with each
    partition's DiT as a GGUF file of `kind` (see the module doc); returns each partition's conversion."""
    gguf_quantize.ggml_type(kind)

    def write(layout: CheckpointLayout, paths: PartitionPaths, path: Path) -> GGUFConversion:
        return convert_dit_to_gguf(layout, paths, path, kind, device)

    return convert_checkpoint_dits(source, out, lambda partition: gguf_file_name(partition, kind), write)
