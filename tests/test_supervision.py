"""The supervision that the worker group and the split stage groups share (`RestartingReplica`), with fake incarnations.

What is checked (no process is started): a broken incarnation is replaced in the background; a restart that fails
fails the one job that finds it, naming what is supervised and why, and the next job gets a new incarnation; only one
restart runs at a time; a job waiting for a restart can be cancelled; `close()` kills the incarnation still starting
and stops the current one, and later jobs are refused as the shutdown.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import CANCELLED_BEFORE_START_MESSAGE, SHUTTING_DOWN_MESSAGE, JobHandle
from h3engine.runtime.messages import JobFailed
from h3engine.runtime.supervision import RestartingReplica

REQUEST = GenerationRequest(task="t2va", prompt="a red kite")
WAIT_S = 10.0


class FakeIncarnation:
    """Ready at once with `outcome` (the facts), raises it when it is an exception, or (None) starts until ended."""

    def __init__(self, outcome: object) -> None:
        self.outcome = outcome
        self.killed = self.stopped = self.broken = False

    def wait_ready(self, abort: threading.Event) -> object:
        while self.outcome is None and not (abort.is_set() or self.killed):
            time.sleep(0.01)
        if self.outcome is None:
            raise RuntimeError("stopped while starting")
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def kill(self) -> None:
        self.killed = True

    def stop(self) -> None:
        self.stopped = True


class FakeReplica(RestartingReplica[FakeIncarnation]):
    supervised = "fake group"

    def __init__(self, *outcomes: object) -> None:
        self.outcomes = iter(outcomes)
        self.started: list[FakeIncarnation] = []
        self._start_first()

    def _start_incarnation(self) -> FakeIncarnation:
        self.started.append(FakeIncarnation(next(self.outcomes)))
        return self.started[-1]

    def _serves(self, current: FakeIncarnation) -> bool:
        return not current.broken


def handle(job_id: str) -> JobHandle:
    return JobHandle(job_id, REQUEST, Path(f"{job_id}.mp4"))


def wait_until(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_restart_fails_one_job_and_the_next_gets_a_new_incarnation() -> None:
    replica = FakeReplica("facts 1", RuntimeError("out of memory"), "facts 3")
    first = replica._ready(handle("a"))
    assert first is replica.started[0] and replica.facts == "facts 1"
    first.broken = True
    replica._replace(first)
    replica._restart.join(WAIT_S)
    assert replica.started[1].killed
    assert replica._ready(handle("b")) == JobFailed(
        "b", "engine", "The fake group could not restart: out of memory."
    )
    third = replica._ready(handle("c"))  # waits for the restart the failed job began
    assert third is replica.started[2] and replica.facts == "facts 3"
    replica.close()
    assert third.stopped and not third.killed


def test_one_restart_at_a_time_a_waiting_job_can_be_cancelled_and_close_ends_the_start() -> None:
    replica = FakeReplica("facts 1", None)
    first = replica.started[0]
    replica._replace(first)
    replica._replace(first)  # no longer the current one: nothing happens
    with replica._lock:
        replica._start_restart()  # a restart is in progress: no second one
    wait_until(lambda: len(replica.started) == 2)
    waiting = handle("a")
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(replica._ready(waiting)))
    thread.start()
    time.sleep(0.3)
    assert not result  # it waits for the restart
    waiting._cancel_requested.set()
    thread.join(WAIT_S)
    assert result == [JobFailed("a", "cancelled", CANCELLED_BEFORE_START_MESSAGE)]
    replica.close()
    assert replica.started[1].killed and len(replica.started) == 2
    assert replica._ready(handle("b")) == JobFailed("b", "cancelled", SHUTTING_DOWN_MESSAGE)
