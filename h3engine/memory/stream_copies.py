"""How a layer stream's device ring orders its copies: `CudaCopies` (a side stream, per-slot ready and free
events) on a GPU, `HostCopies` (nothing to wait for) on the CPU. h3engine.memory.streaming.LayerStream calls them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class CudaCopies:
    """The side stream and the per-slot events of a ring on a GPU."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]
        self.used = [False] * slots

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

    def copied(self) -> torch.cuda.Event:
        """An event marking every copy issued so far on the copy stream (a host buffer they read may be reused)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()

    def after_compute(self) -> None:
        """Copies issued from now on start after everything the compute stream has queued (a restart: the visit that
        stopped half way never marked its slot free)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))


class HostCopies:
    """A ring on the CPU: copies happen at once, in order, so there is nothing to wait for."""

    @contextmanager
    def filling(self, slot: int) -> Iterator[None]:
        yield

    def wait_ready(self, slot: int) -> None:
        pass

    def mark_free(self, slot: int) -> None:
        pass

    def copied(self) -> None:
        return None

    def drain(self) -> None:
        pass

    def after_compute(self) -> None:
        pass
