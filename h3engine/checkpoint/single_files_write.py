"""Writing ComfyUI-style single safetensors files in the layouts h3engine.checkpoint.single_files reads (for tests, our
converter and placeholders, not for serving). `write_single_file(path, tensors, format)` stores each tensor in a format
(one for the file, or one per tensor for a mixed file) under the published key names: fp8 as ComfyUI's per-layer
`comfy_quant` layout or its legacy scaled-fp8 one (`fp8_layout`), int8 (ConvRot included) and NVFP4
(h3engine.checkpoint.nvfp4) as `comfy_quant` layers, whose configs go in `L.comfy_quant` tensors or in the header's
`_quantization_metadata` (`configs_in`). Quantization is single_file_formats' (per-tensor amax / 448 for fp8, per-row
amax / 127 for int8, ConvRot rotating first) and nvfp4.quantize_nvfp4. A file-wide quantized format applies to the
tensors `quantized` picks (the 2-D `.weight`s by default; for ConvRot those of whole groups, for NVFP4 those of rows and
columns in multiples of 16, as comfy-kitchen pads); the others keep their dtype or take the cast format asked ('f32',
'f16', 'bf16'). Names get `prefix` (`model.diffusion_model.` by default). Header and data are written a tensor at a
time in safetensors' order (larger elements first, then by name: every offset aligned to its element size); the file
appears whole or not at all. With `read`, `tensors` only give shapes and dtypes (meta tensors) and each tensor is read
when written (a file larger than memory holds one tensor at a time); with `hole` only the header and the configs are
written, the rest a hole (placeholders).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.safetensors_io import encoded_header, placed
from h3engine.checkpoint.single_file_formats import (
    CONFIG_SUFFIX,
    DEFAULT_CONVROT_GROUP,
    DIFFUSION_MODEL_PREFIX,
    DTYPE_NAMES,
    MARKER_NAME,
    QUANT_METADATA_KEY,
    is_convrot_group,
    quantize_fp8_tensor,
    quantize_int8,
    quantize_int8_convrot,
)

CAST_FORMATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
FP8_SCALED_FORMATS = {"fp8_e4m3_scaled": torch.float8_e4m3fn, "fp8_e5m2_scaled": torch.float8_e5m2}
INT8_FORMATS = ("int8_tensorwise", "int8_rowwise", "int8_convrot")
WRITABLE_FORMATS = ("keep", *CAST_FORMATS, "fp8_e4m3", *FP8_SCALED_FORMATS, *INT8_FORMATS, "nvfp4")
_COMFY_NAMES = {"fp8_e4m3_scaled": "float8_e4m3fn", "fp8_e5m2_scaled": "float8_e5m2", "nvfp4": "nvfp4"}


def default_quantized(name: str, tensor: Tensor) -> bool:
    """The tensors a file-wide quantized format applies to: the matrices of linear layers."""
    return name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()


def _stored_format(
    name: str,
    tensor: Tensor,
    requested: str,
    explicit: bool,
    quantized: Callable[[str, Tensor], bool],
    group: int,
) -> str:
    if requested not in WRITABLE_FORMATS:
        raise ValueError(f"format {requested!r} cannot be written; writable: {', '.join(WRITABLE_FORMATS)}")
    if requested == "keep" or (requested in CAST_FORMATS and not tensor.is_floating_point()):
        return "keep"
    if requested in CAST_FORMATS:
        return requested
    if not explicit and not quantized(name, tensor):
        return "keep"
    if not name.endswith(".weight") or not tensor.is_floating_point():
        raise ValueError(
            f"tensor {name!r}: only floating-point '.weight' tensors are quantized ({requested})"
        )
    if requested in ("int8_rowwise", "int8_convrot", "nvfp4") and tensor.dim() != 2:
        raise ValueError(f"tensor {name!r}: {requested} stores matrices, not shape {list(tensor.shape)}")
    if requested == "int8_convrot" and tensor.shape[1] % group:
        if explicit:
            raise ValueError(
                f"tensor {name!r}: {tensor.shape[1]} columns are not whole ConvRot groups of {group}"
            )
        return "keep"
    if requested == "nvfp4" and (tensor.shape[0] % nvfp4.BLOCK or tensor.shape[1] % nvfp4.BLOCK):
        if explicit:
            raise ValueError(
                f"tensor {name!r}: NVFP4 stores rows and columns of multiples of {nvfp4.BLOCK}, not shape "
                f"{list(tensor.shape)}"
            )
        return "keep"
    return requested


class _Plan:
    """The stored tensors of the file: (key, shape, dtype) each, and how to make each one's values."""

    def __init__(self) -> None:
        self.specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.makers: dict[str, Callable[[], Tensor]] = {}
        self.configs: dict[str, dict[str, object]] = {}

    def add(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, maker: Callable[[], Tensor]) -> None:
        if key in self.makers:
            raise ValueError(f"two tensors are stored as {key!r}")
        self.specs.append((key, tuple(shape), dtype))
        self.makers[key] = maker


