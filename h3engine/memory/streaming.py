"""Layers streamed through a ring of device buffers: a model too large for its GPU visits it a layer at a time,
each layer copied a few layers ahead of the one computing (see `LayerStream` for the mechanics).

Contract: `LayerStream(spec, first, device, ring_depth, ...)` takes over the streamed tensors of `spec.layers[first:]`
(their home: one host image per layer, pinned on a GPU, FP8 with `quantize`; or the mapped checkpoint files, read at
every visit). Hooks on each layer's `entry` / `exit` submodules acquire and release it; between visits its tensors
are "parked" (right shape and dtype, one broadcast NaN behind them). `open()` allocates the ring (a phase starts),
`close()` frees it (the phase ends): nothing is allocated per step. The same math runs on the same values as with
resident weights, so outputs are bit-identical (FP8 storage aside).

Danger: the entry and exit calls must bracket every read of a layer's streamed tensors (true of the specs in
h3engine.memory.layers). A copy's source must outlive it: images live as long as the stream, and a mapped read goes
through a pinned bounce buffer whose reuse waits for the copy that last read it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from h3engine.checkpoint.safetensors_io import parked
from h3engine.memory.homes import (
    carve,
    dequantize_into,
    host_buffers,
    pinned_or_pageable,
    quantizable,
    quantized_bytes,
)
from h3engine.memory.layers import LayerSpec
from h3engine.memory.slabs import aligned
from h3engine.quantization import quantize_rows

# A reader of a mapped home: the tensor's values on the host, in the layer's dtype and shape (a view of the memory-
# mapped file when it can be, so that reading costs the page cache's copy and nothing else).
TensorReader = Callable[[], Tensor]


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
        return _typed_view(slot, self.slot_offset, self.dtype, self.shape)


def _typed_view(buffer: Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
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


def _layout(
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


class _CudaCopies:
    """The side stream and the per-slot events of a ring on a GPU."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]
        self.used = [False] * slots
        self.bounce_done = [torch.cuda.Event(), torch.cuda.Event()]

    @contextmanager
    def filling(self, slot: int) -> Iterator[None]:
        """Work issued inside runs on the copy stream, after the compute that last read `slot`."""
        with torch.cuda.stream(self.stream):
            if self.used[slot]:
                self.stream.wait_event(self.free[slot])
            yield
            self.ready[slot].record(self.stream)
        self.used[slot] = True

    def wait_ready(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def mark_free(self, slot: int) -> None:
        self.free[slot].record(torch.cuda.current_stream(self.device))

    def bounce_ready(self, bounce: int) -> None:
        self.bounce_done[bounce].synchronize()

    def bounce_read(self, bounce: int) -> None:
        self.bounce_done[bounce].record(self.stream)

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def after_compute(self) -> None:
        """Copies issued from now on start after everything the compute stream has queued (a restart: the visit that
        stopped half way never marked its slot free)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))


class _HostCopies:
    """A ring on the CPU: copies happen at once, in order, so there is nothing to wait for."""

    @contextmanager
    def filling(self, slot: int) -> Iterator[None]:
        yield

    def wait_ready(self, slot: int) -> None:
        pass

    def mark_free(self, slot: int) -> None:
        pass

    def bounce_ready(self, bounce: int) -> None:
        pass

    def bounce_read(self, bounce: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def after_compute(self) -> None:
        pass


class LayerStream:
    """The streamed layers of one model and their ring.

    The ring holds `ring_depth` slots of device memory, each as large as the largest layer; a layer's tensors are
    views into its slot at fixed offsets. Layers are visited in order, cyclically (one DiT forward runs every block,
    the next starts again at the first): when layer i is released, the copy of the layer `ring_depth` visits ahead
    starts into the slot it freed. On a GPU copies run on a side stream: a copy waits (GPU-side) for the compute that
    last read its slot, the compute waits for the copy of the layer it is about to read; the host waits for neither.
    A visit out of that order (a forward that stopped half way: an error, a cancel) restarts the ring there.
    """

    def __init__(
        self,
        spec: LayerSpec,
        first: int,
        device: torch.device | str,
        ring_depth: int,
        quantize: bool = False,
        readers: Sequence[Sequence[TensorReader]] | None = None,
        mapped: bool = False,
        pin: bool | None = None,
    ) -> None:
        """Take over `spec.layers[first:]`. `readers` gives, per layer and per streamed tensor (in `streamed_tensors`
        order), how to read it from the checkpoint (the loader left them unread); without readers the tensors hold
        their values on the host. `mapped`: read through the readers at every visit (no image is kept); else each
        layer's image is filled once, layer by layer (the host holds one extra layer at a time). `pin`: page-locked
        images (default: when the device is a GPU)."""
        self.device = torch.device(device)
        self.layers = spec.layers[first:]
        if not self.layers:
            raise ValueError("a layer stream needs at least one layer")
        if ring_depth < 1:
            raise ValueError(f"ring_depth must be >= 1, got {ring_depth}")
        if mapped and (readers is None or quantize):
            raise ValueError("a mapped home needs readers, and is read as the files store it (no FP8)")
        self.depth = min(ring_depth, len(self.layers))
        self.quantize = quantize
        found = [streamed_tensors(spec, layer) for layer in self.layers]
        layouts = [_layout(tensors, quantize) for tensors in found]
        self.tensors = [placed for placed, _, _ in layouts]
        self.slot_bytes = max(slot_bytes for _, slot_bytes, _ in layouts)
        self.image_bytes = max(image_bytes for _, _, image_bytes in layouts)
        if readers is not None and [len(r) for r in readers] != [len(t) for t in self.tensors]:
            raise ValueError("readers must give one reader per streamed tensor of every streamed layer")
        self._pin = self.device.type == "cuda" if pin is None else pin
        self._parked: dict[torch.dtype, Tensor] = {}
        self._readers = [list(layer) for layer in readers] if mapped else None
        # Host images, one per layer (None for a mapped home), each filled and its layer parked before the next.
        self.images: list[Tensor] | None = None
        if mapped:
            self._park_all()
        else:
            sizes = [image for _, _, image in layouts]
            buffers = carve(sizes) if self._pin else (None for _ in sizes)
            self.images = []
            for index, (buffer, size) in enumerate(zip(buffers, sizes, strict=True)):
                image = pinned_or_pageable(buffer, size)
                self._fill_image(self.tensors[index], image, readers[index] if readers is not None else None)
                self._park(self.tensors[index])
                self.images.append(image)
        self._bounces: list[Tensor] | None = None
        self._copies: _CudaCopies | _HostCopies | None = None
        self._slots: list[Tensor] = []
        self._staging: list[Tensor] = []
        self._queue: collections.deque[tuple[int, int]] = collections.deque()  # (layer, slot) in visit order
        self._current: tuple[int, int] | None = None
        self._next_bounce = 0
        self.visits = 0  # layers computed since the stream was made (for tests and benchmarks)
        self.restarts = 0  # visits out of the cyclic order, each of which reloaded the ring
        self.copied_bytes = 0  # host -> device bytes copied since the stream was made
        self._hooks = []
        for index, layer in enumerate(self.layers):
            entry, exit_ = layer.get_submodule(spec.entry), layer.get_submodule(spec.exit)
            self._hooks.append(entry.register_forward_pre_hook(self._acquire_hook(index)))
            self._hooks.append(exit_.register_forward_hook(self._release_hook(index)))

    # --- set-up ---------------------------------------------------------------------------------------------------

    def _fill_image(
        self, layer_tensors: list[StreamedTensor], image: Tensor, readers: Sequence[TensorReader] | None
    ) -> None:
        for index, placed in enumerate(layer_tensors):
            tensor = readers[index]() if readers is not None else placed.tensor.detach()
            if placed.quantized:
                values, scales = quantize_rows(tensor)
                _typed_view(image, placed.image_offset, values.dtype, values.shape).copy_(values)
                _typed_view(image, placed.scale_offset, scales.dtype, scales.shape).copy_(scales)
            else:
                _typed_view(image, placed.image_offset, placed.dtype, placed.shape).copy_(tensor)

    def _park_all(self) -> None:
        for layer_tensors in self.tensors:
            self._park(layer_tensors)

    def _park(self, layer_tensors: list[StreamedTensor]) -> None:
        for placed in layer_tensors:
            # One parked element per dtype, made once: parking at every release allocates and launches nothing.
            if placed.dtype not in self._parked:
                self._parked[placed.dtype] = parked((), placed.dtype, self.device)
            placed.tensor.data = self._parked[placed.dtype].expand(placed.shape)

    @property
    def host_bytes(self) -> int:
        """Bytes the images hold on the host (0 for a mapped home)."""
        return sum(image.numel() for image in self.images or ())

    @property
    def is_open(self) -> bool:
        return self._copies is not None

    # --- the ring -------------------------------------------------------------------------------------------------

    def open(self, start: int = 0) -> None:
        """Allocate the ring and start copying the first `depth` layers from `start` on."""
        if self.is_open:
            return
        cuda = self.device.type == "cuda"
        self._copies = _CudaCopies(self.device, self.depth) if cuda else _HostCopies()
        self._slots = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.depth)
        ]
        if self.quantize:
            self._staging = [
                torch.empty(self.image_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(self.depth)
            ]
        if cuda:
            # Allocated on the compute stream, written on the copy stream: keep them until that stream is done too.
            for buffer in [*self._slots, *self._staging]:
                buffer.record_stream(self._copies.stream)
            if self._readers is not None and self._bounces is None:
                self._bounces = host_buffers([self.slot_bytes] * 2, pin=self._pin)
        self._restart(start)

    def close(self) -> None:
        """Free the ring (the layers stay parked until the next visit opens it again)."""
        if not self.is_open:
            return
        if self._current is not None:
            self._park(self.tensors[self._current[0]])
            self._current = None
        self._copies.drain()
        self._queue.clear()
        self._slots, self._staging = [], []
        self._copies = None

    def _restart(self, start: int) -> None:
        """Load the `depth` layers from `start` on into the slots, in visit order."""
        if self._current is not None:
            self._park(self.tensors[self._current[0]])
            self._current = None
        self._copies.after_compute()
        self._queue.clear()
        for slot in range(self.depth):
            layer = (start + slot) % len(self.layers)
            self._fill_slot(layer, slot)
            self._queue.append((layer, slot))

    def _following(self, layer: int) -> int:
        """The layer visited after `layer`."""
        return (layer + 1) % len(self.layers)

    def _fill_slot(self, layer: int, slot: int) -> None:
        """Start copying `layer`'s home into `slot` (on a GPU: on the copy stream, after the slot's last reader)."""
        destination = self._slots[slot]
        with self._copies.filling(slot):
            if self._readers is not None:
                self._copy_mapped(layer, destination)
            elif self.quantize:
                staging = self._staging[slot]
                staging[: self.images[layer].numel()].copy_(self.images[layer], non_blocking=True)
                for placed in self.tensors[layer]:
                    target = placed.in_slot(destination)
                    if placed.quantized:
                        values = _typed_view(staging, placed.image_offset, torch.float8_e4m3fn, placed.shape)
                        scales = _typed_view(
                            staging, placed.scale_offset, torch.float32, (placed.shape[0], 1)
                        )
                        dequantize_into(target, values, scales)
                    else:
                        target.copy_(_typed_view(staging, placed.image_offset, placed.dtype, placed.shape))
            else:
                image = self.images[layer]
                destination[: image.numel()].copy_(image, non_blocking=True)
        self.copied_bytes += self.images[layer].numel() if self.images is not None else self.slot_bytes

    def _copy_mapped(self, layer: int, destination: Tensor) -> None:
        """A mapped home: read each tensor from the files (the page cache or the disk) into a pinned bounce buffer,
        then one asynchronous copy of the buffer. On the CPU the reads go straight into the slot."""
        readers, tensors = self._readers[layer], self.tensors[layer]
        if self._bounces is None:
            for placed, read in zip(tensors, readers, strict=True):
                placed.in_slot(destination).copy_(read())
            return
        bounce_index = self._next_bounce
        self._next_bounce = 1 - bounce_index
        self._copies.bounce_ready(bounce_index)  # the copy that last read this buffer is done
        bounce = self._bounces[bounce_index]
        for placed, read in zip(tensors, readers, strict=True):
            placed.in_slot(bounce).copy_(read())
        destination.copy_(bounce, non_blocking=True)
        self._copies.bounce_read(bounce_index)

    # --- visits ---------------------------------------------------------------------------------------------------

    def acquire(self, layer: int) -> None:
        """Layer `layer` is about to run: make the compute wait for its copy and point its tensors into its slot."""
        if not self.is_open:
            self.open(layer)
        elif self._current is not None or not self._queue or self._queue[0][0] != layer:
            self.restarts += 1
            self._restart(layer)
        _, slot = self._queue[0]
        self._copies.wait_ready(slot)
        for placed in self.tensors[layer]:
            placed.tensor.data = placed.in_slot(self._slots[slot])
        self._current = (layer, slot)

    def release(self, layer: int) -> None:
        """Layer `layer` has run: park its tensors, and start the copy of the layer `depth` visits ahead into its
        slot once the compute queued so far (which reads the slot) is done."""
        if self._current is None or self._current[0] != layer:
            return  # a visit the ring did not open (an unexpected call order): the next acquire restarts it
        _, slot = self._queue.popleft()
        self._park(self.tensors[layer])
        self._current = None
        self.visits += 1
        self._copies.mark_free(slot)
        last_queued = self._queue[-1][0] if self._queue else layer
        following = self._following(last_queued)
        self._fill_slot(following, slot)
        self._queue.append((following, slot))

    def _acquire_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            self.acquire(index)

        return hook

    def _release_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            self.release(index)

        return hook

    def remove(self) -> None:
        """Detach from the layers (their tensors stay parked): for a model that is being dropped."""
        self.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
