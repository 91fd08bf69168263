"""The single call site of the fused DiT-block and video-decoder ops: a Triton kernel where one applies, the torch
twin otherwise. (Attention has its own dispatch point, `h3engine.models.attention`.)

Every op here has the signature and result of its twin in `h3engine.models.kernels.reference` (the model's own torch
expressions; see there for shapes and rounding points). Elementwise chains (gated residual, RoPE, SwiGLU, the
relayouts) are bit-identical to the twin; inside the RMSNorm ops the normed value may differ by one ulp in rare
elements (another summation order, libdevice's rsqrt), and the ops after it carry that on. Triton outputs are new
contiguous tensors. `H3_KERNELS=reference` (read at import) or `force_reference()` forces the twins.

Danger: the Triton kernels do not bounds-check the AdaLN `rows` index (an out-of-range entry reads stray memory
where the twin raises); `force_reference` flips a process-wide switch, not a per-thread one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

from h3engine.models.kernels import reference

try:
    from h3engine.models.kernels import triton as triton_kernels
except ImportError:  # torch builds without triton (e.g. CPU-only wheels) always use the reference
    triton_kernels = None

Implementation = Literal["triton", "reference"]
KERNELS_ENVIRONMENT_VARIABLE = "H3_KERNELS"


def _reference_forced_by_environment() -> bool:
    choice = os.environ.get(KERNELS_ENVIRONMENT_VARIABLE, "auto").strip().lower()
    if choice not in ("auto", "", "reference"):
        raise ValueError(
            f"{KERNELS_ENVIRONMENT_VARIABLE}={choice!r}: expected 'reference' or 'auto' (or unset)"
        )
    return choice == "reference"


_reference_forced = _reference_forced_by_environment()


@contextmanager
def force_reference() -> Iterator[None]:
    """Run every op's torch reference inside the block (restores the previous setting on exit)."""
    global _reference_forced
    previous = _reference_forced
    _reference_forced = True
    try:
        yield
    finally:
        _reference_forced = previous


def _triton_applies(name: str, args: tuple[Any, ...]) -> bool:
    """Triton runs when it imports, every tensor is on one CUDA device, no autograd graph is recorded through them,
    and the kernel's `supports_*` accepts the shapes, strides and dtypes (bf16, fp16, fp32)."""
    if _reference_forced or triton_kernels is None:
        return False
    tensors = [value for value in args if isinstance(value, Tensor)]
    device = tensors[0].device
    if device.type != "cuda" or any(tensor.device != device for tensor in tensors):
        return False
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        return False
    supports: Callable[..., bool] = getattr(triton_kernels, f"supports_{name}")
    return supports(*args)


def _run(name: str, *args: Any) -> Any:
    if _triton_applies(name, args):
        # Triton launches on the current CUDA device, which need not be the tensors' one.
        device = next(value.device for value in args if isinstance(value, Tensor))
        with torch.cuda.device(device):
            return getattr(triton_kernels, name)(*args)
    return getattr(reference, name)(*args)


def implementation(name: str, *args: Any) -> Implementation:
    """Which implementation `name(*args)` runs: "triton" or "reference" (positional arguments, as the op takes)."""
    if name not in reference.__all__:
        raise ValueError(f"implementation: no op named {name!r} (ops: {', '.join(reference.__all__)})")
    return "triton" if _triton_applies(name, args) else "reference"


def modulated_rms_norm(
    hidden: Tensor, weight: Tensor, eps: float, scale_plus_one: Tensor, shift: Tensor, rows: Tensor
) -> Tensor:
    """F.rms_norm(hidden, (H,), weight, eps) * scale_plus_one[rows] + shift[rows]; [S, H] -> [S, H]."""
    return _run("modulated_rms_norm", hidden, weight, eps, scale_plus_one, shift, rows)


def gated_residual(hidden: Tensor, gate: Tensor, rows: Tensor, update: Tensor) -> Tensor:
    """hidden + gate[rows] * update; [S, H] -> [S, H]."""
    return _run("gated_residual", hidden, gate, rows, update)


def gated_residual_rms_norm(
    hidden: Tensor,
    gate: Tensor,
    rows: Tensor,
    update: Tensor,
    weight: Tensor,
    eps: float,
    scale_plus_one: Tensor,
    shift: Tensor,
) -> tuple[Tensor, Tensor]:
    """(new = hidden + gate[rows] * update, modulated_rms_norm(new, weight, eps, scale_plus_one, shift, rows))."""
    return _run("gated_residual_rms_norm", hidden, gate, rows, update, weight, eps, scale_plus_one, shift)


def qk_norm_rope(
    query: Tensor,
    key: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor | None,
    sin: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Per-head RMSNorm of query and key [S, heads, D], then rotate-half RoPE of the first R = cos.shape[-1]
    channels (cos/sin [S, R], or both None for no rotation)."""
    return _run("qk_norm_rope", query, key, q_weight, k_weight, eps, cos, sin)


def rms_norm_to(hidden: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """F.rms_norm(hidden.float(), (H,), weight.float(), eps).to(out_dtype); [S, H] -> [S, H]."""
    return _run("rms_norm_to", hidden, weight, eps, out_dtype)


def scaled_residual_rms_norm_to(
    hidden: Tensor, update: Tensor, scale: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(new = hidden + update * scale, rms_norm_to(new, weight, eps, out_dtype)): the video decoder's layer-scaled
    residual on its fp32 stream and the next norm, rounded to the GEMM dtype."""
    return _run("scaled_residual_rms_norm_to", hidden, update, scale, weight, eps, out_dtype)


def swiglu(fused: Tensor) -> Tensor:
    """fc1's [S, 2F] output (gate first) -> [S, F] = silu(gate) * value."""
    return _run("swiglu", fused)


def pack_heads_for_exchange(tensor: Tensor, size: int) -> Tensor:
    """[rows, *lead, heads, D] -> contiguous [size, rows, *lead, heads / size, D]: the send buffer of
    `sequence_to_heads` (head block j in slot j)."""
    return _run("pack_heads_for_exchange", tensor, size)


def unpack_exchanged_heads(received: Tensor) -> Tensor:
    """[size, rows, *lead, local_heads, D] -> contiguous [rows, *lead, size * local_heads, D]: what
    `heads_to_sequence` makes of its receive buffer."""
    return _run("unpack_exchanged_heads", received)
