"""Triton twins of `h3engine.models.kernels.reference.relayout`: the Ulysses send/receive permutations as one strided copy each.

Contract
--------
Same arguments and results as the reference. Both are instances of one copy: the output is a contiguous
[N0, N1, N2, chunk] whose (i0, i1, i2) chunk is read at i0*s0 + i1*s1 + i2*s2 in the input, chunk being a head
block (heads/size x D, or local_heads x D) that is contiguous in both. One program copies one chunk tile. The
input may be strided as long as each head block is contiguous (D unit-stride, heads D apart) and the `lead` axes
merge into one (as torch.view would allow).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import LAUNCH_OPTIONS, SUPPORTED_DTYPES, num_warps_for

# Chunk tile: one program copies up to this many elements of a head block.
CHUNK_TILE = 4096


@triton.jit
def _chunk_permute_kernel(
    in_ptr,
    out_ptr,
    count_1,
    count_2,
    in_stride_0,
    in_stride_1,
    in_stride_2,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
):
    chunk_index = tl.program_id(0)
    index_2 = chunk_index % count_2
    index_1 = (chunk_index // count_2) % count_1
    index_0 = chunk_index // (count_2 * count_1)
    source = (
        in_ptr
        + index_0.to(tl.int64) * in_stride_0
        + index_1.to(tl.int64) * in_stride_1
        + index_2.to(tl.int64) * in_stride_2
    )
    offsets = tl.program_id(1) * TILE + tl.arange(0, TILE)
    in_chunk = offsets < CHUNK
    values = tl.load(source + offsets, mask=in_chunk)
    tl.store(out_ptr + chunk_index.to(tl.int64) * CHUNK + offsets, values, mask=in_chunk)


def _head_blocks(tensor: Tensor, outer_dims: int) -> Tensor | None:
    """[*outer, *lead, heads, D] viewed as [*outer, lead, heads, D] with heads x D contiguous, or None."""
    if tensor.dim() < outer_dims + 2 or tensor.dtype not in SUPPORTED_DTYPES:
        return None
    heads, head_dim = tensor.shape[-2:]
    if (tensor.stride(-1) != 1 and head_dim > 1) or (tensor.stride(-2) != head_dim and heads > 1):
        return None
    lead = math.prod(tensor.shape[outer_dims:-2])
    try:
        return tensor.view(*tensor.shape[:outer_dims], lead, heads, head_dim)
    except RuntimeError:
        return None


def _launch(
    source: Tensor, out: Tensor, counts: tuple[int, int, int], strides: tuple[int, int, int], chunk: int
) -> None:
    if chunk == 0 or math.prod(counts) == 0:
        return
    tile = min(CHUNK_TILE, triton.next_power_of_2(chunk))
    _chunk_permute_kernel[(math.prod(counts), triton.cdiv(chunk, tile))](
        source,
        out,
        counts[1],
        counts[2],
        *strides,
        CHUNK=chunk,
        TILE=tile,
        num_warps=num_warps_for(tile),
        **LAUNCH_OPTIONS,
    )


def supports_pack_heads_for_exchange(tensor: Tensor, size: int) -> bool:
    return (
        isinstance(size, int)
        and size >= 1
        and tensor.dim() >= 3
        and tensor.shape[-2] % size == 0
        and _head_blocks(tensor, outer_dims=1) is not None
    )


def pack_heads_for_exchange(tensor: Tensor, size: int) -> Tensor:
    """[rows, *lead, heads, D] -> contiguous [size, rows, *lead, heads / size, D]."""
    view = _head_blocks(tensor, outer_dims=1)
    rows, lead, heads, head_dim = view.shape
    local_heads = heads // size
    out = torch.empty(
        (size, *tensor.shape[:-2], local_heads, head_dim), dtype=tensor.dtype, device=tensor.device
    )
    # out[s, r, l] is head block s of input row (r, l).
    strides = (local_heads * head_dim, view.stride(0), view.stride(1))
    _launch(view, out, (size, rows, lead), strides, local_heads * head_dim)
    return out


def supports_unpack_exchanged_heads(received: Tensor) -> bool:
    return _head_blocks(received, outer_dims=2) is not None


def unpack_exchanged_heads(received: Tensor) -> Tensor:
    """[size, rows, *lead, local_heads, D] -> contiguous [rows, *lead, size * local_heads, D]."""
    view = _head_blocks(received, outer_dims=2)
    size, rows, lead, local_heads, head_dim = view.shape
    out = torch.empty(
        (*received.shape[1:-2], size * local_heads, head_dim), dtype=received.dtype, device=received.device
    )
    # out[r, l, s] is rank s's head block of row (r, l).
    strides = (view.stride(1), view.stride(2), view.stride(0))
    _launch(view, out, (rows, lead, size), strides, local_heads * head_dim)
    return out