def _quantizer(source: Callable[[], Tensor], fmt: str, group: int) -> Callable[[str], Tensor]:
    """The parts of one quantized tensor ('values', 'scale'; NVFP4 'block_scale' too), each made by quantizing `source()` again: nothing is
    held between the two parts (safetensors' order writes every scale before any values). Quantization is
    deterministic (the same values give the same bits), so the two parts agree: the values are quantized from a
    float32 copy of their own, as CPU GEMM kernels (ConvRot's rotation) may round differently by where a tensor lies
    (a view into a mapped file), so a tensor read from a file gives the bytes the same tensor in memory gives."""

    def part(which: str) -> Tensor:
        tensor = placed(source(), "cpu", torch.float32)
        if fmt == "nvfp4":
            values, block_scale, scale = nvfp4.quantize_nvfp4(tensor)
            return {"values": values, "scale": scale, "block_scale": block_scale}[which]
        if fmt in FP8_SCALED_FORMATS:
            values, scale = quantize_fp8_tensor(tensor, FP8_SCALED_FORMATS[fmt])
        elif fmt == "int8_convrot":
            values, scale = quantize_int8_convrot(tensor, group)
        else:
            values, scale = quantize_int8(tensor, per_row=fmt == "int8_rowwise")
        return values if which == "values" else scale

    return part


def write_single_file(
    path: str | Path,
    tensors: Mapping[str, Tensor],
    format: str | Mapping[str, str],
    *,
    prefix: str = DIFFUSION_MODEL_PREFIX,
    fp8_layout: str = "comfy_quant",
    configs_in: str = "tensors",
    convrot_group: int = DEFAULT_CONVROT_GROUP,
    input_scale: float | None = None,
    quantized: Callable[[str, Tensor], bool] = default_quantized,
    metadata: Mapping[str, str] | None = None,
    read: Callable[[str], Tensor] | None = None,
    hole: bool = False,
) -> dict[str, str]:
    """Write `tensors` (name -> tensor on the host) to the single file `path`, each in `format` (one WRITABLE_FORMATS
    name for the file, or name -> format, absent names kept as given); returns the format each tensor was stored in.

    `fp8_layout`: 'comfy_quant' (`L.weight_scale` + the layer's config) or 'legacy' (`L.scale_weight` + the
    `scaled_fp8` marker); `configs_in`: 'tensors' (`L.comfy_quant`) or 'metadata' (`_quantization_metadata`);
    `input_scale`: a value stored as every fp8-scaled layer's input scale (read back, never applied); `read`: name ->
    the tensor, called when that tensor is written (each quantized one twice), the values of `tensors` then standing
    only for its shape and dtype; `hole`: the data a hole of zeros (a sparse file) but the configs' bytes."""
    path = Path(path)
    if fp8_layout not in ("comfy_quant", "legacy") or configs_in not in ("tensors", "metadata"):
        raise ValueError(
            f"fp8_layout {fp8_layout!r} / configs_in {configs_in!r} is not a layout written here"
        )
    if not is_convrot_group(convrot_group):
        raise ValueError(f"ConvRot group size {convrot_group} is not a power of 4")
    if not isinstance(format, str) and (unknown := sorted(set(format) - set(tensors))):
        raise ValueError(f"format names tensors not given: {unknown}")
    stored: dict[str, str] = {}
    plan = _Plan()
    for name, tensor in tensors.items():
        requested = format if isinstance(format, str) else format.get(name, "keep")
        fmt = _stored_format(name, tensor, requested, not isinstance(format, str), quantized, convrot_group)
        stored[name] = fmt
        key = prefix + name
        source = (lambda tensor=tensor: tensor) if read is None else (lambda name=name: read(name))
        if fmt == "keep" or fmt in CAST_FORMATS or fmt == "fp8_e4m3":
            if fmt == "keep":
                dtype = tensor.dtype
            else:
                dtype = torch.float8_e4m3fn if fmt == "fp8_e4m3" else CAST_FORMATS[fmt]
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name here")
            plan.add(key, tuple(tensor.shape), dtype, lambda source=source, dtype=dtype: source().to(dtype))
            continue
        layer = key.removesuffix(".weight")
        part = _quantizer(source, fmt, convrot_group)
        legacy = fp8_layout == "legacy" and fmt in FP8_SCALED_FORMATS
        _plan_values_and_scale(plan, layer, tuple(tensor.shape), fmt, legacy, part)
        if input_scale is not None and (fmt in FP8_SCALED_FORMATS or fmt == "nvfp4"):
            input_key = f"{layer}.scale_input" if legacy else f"{layer}.input_scale"
            plan.add(input_key, (), torch.float32, lambda: torch.tensor(float(input_scale)))
        if legacy:
            continue
        config: dict[str, object] = {"format": _COMFY_NAMES.get(fmt, "int8_tensorwise")}
        if fmt == "int8_convrot":
            config.update(convrot=True, convrot_groupsize=convrot_group)
        plan.configs[layer] = config
        if configs_in == "tensors":
            encoded = torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)
            plan.add(
                f"{layer}.{CONFIG_SUFFIX}", tuple(encoded.shape), torch.uint8, lambda encoded=encoded: encoded
            )
    if fp8_layout == "legacy" and any(fmt in FP8_SCALED_FORMATS for fmt in stored.values()):
        plan.add(
            prefix + MARKER_NAME, (0,), torch.float8_e4m3fn, lambda: torch.empty(0, dtype=torch.float8_e4m3fn)
        )
    header_metadata = {"format": "pt", **(metadata or {})}
    if configs_in == "metadata" and plan.configs:
        header_metadata[QUANT_METADATA_KEY] = json.dumps({"format_version": "1.0", "layers": plan.configs})
    _write(path, plan, header_metadata, hole)
    return stored


