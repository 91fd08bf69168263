"""Full (unmasked) attention over one packed document: the one dispatch point for the attention kernel.

`attention(query, key, value)` takes and returns [S, heads, head_dim] tensors, softmax scale 1/sqrt(head_dim). The
backend is chosen once per (device, dtype, head_dim), fastest exact one first: ``fa4`` (FlashAttention-4, Hopper
and newer, bf16/fp16, with the tiles of `FA4_TUNED_TILES` at the released shapes), ``cudnn`` (torch's cuDNN SDPA
kernel), ``sdpa`` (torch's own SDPA dispatch: the reference twin and the fallback everywhere else, e.g. the CPU
and fp32). All three are exact attention and differ only in bf16 rounding. `H3_ATTENTION=sdpa|cudnn|fa4` forces
one; a forced backend that cannot run raises instead of falling back. Their speeds are in benchmarks/NOTES.md.

Danger: a backend that fails on its first call (a missing CUDA library, an unsupported shape) is dropped for that
key with a warning and the next one is tried, so a broken FA4 install costs speed, never a request. The tuned
tiles go through FA4's internal `_flash_attn_fwd`; if that call fails, FA4 runs with its own tiles from then on.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

BACKENDS = ("fa4", "cudnn", "sdpa")
FORCE_ENVIRONMENT_VARIABLE = "H3_ATTENTION"

# (device type, device index, dtype, head_dim) -> backends known to fail there.
_failed: dict[tuple, set[str]] = {}


# (query, key, value) [S, heads, head_dim] -> [S, heads, head_dim]: how the packed rows attend to each other.
AttentionKernel = Callable[[Tensor, Tensor, Tensor], Tensor]


def sdpa_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """The reference twin: torch's SDPA dispatch on [1, heads, S, head_dim] views."""
    # SDPA's fused kernels (flash, cuDNN, CPU flash) only take 4-D [batch, heads, S, head_dim]; a 3-D call falls
    # back to the unfused math path, which rounds differently in bf16 and is far slower.
    query, key, value = (tensor.transpose(0, 1).unsqueeze(0) for tensor in (query, key, value))
    return F.scaled_dot_product_attention(query, key, value).squeeze(0).transpose(0, 1)


def cudnn_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return sdpa_attention(query, key, value)


@functools.cache
def _fa4_function() -> Callable | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as error:  # a broken install (missing CUDA DSL libraries) is a missing backend
        logger.warning("FlashAttention-4 is installed but does not import (%s); not using it", error)
        return None
    return flash_attn_func


# (compute capability major, head_dim) -> FA4 forward settings that beat FA4's own choice. FA4 picks 128 x 128 tiles
# with two MMA warp groups for head_dim 128 on Hopper; 192 x 128 tiles with three warp groups (no intra-warpgroup
# overlap, which three groups do not support) run faster at the released shapes on an H200, with the same error
# against fp32 (benchmarks/attention_configs.py; numbers in benchmarks/NOTES.md). Other pairs keep FA4's choice.
FA4_TUNED_TILES: dict[tuple[int, int], dict] = {
    (9, 128): {"tile_mn": (192, 128), "mma_pv_is_rs": True, "intra_wg_overlap": False, "num_threads": 512},
}
# Keys (as `_key`) whose tuned FA4 call failed once: they use FA4's own tiles.
_untuned: set[tuple] = set()


@functools.cache
def _fa4_forward_with_tiles() -> Callable | None:
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception:  # noqa: BLE001 - another FA4 version: its public function still works
        return None
    return _flash_attn_fwd


def fa4_tiles(query: Tensor) -> dict | None:
    """The tuned FA4 settings `fa4_attention` passes for tensors like `query`, or None for FA4's own choice."""
    if query.device.type != "cuda" or _key(query) in _untuned or _fa4_forward_with_tiles() is None:
        return None
    major, _ = torch.cuda.get_device_capability(query.device)
    return FA4_TUNED_TILES.get((major, query.shape[-1]))


def fa4_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    flash_attn_func = _fa4_function()
    if flash_attn_func is None:
        raise RuntimeError("FlashAttention-4 (flash_attn.cute) is not importable")
    batched = (query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0))
    tiles = fa4_tiles(query)
    if tiles is not None:
        try:
            # (out, lse, ...): out is [1, S, heads, head_dim].
            return _fa4_forward_with_tiles()(*batched, **tiles)[0].squeeze(0)
        except Exception as error:  # noqa: BLE001 - the tuned tiles are optional, FA4's own still run
            _untuned.add(_key(query))
            logger.warning("FlashAttention-4 with tiles %s failed (%s); using its own tiles", tiles, error)
    output = flash_attn_func(*batched)
    # Some versions return (out, lse), others out alone.
    output = output[0] if isinstance(output, tuple) else output
    return output.squeeze(0)


_IMPLEMENTATIONS: dict[str, AttentionKernel] = {
    "fa4": fa4_attention,
    "cudnn": cudnn_attention,
    "sdpa": sdpa_attention,
}


def forced_backend() -> str | None:
    forced = os.environ.get(FORCE_ENVIRONMENT_VARIABLE, "").strip().lower() or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"{FORCE_ENVIRONMENT_VARIABLE}={forced!r}: expected one of {', '.join(BACKENDS)}")
    return forced


def candidate_backends(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[str]:
    """The backends worth trying for this device, dtype and head size, fastest first (`sdpa` always last)."""
    forced = forced_backend()
    if forced is not None:
        return [forced]
    candidates = []
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        major, _ = torch.cuda.get_device_capability(device)
        # Both fast kernels take head sizes that are multiples of 8 up to 256 (the tiny test DiT's 12 takes SDPA).
        fast_head = head_dim % 8 == 0 and 8 <= head_dim <= 256
        if major >= 9 and fast_head and _fa4_function() is not None:
            candidates.append("fa4")
        if fast_head and torch.backends.cuda.cudnn_sdp_enabled():
            candidates.append("cudnn")
    candidates.append("sdpa")
    return candidates


def _key(tensor: Tensor) -> tuple:
    return (tensor.device.type, tensor.device.index, tensor.dtype, tensor.shape[-1])


def selected_backend(query: Tensor) -> str:
    """The backend `attention` will use for tensors like `query` (before any first-call failure)."""
    failed = _failed.get(_key(query), set())
    candidates = candidate_backends(query.device, query.dtype, query.shape[-1])
    return next(name for name in candidates if name not in failed)


def attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Bidirectional attention over one packed document, [S, heads, head_dim] in and out."""
    cache_key = _key(query)
    failed = _failed.setdefault(cache_key, set())
    candidates = candidate_backends(query.device, query.dtype, query.shape[-1])
    for name in candidates:
        if name in failed:
            continue
        if len(candidates) == 1 or name == "sdpa":
            return _IMPLEMENTATIONS[name](query, key, value)
        try:
            return _IMPLEMENTATIONS[name](query, key, value)
        except Exception as error:  # noqa: BLE001 - any failure of an optional fast path falls back
            failed.add(name)
            logger.warning("attention backend %s failed (%s); falling back", name, error)
    raise RuntimeError("no attention backend left")  # unreachable: sdpa is always a candidate
