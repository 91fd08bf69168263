"""A released checkpoint's DiT as a ComfyUI-style INT8 ConvRot single safetensors file (`--dit FILE.safetensors`
reads it), a tensor at a time.

`convert_dit_to_int8(layout, paths, out, group)` writes one partition's DiT (either layout, read as native through
`dit_format.as_native_files`) with h3engine.checkpoint.single_files_write: names `model.diffusion_model.` + native key,
QKV rows stacked [q; k; v] as our module holds them (the keys of h3engine.checkpoint.gguf_convert), `rope.inv_freq` left
out. A linear's 2-D weight whose columns are whole ConvRot groups of `group` is stored in 'int8_convrot' (rotated, int8
with one fp32 scale per row, the layer's `comfy_quant` config beside it), any other linear's in 'int8_rowwise' (not
rotated); the fp32 islands (FP32_PARAMETER_NAMES, PRUNED_FP32_NAMES, a linear the module holds in fp32) and everything
else as stored. The writer reads each tensor when it writes it (`read=`): the host holds one tensor at a time, the file
appears whole or not at all; each quantized tensor's error is then measured on the file, a few rows at a time.

`convert_checkpoint_to_int8(source, out, group)` writes a folder (h3engine.checkpoint.dit_convert: the rest linked,
`gguf_files.json` last, removed on failure) with each partition's DiT as `<partition>-dit-int8_convrot.safetensors`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from h3engine.checkpoint import dit_format, gguf_quantize
from h3engine.checkpoint.dit_convert import (
    DiTConversion,
    convert_checkpoint_dits,
    is_fp32_island,
    linear_weight,
    module_tensor,
)
from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.layout import CheckpointLayout, PartitionPaths
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.single_file_formats import DEFAULT_CONVROT_GROUP, dequantize_scaled, is_convrot_group
from h3engine.checkpoint.single_files import SingleFile
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig

INT8_FORMAT = "int8_convrot"
# Linears whose columns are not whole ConvRot groups: INT8 with one scale per row, not rotated.
INT8_ROWWISE = "int8_rowwise"


def int8_file_name(partition: str) -> str:
    """`<partition>-dit-int8_convrot.safetensors`."""
    return f"{partition}-dit-{INT8_FORMAT}.safetensors"


def stored_format(module: nn.Module, key: str, shape: tuple[int, ...], group: int) -> str:
    """For a linear layer's 2-D weight that is no fp32 island of `module` (built in bf16): 'int8_convrot' where its
    columns are whole `group`-column groups, else 'int8_rowwise' (the exact AdaLN projections' 2688 columns: kept in
    bf16 they would be 24 GiB of a 43 GiB file, the community's unpruned INT8 file is 31.7); anything else 'keep'."""
    linear, fp32 = linear_weight(module, key)
    if not linear or len(shape) != 2 or is_fp32_island(key, fp32):
        return "keep"
    return INT8_FORMAT if shape[1] % group == 0 else INT8_ROWWISE


def convert_dit_to_int8(
    layout: CheckpointLayout,
    paths: PartitionPaths,
    out: str | os.PathLike[str],
    group: int = DEFAULT_CONVROT_GROUP,
) -> DiTConversion:
    """Write the DiT of partition `paths` of `layout` to the single file `out` with its large linears in INT8
    ConvRot of `group` (see the module doc)."""
    out = Path(out)
    if not is_convrot_group(group):
        raise ValueError(f"ConvRot group size {group} is not a power of 4")
    if paths.dit_weights is not None:
        raise CheckpointError(f"{paths.dit_weights}: this partition's DiT is already a single file")
    source = dit_source(layout, paths, torch.bfloat16)
    files = dit_format.as_native_files(source.files, source.config)
    try:
        with torch.device("meta"):
            module = source.build()  # in bf16: what it holds in fp32 is an island
        keys = sorted(key for key in files.infos if key != ROPE_KEY)
        stand_ins = {key: _stand_in(files, key) for key in keys}
        formats = {key: stored_format(module, key, tuple(stand_ins[key].shape), group) for key in keys}
        types = write_single_file(
            out,
            stand_ins,
            formats,
            convrot_group=group,
            read=lambda key: module_tensor(files, source.config, key),
        )
        try:
            errors = _errors(out, files, source.config, types)
        except BaseException:
            out.unlink(missing_ok=True)
            raise
    finally:
        files.close()
        source.files.close()
    before = sum(files.infos[key].nbytes for key in keys)
    return DiTConversion(out, before, out.stat().st_size, types, errors)


def _stand_in(files: WeightFiles, key: str) -> torch.Tensor:
    """A meta tensor of the shape and dtype `files.tensor(key)` reads (a weight stored in FP8 reads as fp32)."""
    info = files.infos[key]
    dtype = torch.float32 if key in getattr(files, "scales", {}) else info.dtype
    return torch.empty(info.shape, dtype=dtype, device="meta")


def _errors(path: Path, files: WeightFiles, config: DiTConfig, types: dict[str, str]) -> dict[str, float]:
    """Per key, RMS error over RMS value of the file's values against the source's (0 for a tensor kept as stored),
    the quantized ones dequantized from the written file a few rows at a time."""
    errors = {key: 0.0 for key, fmt in types.items() if fmt not in (INT8_FORMAT, INT8_ROWWISE)}
    single = SingleFile.open(path)
    try:
        for key in sorted(set(types) - set(errors)):
            record = single.records[key]
            reference = module_tensor(files, config, key)
            step = max(1, gguf_quantize.CHUNK_VALUES // reference.shape[1])
            error = energy = 0.0
            for start in range(0, reference.shape[0], step):
                rows = slice(start, start + step)
                expected = reference[rows].float()
                assert record.values is not None and record.scale is not None
                stored = dequantize_scaled(
                    record.values[rows], record.scale[rows], record.convrot_group, torch.float32
                )
                error += float((stored - expected).square().sum(dtype=torch.float64))
                energy += float(expected.square().sum(dtype=torch.float64))
            errors[key] = math.sqrt(error / energy) if energy > 0 else math.sqrt(error)
    finally:
        single.close()
    return errors


def convert_checkpoint_to_int8(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    group: int = DEFAULT_CONVROT_GROUP,
) -> dict[str, DiTConversion]:
    """Write `source` (a released checkpoint, either layout) into the empty or missing folder `out` with each
    partition's DiT as an INT8 ConvRot single file (see the module doc); returns each partition's conversion."""
    if not is_convrot_group(group):
        raise ValueError(f"ConvRot group size {group} is not a power of 4")

    def write(layout: CheckpointLayout, paths: PartitionPaths, path: Path) -> DiTConversion:
        return convert_dit_to_int8(layout, paths, path, group)

    return convert_checkpoint_dits(source, out, int8_file_name, write)
