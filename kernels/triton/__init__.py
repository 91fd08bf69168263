"""Triton kernels for the elementwise ops of the DiT block and the video decoder, the twins of `h3engine.models.kernels.reference`
(same names, same results).

Each op `name` comes with `supports_name(...)`, taking the op's arguments: True when the kernel handles those
shapes, strides and dtypes (bf16, fp16, fp32). Device placement is the caller's check (`h3engine.models.ops` sends only
CUDA tensors here); under TRITON_INTERPRET=1 the kernels also run on CPU tensors, which the CPU tests use.
Importing this package needs `triton`.
"""

from .activation import supports_swiglu, swiglu
from .norms import (
    gated_residual,
    gated_residual_rms_norm,
    modulated_rms_norm,
    rms_norm_to,
    scaled_residual_rms_norm_to,
    supports_gated_residual,
    supports_gated_residual_rms_norm,
    supports_modulated_rms_norm,
    supports_rms_norm_to,
    supports_scaled_residual_rms_norm_to,
)
from .relayout import (
    pack_heads_for_exchange,
    supports_pack_heads_for_exchange,
    supports_unpack_exchanged_heads,
    unpack_exchanged_heads,
)
from .rope import qk_norm_rope, supports_qk_norm_rope

__all__ = [
    "gated_residual",
    "gated_residual_rms_norm",
    "modulated_rms_norm",
    "pack_heads_for_exchange",
    "qk_norm_rope",
    "rms_norm_to",
    "scaled_residual_rms_norm_to",
    "supports_gated_residual",
    "supports_gated_residual_rms_norm",
    "supports_modulated_rms_norm",
    "supports_pack_heads_for_exchange",
    "supports_qk_norm_rope",
    "supports_rms_norm_to",
    "supports_scaled_residual_rms_norm_to",
    "supports_swiglu",
    "supports_unpack_exchanged_heads",
    "swiglu",
    "unpack_exchanged_heads",
]
