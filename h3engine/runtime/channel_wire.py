"""What travels through a tensor channel's queues (h3engine.runtime.channel): small pickled messages that say
which slot holds which tensors (`SlotFilled`, with their `Placement`s), that a slot may be written again
(`SlotReleased`) or that the producer is done (`ProducerFinished`). The tensors themselves stay in the slots.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

# Every tensor starts at a multiple of this inside a slot, so any dtype view is aligned for vectorized kernels.
TENSOR_ALIGNMENT_BYTES = 256


@dataclass(frozen=True)
class Placement:
    """Where one tensor sits in a slot buffer: `nbytes` bytes at `offset`, read back as `dtype` of `shape`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SlotFilled:
    """Producer -> consumer. `new_buffer` only when the slot got a new buffer (first use, growth); `ready_event`
    only on the slot's first use on CUDA (an interprocess event must be opened once per process)."""

    slot: int
    tag: Hashable
    placements: tuple[Placement, ...]
    new_buffer: torch.Tensor | None
    ready_event: torch.cuda.Event | None


@dataclass(frozen=True)
class ProducerFinished:
    """Producer -> consumer: the producer is closing; nothing follows."""


@dataclass(frozen=True)
class SlotReleased:
    """Consumer -> producer: the slot may be written again. `consumed_event` only on the slot's first release
    on CUDA; later releases re-record the same event."""

    slot: int
    consumed_event: torch.cuda.Event | None


def serialize(message: object) -> bytes:
    # Pickled here, in the caller's thread, rather than later in the queue's feeder thread: a tensor or event
    # that cannot be shared fails in `send` itself, and torch's own sharing event for a new CUDA buffer is
    # recorded on the caller's current stream.
    return bytes(ForkingPickler.dumps(message))


def place_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[Placement, ...], int]:
    """The placements of `tensors` packed in order, and the bytes a slot needs to hold them."""
    placements = []
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        placements.append(Placement(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset = round_up(offset + nbytes, TENSOR_ALIGNMENT_BYTES)
    return tuple(placements), offset


def slot_view(buffer: torch.Tensor, placement: Placement) -> torch.Tensor:
    raw = buffer[placement.offset : placement.offset + placement.nbytes]
    return raw.view(placement.dtype).view(placement.shape)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
