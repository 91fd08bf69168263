"""Supervision shared by the replicas made of rank processes: start, wait until ready, restart in the background.

`RestartingReplica` keeps one incarnation of what it supervises (a worker group, h3engine.runtime.workers; or the
three stage groups and their channels, h3engine.runtime.split) and makes a new one when that breaks. A subclass says
how to start an incarnation (`_start_incarnation`), whether a current one can take a job (`_serves`), and how to
run a job on it; the job that a failure cost is the subclass's to fail. Here: `_ready` hands a job the current
incarnation, waiting for a restart in progress (starting one if none is) unless the job is cancelled or the replica
closes, and fails the job once when a restart failed; `_replace` retires a broken incarnation and starts a new one
in a background thread (only one at a time); `close` ends the starting incarnation, then stops the current one
(kills it, when a job still holds it).

`partition_on_device()` (the front's optional `Replica` method) is the DiT partition of the last job a subclass
started (`_started`), else the first partition (every incarnation's ranks load that one at start). Stalls: a
`ProgressWatch` per job (or per busy group) says when its ranks were silent past `StallPolicy`'s limit (README,
"Stall watchdog"); the subclass then kills the incarnation, fails that job and a new one starts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from h3engine.checkpoint.layout import PARTITION_OF_TASK
from h3engine.errors import RequestError
from h3engine.media.leftovers import WORKER_FOLDER_PREFIX, remove_dead_temp_folders
from h3engine.runtime.front import CANCELLED_BEFORE_START_MESSAGE, SHUTTING_DOWN_MESSAGE, JobHandle
from h3engine.runtime.messages import JobFailed, StepProgress

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# Without --stall-timeout, the silence a job's ranks are allowed is the longest of: STALL_FLOOR_S; STALL_STEPS times
# the slowest denoising step the replica has taken (a decode, a prepare or a first step with its compiles takes a few
# steps' time); STALL_START_UPS times the longest start of its ranks (a DiT partition switch reloads a DiT).
STALL_FLOOR_S = 300.0
STALL_STEPS = 10
STALL_START_UPS = 2
# After a cancel, the ranks vote before their next step: they get the longer of these to end the job.
CANCEL_GRACE_S = 10.0
CANCEL_GRACE_STEPS = 2


def checked_stall_timeout(value: float | None, flag: str = "--stall-timeout") -> float | None:
    """The `--stall-timeout` flag's seconds (None: derived); RequestError naming the flag unless positive."""
    if value is not None and not 0 < value < float("inf"):
        raise RequestError(flag, f"must be a positive number of seconds, got {value:g}")
    return value


@dataclass(frozen=True)
class StallPolicy:
    """How long a job's ranks may be silent: `timeout_s` (--stall-timeout) or, when None, the derived limit; after a
    cancel, `cancel_grace_s` (at least: a slow step stretches it)."""

    timeout_s: float | None = None
    cancel_grace_s: float = CANCEL_GRACE_S


class Pace:
    """What a replica has seen of its ranks' speed: the slowest denoising step and the longest start. Written by the
    threads that read the ranks' messages; a float read mid-update is only a slightly old estimate."""

    def __init__(self) -> None:
        self.slowest_step_s = 0.0
        self.longest_start_s = 0.0
        self._last_step: tuple[str, int, float] = ("", 0, 0.0)  # job, step, elapsed

    def step(self, progress: StepProgress) -> None:
        job_id, step, elapsed = self._last_step
        if progress.job_id != job_id or progress.step <= step:
            step, elapsed = 0, 0.0  # a new job: its first report covers its steps so far
        duration = (progress.elapsed_s - elapsed) / (progress.step - step)
        self.slowest_step_s = max(self.slowest_step_s, duration)
        self._last_step = (progress.job_id, progress.step, progress.elapsed_s)

    def started(self, seconds: float) -> None:
        self.longest_start_s = max(self.longest_start_s, seconds)

    def stall_limit_s(self, policy: StallPolicy) -> float:
        if policy.timeout_s is not None:
            return policy.timeout_s
        return max(STALL_FLOOR_S, STALL_STEPS * self.slowest_step_s, STALL_START_UPS * self.longest_start_s)

    def cancel_grace_s(self, policy: StallPolicy) -> float:
        return max(policy.cancel_grace_s, CANCEL_GRACE_STEPS * self.slowest_step_s)


