"""Tensor channel: one producer process hands named tensors to one consumer process through reusable slots.

Contract: the engine process creates a `TensorChannel` and passes it to two spawned worker processes; one calls
`producer()`, the other `consumer()`. The engine never touches a tensor: the queues inside carry only small
pickled messages. `ChannelProducer.send` copies into a free slot and returns; `ChannelConsumer.receive` hands out
views of the slot until `release`. On "cuda" the slot buffers are shared through CUDA IPC and every hand-over is
ordered by interprocess events; on "cpu" they are shared-memory tensors. Teardown and liveness: `TensorChannel`.

Danger: received tensors alias the slot: reading them after `release` (or the consumer's `close`) reads whatever
the producer writes next, so clone what must live longer. On "cuda" the consumer's reads must be queued on its
current stream between `receive` and `release`, the two ends must live in different processes, and a producer
that dies takes the slot memory with it, so the consumer hands out nothing once the producer is gone. Endpoints
are not thread-safe. Both workers must descend from the process that made the channel (CPU buffers travel as file
descriptors through multiprocessing's resource sharer, which trusts the authkey they inherit).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

from h3engine.runtime.channel_errors import ChannelClosed, ChannelError, ChannelPeerGone, ChannelTimeout
from h3engine.runtime.channel_peers import Peer, Role, SharedState, remove_shared_memory_of
from h3engine.runtime.channel_wire import (
    ProducerFinished,
    SlotFilled,
    SlotReleased,
    place_tensors,
    round_up,
    serialize,
    slot_view,
)

logger = logging.getLogger(__name__)

# How often a blocked call looks at the other side's liveness and the closing flag; also the detection latency.
POLL_INTERVAL_S = 0.05
# Slot buffers are sized in whole granules, and grow by at least half, so slowly growing sends rarely reallocate.
BUFFER_GRANULE_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------------------------------------------
# The channel (made in the engine process)
# --------------------------------------------------------------------------------------------------------------


class TensorChannel:
    """One producer -> one consumer, `slots` reusable buffers on `device` ("cpu" or a CUDA device).

    `timeout_s` is the default wait of `send`, `receive` and the `close` calls. Create it in the engine process
    and pass it to the worker processes as a process argument (`torch.multiprocessing`, spawn or fork server),
    before they start; each role is claimed once per channel.

    Teardown, in this order: consumers, producers, channel. `consumer.close()` drops its mappings.
    `producer.close()` tells the consumer that nothing more comes (its next `receive` raises `ChannelClosed`), then
    waits until the consumer has closed or died before it frees the slot buffers: a CUDA IPC buffer must outlive
    every mapping of it in other processes. `TensorChannel.close()` in the engine wakes any call blocked in a worker
    (it raises `ChannelClosed`), waits until each side has closed or exited, and closes the queues. The channel
    starts no process and owns none; the engine joins its workers.

    A side that died is noticed within `POLL_INTERVAL_S`: `send` and `receive` raise `ChannelPeerGone` instead of
    waiting out their timeout, and `close` does not wait for it. Liveness comes from /proc (pid plus the kernel's
    start time, so a zombie or a reused pid counts as gone): Linux only, like the engine. On "cpu" both ends may
    live in one process, as in the tests.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        slots: int = 2,
        name: str = "tensor channel",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"a tensor channel runs on 'cpu' or a CUDA device, got {str(device)!r}")
        if slots < 1:
            raise ValueError(f"a tensor channel needs at least one slot, got {slots}")
        # An index is fixed here, without touching CUDA: the engine process never initializes the GPU.
        self.device = torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device
        self.slots = slots
        self.name = name
        self.timeout_s = timeout_s
        context = torch.multiprocessing.get_context("spawn")
        self._messages = context.Queue()  # producer -> consumer: SlotFilled, ProducerFinished
        self._releases = context.Queue()  # consumer -> producer: SlotReleased
        self._state = SharedState(context)
        self._closed = False

    @property
    def describe(self) -> str:
        return f"tensor channel {self.name!r}"

    def _check_peer(self, peer: Role, when_closed: str, when_gone: str) -> None:
        """ChannelClosed once the engine closes the channel or `peer` closed its end (`when_closed` says what that
        means); ChannelPeerGone once the peer's process exited (`when_gone` says what is lost)."""
        if self._state.closing():
            raise ChannelClosed(f"{self.describe}: the engine closed the channel")
        status = self._state.status(peer)
        if status is Peer.CLOSED:
            raise ChannelClosed(f"{self.describe}: {when_closed}")
        if status is Peer.GONE:
            raise ChannelPeerGone(
                f"{self.describe}: the {peer.name.lower()} process (pid {self._state.pid(peer)}) exited; "
                f"{when_gone}"
            )

    def producer(self) -> ChannelProducer:
        """Attach this process as the channel's only producer."""
        self._state.claim(Role.PRODUCER, self.describe)
        return ChannelProducer(self)

    def consumer(self) -> ChannelConsumer:
        """Attach this process as the channel's only consumer."""
        self._state.claim(Role.CONSUMER, self.describe)
        return ChannelConsumer(self)

    def close(self, timeout: float | None = None) -> bool:
        """Wake blocked workers, wait for both sides to close or exit, close the queues.

        Returns False when a side was still attached after `timeout` (the engine should then stop that worker);
        the queues are closed in this process either way.
        """
        if self._closed:
            return True
        self._closed = True
        self._state.set_closing()
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        settled = (Peer.UNCLAIMED, Peer.CLOSED, Peer.GONE)
        while not all(self._state.status(role) in settled for role in Role):
            if time.monotonic() >= deadline:
                logger.warning(
                    "%s: closed with the producer %s and the consumer %s",
                    self.describe,
                    self._state.status(Role.PRODUCER).value,
                    self._state.status(Role.CONSUMER).value,
                )
                break
            time.sleep(POLL_INTERVAL_S)
        clean = all(self._state.status(role) in settled for role in Role)
        for role in Role:
            if self._state.status(role) is Peer.GONE:
                remove_shared_memory_of(self._state.pid(role))
        for channel_queue in (self._messages, self._releases):
            channel_queue.close()
            channel_queue.join_thread()
        return clean

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout is None else timeout)


