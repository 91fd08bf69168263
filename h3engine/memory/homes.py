"""Host homes: page-locked copies of weights (packed into slabs), and the FP8 form a home can store weights in.

* `pin_in_place(tensors)` moves tensors' data into pinned slabs (parameters keep their identity): the low-memory
  placement's homes and the DiT's offloaded AdaLN projections.
* `host_buffers(sizes, pin)` hands out byte buffers carved from the same kind of slabs (pageable when `pin` is
  False or pinning fails): a streamed layer's home image (h3engine.memory.streaming).
* `quantize_rows` (h3engine.models.quantization's) / `dequantize_into` are the FP8 storage of `--weights fp8`: e4m3 values with one fp32 scale per
  output row (h3engine.models.quantization's scheme), turned back into the compute dtype as `dtype(float32(q) * scale)`,
  one rounding. A home in FP8 holds half the bytes of bf16 and crosses PCIe in half the time; the values the layer
  computes with are no longer the released ones (a stated, measured error, never the default).

Danger: torch's pinned allocator rounds every allocation up to a power of two; pinning tensor by tensor would cost
up to twice the bytes. Everything pinned here goes through slabs.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from h3engine.memory.slabs import PINNED_SLAB_BYTES, aligned, slab_plan
from h3engine.models.quantization import quantize_rows

logger = logging.getLogger(__name__)


def _pinned_bytes(size: int) -> Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _pageable_bytes(size: int) -> Tensor:
    return torch.empty(size, dtype=torch.uint8)


def carve(
    sizes: Sequence[int],
    slab_bytes: int = PINNED_SLAB_BYTES,
    allocate: Callable[[int], Tensor] = _pinned_bytes,
) -> Iterator[Tensor | None]:
    """Byte buffers of `sizes`, packed in order into the slabs of `slab_plan`, each slab allocated when the first
    buffer in it is asked for: a caller that fills each buffer before asking for the next holds at most one
    unfilled slab. From the first allocation that fails on, the rest are None."""
    index = 0
    for allocation, count in slab_plan(sizes, slab_bytes):
        try:
            slab = allocate(allocation)
        except RuntimeError as error:
            logger.warning("could not pin more host memory (%s); copies to the GPU will be slower", error)
            yield from [None] * (len(sizes) - index)
            return
        used = 0
        for size in sizes[index : index + count]:
            yield slab[used : used + size]
            used += aligned(size)
        index += count


def host_buffers(sizes: Sequence[int], pin: bool, slab_bytes: int = PINNED_SLAB_BYTES) -> list[Tensor]:
    """uint8 host buffers of `sizes`, each starting on `ALIGNMENT`: pinned when `pin` (pageable for those that
    could not be pinned), else pageable."""
    if not pin:
        return [_pageable_bytes(size) for size in sizes]
    return [
        pinned_or_pageable(buffer, size) for buffer, size in zip(carve(sizes, slab_bytes), sizes, strict=True)
    ]


def pinned_or_pageable(buffer: Tensor | None, size: int) -> Tensor:
    """A buffer `carve` gave, or a pageable one of `size` where pinning failed."""
    return buffer if buffer is not None else _pageable_bytes(size)


def pin_in_place(
    tensors: Sequence[Tensor],
    slab_bytes: int = PINNED_SLAB_BYTES,
    allocate: Callable[[int], Tensor] = _pinned_bytes,
) -> None:
    """Move each tensor's data (parameters and buffers keep their identity) into page-locked host memory, for fast
    asynchronous copies to the GPU, packed in order into slabs (see `host_buffers`). One tensor at a time, so the
    host holds one extra tensor, not a module's worth. From the first allocation that fails on, the remaining
    tensors stay as they are (pageable: slower copies, same values)."""
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    for tensor, buffer in zip(tensors, carve(sizes, slab_bytes, allocate), strict=True):
        if buffer is None:
            return
        pinned = buffer.view(tensor.dtype).view(tensor.shape)
        pinned.copy_(tensor.data)
        tensor.data = pinned


class PageLockedBuffer:
    """`size` bytes of host memory, exactly: an anonymous mapping of that size, page-locked in place
    (cudaHostRegister) when `register`, so that copies to the GPU from it are asynchronous. Unlike torch's pinned
    allocator, which rounds each allocation up to a power of two (a 1.2 GB buffer would lock 2 GB), it locks what it
    holds. `tensor` is its uint8 view; `close()` unlocks and unmaps it (nothing may use the view afterwards)."""

    def __init__(self, size: int, register: bool) -> None:
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1))
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=size)
        self.registered = False
        if register:
            status = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0))
            if status != 0:
                logger.warning(
                    "could not page-lock %d bytes (cudaError %d); copies from them are slower", size, status
                )
            self.registered = status == 0

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


# --- FP8 storage -------------------------------------------------------------------------------------------------


def quantizable(tensor: Tensor) -> bool:
    """Whether `--weights fp8` stores this tensor in FP8: a 2-D 16-bit float matrix (a linear's weight). Vectors
    (norms, biases) and the fp32 islands keep their dtype."""
    return tensor.dim() == 2 and tensor.dtype in (torch.bfloat16, torch.float16)


def quantized_bytes(shape: Sequence[int]) -> tuple[int, int]:
    """(e4m3 value bytes, fp32 scale bytes) of a quantized [rows, columns] matrix."""
    rows, columns = shape
    return rows * columns, rows * 4


def dequantize_into(destination: Tensor, values: Tensor, scales: Tensor) -> Tensor:
    """destination = dtype(float32(values) * scales), rounded once: the e4m3 values are exact in bf16 and fp16, and
    the multiply promotes to fp32 before the in-place cast back (the same bits as dequantize-then-cast)."""
    destination.copy_(values)
    return destination.mul_(scales)


def dequantized(weight: Tensor) -> Tensor:
    """The weight as `--weights fp8` computes with it (its dtype and device), from its FP8 form."""
    values, scales = quantize_rows(weight)
    return dequantize_into(torch.empty_like(weight), values, scales)
