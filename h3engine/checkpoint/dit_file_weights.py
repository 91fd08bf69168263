"""A community DiT file read as a component's weight files, under our module's keys (`--dit FILE`).

Community H3 DiT files (GGUF, or ComfyUI single safetensors files in bf16 / fp16 / FP8 scaled / INT8 / INT8 ConvRot /
NVFP4 or mixed) hold the native key names behind the single-file prefix (stripped by their readers), QKV rows stacked
as our module computes them (H3_SPEC.md §1.3), their large linears quantized and the rest as floats. `DiTFileWeights`
presents one as `WeightFiles`: a float tensor under its own name, dtype and shape, its place in the file known; a
quantized weight `X.weight` as the keys of a `StoredLinear` (h3engine.models.stored_linear): `X.quantized`, uint8
[rows, row bytes], the file's bytes as they are, and for a scaled form `X.scale`, float32 (NVFP4: the global scale,
and `X.block_scale`, its block scales unswizzled when read to row-major e4m3 [rows, columns / 16], a small copy); the
layer dequantizes them where it computes (`stored_forms` lists them for `store_linears`); `rope.inv_freq`, which
community files leave out, computed from the config. Nothing is read at open beyond the headers (views of the map).

Refusals (CheckpointError naming the file and the tensor), before anything loads: another model's file (its
architecture named), a type or format not read here, a quantized tensor that is not a 2-D linear weight, a tensor
missing, extra or of another shape than the module's (`WeightFiles.check`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.gguf_blocks import GGMLType
from h3engine.checkpoint.gguf_files import GGUFFile
from h3engine.checkpoint.safetensors_io import TensorInfo, WeightFiles
from h3engine.checkpoint.single_file_formats import DTYPES, StoredTensor
from h3engine.checkpoint.single_files import SingleFile
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import rope_inverse_frequencies
from h3engine.models.stored_linear import BLOCK_SCALE_BUFFER, QUANTIZED_BUFFER, SCALE_BUFFER, WeightForm

# The GGUF float types and the torch dtype their bytes are.
GGUF_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
# Single-file formats held as StoredLinear layers: their values' dtype and whether their scale is per row.
SCALED_FORMATS = {
    "fp8_e4m3_scaled": (torch.float8_e4m3fn, False),
    "fp8_e5m2_scaled": (torch.float8_e5m2, False),
    "int8_tensorwise": (torch.int8, False),
    "int8_rowwise": (torch.int8, True),
    "int8_convrot": (torch.int8, True),
}
WEIGHT_SUFFIX = ".weight"
# A tensor every H3 DiT file holds: a file without it is another model's.
FIRST_BLOCK_QKV = "blocks.0.attn.qkv_proj.weight"


def layer_of(name: str, path: Path, what: str, shape: tuple[int, ...]) -> str:
    """The layer path of a quantized weight `name` (CheckpointError unless it is a 2-D `.weight`)."""
    if not name.endswith(WEIGHT_SUFFIX) or len(shape) != 2:
        raise CheckpointError(
            f"{path}: tensor {name!r} is stored as {what}, which only a linear's 2-D weight may be"
        )
    return name.removesuffix(WEIGHT_SUFFIX)


def scaled_parts(record: StoredTensor) -> tuple[WeightForm, list[tuple[str, Tensor, int]]]:
    """A single file's scaled weight (SCALED_FORMATS) as a StoredLinear holds it: its form, and (buffer name, view of
    the file's map, byte offset in the file or -1) for its bytes [rows, columns] and its float32 scale."""
    values_dtype, per_row = SCALED_FORMATS[record.format]
    form = WeightForm(None, values_dtype, per_row, record.convrot_group or 0)
    values = record.values.view(torch.uint8).view(record.shape[0], -1)
    scale = record.scale.to(torch.float32).reshape((record.shape[0], 1) if per_row else (1,))
    scale_offset = record.part("scale").offset if record.scale.dtype == torch.float32 else -1
    return form, [
        (QUANTIZED_BUFFER, values, record.part("values").offset),
        (SCALE_BUFFER, scale, scale_offset),
    ]


def nvfp4_parts(record: StoredTensor) -> tuple[list[tuple[str, Tensor, int]], Tensor]:
    """A single file's NVFP4 weight as a StoredLinear holds it: (buffer name, view of the map, byte offset) for its
    bytes [rows, columns / 2] and its float32 global scale [1], and the block scales as stored (swizzled), which
    `unswizzled_block_scales` turns into the layer's row-major `block_scale`."""
    assert record.scale is not None and record.block_scale is not None
    scale = record.scale.to(torch.float32).reshape(1)
    scale_offset = record.part("scale").offset if record.scale.dtype == torch.float32 else -1
    parts = [
        (QUANTIZED_BUFFER, record.values.view(record.shape[0], -1), record.part("values").offset),
        (SCALE_BUFFER, scale, scale_offset),
    ]
    return parts, record.block_scale