# --------------------------------------------------------------------------------------------------------------
# Producer side
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ProducerStats:
    """Counters of one producer. `slot_reuses`: sends into a slot that had already carried one."""

    sends: int = 0
    slot_reuses: int = 0
    buffer_allocations: int = 0
    bytes_sent: int = 0
    blocked_s: float = 0.0


@dataclass
class _ProducerSlot:
    buffer: torch.Tensor | None = None
    used: bool = False
    ready_event: torch.cuda.Event | None = None
    consumed_event: torch.cuda.Event | None = None


class ChannelProducer:
    """The sending end; get it with `TensorChannel.producer()` in the producing process.

    `send(tensors, tag)` copies the tensors into one free slot's buffer and returns; the caller may overwrite its
    own tensors at once. The slot buffer is a flat byte buffer on the channel's device, allocated the first time the
    slot is used and replaced by a larger one when a send does not fit. On "cuda" the producer records a per-slot
    interprocess event after its copies on its current stream, and the consumer's current stream waits on it before
    any read; on "cpu" the copy is done when `send` returns. `send` blocks while every slot is in flight and fails
    after `timeout` with `ChannelTimeout`.
    """

    def __init__(self, channel: TensorChannel) -> None:
        self._channel = channel
        self._slots = [_ProducerSlot() for _ in range(channel.slots)]
        # Least recently released first: on CUDA that slot's consumer reads are the likeliest to be finished.
        self._free_slots = deque(range(channel.slots))
        self._in_flight: dict[int, Hashable] = {}
        self._stats = ProducerStats()
        self._closed = False

    @property
    def stats(self) -> ProducerStats:
        return dataclasses.replace(self._stats)

    def send(self, tensors: Mapping[str, torch.Tensor], tag: Hashable, timeout: float | None = None) -> None:
        """Copy `tensors` into a free slot and announce it under `tag`.

        Blocks while every slot is in flight, or while an earlier send under the same tag is (tags name what the
        consumer holds, so they must be unique among the sends in flight). Raises ChannelTimeout after `timeout`
        seconds (default: the channel's), ChannelPeerGone once the consumer has died, ChannelClosed once anything
        was closed.
        """
        self._check_can_send()
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                raise ValueError(f"{self._channel.describe}: {name!r} is not a dense tensor")
        slot_index = self._take_free_slot(tag, timeout)
        try:
            message = self._fill_slot(slot_index, tensors, tag)
            self._channel._messages.put(serialize(message))
        except BaseException:
            self._free_slots.appendleft(slot_index)
            raise
        self._in_flight[slot_index] = tag
        self._stats.sends += 1
        self._stats.bytes_sent += sum(placement.nbytes for placement in message.placements)

    def close(self, timeout: float | None = None) -> None:
        """Tell the consumer nothing more comes, wait until it has closed or died, then free the slot buffers."""
        if self._closed:
            return
        self._closed = True
        state = self._channel._state
        if state.status(Role.CONSUMER) in (Peer.UNCLAIMED, Peer.ALIVE):
            self._channel._messages.put(serialize(ProducerFinished()))
        deadline = self._channel._deadline(timeout)
        while self._stats.sends and not self._consumer_let_go():
            if time.monotonic() >= deadline:
                logger.warning(
                    "%s: the consumer (pid %d) did not close; freeing the slot buffers anyway",
                    self._channel.describe,
                    state.pid(Role.CONSUMER),
                )
                break
            time.sleep(POLL_INTERVAL_S)
        try:
            if self._channel.device.type == "cuda":
                torch.cuda.synchronize(self._channel.device)
        finally:
            # Even after a CUDA error: the buffers go and the channel learns that this side is done.
            self._slots = []
            self._free_slots.clear()
            self._in_flight.clear()
            if state.status(Role.CONSUMER) is Peer.GONE:
                # Nobody will read the pipe again: do not let this process's exit wait to flush into it.
                self._channel._messages.cancel_join_thread()
            state.mark_closed(Role.PRODUCER)

    def __enter__(self) -> ChannelProducer:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()

    def _consumer_let_go(self) -> bool:
        consumer = self._channel._state.status(Role.CONSUMER)
        if consumer is Peer.UNCLAIMED:
            # Nothing was mapped yet; once the channel is closing no consumer can attach any more.
            return self._channel._state.closing()
        return consumer in (Peer.CLOSED, Peer.GONE)

    def _check_can_send(self) -> None:
        if self._closed:
            raise ChannelClosed(f"{self._channel.describe}: this producer is closed")
        self._channel._check_peer(Role.CONSUMER, "the consumer closed its end", "nothing more can be sent")

    def _take_free_slot(self, tag: Hashable, timeout: float | None) -> int:
        """A free slot, once the consumer no longer holds an earlier send under the same `tag`.

        Waiting on a busy tag (rather than refusing it) matters when the consumer has just released it: the
        release may still be on its way through the queue.
        """
        deadline = self._channel._deadline(timeout)
        started = time.monotonic()
        self._collect_releases(wait_s=0.0)
        while not self._free_slots or tag in self._in_flight.values():
            self._check_can_send()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout(
                    f"{self._channel.describe}: {self._why_no_slot(tag, time.monotonic() - started)}"
                )
            self._collect_releases(wait_s=min(POLL_INTERVAL_S, remaining))
        self._stats.blocked_s += time.monotonic() - started
        return self._free_slots.popleft()

    def _why_no_slot(self, tag: Hashable, waited_s: float) -> str:
        consumer_pid = self._channel._state.pid(Role.CONSUMER)
        if tag in self._in_flight.values():
            return (
                f"the consumer (pid {consumer_pid}) still holds the send tagged {tag!r} after {waited_s:.1f} s; "
                f"tags must be unique among the sends in flight"
            )
        why = (
            f"the consumer (pid {consumer_pid}) has released none"
            if consumer_pid
            else "no consumer has attached"
        )
        return (
            f"no free slot within {waited_s:.1f} s; all {self._channel.slots} slots are in flight and {why}"
        )

    def _collect_releases(self, wait_s: float) -> None:
        """Take every release message waiting; block up to `wait_s` for the first one."""
        releases = self._channel._releases
        try:
            payload = releases.get(timeout=wait_s) if wait_s > 0 else releases.get_nowait()
            while True:
                release: SlotReleased = ForkingPickler.loads(payload)
                if self._in_flight.pop(release.slot, None) is None:
                    raise ChannelError(f"{self._channel.describe}: slot {release.slot} released twice")
                if release.consumed_event is not None:
                    self._slots[release.slot].consumed_event = release.consumed_event
                self._free_slots.append(release.slot)
                payload = releases.get_nowait()
        except queue.Empty:
            return

    def _fill_slot(self, slot_index: int, tensors: Mapping[str, torch.Tensor], tag: Hashable) -> SlotFilled:
        placements, needed_bytes = place_tensors(tensors)
        slot = self._slots[slot_index]
        new_buffer = None
        if slot.buffer is None or slot.buffer.numel() < needed_bytes:
            old_bytes = 0 if slot.buffer is None else slot.buffer.numel()
            capacity = round_up(max(needed_bytes, old_bytes + old_bytes // 2, 1), BUFFER_GRANULE_BYTES)
            slot.buffer = new_buffer = self._allocate(capacity)
            self._stats.buffer_allocations += 1
        if slot.used:
            self._stats.slot_reuses += 1
        slot.used = True
        if self._channel.device.type == "cpu":
            with torch.no_grad():
                for placement, tensor in zip(placements, tensors.values(), strict=True):
                    slot_view(slot.buffer, placement).copy_(tensor)
            return SlotFilled(slot_index, tag, placements, new_buffer, None)

        announce_event = slot.ready_event is None
        with torch.no_grad(), torch.cuda.device(self._channel.device):
            stream = torch.cuda.current_stream(self._channel.device)
            if slot.consumed_event is not None:
                # The consumer's reads of the previous contents may still be queued on its stream.
                stream.wait_event(slot.consumed_event)
            for placement, tensor in zip(placements, tensors.values(), strict=True):
                slot_view(slot.buffer, placement).copy_(tensor)
            if announce_event:
                slot.ready_event = torch.cuda.Event(interprocess=True)
            slot.ready_event.record(stream)
        return SlotFilled(
            slot_index, tag, placements, new_buffer, slot.ready_event if announce_event else None
        )

    def _allocate(self, capacity: int) -> torch.Tensor:
        if self._channel.device.type == "cpu":
            # With torch's default "file_descriptor" strategy the segment is unlinked at once: nothing is left
            # in /dev/shm even if every process is killed.
            return torch.empty(capacity, dtype=torch.uint8).share_memory_()
        return torch.empty(capacity, dtype=torch.uint8, device=self._channel.device)


# --------------------------------------------------------------------------------------------------------------
# Consumer side
# --------------------------------------------------------------------------------------------------------------


class ChannelConsumer:
    """The receiving end; get it with `TensorChannel.consumer()` in the consuming process.

    `receive(timeout)` returns `(tag, tensors)`: views into the slot (on the producer's device), valid until
    `release(tag)` (or the end of a `with consumer.receiving() as (tag, tensors):` block). Releasing acknowledges
    the slot; only then may the producer write into it again. On "cuda" the release records a consumer-side
    interprocess event on the consumer's current stream and the producer's stream waits on it before reusing the
    slot, so reads the consumer has queued but not finished are never overwritten.
    """

    def __init__(self, channel: TensorChannel) -> None:
        self._channel = channel
        self._buffers: dict[int, torch.Tensor] = {}
        self._ready_events: dict[int, torch.cuda.Event] = {}
        # Kept until this object goes away, also after close: the producer may have opened them and an exported
        # CUDA event must outlive every process that waits on it.
        self._consumed_events: dict[int, torch.cuda.Event] = {}
        self._held: dict[Hashable, int] = {}
        self._producer_finished = False
        self._closed = False

    def receive(self, timeout: float | None = None) -> tuple[Hashable, dict[str, torch.Tensor]]:
        """The next `(tag, tensors)`; the tensors alias the slot until `release(tag)`.

        Raises ChannelTimeout after `timeout` seconds (default: the channel's; `math.inf` waits for as long as
        the producer lives), ChannelPeerGone once the producer has died, ChannelClosed once the producer has
        finished or anything was closed.
        """
        wait_s = self._channel.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        while True:
            self._check_can_receive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout(f"{self._channel.describe}: nothing received within {wait_s:.1f} s")
            try:
                payload = self._channel._messages.get(timeout=min(POLL_INTERVAL_S, remaining))
            except queue.Empty:
                continue
            message = self._unpickle(payload)
            if isinstance(message, ProducerFinished):
                self._producer_finished = True
                continue
            return self._accept(message)

    @contextmanager
    def receiving(self, timeout: float | None = None) -> Iterator[tuple[Hashable, dict[str, torch.Tensor]]]:
        """`receive`, then `release` when the block ends (also when it raises)."""
        tag, tensors = self.receive(timeout)
        try:
            yield tag, tensors
        finally:
            if tag in self._held:
                self.release(tag)

    def release(self, tag: Hashable) -> None:
        """Done with the tensors received under `tag`: the producer may write that slot again."""
        if tag not in self._held:
            raise ValueError(f"{self._channel.describe}: no received slot is held under tag {tag!r}")
        slot = self._held.pop(tag)
        event_to_share = None
        if self._channel.device.type == "cuda":
            consumed_event = self._consumed_events.get(slot)
            if consumed_event is None:
                consumed_event = event_to_share = torch.cuda.Event(interprocess=True)
                self._consumed_events[slot] = consumed_event
            consumed_event.record(torch.cuda.current_stream(self._channel.device))
        self._channel._releases.put(serialize(SlotReleased(slot, event_to_share)))

    def close(self) -> None:
        """Drop every mapping of the producer's buffers and report this end closed (the producer waits for it)."""
        if self._closed:
            return
        self._closed = True
        producer = self._channel._state.status(Role.PRODUCER)
        try:
            if self._channel.device.type == "cuda" and self._buffers:
                # A mapping must not go while reads of it are still queued.
                torch.cuda.synchronize(self._channel.device)
        finally:
            # Even after a CUDA error: the producer waits for this flag before it frees its buffers.
            self._held.clear()
            self._buffers.clear()
            self._ready_events.clear()
            if producer is Peer.ALIVE:
                self._discard_unread_messages()
            if producer is Peer.GONE:
                # Nobody will read the pipe again: do not let this process's exit wait to flush into it.
                self._channel._releases.cancel_join_thread()
            self._channel._state.mark_closed(Role.CONSUMER)

    def __enter__(self) -> ChannelConsumer:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()

    def _check_can_receive(self) -> None:
        finished = "the producer closed its end; nothing more comes"
        if self._closed:
            raise ChannelClosed(f"{self._channel.describe}: this consumer is closed")
        if self._producer_finished:
            raise ChannelClosed(f"{self._channel.describe}: {finished}")
        self._channel._check_peer(Role.PRODUCER, finished, "its slot buffers are gone")

    def _unpickle(self, payload: bytes) -> SlotFilled | ProducerFinished:
        try:
            return ForkingPickler.loads(payload)
        except Exception as error:
            # A CPU buffer arrives as a file descriptor fetched from the producer process, a CUDA one as an IPC
            # handle into its memory: both fail when the producer has just died.
            if self._channel._state.status(Role.PRODUCER) is Peer.GONE:
                raise ChannelPeerGone(
                    f"{self._channel.describe}: the producer process exited before its buffer could be mapped"
                ) from error
            raise ChannelError(f"{self._channel.describe}: could not map a slot buffer: {error}") from error

    def _accept(self, message: SlotFilled) -> tuple[Hashable, dict[str, torch.Tensor]]:
        slot = message.slot
        if message.new_buffer is not None:
            if slot in self._buffers and slot in self._consumed_events:
                # The old mapping goes now; the reads queued before its release must be done first.
                self._consumed_events[slot].synchronize()
            self._buffers[slot] = message.new_buffer
        if message.ready_event is not None:
            self._ready_events[slot] = message.ready_event
        if self._channel.device.type == "cuda":
            self._ready_events[slot].wait(torch.cuda.current_stream(self._channel.device))
        buffer = self._buffers[slot]
        self._held[message.tag] = slot
        return message.tag, {placement.name: slot_view(buffer, placement) for placement in message.placements}

    def _discard_unread_messages(self) -> None:
        # Unpickling a CUDA buffer and dropping it releases torch's IPC reference count in the producer, which
        # otherwise keeps that memory (and warns) until it exits.
        while True:
            try:
                payload = self._channel._messages.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                return
            try:
                ForkingPickler.loads(payload)
            except Exception:
                logger.debug("%s: an unread message could not be unpickled at close", self._channel.describe)
