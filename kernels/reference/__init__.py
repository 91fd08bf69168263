"""Plain-torch twins of the fused kernels: the model's own expressions, op for op, so the roundings are its own.

Each twin is what `h3engine.models.ops` runs when no Triton kernel applies (CPU tensors, `H3_KERNELS=reference`,
unsupported shapes) and what the Triton kernels are tested against.
"""

from .activation import swiglu
from .norms import (
    gated_residual,
    gated_residual_rms_norm,
    modulated_rms_norm,
    rms_norm_to,
    scaled_residual_rms_norm_to,
)
from .relayout import pack_heads_for_exchange, unpack_exchanged_heads
from .rope import qk_norm_rope

__all__ = [
    "gated_residual",
    "gated_residual_rms_norm",
    "modulated_rms_norm",
    "pack_heads_for_exchange",
    "qk_norm_rope",
    "rms_norm_to",
    "scaled_residual_rms_norm_to",
    "swiglu",
    "unpack_exchanged_heads",
]
