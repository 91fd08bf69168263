"""The in-process engine front: a job queue in front of one or more engine replicas, one worker thread each.

A replica is an `Engine` (run here by `EngineReplica`) or anything with the `Replica` interface, such as a worker
group (h3engine.runtime.workers.ProcessReplica). `resolve(request)` is the one checker on the replicas' facts and
memory plan; a door submits its `ResolvedRequest` (`submit`), which travels with the job, and reads the `JobHandle`'s
messages (h3engine.runtime.messages). A chained extend runs a job a window. `cancel`, `shutdown` stop.

Order: a replica that says which DiT partition is on its device (`Replica.partition_on_device`) takes the oldest
waiting job of that partition's tasks, so a queue mixing t2va/fl2va and ref2va does not swap DiTs on every job; a
job passed over `MAX_PASSED_OVER` times is taken before anything younger (`next_job_index`).

Danger: an `Engine` is not thread-safe; each one is only called from its own worker thread. Whatever a replica
raises ends only that job (`JobFailed`, logged with its traceback): the thread takes the next. `on_step` runs inside
the denoising loop and only puts small messages without blocking: a full buffer drops progress and previews, never
the terminal message. A full disk fails a job with the free space left (`output_failure_message`).
"""

from __future__ import annotations

import gc
import logging
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import PARTITION_OF_TASK
from h3engine.engine.conditioning.remix import chain_windows
from h3engine.engine.engine import Engine
from h3engine.engine.resolved import ResolvedRequest, resolve_request, with_memory_check
from h3engine.errors import RequestError
from h3engine.media.leftovers import WARM_UP_FOLDER_PREFIX, owned_temp_folder
from h3engine.media.outputs import checked_output_files
from h3engine.request.files import MediaFacts
from h3engine.request.model import GenerationRequest
from h3engine.runtime.messages import (
    ENGINE_FAILURE_MESSAGE,
    TERMINAL_EVENTS,
    JobEvent,
    JobFailed,
    JobFinished,
    JobQueued,
    job_failed,
    job_finished,
    job_started,
    output_failure_message,
    step_reporter,
)

logger = logging.getLogger(__name__)

DEFAULT_PREVIEW_EVERY = 5
# Messages a handle buffers for its reader; past that, progress and previews are dropped (the newest win later).
EVENT_BUFFER_SIZE = 64
CANCELLED_BEFORE_START_MESSAGE = "Cancelled before it started."
SHUTTING_DOWN_MESSAGE = "The app is shutting down."
# `shutdown`: how long cancelled jobs get to end by themselves before the replicas are closed under them, and how
# long it waits in all (the replicas' `close` ends their processes within a few seconds whatever the ranks do).
SHUTDOWN_CANCEL_WAIT_S = 2.0
SHUTDOWN_TIMEOUT_S = 8.0
# What a warm-up runs: the shortest duration at the verified canvas, one step. It uses the same kernels as any request
# (the DiT's head size, the video decoder's full-size tiles).
WARM_UP_REQUEST = GenerationRequest(task="t2va", prompt="A warm-up run.", duration_seconds=4.0, steps=1)
# How many times a waiting job may see a younger one taken before it. Each pass spares one DiT partition switch (a
# host-to-device copy of the DiT, or a disk read of it, on the order of the DiT's load time) and costs the passed job
# one other job's run. 2 lets a run of same-partition jobs save up to two switches in three jobs, and keeps the
# worst extra wait of any job to two runs: the price of a preference, not a second queue.
MAX_PASSED_OVER = 2


def warm_up_request(facts: CheckpointFacts) -> GenerationRequest:
    """`WARM_UP_REQUEST`, on a step-distilled checkpoint with the one step count it accepts."""
    steps = facts.distilled_steps(WARM_UP_REQUEST.task, WARM_UP_REQUEST.recipe)
    return WARM_UP_REQUEST if steps is None else replace(WARM_UP_REQUEST, steps=steps)


