"""Where a streamed layer's tensors sit and how they are read: their places in a device slot and a host image
(`StreamedTensor`, `tensor_layout`), and how a file home gives their values (`TensorRead`, `read_extents`).

h3engine.memory.streaming.LayerStream runs the rings over these. A slot holds a layer's tensors as they compute, at
aligned offsets; an image holds the same tensors on the host, or with `quantize` each quantizable one as e4m3 values
and fp32 row scales.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from h3engine.checkpoint.safetensors_io import FileExtent
from h3engine.memory.homes import quantizable, quantized_bytes
from h3engine.memory.layers import LayerSpec
from h3engine.memory.slabs import aligned

# A reader of a file home: the tensor's values on the host, in the layer's dtype and shape; or, for a tensor stored in
# FP8 in the files, its (e4m3 values, fp32 row scales).
TensorReader = Callable[[], "Tensor | tuple[Tensor, Tensor]"]


@dataclass(frozen=True)
class TensorRead:
    """How to read one streamed tensor from the files: `read()`, or `extents` (its bytes, as the layer holds them, at
    these places of the files) that a reader thread copies straight into a host buffer; `scale_extents` likewise for
    the row scales of a tensor the files store in FP8."""

    read: TensorReader
    extents: tuple[FileExtent, ...] | None = None
    scale_extents: tuple[FileExtent, ...] | None = None
    fp8: bool = False  # `read` gives (e4m3 values, fp32 row scales) as the files store them


@dataclass(frozen=True)
class StreamedTensor:
    """One streamed parameter or buffer of a layer: where it lives in a slot and in the layer's host image."""

    owner: nn.Module
    name: str  # the attribute on `owner`
    shape: torch.Size
    dtype: torch.dtype
    slot_offset: int
    image_offset: int  # its bytes, or its e4m3 values when quantized
    scale_offset: int = -1  # quantized: its fp32 row scales in the image; -1 otherwise

    @property
    def quantized(self) -> bool:
        return self.scale_offset >= 0

    @property
    def tensor(self) -> Tensor:
        return getattr(self.owner, self.name)

    def in_slot(self, slot: Tensor) -> Tensor:
        return typed_view(slot, self.slot_offset, self.dtype, self.shape)


def typed_view(buffer: Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + size].view(dtype).view(shape)


def streamed_tensors(spec: LayerSpec, layer: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """(owner, attribute, tensor) of each parameter and buffer of a layer's streamed parts, in a fixed order."""
    found = []
    for part in spec.parts_of(layer):
        for owner in part.modules():
            for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
                if tensor is not None:
                    found.append((owner, name, tensor))
    return found


def tensor_layout(
    tensors: Sequence[tuple[nn.Module, str, Tensor]], quantize: bool
) -> tuple[list[StreamedTensor], int, int]:
    """Each tensor's place in a slot and in the host image, the slot's bytes and the image's."""
    placed, slot_bytes, image_bytes = [], 0, 0
    for owner, name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        scale_offset = -1
        image_offset = image_bytes
        if quantize and quantizable(tensor):
            value_bytes, scale_bytes = quantized_bytes(tensor.shape)
            scale_offset = aligned(image_offset + value_bytes)
            image_bytes = aligned(scale_offset + scale_bytes)
        else:
            image_bytes = aligned(image_offset + nbytes)
        placed.append(
            StreamedTensor(owner, name, tensor.shape, tensor.dtype, slot_bytes, image_offset, scale_offset)
        )
        slot_bytes = aligned(slot_bytes + nbytes)
    return placed, slot_bytes, image_bytes


def read_extents(extents: Sequence[FileExtent], destination: Tensor) -> int:
    """Copy each extent's bytes from its file into `destination` (a contiguous uint8 host tensor) at its target;
    returns the bytes read. The reads release the GIL (os.preadv)."""
    view = memoryview(destination.numpy())
    total = 0
    for extent in extents:
        descriptor = os.open(extent.path, os.O_RDONLY)
        try:
            done = 0
            while done < extent.length:
                part = view[extent.target + done : extent.target + extent.length]
                count = os.preadv(descriptor, [part], extent.offset + done)
                if count <= 0:
                    raise OSError(f"{extent.path}: ended {extent.length - done} bytes early")
                done += count
        finally:
            os.close(descriptor)
        total += extent.length
    return total


def to_tensor_read(reader: TensorRead | TensorReader) -> TensorRead:
    return reader if isinstance(reader, TensorRead) else TensorRead(reader)


def shifted(extents: Sequence[FileExtent], offset: int) -> list[FileExtent]:
    """Extents whose targets are relative to a tensor, moved to where the tensor starts in an image."""
    return [FileExtent(e.path, e.offset, e.length, e.target + offset) for e in extents]


def tensor_parts(tensor: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
    return tensor if isinstance(tensor, tuple) else (tensor,)
