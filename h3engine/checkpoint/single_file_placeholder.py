"""A DiT placeholder as a community single safetensors file (`make-placeholder-checkpoint --weights int8`, `fp8_scaled`,
`nvfp4`).

`write_single_file_placeholder(path, config, weights)` writes the header `convert --weights int8` writes for a DiT of
`config` (h3engine.checkpoint.int8_convert: the same keys, dtypes, shapes, `comfy_quant` configs and scales, in the
same stored order, through the same writer), or for `fp8_scaled` ComfyUI's FP8 e4m3 scaled `comfy_quant` layout of
the same linears (every linear's 2-D weight that is no fp32 island, one float32 scale a tensor), or for `nvfp4`
ComfyUI's NVFP4 layout of those of whole 16-value blocks (h3engine.checkpoint.nvfp4), then a hole: the file
has its full length and nothing of its data is written (a sparse file; values and scales read as zeros) but the layers'
`comfy_quant` config tensors, a few bytes each, written at their offsets so the file reads as the converter's does.
The header's `__metadata__` carries PLACEHOLDER_KEY = "hole", as a GGUF placeholder's does: a reader says
`SingleFile.placeholder` and `DiTFileWeights.placeholder` (the engine and planner then treat it as they treat a GGUF
placeholder). The configs stay tensors, not `_quantization_metadata`, so the keys are the converter's keys.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.dit_convert import is_fp32_island, linear_weight
from h3engine.checkpoint.dit_keys import ROPE_KEY, native_state_shapes, native_storage_dtype
from h3engine.checkpoint.gguf_files import PLACEHOLDER_KEY
from h3engine.checkpoint.int8_convert import int8_file_name, stored_format
from h3engine.checkpoint.single_file_formats import DEFAULT_CONVROT_GROUP
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig

# `--weights` of a placeholder whose DiTs are single safetensors files, and the format of their quantized linears.
SINGLE_FILE_WEIGHTS = {"int8": "int8_convrot", "fp8_scaled": "fp8_e4m3_scaled", "nvfp4": "nvfp4"}


def single_file_name(partition: str, weights: str) -> str:
    """`<partition>-dit-int8_convrot.safetensors` (the converter's name) or `<partition>-dit-fp8_e4m3_scaled...`."""
    if weights == "int8":
        return int8_file_name(partition)
    return f"{partition}-dit-{SINGLE_FILE_WEIGHTS[weights]}.safetensors"


def placeholder_formats(
    config: DiTConfig, weights: str, group: int = DEFAULT_CONVROT_GROUP
) -> dict[str, str]:
    """Per native key (rope.inv_freq aside, sorted), the format it is written in: int8 as the converter chooses
    (int8_convert.stored_format), fp8_scaled every linear's 2-D weight that is no fp32 island (nvfp4 those of whole
    16-value blocks); the rest 'keep'."""
    if weights not in SINGLE_FILE_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(SINGLE_FILE_WEIGHTS)}; got {weights!r}")
    with torch.device("meta"):
        module = H3DiT(config, dtype=torch.bfloat16)  # what it holds in fp32 is an island
    shapes = native_state_shapes(config)
    formats: dict[str, str] = {}
    for key in sorted(key for key in shapes if key != ROPE_KEY):
        shape = tuple(shapes[key])
        if weights == "int8":
            formats[key] = stored_format(module, key, shape, group)
            continue
        linear, fp32 = linear_weight(module, key)
        quantized = linear and len(shape) == 2 and not is_fp32_island(key, fp32)
        if weights == "nvfp4":  # whole 16-value blocks of rows and columns, as comfy-kitchen pads
            quantized = quantized and shape[0] % nvfp4.BLOCK == 0 and shape[1] % nvfp4.BLOCK == 0
        formats[key] = SINGLE_FILE_WEIGHTS[weights] if quantized else "keep"
    return formats


def write_single_file_placeholder(
    path: str | os.PathLike[str], config: DiTConfig, weights: str, group: int = DEFAULT_CONVROT_GROUP
) -> dict[str, str]:
    """Write the placeholder single file of a DiT of `config` in `weights` (SINGLE_FILE_WEIGHTS) to `path` (see the
    module doc); returns the format each native key is stored in."""
    formats = placeholder_formats(config, weights, group)
    shapes = native_state_shapes(config)
    stand_ins = {
        key: torch.empty(tuple(shapes[key]), dtype=native_storage_dtype(key), device="meta")
        for key in formats
    }
    return write_single_file(
        Path(path),
        stand_ins,
        formats,
        convrot_group=group,
        metadata={PLACEHOLDER_KEY: "hole"},
        hole=True,
    )