class JobHandle:
    """One submitted job: read its messages with `next_event` / `drain`; cancel it through the front."""

    def __init__(
        self,
        job_id: str,
        request: GenerationRequest | ResolvedRequest,
        out_path: Path,
        save_tensors_path: Path | None = None,
        capture: Any = None,
    ) -> None:
        self.job_id = job_id
        # What the job runs: resolved once, at its door or by `EngineFront.submit` (None: a bare request, resolved
        # where it runs, as a warm-up's on a Ray replica).
        self.resolved = request if isinstance(request, ResolvedRequest) else None
        self.request = request.request if isinstance(request, ResolvedRequest) else request
        self.out_path = out_path
        self.save_tensors_path = save_tensors_path
        self.capture = capture  # a CaptureSpec for a worker group's rank 0 (`generate --capture`), or None
        self.submitted_at = time.monotonic()
        # Times a younger job was taken before this one while it waited (the front's, under its lock).
        self.passed_over = 0
        self._events: queue.Queue[JobEvent] = queue.Queue(maxsize=EVENT_BUFFER_SIZE)
        self._cancel_requested = threading.Event()
        self._done = threading.Event()

    def window(self, resolved: ResolvedRequest, out_path: Path, save_tensors_path: Path | None) -> JobHandle:
        """A handle for one window of this chained job: its own request and files, this job's id, messages and
        cancel flag; the capture goes with the last window (the one writing this job's MP4)."""
        capture = self.capture if out_path == self.out_path else None
        window = JobHandle(self.job_id, resolved, out_path, save_tensors_path, capture)
        window.submitted_at = self.submitted_at
        window._events, window._cancel_requested = self._events, self._cancel_requested
        return window

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested.is_set()

    @property
    def done(self) -> bool:
        """True once the terminal message was published (it may still be unread)."""
        return self._done.is_set()

    def next_event(self, timeout: float | None = None) -> JobEvent | None:
        """The next message, waiting up to `timeout` seconds (None: forever); None if none came in time."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[JobEvent]:
        """Every message available now, without waiting."""
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def publish(self, event: JobEvent) -> None:
        """Buffer a queue, start, progress or preview message for the reader (replicas call this)."""
        try:
            self._events.put_nowait(event)
        except queue.Full:
            pass  # a reader that lags behind only misses intermediate progress

    def _finish(self, event: JobFinished | JobFailed) -> None:
        # The terminal message must get through: make room by dropping the oldest buffered progress.
        while True:
            try:
                self._events.put_nowait(event)
                break
            except queue.Full:
                try:
                    self._events.get_nowait()
                except queue.Empty:
                    pass
        self._done.set()


class Replica(Protocol):
    """What the front needs from a replica. `run` is only called from that replica's worker threads: one, or
    `jobs_in_flight` when the replica has that attribute (a pipelined replica: h3engine.runtime.split).

    Optional (looked up with getattr, so not a member here; without it the replica is served in submission order):
    `partition_on_device() -> str | None`, the DiT partition (a value of h3engine.checkpoint.layout.PARTITION_OF_TASK:
    "fl2va", "ref2va") that the replica's next job would find on its device, None when it cannot tell. The front
    calls it under its lock from any worker thread, also while the replica runs jobs: it must be cheap, never block
    and never raise (an exception is logged and read as None).
    """

    facts: CheckpointFacts

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        """Run one job to its end, publishing its start, progress and previews on the handle; the terminal message
        is returned (the front publishes it). Should not raise: what it raises fails only this job."""
        ...

    def close(self) -> None:
        """Release everything (called once, by `shutdown`, after the jobs were cancelled; a job still running then
        is to be ended within seconds)."""
        ...


class EngineReplica:
    """A replica in this process: an `Engine`, driven by the front's worker thread for it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.facts = CheckpointFacts.from_engine(engine)

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        try:
            return self._run(handle, replica_index, preview_every)
        finally:
            release_memory(self.engine.device)

    def _run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        job_id, engine = handle.job_id, self.engine
        if handle.cancel_requested:
            return JobFailed(job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE)
        try:
            resolved = engine.resolved(handle.resolved or handle.request)
            geometry = resolved.geometry
            assert geometry is not None  # resolved on the engine's checkpoint
            handle.publish(job_started(job_id, replica_index, handle.submitted_at, geometry))
            written = engine.generate_to_file(
                resolved,
                handle.out_path,
                save_tensors_path=handle.save_tensors_path,
                on_step=step_reporter(job_id, geometry, preview_every, handle.publish),
                should_cancel=lambda: handle.cancel_requested,
            )
            return job_finished(job_id, written)
        except Exception as error:
            # Out of memory too: the job's tensors go with its frames (`run` releases the cached memory), the
            # engine keeps serving.
            return job_failed(
                job_id, error, engine, f"in engine replica {replica_index}", handle.out_path.parent
            )

    def partition_on_device(self) -> str | None:
        """The partition whose DiT the engine's model store holds (None before any)."""
        return self.engine.store.partition_on_device

    def close(self) -> None:
        pass  # the engine's models go with the process


