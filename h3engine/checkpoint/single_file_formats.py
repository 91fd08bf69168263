"""The weight formats of ComfyUI-style single safetensors files: their key names, their records, and their math in
plain torch (the dequantization `dequantize_stored` and the quantizers our writer uses).

The formats, their key names and math are listed in the comment below the imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.safetensors_io import DTYPE_NAMES as DTYPE_NAMES
from h3engine.checkpoint.safetensors_io import DTYPES as DTYPES
from h3engine.checkpoint.safetensors_io import FileExtent
from h3engine.errors import CheckpointError

# The layouts, as ComfyUI (comfy/ops.py `_load_quantized_module`, comfy/utils.py `convert_old_quants`,
# comfy/quant_ops.py `QUANT_ALGOS`) and comfy-kitchen (comfy_kitchen/tensor/fp8.py, tensor/int8.py, tensor/int8_utils.py,
# backends/eager/quantization.py) define them; `L` is a layer (`blocks.0.attn.qkv_proj`):
# * plain ('f32', 'f16', 'bf16', 'f64'): the values. F8_E4M3 / F8_E5M2 with no scale ('fp8_e4m3', 'fp8_e5m2'): a cast
#   (ComfyUI casts such a weight to the compute dtype).
# * legacy scaled fp8 ('fp8_e4m3_scaled'): an e4m3 `L.weight`, a float32 `L.scale_weight` (one value; one per row
#   [rows, 1] broadcasts the same way), optionally `L.scale_input`, and a marker tensor `scaled_fp8` (empty, or two
#   elements; its dtype names the weights' fp8 dtype, float32 meaning e4m3). weight = values * scale_weight.
# * per-layer configs: `L.comfy_quant`, a uint8 tensor holding UTF-8 JSON {"format": ..., ...}, or the same configs
#   in the header's `__metadata__["_quantization_metadata"]` = '{"layers": {"L": {...}}}':
#   - "float8_e4m3fn" / "float8_e5m2" ('fp8_e4m3_scaled' / 'fp8_e5m2_scaled'): float32 `L.weight_scale`, one value;
#     weight = values * weight_scale.
#   - "int8_tensorwise": int8 `L.weight`, float32 `L.weight_scale`, one value ('int8_tensorwise') or one per row
#     [rows, 1] ('int8_rowwise'); weight = values * weight_scale.
#   - "int8_tensorwise" with "convrot": true and "convrot_groupsize": g (default 256; also accepted under "params")
#     ('int8_convrot', the "INT8 ConvRot" W8A8 files): the rows were rotated, then quantized per row:
#     W_rot[:, j*g:(j+1)*g] = W[:, j*g:(j+1)*g] @ H^T, scale = max|row of W_rot| / 127, values = round(W_rot / scale),
#     H the normalized regular Hadamard of size g (`regular_hadamard`: symmetric, orthogonal, its own inverse's
#     transpose). Dequantized: W[:, group] = (values * scale)[:, group] @ H^T. The matmul rotates the activations the
#     same way (x[:, group] @ H) and quantizes them per row: the W8A8 part, which changes nothing in the weight.
#   - "nvfp4" ('nvfp4'): uint8 `L.weight` [R, K/2] (two e2m1 codes a byte), swizzled float8_e4m3fn block scales
#     `L.weight_scale` (one per 16 values), a float32 global scale `L.weight_scale_2`; the record's `block_scale`,
#     `scale`; its layout and math: h3engine.checkpoint.nvfp4 (`dequantize_nvfp4`).
#   An optional float32 `L.input_scale` (legacy `L.scale_input`) only scales the activations of an fp8 x fp8 matmul:
#   records keep it (`input_scale`), no dequantization applies it.
# * refused (listed, never decoded): "mxfp8" (e8m0 block scales), "convrot_w4a4", "asym_w4a8_int8" (`weight_s_rel`, `weight_s_channel`, `weight_codebook`),
#   "awq_w4a16", and any format name not known.
#
# Our dequantization computes in float32 and rounds once to the dtype asked for. ComfyUI's own fp8 dequantization
# casts values and scale to the compute dtype and multiplies there (two roundings in bf16); the values agree wherever
# the scale is exact in that dtype.

DIFFUSION_MODEL_PREFIX = "model.diffusion_model."
MARKER_NAME = "scaled_fp8"
CONFIG_SUFFIX = "comfy_quant"
QUANT_METADATA_KEY = "_quantization_metadata"
DEFAULT_CONVROT_GROUP = 256

# safetensors dtype names -> torch dtypes viewed here, and the bits per element of the others (for the size check).
OTHER_DTYPE_BITS = {
    "U64": 64,
    "U32": 32,
    "U16": 16,
    "C64": 64,
    "F8_E8M0": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
}

# Stored dtype -> format name, without a scale and with one.
PLAIN_FORMATS = {
    "F64": "f64",
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "F8_E4M3": "fp8_e4m3",
    "F8_E5M2": "fp8_e5m2",
}
SCALED_FP8 = {"F8_E4M3": "fp8_e4m3_scaled", "F8_E5M2": "fp8_e5m2_scaled"}
# comfy_quant format names -> the stored dtype of their weight.
COMFY_FP8 = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
COMFY_INT8 = "int8_tensorwise"
COMFY_NVFP4 = "nvfp4"
COMFY_REFUSED = ("mxfp8", "convrot_w4a4", "asym_w4a8_int8", "awq_w4a16")
# The tensors a configured layer may carry beside its weight (every format ComfyUI reads), and the legacy ones.
LAYER_PARTS = (
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "pre_quant_scale",
    "weight_s_rel",
    "weight_s_channel",
    "weight_codebook",
)
LEGACY_PARTS = ("scale_weight", "scale_input")
SUPPORTED_FORMATS = frozenset(
    [
        *PLAIN_FORMATS.values(),
        *SCALED_FP8.values(),
        "int8_tensorwise",
        "int8_rowwise",
        "int8_convrot",
        "nvfp4",
    ]
)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
INT8_MAX = 127.0
# comfy-kitchen's floor for an int8 scale (an all-zero row); a zero fp8 tensor gets the smallest normal fp32.
INT8_MIN_SCALE = 1e-30
FP8_MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class StoredPart:
    """One stored tensor of a record: `nbytes` bytes at absolute `offset` of the file."""

    role: str  # 'values', 'scale', 'input_scale', 'config', or a refused format's own part ('weight_scale_2', ...)
    stored_name: str
    dtype: str  # the safetensors dtype name
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class StoredTensor:
    """One logical tensor of a single file, as stored.

    `values`, `scale`, `input_scale` and `block_scale` are views of the file's map (a copy only where the file places
    a tensor at an offset that is not a multiple of its element size); `values` is None for a dtype torch cannot
    view. `format` is a SUPPORTED_FORMATS name, else the format or dtype found, with `reason` saying why it is not
    read. `shape` is the logical shape (the stored one for every format read here but nvfp4: [R, K] of [R, K/2])."""

    name: str
    stored_name: str
    format: str
    shape: tuple[int, ...]
    values: Tensor | None
    scale: Tensor | None = None
    input_scale: Tensor | None = None
    block_scale: Tensor | None = None  # nvfp4: the block scales as stored (swizzled, padded)
    convrot_group: int | None = None
    config: dict[str, Any] | None = None
    parts: tuple[StoredPart, ...] = ()
    reason: str | None = None
    path: Path | None = field(default=None, compare=False)

    @property
    def supported(self) -> bool:
        return self.reason is None

    def part(self, role: str) -> StoredPart:
        for part in self.parts:
            if part.role == role:
                return part
        raise KeyError(f"{self.stored_name}: no stored part {role!r}")

    def extent(self, role: str = "values") -> FileExtent:
        """Where a stored part's bytes lie in the file (to read them straight into a buffer)."""
        part = self.part(role)
        assert self.path is not None
        return FileExtent(self.path, part.offset, part.nbytes, 0)

    def moved(self, device: torch.device | str, non_blocking: bool = False) -> StoredTensor:
        """This record with its values and scales on `device` (for `dequantize_stored` there)."""

        def move(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=non_blocking)

        return replace(
            self,
            values=move(self.values),
            scale=move(self.scale),
            input_scale=move(self.input_scale),
            block_scale=move(self.block_scale),
        )


