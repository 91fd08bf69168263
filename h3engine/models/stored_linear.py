"""Linear layers whose weight stays in a file's quantized form and is dequantized where it computes.

Community H3 files store their big linears quantized: GGUF block types (Q4_K, Q8_0, ...) or the ComfyUI single
files' scaled forms (FP8 x a tensor scale, INT8 x a tensor or row scale, INT8 ConvRot: per-row INT8 of the weight
rotated by a Hadamard in groups of columns). `StoredLinear` keeps such a weight as the file holds it: a uint8 buffer
`quantized` of [out_features, row bytes] (rows are independent, so a row range is a byte range) and, for a scaled
form, a float32 `scale` ([1] or [out_features, 1]); NVFP4 adds `block_scale`, float8_e4m3fn [out_features, in/16],
the file's block scales unswizzled at load, its `quantized` two e2m1 codes a byte and its `scale` the global one.
Every home the memory plan gives a layer (resident, pinned, streamed through the ring, mapped from the file) carries
those bytes, never a dequantized copy. `weight` dequantizes
them on their device into the compute dtype, each call (GGUF: h3engine.models.gguf_ops, a Triton kernel on CUDA and
its plain-torch twin elsewhere; the scaled forms: h3engine.models.scaled_ops, likewise), so code that reads a
linear's `weight` works unchanged and a LoRA rides beside it (its forward hook): the bytes are never written.
`store_linears(module, forms)` swaps named nn.Linear layers of a meta-built module for StoredLinear ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.models import gguf_ops, scaled_ops

# The state-dict names of a StoredLinear's bytes and scales (a file's `X.weight` is the module's `X.quantized`).
QUANTIZED_BUFFER = "quantized"
SCALE_BUFFER = "scale"
BLOCK_SCALE_BUFFER = "block_scale"


@dataclass(frozen=True)
class WeightForm:
    """How a StoredLinear's bytes hold its weight: a GGUF block type (`ggml_type`), or scaled values of
    `values_dtype` (float8_e4m3fn, float8_e5m2, int8) with one scale (or one per row), ConvRot-rotated in groups of
    `rotation_group` columns (0: not rotated), or NVFP4 (`nvfp4`: e2m1 codes, block scales, a global scale)."""

    ggml_type: int | None = None
    values_dtype: torch.dtype | None = None
    scale_per_row: bool = False
    rotation_group: int = 0
    nvfp4: bool = False

    @classmethod
    def gguf(cls, ggml_type: int) -> WeightForm:
        return cls(ggml_type=int(ggml_type))

    @classmethod
    def nvfp4_form(cls) -> WeightForm:
        return cls(nvfp4=True)

    @property
    def name(self) -> str:
        if self.ggml_type is not None:
            return gguf_ops.type_name(self.ggml_type)
        if self.nvfp4:
            return "nvfp4 (e2m1 x e4m3 block scale x global scale)"
        values = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(
            self.values_dtype, "int8"
        )
        rotated = f", ConvRot {self.rotation_group}" if self.rotation_group else ""
        return f"{values} x {'row' if self.scale_per_row else 'tensor'} scale{rotated}"

    def row_bytes(self, in_features: int, name: str = "") -> int:
        """Bytes of one row of `in_features` values (GGUF: whole blocks, CheckpointError otherwise)."""
        if self.ggml_type is not None:
            return gguf_ops.byte_count(self.ggml_type, (1, in_features), name)
        if self.nvfp4:
            return scaled_ops.nvfp4_row_bytes(in_features, name)
        return in_features


class StoredLinear(nn.Module):
    """y = x W^T + b with W held in a file's quantized `form` and dequantized to `dtype` on use."""

    STORED_TENSORS = (QUANTIZED_BUFFER, SCALE_BUFFER, BLOCK_SCALE_BUFFER)
    # Row-wise and local, as an nn.Linear: the DiT may call it per row chunk (h3engine.models.dit_chunks).
    ROW_WISE = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        form: WeightForm,
        bias: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.form, self.dtype, self.name = form, dtype, name
        width = form.row_bytes(in_features, name)
        self.register_buffer(
            QUANTIZED_BUFFER, torch.empty(out_features, width, dtype=torch.uint8, device=device)
        )
        if form.ggml_type is None:
            scales = (out_features, 1) if form.scale_per_row else (1,)
            self.register_buffer(SCALE_BUFFER, torch.empty(scales, dtype=torch.float32, device=device))
        if form.nvfp4:
            blocks = (out_features, in_features // scaled_ops.NVFP4_BLOCK)
            self.register_buffer(
                BLOCK_SCALE_BUFFER, torch.empty(blocks, dtype=torch.float8_e4m3fn, device=device)
            )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @property
    def weight(self) -> Tensor:
        """The weight [out, in] in `dtype`, dequantized from the bytes on their device (one rounding from fp32)."""
        return self.weight_from(*self.stored())

    def stored(self) -> tuple[Tensor, ...]:
        """The tensors that hold the weight as stored, in their buffers' order: the bytes, the scale of a scaled
        form, and NVFP4's block scales."""
        if self.form.ggml_type is not None:
            return (self.quantized,)
        if self.form.nvfp4:
            return (self.quantized, self.scale, self.block_scale)
        return (self.quantized, self.scale)

    def weight_from(
        self, quantized: Tensor, scale: Tensor | None = None, block_scale: Tensor | None = None
    ) -> Tensor:
        """The weight that stored tensors of this layer's form hold (copies of `stored()` elsewhere, e.g. on the
        device that builds AdaLN tables), dequantized where they are."""
        if self.form.ggml_type is not None:
            shape = (self.out_features, self.in_features)
            return gguf_ops.dequantize(quantized, self.form.ggml_type, shape, self.name, self.dtype)
        if self.form.nvfp4:
            assert scale is not None and block_scale is not None
            return scaled_ops.dequantize_nvfp4(quantized, block_scale, scale, self.dtype)
        values = quantized.view(self.form.values_dtype)
        return scaled_ops.dequantize(values, scale, self.form.rotation_group or None, self.dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, form={self.form.name}"


def store_linears(module: nn.Module, forms: Mapping[str, WeightForm]) -> None:
    """Replace each nn.Linear of `module` named in `forms` (its module path) by a StoredLinear of that form, with
    the same shape, bias and dtype, on the same device (meta before a load)."""
    for path, form in forms.items():
        parent_path, _, attribute = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        linear = getattr(parent, attribute)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{path} is a {type(linear).__name__}, not a linear layer")
        stored = StoredLinear(
            linear.in_features,
            linear.out_features,
            form,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            name=f"{path}.weight",
        )
        setattr(parent, attribute, stored)