def unswizzled_block_scales(record: StoredTensor) -> Tensor:
    """An NVFP4 record's block scales, row-major [rows, columns / 16] float8_e4m3fn (a copy)."""
    rows, columns = record.shape
    assert record.block_scale is not None
    return nvfp4.unswizzle_block_scales(record.block_scale, rows, columns // nvfp4.BLOCK)


class DiTFileWeights(WeightFiles):
    """The tensors of one community DiT file under the module's keys (see the module doc)."""

    def __init__(self, path: Path, config: DiTConfig, architecture: str | None) -> None:
        self.path = path
        self.config = config
        self.views: dict[
            str, Tensor
        ] = {}  # module key -> its bytes as the module holds them (a view of the map)
        self.stored_forms: dict[str, WeightForm] = {}
        # module key -> the NVFP4 record whose block scales it is (unswizzled when read).
        self.block_scales: dict[str, StoredTensor] = {}
        self.logical_shapes: dict[str, tuple[int, ...]] = {}
        self._infos: dict[str, TensorInfo] = {}
        self.architecture = architecture
        # A placeholder's hole of zeros (h3engine.checkpoint.gguf_write, h3engine.checkpoint.single_file_placeholder).
        self.is_placeholder = False

    @classmethod
    def open_file(cls, path: Path, config: DiTConfig) -> DiTFileWeights:
        """A GGUF (`.gguf`) or single safetensors (`.safetensors`) DiT file."""
        if path.suffix == ".gguf":
            return cls.from_gguf(GGUFFile.open(path), config)
        if path.suffix == ".safetensors":
            return cls.from_single_file(SingleFile.open(path), config)
        raise CheckpointError(f"{path}: a DiT file must be a GGUF (.gguf) or safetensors (.safetensors) file")

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, config: DiTConfig) -> DiTFileWeights:
        gguf.check_supported()
        files = cls(gguf.path, config, gguf.architecture)
        files.is_placeholder = gguf.placeholder
        for name, record in gguf.tensors.items():
            files.logical_shapes[name] = record.shape
            if record.ggml_type in GGUF_FLOATS:
                dtype = GGUF_FLOATS[GGMLType(record.ggml_type)]
                files._add(name, record.raw.view(dtype).view(record.shape), record.offset)
                continue
            layer = layer_of(name, gguf.path, record.type_name, record.shape)
            files.stored_forms[layer] = WeightForm.gguf(record.ggml_type)
            files._add(f"{layer}.{QUANTIZED_BUFFER}", record.raw.view(record.shape[0], -1), record.offset)
        return files.checked()

    @classmethod
    def from_single_file(cls, single: SingleFile, config: DiTConfig) -> DiTFileWeights:
        single.check_supported()
        files = cls(single.path, config, single.metadata.get("modelspec.architecture"))
        files.is_placeholder = single.placeholder
        for name, record in single.records.items():
            files.logical_shapes[name] = record.shape
            if record.format == "nvfp4":
                layer = layer_of(name, single.path, record.format, record.shape)
                files.stored_forms[layer] = WeightForm.nvfp4_form()
                parts, _ = nvfp4_parts(record)
                for leaf, view, offset in parts:
                    files._add(f"{layer}.{leaf}", view, offset)
                key = f"{layer}.{BLOCK_SCALE_BUFFER}"
                files.block_scales[key] = record
                rows, columns = record.shape
                files._infos[key] = TensorInfo(
                    single.path, torch.float8_e4m3fn, (rows, columns // nvfp4.BLOCK)
                )
                continue
            if record.format not in SCALED_FORMATS:
                files._add(name, _plain_values(record), record.part("values").offset)
                continue
            layer = layer_of(name, single.path, record.format, record.shape)
            files.stored_forms[layer], parts = scaled_parts(record)
            for leaf, view, offset in parts:
                files._add(f"{layer}.{leaf}", view, offset)
        return files.checked()

    def _add(self, key: str, view: Tensor, offset: int) -> None:
        self.views[key] = view
        self._infos[key] = TensorInfo(self.path, view.dtype, tuple(view.shape), offset=offset)

    def checked(self) -> DiTFileWeights:
        """Refuse another model's file; add `rope.inv_freq` from the config; become a WeightFiles."""
        if not {FIRST_BLOCK_QKV, FIRST_BLOCK_QKV.removesuffix(WEIGHT_SUFFIX) + "." + QUANTIZED_BUFFER} & set(
            self._infos
        ):
            raise CheckpointError(
                f"{self.path}: not an H3 DiT file (architecture {self.architecture!r}, {len(self._infos)} tensors, "
                f"no {FIRST_BLOCK_QKV!r})"
            )
        if ROPE_KEY not in self._infos:
            self.views[ROPE_KEY] = rope_inverse_frequencies(self.config.rope_freq_dim, self.config.rope_theta)
            self._infos[ROPE_KEY] = TensorInfo(self.path, torch.float32, (self.config.rope_freq_dim,))
        super().__init__(self._infos, str(self.path))
        return self

    @property
    def placeholder(self) -> bool:
        return self.is_placeholder

    def _read(self, key: str, rows: slice | None = None, columns: slice | None = None) -> Tensor:
        if key in self.block_scales:
            tensor = unswizzled_block_scales(self.block_scales[key])
            if columns is not None:
                raise CheckpointError(
                    f"{self.path}: {key!r} belongs to rows quantized; its columns are not read apart"
                )
            return tensor[rows] if rows is not None else tensor
        tensor = self.views[key]
        if rows is not None:
            tensor = tensor[rows]
        if columns is not None:
            if key.endswith(QUANTIZED_BUFFER):
                raise CheckpointError(
                    f"{self.path}: {key!r} is quantized by rows; its columns cannot be read apart"
                )
            tensor = tensor[:, columns]
        return tensor


def _plain_values(record: StoredTensor) -> Tensor:
    """A float tensor of a single file as stored (an unscaled fp8 weight is cast by the loader, as ComfyUI casts it)."""
    if record.values is None or record.values.dtype not in DTYPES.values():
        raise CheckpointError(f"{record.path}: tensor {record.stored_name!r} of {record.format} is not read")
    return record.values.view(record.shape)