# ----------------------------------------------------------------------------------------------------------------
# ConvRot's rotation

_HADAMARDS: dict[tuple[int, str], Tensor] = {}
_REGULAR_HADAMARD_4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


def is_convrot_group(size: object) -> bool:
    """Sizes the regular Hadamard exists for: the powers of 4 from 4."""
    return (
        isinstance(size, int)
        and not isinstance(size, bool)
        and size >= 4
        and size & (size - 1) == 0
        and (size.bit_length() - 1) % 2 == 0
    )


def regular_hadamard(size: int, device: torch.device | str = "cpu") -> Tensor:
    """The normalized regular Hadamard matrix of `size` (a power of 4), float32: a Kronecker power of the 4x4
    regular Hadamard divided by sqrt(size), a power of 2, so every entry is exactly +-2^-k. Symmetric, orthogonal."""
    if not is_convrot_group(size):
        raise ValueError(f"a regular Hadamard matrix needs a power of 4 from 4, not {size}")
    key = (size, str(device))
    if key not in _HADAMARDS:
        base = torch.tensor(_REGULAR_HADAMARD_4, dtype=torch.float32, device=device)
        matrix = base
        while matrix.shape[0] < size:
            matrix = torch.kron(matrix, base)
        _HADAMARDS[key] = matrix / math.sqrt(size)
    return _HADAMARDS[key]


