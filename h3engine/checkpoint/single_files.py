"""Reading one ComfyUI-style single safetensors file (the community's H3 DiT, VAE and text-encoder files), in every
weight format those files come in, memory-mapped.

Contract: `SingleFile.open(path)` parses only the safetensors header and maps the file (read-only, as
h3engine.checkpoint.gguf_files does; of the data it reads only the few bytes of each layer's `comfy_quant` config).
Each logical tensor is a `StoredTensor` record under its name without the DiT prefix `model.diffusion_model.` (a file
without the prefix reads the same): its format, logical shape, stored values and scales as zero-copy views of the
map, the file extent of each stored part, and its layer's quantization config. The scale and config tensors belong
to their weight's record and are no tensors of their own. `tensor(name)` dequantizes to float32 on the CPU;
h3engine.checkpoint.single_file_formats.dequantize_stored is the same math as a pure function, for the model layer
to call on any device once a record's tensors are there (`StoredTensor.moved`). The formats, their key names and
their math are listed in h3engine.checkpoint.single_file_formats.

What is reordered (nothing) and what is refused: the comment below the imports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.gguf_files import PLACEHOLDER_KEY
from h3engine.checkpoint.safetensors_io import read_only_tensor, read_raw_header
from h3engine.checkpoint.single_file_formats import (
    COMFY_FP8,
    COMFY_INT8,
    COMFY_NVFP4,
    CONFIG_SUFFIX,
    DEFAULT_CONVROT_GROUP,
    DIFFUSION_MODEL_PREFIX,
    DTYPES,
    LAYER_PARTS,
    LEGACY_PARTS,
    MARKER_NAME,
    OTHER_DTYPE_BITS,
    PLAIN_FORMATS,
    QUANT_METADATA_KEY,
    SCALED_FP8,
    StoredPart,
    StoredTensor,
    check_refused,
    dequantize_stored,
    is_convrot_group,
)
from h3engine.errors import CheckpointError

# QKV: a DiT single file stores `qkv_proj` rows in the stacked [q; k; v] order, our module's order (H3_SPEC.md §1.3),
# not the release's per-head interleave. Nothing here reorders rows; the caller does what its source needs.
#
# Refusals are CheckpointErrors naming the file: a truncated or corrupt header (or a tensor past the end of the file),
# a tensor stored twice (with and without the prefix) or missing, an inconsistent layer (a config or scale with no
# weight, a weight of another dtype than its format stores, a scale of the wrong dtype or shape, a ConvRot group that
# is no power of 4 or does not divide the columns); and, when read (`tensor`, `check_supported`), a tensor whose format
# is not read here (MXFP8, W4A4 / W4A8 ConvRot, AWQ, an unknown format, an integer tensor with no config), named
# with its format. An NVFP4 layer's parts are checked at open (uint8 values of whole 16-value blocks, e4m3 block scales
# of the padded swizzled size, one float global scale).

__all__ = ["DIFFUSION_MODEL_PREFIX", "SingleFile", "StoredPart", "StoredTensor", "dequantize_stored"]

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class _Entry:
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute
    nbytes: int


class SingleFile:
    """The tensors of one single safetensors file, read lazily from its memory map."""

    def __init__(
        self,
        path: Path,
        records: dict[str, StoredTensor],
        metadata: dict[str, str],
        marker: str | None,
        data: Tensor,
    ) -> None:
        self.path = path
        self.records = records
        self.metadata = metadata
        # The dtype name of the legacy `scaled_fp8` marker tensor, None without one.
        self.marker = marker
        self._data = data  # uint8 view of the whole map: the records' tensors are views of it

    @classmethod
    def open(cls, path: str | Path) -> SingleFile:
        """Parse `path`'s header and map the file; nothing of its tensors' data is read (a layer's comfy_quant
        config, a few bytes, is)."""
        path = Path(path)
        entries, metadata, size = _read_header(path)
        data = _map(path, size)
        records, marker = _Layers(path, entries, metadata, data).records()
        return cls(path, records, metadata, marker, data)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.removeprefix(DIFFUSION_MODEL_PREFIX) in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def record(self, name: str) -> StoredTensor:
        """The record of tensor `name` (with or without DIFFUSION_MODEL_PREFIX)."""
        record = self.records.get(name.removeprefix(DIFFUSION_MODEL_PREFIX))
        if record is None:
            raise CheckpointError(
                f"{self.path}: missing tensor {name!r} (the file holds {len(self.records)})"
            )
        return record

    @property
    def placeholder(self) -> bool:
        """Whether the file is a placeholder whose data is a hole of zeros (`__metadata__[PLACEHOLDER_KEY]` "hole":
        h3engine.checkpoint.single_file_placeholder), as a GGUF placeholder is."""
        return self.metadata.get(PLACEHOLDER_KEY) == "hole"

    def formats(self) -> dict[str, int]:
        """How many tensors the file stores in each format."""
        counts: dict[str, int] = {}
        for record in self.records.values():
            counts[record.format] = counts.get(record.format, 0) + 1
        return counts

    def check_supported(self) -> None:
        """Refuse the file if a tensor is stored in a format not read here (the first one, named with its format)."""
        for record in self.records.values():
            if not record.supported:
                self.tensor(record.name)

    def tensor(self, name: str, out_dtype: torch.dtype = torch.float32) -> Tensor:
        """Tensor `name` dequantized (float32 unless asked), on the CPU, in its logical shape."""
        record = self.record(name)
        try:
            return dequantize_stored(record, out_dtype)
        except CheckpointError as error:
            raise CheckpointError(f"{self.path}: {error}; not read") from None

    def close(self) -> None:
        """Drop the records (and with the last view of the map, the map)."""
        self.records = {}
        self._data = torch.empty(0, dtype=torch.uint8)


def _read_header(path: Path) -> tuple[dict[str, _Entry], dict[str, str], int]:
    header, base, size = read_raw_header(path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    entries: dict[str, _Entry] = {}
    for key, entry in header.items():
        try:
            dtype = str(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {key!r}") from None
        if begin < 0 or end < begin or any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: corrupt offsets or shape for tensor {key!r}")
        bits = DTYPES[dtype].itemsize * 8 if dtype in DTYPES else OTHER_DTYPE_BITS.get(dtype)
        if bits is not None and bits % 8 == 0 and end - begin != math.prod(shape) * bits // 8:
            raise CheckpointError(
                f"{path}: tensor {key!r} holds {end - begin} bytes, its {dtype} shape {list(shape)} needs "
                f"{math.prod(shape) * bits // 8}"
            )
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated file: tensor {key!r} ends at byte {base + end}, the file has {size}"
            )
        entries[key] = _Entry(key, dtype, shape, base + begin, end - begin)
    return entries, {str(k): str(v) for k, v in metadata.items()}, size


def _map(path: Path, size: int) -> Tensor:
    try:
        # A read-only map commits no memory (a copy-on-write map larger than RAM is refused); loaders copy.
        return read_only_tensor(np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot map the file ({error})") from None


class _Layers:
    """Groups a header's tensors into records: each layer's weight with its scales and config."""

    def __init__(
        self, path: Path, entries: dict[str, _Entry], metadata: dict[str, str], data: Tensor
    ) -> None:
        self.path = path
        self.data = data
        self.entries: dict[str, _Entry] = {}  # by name without the prefix
        for stored_name, entry in entries.items():
            name = stored_name.removeprefix(DIFFUSION_MODEL_PREFIX)
            if name in self.entries:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is stored twice ({self.entries[name].stored_name!r} and "
                    f"{stored_name!r})"
                )
            self.entries[name] = entry
        self.metadata_configs = self._metadata_configs(metadata)

    def records(self) -> tuple[dict[str, StoredTensor], str | None]:
        consumed: set[str] = set()
        records: dict[str, StoredTensor] = {}
        marker = None
        for name, entry in self.entries.items():
            if name.rsplit(".", 1)[-1] == MARKER_NAME and math.prod(entry.shape) in (0, 2):
                marker = entry.dtype
                consumed.add(name)
        layers = {
            name.removesuffix("." + CONFIG_SUFFIX)
            for name in self.entries
            if name.endswith("." + CONFIG_SUFFIX)
        }
        layers |= set(self.metadata_configs)
        for layer in sorted(layers):
            record = self._quantized(layer, consumed)
            records[record.name] = record
        legacy = {name.rsplit(".", 1)[0] for name in self.entries if name.rsplit(".", 1)[-1] in LEGACY_PARTS}
        if both := sorted(legacy & layers):
            raise CheckpointError(
                f"{self.path}: layer {both[0]!r} has both a quantization config and legacy scaled-fp8 scales"
            )
        for layer in sorted(legacy):
            record = self._legacy(layer, consumed)
            records[record.name] = record
        for name, entry in self.entries.items():
            if name not in consumed and name not in records:
                records[name] = self._plain(name, entry)
        ordered = {name: records[name] for name in self.entries if name in records}
        return ordered, marker

    # --- the configs

    def _metadata_configs(self, metadata: dict[str, str]) -> dict[str, dict[str, Any]]:
        if QUANT_METADATA_KEY not in metadata:
            return {}
        try:
            layers = json.loads(metadata[QUANT_METADATA_KEY])["layers"]
            if not isinstance(layers, dict) or not all(isinstance(c, dict) for c in layers.values()):
                raise TypeError("layers is not an object of objects")
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{self.path}: corrupt {QUANT_METADATA_KEY} metadata ({error})") from None
        return {str(k).removeprefix(DIFFUSION_MODEL_PREFIX): v for k, v in layers.items()}

    def _config(self, layer: str, consumed: set[str]) -> dict[str, Any]:
        config = self.metadata_configs.get(layer)
        entry = self.entries.get(f"{layer}.{CONFIG_SUFFIX}")
        if entry is None:
            assert config is not None
            return config
        consumed.add(f"{layer}.{CONFIG_SUFFIX}")
        try:
            if entry.dtype != "U8" or len(entry.shape) != 1:
                raise TypeError(f"a {entry.dtype} tensor of shape {list(entry.shape)}, not uint8 bytes")
            raw = self.data[entry.offset : entry.offset + entry.nbytes]
            stored = json.loads(bytes(raw.numpy()).decode("utf-8"))
            if not isinstance(stored, dict):
                raise TypeError("not a JSON object")
        except (ValueError, TypeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{self.path}: corrupt {entry.stored_name!r} ({error})") from None
        if config is not None and config != stored:
            raise CheckpointError(
                f"{self.path}: layer {layer!r} has two different configs: {entry.stored_name!r} says {stored}, "
                f"{QUANT_METADATA_KEY} says {config}"
            )
        return stored

    # --- the records

    def _part(self, role: str, entry: _Entry) -> StoredPart:
        return StoredPart(role, entry.stored_name, entry.dtype, entry.shape, entry.offset, entry.nbytes)

    def _view(self, entry: _Entry) -> Tensor | None:
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            return None
        raw = self.data[entry.offset : entry.offset + entry.nbytes]
        if entry.offset % dtype.itemsize:
            raw = raw.clone()  # not aligned for a view of this dtype
        return raw.view(dtype).view(entry.shape)

    def _plain(self, name: str, entry: _Entry) -> StoredTensor:
        fmt = PLAIN_FORMATS.get(entry.dtype)
        reason = None
        if fmt is None:
            fmt = f"dtype {entry.dtype}"
            reason = (
                f"{entry.dtype} values with no scale or quantization config are not a weight format read here"
            )
        return StoredTensor(
            name=name,
            stored_name=entry.stored_name,
            format=fmt,
            shape=entry.shape,
            values=self._view(entry),
            parts=(self._part("values", entry),),
            reason=reason,
            path=self.path,
        )

    def _weight(self, layer: str, consumed: set[str], what: str) -> _Entry:
        entry = self.entries.get(f"{layer}.weight")
        if entry is None:
            raise CheckpointError(
                f"{self.path}: layer {layer!r} has {what} but no tensor {layer + '.weight'!r}"
            )
        consumed.add(f"{layer}.weight")
        return entry

    def _scale(self, entry: _Entry, weight: _Entry, per_row: bool) -> Tensor:
        """A float scale of one value (or, where allowed, one per row of the weight), as a view."""
        rows = weight.shape[0] if weight.shape else 1
        count = math.prod(entry.shape)
        ok = entry.dtype in ("F32", "F16", "BF16") and (
            count == 1 or (per_row and len(weight.shape) == 2 and entry.shape in ((rows, 1), (rows,)))
        )
        if not ok:
            allowed = "one value" + (f" or one per row ([{rows}, 1])" if per_row else "")
            raise CheckpointError(
                f"{self.path}: scale {entry.stored_name!r} is {entry.dtype} of shape {list(entry.shape)}; the "
                f"layout stores {allowed} in float32 for weight {weight.stored_name!r} of shape "
                f"{list(weight.shape)}"
            )
        view = self._view(entry)
        assert view is not None
        return view

    def _legacy(self, layer: str, consumed: set[str]) -> StoredTensor:
        """ComfyUI's scaled fp8: `L.scale_weight` (and `L.scale_input`) beside an fp8 `L.weight`."""
        weight = self._weight(layer, consumed, "a scale_weight or scale_input")
        parts = [self._part("values", weight)]
        scale = input_scale = None
        scale_entry = self.entries.get(f"{layer}.scale_weight")
        input_entry = self.entries.get(f"{layer}.scale_input")
        if weight.dtype not in SCALED_FP8:
            which = scale_entry or input_entry
            assert which is not None
            raise CheckpointError(
                f"{self.path}: {which.stored_name!r} scales {weight.stored_name!r}, which is {weight.dtype}, not "
                "an fp8 weight (scaled fp8 stores F8_E4M3 or F8_E5M2)"
            )
        if scale_entry is not None:
            consumed.add(f"{layer}.scale_weight")
            scale = self._scale(scale_entry, weight, per_row=True)
            parts.append(self._part("scale", scale_entry))
        if input_entry is not None:
            consumed.add(f"{layer}.scale_input")
            input_scale = self._scale(input_entry, weight, per_row=False)
            parts.append(self._part("input_scale", input_entry))
        return StoredTensor(
            name=f"{layer}.weight",
            stored_name=weight.stored_name,
            format=SCALED_FP8[weight.dtype] if scale is not None else PLAIN_FORMATS[weight.dtype],
            shape=weight.shape,
            values=self._view(weight),
            scale=scale,
            input_scale=input_scale,
            parts=tuple(parts),
            path=self.path,
        )

    def _quantized(self, layer: str, consumed: set[str]) -> StoredTensor:
        """A layer with a comfy_quant config: its weight read in the config's format."""
        config = self._config(layer, consumed)
        weight = self._weight(layer, consumed, "a quantization config")
        extra = {}
        for part in LAYER_PARTS:
            entry = self.entries.get(f"{layer}.{part}")
            if entry is not None:
                consumed.add(f"{layer}.{part}")
                extra[part] = entry
        parts = [self._part("values", weight)]
        config_entry = self.entries.get(f"{layer}.{CONFIG_SUFFIX}")
        if config_entry is not None:
            parts.append(self._part("config", config_entry))
        record = StoredTensor(
            name=f"{layer}.weight",
            stored_name=weight.stored_name,
            format=str(config.get("format")),
            shape=weight.shape,
            values=self._view(weight),
            config=config,
            path=self.path,
        )
        fmt = config.get("format")
        params = config.get("params") if isinstance(config.get("params"), dict) else {}
        convrot = bool(config.get("convrot", params.get("convrot", False)))
        if fmt == COMFY_NVFP4:
            return self._nvfp4(layer, record, weight, extra, parts)
        if fmt not in COMFY_FP8 and fmt != COMFY_INT8:
            parts += [self._part(name, entry) for name, entry in extra.items()]
            return replace(record, format=str(fmt), parts=tuple(parts), reason=check_refused(fmt))
        expected = COMFY_FP8.get(fmt, "I8")
        if weight.dtype != expected:
            raise CheckpointError(
                f"{self.path}: {weight.stored_name!r} is {weight.dtype}; its {fmt} config stores {expected}"
            )
        unexpected = sorted(set(extra) - {"weight_scale", "input_scale"})
        if unexpected or "weight_scale" not in extra:
            what = f"carries {unexpected}" if unexpected else "has no weight_scale"
            raise CheckpointError(f"{self.path}: {fmt} layer {layer!r} {what}")
        scale_entry = extra["weight_scale"]
        scale = self._scale(scale_entry, weight, per_row=fmt == COMFY_INT8)
        parts.append(self._part("scale", scale_entry))
        input_scale = None
        if "input_scale" in extra:
            input_scale = self._scale(extra["input_scale"], weight, per_row=False)
            parts.append(self._part("input_scale", extra["input_scale"]))
        if fmt in COMFY_FP8:
            name = SCALED_FP8[weight.dtype]
            return replace(record, format=name, scale=scale, input_scale=input_scale, parts=tuple(parts))
        if not convrot:
            name = "int8_tensorwise" if scale.numel() == 1 else "int8_rowwise"
            return replace(record, format=name, scale=scale, input_scale=input_scale, parts=tuple(parts))
        stored_group = config.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_CONVROT_GROUP))
        group = _whole_number(stored_group)
        if group is None or not is_convrot_group(group):
            raise CheckpointError(
                f"{self.path}: ConvRot layer {layer!r}: group size {stored_group!r} is not a power of 4 (4, 16, "
                "64, 256...)"
            )
        if len(weight.shape) != 2 or weight.shape[1] % group:
            raise CheckpointError(
                f"{self.path}: ConvRot weight {weight.stored_name!r} of shape {list(weight.shape)} is not a matrix "
                f"of whole {group}-column groups"
            )
        return replace(
            record,
            format="int8_convrot",
            scale=scale,
            input_scale=input_scale,
            convrot_group=group,
            parts=tuple(parts),
        )

    def _nvfp4(
        self,
        layer: str,
        record: StoredTensor,
        weight: _Entry,
        extra: dict[str, _Entry],
        parts: list[StoredPart],
    ) -> StoredTensor:
        """An NVFP4 layer (h3engine.checkpoint.nvfp4): packed values, swizzled block scales, a global scale."""
        if weight.dtype != "U8" or len(weight.shape) != 2:
            raise CheckpointError(
                f"{self.path}: {weight.stored_name!r} is {weight.dtype} of shape {list(weight.shape)}; its nvfp4 "
                "config stores uint8 [rows, columns / 2]"
            )
        unexpected = sorted(set(extra) - {"weight_scale", "weight_scale_2", "input_scale"})
        missing = [name for name in ("weight_scale", "weight_scale_2") if name not in extra]
        if unexpected or missing:
            what = f"carries {unexpected}" if unexpected else f"has no {missing[0]}"
            awq = " (NVFP4-AWQ, not read here)" if "pre_quant_scale" in unexpected else ""
            raise CheckpointError(f"{self.path}: nvfp4 layer {layer!r} {what}{awq}")
        rows, columns = weight.shape[0], weight.shape[1] * 2
        if columns % nvfp4.BLOCK:
            raise CheckpointError(
                f"{self.path}: nvfp4 weight {weight.stored_name!r} has {columns} columns, not whole blocks of "
                f"{nvfp4.BLOCK}"
            )
        blocks = extra["weight_scale"]
        padded = nvfp4.blocked_shape(rows, columns // nvfp4.BLOCK)
        if blocks.dtype not in ("F8_E4M3", "U8") or math.prod(blocks.shape) != padded[0] * padded[1]:
            raise CheckpointError(
                f"{self.path}: block scales {blocks.stored_name!r} are {blocks.dtype} of shape "
                f"{list(blocks.shape)}; the layout stores float8_e4m3fn {list(padded)} for weight "
                f"{weight.stored_name!r} of shape {list(weight.shape)}"
            )
        block_view = self._view(blocks)
        assert block_view is not None
        scale = self._scale(extra["weight_scale_2"], weight, per_row=False)
        parts += [self._part("scale", extra["weight_scale_2"]), self._part("block_scale", blocks)]
        input_scale = None
        if "input_scale" in extra:
            input_scale = self._scale(extra["input_scale"], weight, per_row=False)
            parts.append(self._part("input_scale", extra["input_scale"]))
        return replace(
            record,
            format="nvfp4",
            shape=(rows, columns),
            scale=scale,
            block_scale=block_view.view(torch.float8_e4m3fn),
            input_scale=input_scale,
            parts=tuple(parts),
        )


def _whole_number(value: object) -> int | None:
    """A config's number as ComfyUI's int() reads it (an int, a whole float, digits), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None
