"""Supervision shared by the replicas made of rank processes: start, wait until ready, restart in the background.

`RestartingReplica` keeps one incarnation of what it supervises (a worker group, h3engine.runtime.workers; or the
three stage groups and their channels, h3engine.runtime.split) and makes a new one when that breaks. A subclass says
how to start an incarnation (`_start_incarnation`), whether a current one can take a job (`_serves`), and how to
run a job on it; the job that a failure cost is the subclass's to fail. Here: `_ready` hands a job the current
incarnation, waiting for a restart in progress (starting one if none is) unless the job is cancelled or the replica
closes, and fails the job once when a restart failed; `_replace` retires a broken incarnation and starts a new one
in a background thread (only one at a time); `close` ends the starting incarnation, then stops the current one.

Partition: `partition_on_device()` (the front's optional `Replica` method) is the DiT partition of the last job a
subclass started (`_started`), or the first partition (`CheckpointFacts.first_partition`) while no job started on
the current incarnation: every incarnation's ranks load that one at start. A retired incarnation resets it, since
its replacement starts with the first partition again.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Generic, Protocol, TypeVar

from h3engine.checkpoint.layout import PARTITION_OF_TASK
from h3engine.leftovers import WORKER_FOLDER_PREFIX, remove_dead_temp_folders
from h3engine.runtime.front import CANCELLED_BEFORE_START_MESSAGE, SHUTTING_DOWN_MESSAGE, JobHandle
from h3engine.runtime.messages import JobFailed

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


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
    `_start_incarnation` and `_serves`, call `_start_first` in `__init__`, and `_started(handle)` when a job is
    handed to an incarnation.
    """

    supervised = "worker group"

    def _start_first(self) -> None:
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
        remove_dead_temp_folders(WORKER_FOLDER_PREFIX)
        first = self._start_incarnation()
        try:
            self.facts = first.wait_ready(self._closed)
        except BaseException:
            first.kill()
            raise
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
        """End a restart in progress, then stop the current incarnation gracefully."""
        with self._lock:
            self._closed.set()
            current, starting, restart = self._current, self._starting, self._restart
            self._current = self._starting = None
        if starting is not None:
            starting.kill()
        if restart is not None:
            restart.join()
        if current is not None:
            current.stop()
