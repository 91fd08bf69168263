"""Linear layers whose weight stays in a file's quantized form (a GGUF block type) and is dequantized where it computes.

A community GGUF DiT stores its big linears in ggml block types (Q4_K, Q8_0, ...). `StoredLinear` keeps such a
weight as its file holds it: a uint8 buffer `quantized` of [out_features, row bytes] (a GGUF row is whole blocks, so
rows are independent and a row range is a byte range). The module's state dict holds those bytes, so every home
the memory plan gives a layer (resident on the GPU, pinned on the host, streamed through the ring, read from the
mapped file) carries the quantized bytes, never a dequantized copy. `weight` dequantizes them on the buffer's
device (`h3engine.models.gguf_ops`: a Triton kernel on CUDA, the plain-torch twin elsewhere) into the compute dtype,
each call; `forward` is `F.linear(x, weight, bias)`. Code that reads a linear's `weight` (the stacked QKV chunks,
the AdaLN projection) works unchanged, and a LoRA rides beside it as on an nn.Linear (its forward hook adds the
update): the quantized bytes are never written.

`store_linears(module, types)` swaps the named nn.Linear layers of a module built on the meta device for
StoredLinear layers of the given ggml types (what a GGUF file stores them in), before the state is assigned.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.models import gguf_ops

# The state-dict name of a StoredLinear's bytes (a file's `X.weight` is the module's `X.quantized`).
QUANTIZED_BUFFER = "quantized"


def row_bytes(in_features: int, ggml_type: int, name: str = "") -> int:
    """Bytes of one row of `in_features` values of a ggml block type (whole blocks; CheckpointError otherwise)."""
    return gguf_ops.byte_count(ggml_type, (1, in_features), name)


class StoredLinear(nn.Module):
    """y = x W^T + b with W held as GGUF blocks of `ggml_type` and dequantized to `dtype` on use."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ggml_type: int,
        bias: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ggml_type = int(ggml_type)
        self.dtype = dtype
        self.name = name
        width = row_bytes(in_features, ggml_type, name)
        self.register_buffer(
            QUANTIZED_BUFFER, torch.empty(out_features, width, dtype=torch.uint8, device=device)
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @property
    def weight(self) -> Tensor:
        """The weight [out, in] in `dtype`, dequantized from the bytes on their device (one rounding from fp32)."""
        return gguf_ops.dequantize(
            self.quantized, self.ggml_type, (self.out_features, self.in_features), self.name, self.dtype
        )

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.weight, self.bias)

    def extra_repr(self) -> str:
        type_name = gguf_ops.type_name(self.ggml_type)
        return f"in_features={self.in_features}, out_features={self.out_features}, type={type_name}"


def store_linears(module: nn.Module, types: Mapping[str, int]) -> None:
    """Replace each nn.Linear of `module` named in `types` (its module path) by a StoredLinear of that ggml type,
    with the same shape, bias and dtype, on the same device (meta before a load)."""
    for path, ggml_type in types.items():
        parent_path, _, attribute = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        linear = getattr(parent, attribute)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{path} is a {type(linear).__name__}, not a linear layer")
        stored = StoredLinear(
            linear.in_features,
            linear.out_features,
            ggml_type,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            name=f"{path}.weight",
        )
        setattr(parent, attribute, stored)