def _plan_values_and_scale(
    plan: _Plan, layer: str, shape: tuple[int, ...], fmt: str, legacy: bool, part: Callable[[str], Tensor]
) -> None:
    """A quantized weight's values and scale; NVFP4's values (uint8 [R, K/2]), swizzled block scales (e4m3, padded
    to 128 x 4 tiles) and global scale `weight_scale_2`."""
    if fmt == "nvfp4":
        rows, columns = shape
        plan.add(f"{layer}.weight", (rows, columns // 2), torch.uint8, lambda: part("values"))
        blocks = nvfp4.blocked_shape(rows, columns // nvfp4.BLOCK)
        plan.add(f"{layer}.weight_scale", blocks, torch.float8_e4m3fn, lambda: part("block_scale"))
        plan.add(f"{layer}.weight_scale_2", (), torch.float32, lambda: part("scale"))
        return
    plan.add(f"{layer}.weight", shape, FP8_SCALED_FORMATS.get(fmt, torch.int8), lambda: part("values"))
    scale_shape = (shape[0], 1) if fmt in ("int8_rowwise", "int8_convrot") else ()
    scale_key = f"{layer}.scale_weight" if legacy else f"{layer}.weight_scale"
    plan.add(scale_key, scale_shape, torch.float32, lambda: part("scale"))


def _write(path: Path, plan: _Plan, metadata: Mapping[str, str], hole: bool = False) -> None:
    # safetensors' order: larger elements first, then by key, so each tensor's offset is a multiple of its size.
    ordered = sorted(plan.specs, key=lambda spec: (-torch.empty((), dtype=spec[2]).element_size(), spec[0]))
    encoded, data_bytes = encoded_header(ordered, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as handle:
            handle.write(encoded)
            if hole:  # the data's length, nothing of it written (a hole), but the configs (a few bytes)
                handle.truncate(len(encoded) + data_bytes)
            for key, shape, dtype in ordered:
                nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                if hole and not key.endswith("." + CONFIG_SUFFIX):
                    handle.seek(nbytes, os.SEEK_CUR)
                    continue
                tensor = plan.makers[key]().detach().to("cpu")
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise ValueError(
                        f"{key}: made {tensor.dtype} {list(tensor.shape)}, declared {dtype} {list(shape)}"
                    )
                handle.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
