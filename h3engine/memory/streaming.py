"""Layers streamed through a ring of device buffers: a model too large for its GPU visits it a layer at a time,
each layer copied a few layers ahead of the one computing (see `LayerStream` for the mechanics).

Contract: `LayerStream(spec, first, device, ring_depth, ...)` takes over the streamed tensors of `spec.layers[first:]`.
Each layer's home is an image in host memory (pinned on a GPU; FP8 with `quantize`) or, for the layers `mapped` names,
the checkpoint files themselves: reader threads read those `read_ahead` layers ahead of their turn into a host ring of
exactly that many page-locked buffers (h3engine.memory.homes.PageLockedBuffer), straight from the files where the
loader gave their extents. Hooks on each layer's `entry` / `exit` submodules acquire and release it; between visits
its tensors are "parked". `open()` allocates the rings (a phase starts), `close()` frees them. The same math runs on
the same values as with resident weights: outputs are bit-identical (FP8 storage aside).

Danger: the entry and exit calls must bracket every read of a layer's streamed tensors (true of the specs in
h3engine.memory.layers). A copy's source must outlive it: an image lives as long as the stream, a host-ring buffer is
refilled only after the copy that read it is done (its event), and `close()` waits for the reader threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from h3engine.checkpoint.safetensors_io import parked
from h3engine.memory.homes import PageLockedBuffer, carve, dequantize_into, pinned_or_pageable
from h3engine.memory.layers import LayerSpec
from h3engine.memory.stream_copies import CudaCopies, HostCopies
from h3engine.memory.stream_layout import (
    StreamedTensor,
    TensorRead,
    TensorReader,
    read_extents,
    shifted,
    streamed_tensors,
    tensor_layout,
    tensor_parts,
    to_tensor_read,
    typed_view,
)
from h3engine.models.quantization import quantize_rows

# Layers read ahead of their turn into the host ring, and the threads reading them, by default.
READ_AHEAD = 2
READER_THREADS = 2


@dataclass
class _Read:
    """A file-home layer being read (or read) into host-ring buffer `buffer`."""

    layer: int
    buffer: int
    future: concurrent.futures.Future


class LayerStream:
    """The streamed layers of one model and their rings.

    The device ring holds `ring_depth` slots of device memory, each as large as the largest layer; a layer's tensors
    are views into its slot at fixed offsets. Layers are visited in order, cyclically (one DiT forward runs every
    block, the next starts again at the first): when layer i is released, the copy of the layer `ring_depth` visits
    ahead starts into the slot it freed. On a GPU copies run on a side stream: a copy waits (GPU-side) for the compute
    that last read its slot, the compute waits for the copy of the layer it is about to read; the host waits for
    neither, except for a file-home layer whose read has not finished: then the disk is slower than the compute.
    File-home layers are read by reader threads in visit order, as far ahead as the host ring has free buffers, and
    never one layer into two buffers. A visit out of that order (a forward that stopped half way: an error, a
    cancel) restarts both rings there.
    """

    def __init__(
        self,
        spec: LayerSpec,
        first: int,
        device: torch.device | str,
        ring_depth: int,
        quantize: bool = False,
        readers: Sequence[Sequence[TensorRead | TensorReader]] | None = None,
        mapped: bool | Sequence[bool] = False,
        pin: bool | None = None,
        read_ahead: int = READ_AHEAD,
        reader_threads: int = READER_THREADS,
    ) -> None:
        """Take over `spec.layers[first:]` (the first `first` stay resident on the device; `set_resident_layers`
        changes how many, between phases). `readers` gives, per layer and per streamed tensor (in `streamed_tensors`
        order), how to read it from the checkpoint (the loader left them unread): for the streamed layers, or for
        every layer (then a resident layer can be streamed later, from the files); without readers the tensors hold
        their values on the host. `mapped` (all streamed layers, or one flag each): the layers whose home is the
        files, read at every visit; the others' images are filled once, layer by layer (the host holds one extra
        layer at a time). `pin`: page-locked host memory (default: when the device is a GPU). `quantize`: FP8 images
        (a file-home layer then needs readers that give FP8 values and scales: files stored in FP8)."""
        self.device = torch.device(device)
        self._all_layers = tuple(spec.layers)
        flags = _home_flags(
            len(self._all_layers), first, ring_depth, read_ahead, reader_threads, mapped, readers
        )
        self.first = first
        self.ring_depth = ring_depth
        self.quantize = quantize
        layouts = [tensor_layout(streamed_tensors(spec, layer), quantize) for layer in self._all_layers]
        self._tensors_all = [placed for placed, _, _ in layouts]
        self.slot_bytes = max(slot_bytes for _, slot_bytes, _ in layouts)
        self.image_bytes = max(image_bytes for _, _, image_bytes in layouts)
        self._sizes_all = [image for _, _, image in layouts]
        reads = _layer_reads(readers, first, self._tensors_all)
        self._reads_all: list[list[TensorRead] | None] | None = reads
        # A resident layer that can be streamed later reads from the files (its home); the others have none.
        self._file_all = [reads is not None and reads[index] is not None for index in range(first)] + flags
        if any(flags) and reads is None:
            raise ValueError("a file home needs readers")
        self._pin = self.device.type == "cuda" if pin is None else pin
        self._parked: dict[torch.dtype, Tensor] = {}
        self._images_all = self._host_images()
        self.read_ahead = read_ahead
        self._reader_threads = reader_threads
        self._closed_rings()
        self.visits = 0  # layers computed since the stream was made (for tests and benchmarks)
        self.restarts = 0  # visits out of the cyclic order, each of which reloaded the ring
        self.copied_bytes = 0  # host -> device bytes copied since the stream was made
        self.read_bytes = 0  # bytes read from the files into the host ring since the stream was made
        self.layer_reads = 0  # file-home layers read since the stream was made
        self.waited_reads = 0  # reads the host had to wait for (the disk was behind the compute)
        self.most_reads_ahead = 0  # the most file-home layers read or being read ahead of their turn at once
        self._hooks = []
        for index, layer in enumerate(self._all_layers):
            entry, exit_ = layer.get_submodule(spec.entry), layer.get_submodule(spec.exit)
            self._hooks.append(entry.register_forward_pre_hook(self._acquire_hook(index)))
            self._hooks.append(exit_.register_forward_hook(self._release_hook(index)))

    def _host_images(self) -> list[Tensor | None]:
        """Host images, one per layer (None for a file home or a resident layer), each filled and its layer parked
        before the next."""
        count = len(self._all_layers)
        images: list[Tensor | None] = [None] * count
        image_sizes = [
            self._sizes_all[index] for index in range(self.first, count) if not self._file_all[index]
        ]
        buffers = iter(carve(image_sizes) if self._pin else [None] * len(image_sizes))
        for index in range(self.first, count):
            if not self._file_all[index]:
                image = pinned_or_pageable(next(buffers), self._sizes_all[index])
                self._fill_image(index, image)
                images[index] = image
            self._park(self._tensors_all[index])
        return images

    def _closed_rings(self) -> None:
        """The state of the rings while they are closed: no buffers, no reads, no copies queued."""
        self._host_ring: list[PageLockedBuffer] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._reads: collections.deque[_Read] = collections.deque()  # in visit order
        self._free_buffers: list[int] = []
        self._buffer_copied: list[object] = []  # per host buffer: the event of the last copy that read it
        # The streamed layer (an index into `layers`) from which the next read looks for a file-home layer.
        self._read_cursor = 0
        self._copies: CudaCopies | HostCopies | None = None
        self._slots: list[Tensor] = []
        self._staging: list[Tensor] = []
        self._queue: collections.deque[tuple[int, int]] = collections.deque()  # (layer, slot) in visit order
        self._current: tuple[int, int] | None = None

    # --- the streamed layers (those after the resident ones), indexed from 0 -----------------------------------------

    @property
    def layers(self) -> tuple[nn.Module, ...]:
        return self._all_layers[self.first :]

    @property
    def tensors(self) -> list[list[StreamedTensor]]:
        return self._tensors_all[self.first :]

    @property
    def images(self) -> list[Tensor | None]:
        return self._images_all[self.first :]

    @property
    def home_is_file(self) -> list[bool]:
        return self._file_all[self.first :]

    @property
    def image_sizes(self) -> list[int]:
        return self._sizes_all[self.first :]

    @property
    def _reads_of(self) -> list[list[TensorRead] | None] | None:
        return None if self._reads_all is None else self._reads_all[self.first :]

    @property
    def depth(self) -> int:
        return min(self.ring_depth, len(self.layers))

    @property
    def lowest_resident(self) -> int:
        """The fewest leading layers that can be resident: those below it have no home to stream from."""
        lowest = self.first
        while lowest > 0 and self._has_home(lowest - 1):
            lowest -= 1
        return lowest

    def _has_home(self, layer: int) -> bool:
        if self._images_all[layer] is not None:
            return True
        return self._file_all[layer] and (not self.quantize or self._reads_give_fp8(layer))

    def _reads_give_fp8(self, layer: int) -> bool:
        return all(
            read.fp8 or not placed.quantized
            for read, placed in zip(self._reads_all[layer], self._tensors_all[layer], strict=True)
        )

    def set_resident_layers(self, count: int) -> None:
        """Keep the first `count` layers on the device (the ring must be closed): layers that join are copied there
        from their home, layers that leave free their device memory and stream from their home (the files, for a
        layer that was resident from the start)."""
        if self.is_open:
            raise RuntimeError("the resident layers change only between phases (the ring is open)")
        if not self.lowest_resident <= count < len(self._all_layers):
            raise ValueError(
                f"resident layers must be within [{self.lowest_resident}, {len(self._all_layers) - 1}], got {count}"
            )
        for index in range(self.first, count):
            image = self._images_all[index]
            if image is None:
                image = torch.empty(self._sizes_all[index], dtype=torch.uint8)
                self._fill_image(index, image)
            for placed in self._tensors_all[index]:
                value = torch.empty(placed.shape, dtype=placed.dtype, device=self.device)
                if placed.quantized:
                    values = typed_view(image, placed.image_offset, torch.float8_e4m3fn, placed.shape)
                    scales = typed_view(image, placed.scale_offset, torch.float32, (placed.shape[0], 1))
                    dequantize_into(value, values.to(self.device), scales.to(self.device))
                else:
                    value.copy_(typed_view(image, placed.image_offset, placed.dtype, placed.shape))
                placed.tensor.data = value
        for index in range(count, self.first):
            self._park(self._tensors_all[index])
        self.first = count

    # --- set-up ---------------------------------------------------------------------------------------------------

    def _fill_image(self, layer: int, image: Tensor) -> None:
        """A layer's host image (`layer` counts every layer, resident ones included) from its readers (or its loaded
        values): values, or FP8 values and scales."""
        reads = self._reads_all[layer] if self._reads_all is not None else None
        for index, placed in enumerate(self._tensors_all[layer]):
            tensor = reads[index].read() if reads is not None else placed.tensor.detach()
            self._put(placed, image, tensor)

    def _put(self, placed: StreamedTensor, image: Tensor, tensor: Tensor | tuple[Tensor, Tensor]) -> None:
        """One tensor's values into a layer's image (quantized there when the image is FP8)."""
        if placed.quantized:
            values, scales = tensor if isinstance(tensor, tuple) else quantize_rows(tensor)
            typed_view(image, placed.image_offset, values.dtype, values.shape).copy_(values)
            typed_view(image, placed.scale_offset, torch.float32, (placed.shape[0], 1)).copy_(
                scales.view(placed.shape[0], 1)
            )
        elif isinstance(tensor, tuple):
            raise ValueError("a tensor stored in FP8 streams only into an FP8 stream (--weights fp8)")
        else:
            typed_view(image, placed.image_offset, placed.dtype, placed.shape).copy_(tensor)

    def _park(self, layer_tensors: list[StreamedTensor]) -> None:
        for placed in layer_tensors:
            # One parked element per dtype, made once: parking at every release allocates and launches nothing.
            if placed.dtype not in self._parked:
                self._parked[placed.dtype] = parked((), placed.dtype, self.device)
            placed.tensor.data = self._parked[placed.dtype].expand(placed.shape)

    @property
    def host_bytes(self) -> int:
        """Bytes the images hold on the host (file-home layers hold none; the host ring holds `host_ring_buffers` x
        `host_ring_bytes` more while the stream is open)."""
        return sum(image.numel() for image in self._images_all if image is not None)

    @property
    def host_ring_buffers(self) -> int:
        """The host ring's buffers: `read_ahead`, at most one per streamed file-home layer."""
        return min(self.read_ahead, sum(self.home_is_file))

    @property
    def host_ring_bytes(self) -> int:
        """One host-ring buffer: the largest streamed file-home layer's image, exactly."""
        sizes = [size for size, in_file in zip(self.image_sizes, self.home_is_file, strict=True) if in_file]
        return max(sizes, default=0)

    @property
    def is_open(self) -> bool:
        return self._copies is not None

    # --- the rings ------------------------------------------------------------------------------------------------

    def open(self, start: int = 0) -> None:
        """Allocate the rings and start copying the first `depth` layers from `start` on."""
        if self.is_open:
            return
        cuda = self.device.type == "cuda"
        self._copies = CudaCopies(self.device, self.depth) if cuda else HostCopies()
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
        buffers = self.host_ring_buffers
        if buffers:
            size = self.host_ring_bytes
            self._host_ring = [PageLockedBuffer(size, register=cuda and self._pin) for _ in range(buffers)]
            self._buffer_copied = [None] * buffers
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(self._reader_threads, buffers), thread_name_prefix="layer-reader"
            )
        self._restart(start)

    def close(self) -> None:
        """Free the rings (the layers stay parked until the next visit opens them again); waits for the readers."""
        if not self.is_open:
            return
        if self._current is not None:
            self._park(self.tensors[self._current[0]])
            self._current = None
        self._drop_reads()
        self._copies.drain()
        self._queue.clear()
        self._slots, self._staging = [], []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for buffer in self._host_ring:
            buffer.close()
        self._host_ring, self._buffer_copied = [], []
        self._copies = None

    def _restart(self, start: int) -> None:
        """Load the `depth` layers from `start` on into the slots, in visit order (reads ahead from there too)."""
        if self._current is not None:
            self._park(self.tensors[self._current[0]])
            self._current = None
        self._copies.after_compute()
        self._queue.clear()
        self._drop_reads()
        self._read_cursor = start
        for slot in range(self.depth):
            layer = (start + slot) % len(self.layers)
            self._fill_slot(layer, slot)
            self._queue.append((layer, slot))

    def _following(self, layer: int) -> int:
        """The layer visited after `layer`."""
        return (layer + 1) % len(self.layers)

    # --- the host ring (file-home layers) ---------------------------------------------------------------------------

    def _drop_reads(self) -> None:
        """Wait for the reads in flight and forget them (their buffers are free again)."""
        for read in self._reads:
            concurrent.futures.wait([read.future])
        self._reads.clear()
        self._free_buffers = list(range(len(self._host_ring)))

    def _next_file_layer(self, start: int) -> int | None:
        """The first file-home layer visited from `start` on (cyclically), or None."""
        for step in range(len(self.layers)):
            layer = (start + step) % len(self.layers)
            if self.home_is_file[layer]:
                return layer
        return None

    def _schedule_reads(self) -> None:
        """Start reading the next file-home layers, in visit order, into the free host buffers: never a layer that a
        buffer already holds or is reading."""
        while self._free_buffers:
            layer = self._next_file_layer(self._read_cursor)
            if layer is None or any(read.layer == layer for read in self._reads):
                return
            buffer = self._free_buffers.pop(0)
            copied = self._buffer_copied[buffer]
            future = self._pool.submit(self._read_layer, layer, buffer, copied)
            self._reads.append(_Read(layer, buffer, future))
            self.most_reads_ahead = max(self.most_reads_ahead, len(self._reads))
            self._read_cursor = self._following(layer)

    def _read_layer(self, layer: int, buffer: int, copied: object) -> int:
        """(A reader thread.) Read `layer`'s image into host buffer `buffer` once the copy that last read the buffer
        is done; returns the bytes read from the files."""
        if copied is not None:
            copied.synchronize()
        image = self._host_ring[buffer].tensor
        read = 0
        for placed, source in zip(self.tensors[layer], self._reads_of[layer], strict=True):
            # Straight from the files where their bytes are the image's: values as the layer holds them, or an FP8
            # weight's values and row scales as the files store them.
            direct = source.extents is not None and (
                not placed.quantized or (source.fp8 and source.scale_extents is not None)
            )
            if direct:
                read += read_extents(shifted(source.extents, placed.image_offset), image)
                if placed.quantized:
                    read += read_extents(shifted(source.scale_extents, placed.scale_offset), image)
            else:
                tensor = source.read()
                self._put(placed, image, tensor)
                read += sum(part.numel() * part.element_size() for part in tensor_parts(tensor))
        return read

    def _host_image(self, layer: int) -> tuple[Tensor, int]:
        """(the image of file-home `layer` in the host ring, its buffer) once its read is done (waiting if not)."""
        self._schedule_reads()
        if not self._reads or self._reads[0].layer != layer:
            raise RuntimeError(
                f"host ring out of order: layer {layer} asked for, {self._reads[0:1]} read next"
            )
        read = self._reads.popleft()
        if not read.future.done():
            self.waited_reads += 1
        self.read_bytes += read.future.result()
        self.layer_reads += 1
        return self._host_ring[read.buffer].tensor, read.buffer

    def _free_buffer(self, buffer: int) -> None:
        """A host buffer whose image has been copied (issued) to the device: the next read may refill it after that
        copy is done."""
        self._buffer_copied[buffer] = self._copies.copied()
        self._free_buffers.append(buffer)
        self._schedule_reads()

    # --- the device ring --------------------------------------------------------------------------------------------

    def _fill_slot(self, layer: int, slot: int) -> None:
        """Start copying `layer`'s image into `slot` (on a GPU: on the copy stream, after the slot's last reader)."""
        destination = self._slots[slot]
        buffer = None
        if self.home_is_file[layer]:
            image, buffer = self._host_image(layer)
        else:
            image = self.images[layer]
        with self._copies.filling(slot):
            size = self.image_sizes[layer]
            if self.quantize:
                staging = self._staging[slot]
                staging[:size].copy_(image[:size], non_blocking=True)
                for placed in self.tensors[layer]:
                    target = placed.in_slot(destination)
                    if placed.quantized:
                        values = typed_view(staging, placed.image_offset, torch.float8_e4m3fn, placed.shape)
                        scales = typed_view(staging, placed.scale_offset, torch.float32, (placed.shape[0], 1))
                        dequantize_into(target, values, scales)
                    else:
                        target.copy_(typed_view(staging, placed.image_offset, placed.dtype, placed.shape))
            else:
                destination[:size].copy_(image[:size], non_blocking=True)
        self.copied_bytes += size
        if buffer is not None:
            self._free_buffer(buffer)

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
            if index >= self.first:  # a resident layer needs nothing
                self.acquire(index - self.first)

        return hook

    def _release_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if index >= self.first:
                self.release(index - self.first)

        return hook

    def remove(self) -> None:
        """Detach from the layers (their tensors stay parked): for a model that is being dropped."""
        self.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _home_flags(
    count: int,
    first: int,
    ring_depth: int,
    read_ahead: int,
    reader_threads: int,
    mapped: bool | Sequence[bool],
    readers: Sequence[Sequence[TensorRead | TensorReader]] | None,
) -> list[bool]:
    """Whether each streamed layer's home is the files (`mapped`), once the stream's arguments are checked
    (ValueError) against its `count` layers."""
    if not 0 <= first < count:
        raise ValueError(f"a layer stream needs at least one streamed layer, got first={first} of {count}")
    if ring_depth < 1:
        raise ValueError(f"ring_depth must be >= 1, got {ring_depth}")
    if read_ahead < 1 or reader_threads < 1:
        raise ValueError(f"read_ahead and reader_threads must be >= 1, got {read_ahead}, {reader_threads}")
    flags = [mapped] * (count - first) if isinstance(mapped, bool) else list(mapped)
    if len(flags) != count - first:
        raise ValueError(f"mapped names {len(flags)} layers, the stream has {count - first}")
    if readers is not None and len(readers) not in (count, count - first):
        raise ValueError(f"readers for {len(readers)} layers, the stream has {count - first} of {count}")
    return flags


def _layer_reads(
    readers: Sequence[Sequence[TensorRead | TensorReader]] | None,
    first: int,
    tensors: list[list[StreamedTensor]],
) -> list[list[TensorRead] | None] | None:
    """Per layer (resident ones included: None where `readers` cover only the streamed layers), one `TensorRead` per
    streamed tensor; None without readers. ValueError when a layer's readers do not match its tensors."""
    reads = [[to_tensor_read(reader) for reader in layer] for layer in readers] if readers else None
    if reads is not None and len(reads) == len(tensors) - first:
        reads = [None] * first + reads
    if reads is not None and any(
        layer is not None and len(layer) != len(tensors[index]) for index, layer in enumerate(reads)
    ):
        raise ValueError("readers must give one reader per streamed tensor of every layer they cover")
    return reads