def rotate_groups(matrix: Tensor, group: int) -> Tensor:
    """[R, K] float32 -> each run of `group` columns times H^T (H = regular_hadamard(group)), in float32. As H is
    symmetric and orthogonal this is its own inverse (up to rounding): it rotates a weight and rotates it back."""
    rows, columns = matrix.shape
    hadamard = regular_hadamard(group, matrix.device)
    return torch.matmul(matrix.reshape(rows, columns // group, group), hadamard.T).reshape(rows, columns)


# ----------------------------------------------------------------------------------------------------------------
# Dequantization


def _scale_factor(scale: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A stored scale as a float32 factor broadcasting over a tensor of `shape`: one value, or one per row."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    return scale.reshape(shape[0], *([1] * (len(shape) - 1)))


def dequantize_stored(record: StoredTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The values `record` stands for, in its logical shape, on the device of its tensors: the format's math in
    float32, then one rounding to `out_dtype` (a plain tensor is cast straight to `out_dtype`). No file access."""
    if not record.supported:
        raise CheckpointError(f"tensor {record.stored_name!r} is stored as {record.format}: {record.reason}")
    values = record.values
    assert values is not None
    if record.format in ("f64", "f32", "f16", "bf16"):
        return values.to(out_dtype)
    if record.format == "nvfp4":
        assert record.block_scale is not None and record.scale is not None
        rows, columns = record.shape
        block_scales = nvfp4.unswizzle_block_scales(record.block_scale, rows, columns // nvfp4.BLOCK)
        return nvfp4.dequantize_nvfp4(values, block_scales, record.scale, out_dtype)
    return dequantize_scaled(values, record.scale, record.convrot_group, out_dtype)


def dequantize_scaled(
    values: Tensor, scale: Tensor | None, convrot_group: int | None, out_dtype: torch.dtype
) -> Tensor:
    """fp8 / int8 `values` times `scale` (one value, or one per row), rotated back by ConvRot's Hadamard when
    `convrot_group` is given: float32 math, one rounding to `out_dtype` (what a layer holding them computes with)."""
    result = values.to(torch.float32)
    if scale is not None:
        result = result * _scale_factor(scale, tuple(values.shape))
    if convrot_group is not None:
        result = rotate_groups(result, convrot_group)
    return result.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Quantization (our writer's; the layouts are the published ones, the rounding is ours where it may differ)


def quantize_fp8_tensor(tensor: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """-> (fp8 values, float32 scale of shape []): scale = max|tensor| / the dtype's largest finite value."""
    values = tensor.to(torch.float32)
    amax = torch.linalg.vector_norm(values, ord=float("inf")) if values.numel() else torch.zeros(())
    scale = (amax / torch.finfo(dtype).max).clamp(min=FP8_MIN_SCALE)
    largest = torch.finfo(dtype).max
    return (values / scale).clamp(-largest, largest).to(dtype), scale


def quantize_int8(tensor: Tensor, per_row: bool) -> tuple[Tensor, Tensor]:
    """-> (int8 values, float32 scale: [rows, 1] per row, else []): scale = max|.| / 127 (at least 1e-30),
    values = round(tensor / scale) (half to even, as torch.round)."""
    values = tensor.to(torch.float32)
    if per_row:
        amax = torch.linalg.vector_norm(values, ord=float("inf"), dim=-1, keepdim=True)
    else:
        amax = torch.linalg.vector_norm(values, ord=float("inf")) if values.numel() else torch.zeros(())
    scale = (amax / INT8_MAX).clamp(min=INT8_MIN_SCALE)
    return torch.round(values / scale).clamp(-128.0, 127.0).to(torch.int8), scale


def quantize_int8_convrot(matrix: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """[R, K] -> (int8 values, float32 scales [R, 1]) of the rows rotated by `rotate_groups` (in float32)."""
    if matrix.dim() != 2 or matrix.shape[1] % group:
        raise ValueError(
            f"ConvRot quantizes matrices of whole {group}-column groups, not shape {list(matrix.shape)}"
        )
    return quantize_int8(rotate_groups(matrix.to(torch.float32), group), per_row=True)


def check_refused(fmt: object) -> str:
    """Why a comfy_quant format other than the fp8, int8 and nvfp4 ones is not read."""
    known = (
        "a format this reader does not decode" if fmt in COMFY_REFUSED else "an unknown quantization format"
    )
    return f"{known} ({fmt!r})"