class EngineFront:
    """A job queue in front of the replicas, one worker thread each.

    Jobs run one per replica (or per worker thread of a pipelined one), in submission order but for the partition
    preference in the module's docstring. A handle yields `JobQueued` on every queue move, `JobStarted`,
    `StepProgress` after every step, `PreviewFrame` every `preview_every` steps, then one `JobFinished` or
    `JobFailed`; by default the MP4 gets a stamped name in the outputs folder. `cancel` removes a waiting job at once
    or stops a running one at its next check (its memory freed for the next job); `shutdown()` cancels everything,
    gives the running jobs `SHUTDOWN_CANCEL_WAIT_S` to end, closes the replicas and joins the workers (within about
    `SHUTDOWN_TIMEOUT_S` for process replicas). With `warm_up=True` each replica first runs `WARM_UP_REQUEST`, so that
    one-time costs are paid at start. The engine validates every request again; its RequestError becomes a
    `JobFailed(kind="request")`.
    """

    def __init__(
        self,
        replicas: Sequence[Engine | Replica],
        outputs_dir: str | Path,
        preview_every: int = DEFAULT_PREVIEW_EVERY,
        warm_up: bool = False,
    ) -> None:
        if not replicas:
            raise ValueError("EngineFront needs at least one engine replica")
        if preview_every < 1:
            raise ValueError(f"preview_every must be >= 1, got {preview_every}")
        self.outputs_dir = Path(outputs_dir)
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        self.preview_every = preview_every
        self.warm_up = warm_up
        self._replicas: list[Replica] = [
            EngineReplica(replica) if isinstance(replica, Engine) else replica for replica in replicas
        ]
        self.facts = self._replicas[0].facts
        self._pending: list[JobHandle] = []
        self._running: dict[tuple[int, int], JobHandle] = {}  # (replica, its worker thread) -> its job
        # Replica -> the task of the job last handed to it: while jobs run there, the next one's DiT turn comes
        # after theirs, so their partition is what it will find (the replica may not have started them yet).
        self._last_taken_task: dict[int, str] = {}
        self._condition = threading.Condition()
        self._stopping = False
        self._shutdown_lock = threading.Lock()
        self._shut_down = False
        # Replicas whose warm-up has not ended yet (`ready`).
        self._warm_ups_left = len(self._replicas) if warm_up else 0
        self._workers = [
            threading.Thread(
                target=self._worker_loop,
                args=(index, slot, replica),
                name=f"h3-replica-{index}" + (f"-{slot}" if slot else ""),
                daemon=True,
            )
            for index, replica in enumerate(self._replicas)
            for slot in range(getattr(replica, "jobs_in_flight", 1))
        ]
        for worker in self._workers:
            worker.start()

    @property
    def replicas(self) -> int:
        return len(self._replicas)

    @property
    def ready(self) -> bool:
        """True once every replica's warm-up ended (at once without warm-up): the app's /readyz."""
        with self._condition:
            return self._warm_ups_left == 0

    @property
    def waiting(self) -> int:
        with self._condition:
            return len(self._pending)

    @property
    def running(self) -> int:
        with self._condition:
            return len(self._running)

    # --- the one resolve, before a job queues ------------------------------------------------------------

    def resolve(self, request: GenerationRequest, media: MediaFacts | None = None) -> ResolvedRequest:
        """`resolve_request` on the replicas' checkpoint facts and memory plan (RequestError naming the field): every
        rule the engine applies, without touching a model. A door resolves once and submits the result."""
        return resolve_request(request, self.facts, media)

    # --- jobs -------------------------------------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest | ResolvedRequest,
        out_path: str | Path | None = None,
        save_tensors_path: str | Path | None = None,
        capture: Any = None,
    ) -> JobHandle:
        """Queue a job; a bare request is resolved first (`resolve`). RequestError (naming the field: the request,
        its memory, its output files) before the job takes a place."""
        resolved = request if isinstance(request, ResolvedRequest) else self.resolve(request)
        if resolved.memory_shape is None and self.facts is not None and self.facts.memory_plan is not None:
            resolved = with_memory_check(
                resolved, self.facts.memory_plan
            )  # resolved before the plan was known
        job_id = secrets.token_hex(4)
        if out_path is None:
            out_path = self.outputs_dir / stamped_output_name(resolved.request.task, job_id)
        files = checked_output_files(out_path, save_tensors_path)
        handle = JobHandle(job_id, resolved, files.video, files.tensors, capture)
        with self._condition:
            if self._stopping:
                raise RuntimeError("the engine front is shut down")
            self._pending.append(handle)
            handle.publish(JobQueued(job_id, position=len(self._pending)))
            self._condition.notify()
        return handle

    def cancel(self, handle: JobHandle) -> None:
        handle._cancel_requested.set()
        with self._condition:
            if handle not in self._pending:
                return  # running: the replica sees the flag before the next step; finished: nothing to do
            self._pending.remove(handle)
            self._announce_positions()
        handle._finish(JobFailed(handle.job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE))

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Cancel everything, close the replicas and join the workers, waiting `timeout` seconds at most for them (an
        in-process engine in a long step is left to its daemon thread). A second call (another thread's too) returns
        once the first is done."""
        with self._shutdown_lock:
            if not self._shut_down:
                self._shut_down = True
                self._shut_down_within(timeout)

    def _shut_down_within(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._condition:
            self._stopping = True
            waiting, self._pending = self._pending, []
            for handle in self._running.values():
                handle._cancel_requested.set()
            self._condition.notify_all()
        for handle in waiting:
            handle._cancel_requested.set()
            handle._finish(JobFailed(handle.job_id, "cancelled", SHUTTING_DOWN_MESSAGE))
        cancel_deadline = min(deadline, time.monotonic() + SHUTDOWN_CANCEL_WAIT_S)
        for worker in self._workers:
            worker.join(max(0.0, cancel_deadline - time.monotonic()))
        for replica in self._replicas:
            try:
                replica.close()
            except Exception:
                logger.exception("a replica failed to close")
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    # --- workers ----------------------------------------------------------------------------------------

    def _announce_positions(self) -> None:
        for position, handle in enumerate(self._pending, start=1):
            handle.publish(JobQueued(handle.job_id, position))

    def _take(self, key: tuple[int, int], replica: Replica) -> JobHandle | None:
        with self._condition:
            while not self._pending and not self._stopping:
                self._condition.wait()
            if self._stopping:
                return None
            index = next_job_index(self._pending, self._partition_for_next(key, replica))
            for passed in self._pending[:index]:
                passed.passed_over += 1
            handle = self._pending.pop(index)
            self._running[key] = handle
            self._last_taken_task[key[0]] = handle.request.task
            self._announce_positions()
            return handle

    def _partition_for_next(self, key: tuple[int, int], replica: Replica) -> str | None:
        """The partition the next job of `replica` would find on its device (the caller holds the lock)."""
        report = getattr(replica, "partition_on_device", None)
        if report is None:
            return None
        try:
            reported = report()
        except Exception:  # a preference must never stop the worker thread: serve in order
            logger.exception("replica %d could not say which partition it holds", key[0])
            return None
        if reported is None:
            return None
        if any(index == key[0] for index, _ in self._running):
            return PARTITION_OF_TASK.get(self._last_taken_task.get(key[0], ""), reported)
        return reported

    def _warm_up(self, index: int, replica: Replica) -> None:
        if WARM_UP_REQUEST.task not in replica.facts.tasks:  # e.g. a checkpoint of the Ref2VA partition alone
            logger.info(
                "replica %d: no warm-up, the checkpoint does not serve %s", index, WARM_UP_REQUEST.task
            )
            return
        folder = owned_temp_folder(WARM_UP_FOLDER_PREFIX)
        try:
            handle = JobHandle(
                f"warm-up-{index}", warm_up_request(replica.facts), folder / "warm-up.mp4", None
            )
            with self._condition:
                if self._stopping:
                    return
                self._running[index, 0] = handle  # so that `shutdown` cancels it
                self._last_taken_task[index] = handle.request.task
            started = time.perf_counter()
            try:
                result = self._run_one(handle, index, replica)
            finally:
                with self._condition:
                    del self._running[index, 0]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(result, JobFailed):
            logger.warning("replica %d: the warm-up run did not finish (%s)", index, result.message)
        else:
            logger.info("replica %d warmed up in %.1f s", index, time.perf_counter() - started)

    def _worker_loop(self, index: int, slot: int, replica: Replica) -> None:
        if self.warm_up and slot == 0:
            try:
                self._warm_up(index, replica)
            finally:
                with self._condition:
                    self._warm_ups_left -= 1
        while (handle := self._take((index, slot), replica)) is not None:
            try:
                result = self._run_one(handle, index, replica)
            finally:
                with self._condition:
                    del self._running[index, slot]
            handle._finish(result)

    def _run_one(self, handle: JobHandle, index: int, replica: Replica) -> JobFinished | JobFailed:
        """The job's terminal message from `replica`; whatever it raises (or returns instead) fails this job alone.
        An extend chaining several windows runs as one job of the replica a window (`_run_windows`)."""
        remix = handle.request.remix
        if remix is not None and remix.windows > 1:
            return self._run_windows(handle, index, replica)
        try:
            result = replica.run(handle, index, self.preview_every)
        except Exception as error:
            logger.exception("job %s: replica %d raised", handle.job_id, index)
            return JobFailed(handle.job_id, "engine", output_failure_message(error, handle.out_path.parent))
        if not isinstance(result, TERMINAL_EVENTS):
            logger.error(
                "job %s: replica %d returned %r instead of the job's end", handle.job_id, index, result
            )
            return JobFailed(handle.job_id, "engine", ENGINE_FAILURE_MESSAGE)
        return result

    def _run_windows(self, handle: JobHandle, index: int, replica: Replica) -> JobFinished | JobFailed:
        """A chained extend: window k extends window k-1's MP4 (h3engine.engine.conditioning.remix.chain_windows),
        each window resolved (its source is the last window's MP4) and run as its own job of `replica`, under this
        job's id, messages and cancel flag. The first window that does not finish ends the job."""
        ends: list[JobFinished | JobFailed] = []

        def run_window(single: GenerationRequest, video: Path, tensors: Path | None, *_: object) -> Any:
            try:
                window = handle.window(self.resolve(single), video, tensors)
            except RequestError as error:
                ends.append(job_failed(handle.job_id, error, None, "", handle.out_path.parent))
                raise _WindowEnded from None
            ends.append(self._run_one(window, index, replica))
            if isinstance(ends[-1], JobFailed):
                raise _WindowEnded
            return SimpleNamespace(video=Path(ends[-1].video_path))

        files = SimpleNamespace(video=handle.out_path, tensors=handle.save_tensors_path)
        try:
            chain_windows(run_window, handle.request, files, None, None)
        except _WindowEnded:
            pass
        return ends[-1]


class _WindowEnded(Exception):
    """A window of a chained job did not finish (its end is the job's)."""


def next_job_index(pending: Sequence[JobHandle], partition: str | None) -> int:
    """Which waiting job (oldest first) a replica holding `partition` takes: the oldest of that partition's tasks
    (or of a task of no partition), unless an older job was passed over `MAX_PASSED_OVER` times: then the oldest such
    job. With `partition` None, or no job of it, the oldest job."""
    if partition is None:
        return 0
    for index, handle in enumerate(pending):
        if handle.passed_over >= MAX_PASSED_OVER:
            return index
        if PARTITION_OF_TASK.get(handle.request.task, partition) == partition:
            return index
    return 0


def stamped_output_name(task: str, job_id: str) -> str:
    """A job's default MP4 name in the outputs folder (h3engine.media.leftovers.STAMPED_OUTPUT_NAME matches it)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{task}-{job_id}.mp4"


def settle_heap() -> None:
    """Collect once, then freeze what start-up made (modules, models, the app's page): the collection after each
    job (`release_memory`) then walks only what jobs made. With the app loaded it took 0.5-0.8 s a job before, ~0
    after. Frozen objects are still freed when their last reference goes; only their cycles are no longer looked for."""
    gc.collect()
    gc.freeze()


def release_memory(device: torch.device) -> None:
    # A cancelled or failed job's tensors die with its frames; collect them now and give cached GPU blocks back
    # so the next job (or another process) sees the memory as free.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