@dataclass(frozen=True)
class Silence:
    """Ranks that said nothing past their limit: for how long, and whether the job they held was cancelled."""

    seconds: float
    cancelled: bool

    def job_failed(self, job_id: str, silent: str, restarting: str) -> JobFailed:
        """The job's end: `silent` names who said nothing ("worker group", "DiT group"), `restarting` what happens
        next ("the worker group is restarting")."""
        duration = seconds_text(self.seconds)
        if self.cancelled:
            return JobFailed(
                job_id,
                "cancelled",
                f"Cancelled; the {silent} did not answer for {duration}, so {restarting}.",
            )
        return JobFailed(
            job_id,
            "engine",
            f"The job stopped making progress: no word from the {silent} for {duration}; {restarting}.",
        )


def seconds_text(seconds: float) -> str:
    """'7 s', '95 s', '5.2 minutes'."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"


class ProgressWatch:
    """When the ranks working on a job (or a busy group) were last heard from, and whether that is too long ago."""

    def __init__(self, policy: StallPolicy, pace: Pace) -> None:
        self._policy, self._pace = policy, pace
        self._last_heard = time.monotonic()
        self._cancelled_at: float | None = None

    def restart(self) -> None:
        """The clock starts again (a group that was idle took a job)."""
        self._last_heard, self._cancelled_at = time.monotonic(), None

    def heard(self, message: Any) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, StepProgress):
            self._pace.step(message)

    def cancelled(self) -> None:
        """The job was cancelled now: its ranks get the cancel grace from here."""
        if self._cancelled_at is None:
            self._cancelled_at = time.monotonic()

    def overdue(self) -> Silence | None:
        """The silence, once past the stall limit or (after a cancel) past the cancel grace; else None."""
        now = time.monotonic()
        silent = now - self._last_heard
        cancelled = self._cancelled_at is not None
        if silent > self._pace.stall_limit_s(self._policy):
            return Silence(silent, cancelled)
        if cancelled and now - max(self._last_heard, self._cancelled_at) > self._pace.cancel_grace_s(
            self._policy
        ):
            return Silence(silent, cancelled)
        return None


class Incarnation(Protocol):
    """One start of what a replica supervises."""

    def wait_ready(self, abort: threading.Event) -> Any:
        """Block until it can take jobs (raising when it cannot start or `abort` is set); the checkpoint facts."""
        ...

    def kill(self) -> None:
        """End it now."""
        ...

    def stop(self) -> None:
        """End it gracefully (the replica is closing)."""
        ...


T = TypeVar("T", bound=Incarnation)


class RestartingReplica(Generic[T]):
    """The supervision half of a process replica; see the module's docstring.

    Subclasses set `supervised` (what the messages call it: "worker group", "stage groups"), implement
    `_start_incarnation` and `_serves`, call `_start_first` in `__init__`, run each job inside `_job_in_flight()`
    and call `_started(handle)` when a job is handed to an incarnation. `stall` and `pace` are for their
    `ProgressWatch`es.
    """

    supervised = "worker group"

    def _start_first(self, stall: StallPolicy = StallPolicy()) -> None:
        """Start the first incarnation and wait until it is ready (nothing is left running when that fails)."""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._job_numbers = itertools.count()
        self._current: T | None = None
        self._starting: T | None = None
        self._restart: threading.Thread | None = None
        self._restarting = False  # a restart thread runs and has not yet set `_current` or `_restart_error`
        self._restart_error: str | None = None
        self._partition: str | None = None
        self._in_flight = 0  # jobs inside `_job_in_flight`
        self.stall, self.pace = stall, Pace()
        remove_dead_temp_folders(WORKER_FOLDER_PREFIX)
        started = time.monotonic()
        first = self._start_incarnation()
        try:
            self.facts = first.wait_ready(self._closed)
        except BaseException:
            first.kill()
            raise
        self.pace.started(time.monotonic() - started)
        self._current = first
        self._partition = self._first_partition()

    def _start_incarnation(self) -> T:
        """A new incarnation, started but not waited for (called with the lock held during restarts)."""
        raise NotImplementedError

    def _serves(self, current: T) -> bool:
        """Whether `current` can take a job now; when it cannot, this retires it (or waits while it is retired)."""
        raise NotImplementedError

    # --- the partition on the device -------------------------------------------------------------------

    def partition_on_device(self) -> str | None:
        """The DiT partition the next job finds loaded (see the module's docstring); None when the facts do not
        name one. A plain read, no lock: the front asks under its own lock, and a restart may hold ours for long."""
        return self._partition

    def _first_partition(self) -> str | None:
        return getattr(self.facts, "first_partition", None)

    def _started(self, handle: JobHandle) -> None:
        """`handle`'s job was handed to the current incarnation: its ranks now load (or keep) its task's partition.
        A task of no partition leaves the DiT where it is."""
        self._partition = PARTITION_OF_TASK.get(handle.request.task, self._partition)

    # --- jobs -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _job_in_flight(self) -> Iterator[None]:
        """Around a job's run: `close` kills rather than stops an incarnation that a job still holds."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def _ready(self, handle: JobHandle) -> T | JobFailed:
        """The current incarnation; waits for a restart in progress (starting one if none is), unless cancelled.

        A failed restart fails the one job that finds it, and another restart begins for the jobs after it.
        """
        while True:
            with self._lock:
                current = self._current
                if current is None and not self._restarting:
                    if self._restart_error is not None:
                        error, self._restart_error = self._restart_error, None
                        self._start_restart()  # for the jobs after this one
                        return JobFailed(
                            handle.job_id, "engine", f"The {self.supervised} could not restart: {error}."
                        )
                    self._start_restart()
            if current is not None:
                if self._serves(current):
                    return current
                continue
            if self._closed.is_set():
                return JobFailed(handle.job_id, "cancelled", SHUTTING_DOWN_MESSAGE)
            if handle.cancel_requested:
                return JobFailed(handle.job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE)
            time.sleep(POLL_INTERVAL_S)

    # --- restarts and shutdown --------------------------------------------------------------------------

    def _replace(self, broken: T) -> None:
        """`broken` (already ended) is no longer served; a new incarnation starts in the background."""
        with self._lock:
            if self._current is broken:
                self._current = None
                self._partition = self._first_partition()
                self._start_restart()

    def _start_restart(self) -> None:
        """Start a new incarnation in the background (the caller holds the lock)."""
        if self._closed.is_set() or self._restarting:
            return
        self._restarting = True
        name = f"h3-{self.supervised.replace(' ', '-')}-restart"
        self._restart = threading.Thread(target=self._restart_incarnation, name=name, daemon=True)
        self._restart.start()

    def _restart_incarnation(self) -> None:
        incarnation = None
        started = time.monotonic()
        try:
            with self._lock:
                if self._closed.is_set():
                    self._restarting = False
                    return
                incarnation = self._starting = self._start_incarnation()
            facts = incarnation.wait_ready(self._closed)
        except Exception as error:
            with self._lock:
                # Ended by `close`, it did not fail: the jobs are told of the shutdown instead.
                if not self._closed.is_set():
                    logger.error("the %s could not restart: %s", self.supervised, error)
                    self._restart_error = str(error)
                self._starting, self._restarting = None, False
            if incarnation is not None:
                incarnation.kill()
            return
        self.pace.started(time.monotonic() - started)
        with self._lock:
            self._starting, self._restarting = None, False
            keep = not self._closed.is_set()
            if keep:
                self.facts, self._current = facts, incarnation
                self._partition = self._first_partition()
        if keep:
            logger.info("%s restarted", self.supervised)
        else:
            incarnation.kill()

    def close(self) -> None:
        """End a restart in progress, then stop the current incarnation: gracefully when idle, at once when a job
        still holds it (the front cancelled its jobs before: ranks that did not end them are not answering)."""
        with self._lock:
            self._closed.set()
            current, starting, restart = self._current, self._starting, self._restart
            self._current = self._starting = None
            busy = self._in_flight > 0
        if starting is not None:
            starting.kill()
        if restart is not None:
            restart.join()
        if current is not None:
            if busy:
                current.kill()
            else:
                current.stop()
