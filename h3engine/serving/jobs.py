"""Store jobs on the engine front: submit, follow, delete, and recover after a restart.

Contract: `VideoJobs.create` writes the job's row (status queued) before the front queues it, so a crash never
loses a job the API accepted. One follower thread drains every active job's messages: the row follows (started:
in_progress and `attempts` + 1; progress at most once a second; completed with its files, or failed with a code
and the checker's or engine's sentence), SSE subscribers get each message, webhooks and metrics the endings.
`delete` cancels a queued or running job for real and removes its files. A job cancelled by shutdown stays queued
in the store. `recover()` at start: a job whose MP4 and sidecar exist is completed from its sidecar (never run
twice to completion); a queued one runs again; one that was running runs once more, or (started
`MAX_ATTEMPTS` times already) fails saying so; a UI job of a page session (gone with the process) fails.
Nothing stays in_progress.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

from h3engine.engine.options import cannot_write
from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.media.outputs import output_paths
from h3engine.request.model import GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.runtime.front import EngineFront, JobHandle, stamped_output_name
from h3engine.runtime.messages import (
    ENGINE_FAILURE_MESSAGE,
    JobFailed,
    JobFinished,
    JobQueued,
    JobStarted,
    PreviewFrame,
    StepProgress,
    outputs_refuse_writes,
)
from h3engine.serving.inputs import (
    DEFAULT_QUOTA_BYTES,
    ClientFiles,
    job_inputs,
    new_job_id,
    owner_key,
    remove_folder,
)
from h3engine.serving.job_images import (
    SPRITESHEET_SUFFIX,
    THUMBNAIL_SUFFIX,
    preview_data_url,
    write_thumbnail,
)
from h3engine.serving.store import JobRecord, JobStore, now
from h3engine.serving.videos import video_object

logger = logging.getLogger(__name__)

# Starts a job may have: the first run, and one more after a crash or restart during it.
MAX_ATTEMPTS = 2
INTERRUPTED_MESSAGE = "The server stopped twice while this job ran; it is not run a third time."
SESSION_GONE_MESSAGE = "The server stopped while this job waited or ran, and its page session is gone."
# UI owners that do not outlive the process (ui.access: a Gradio session's folder); users and browsers do.
EPHEMERAL_UI_OWNER = "ui:sessions/"
# The owner of keyless API calls on a loopback bind (h3engine.serving.api).
LOCAL_OWNER = "local"
FOLLOW_INTERVAL_S = 0.05
PROGRESS_WRITE_INTERVAL_S = 1.0
SUBSCRIBER_BUFFER = 64
FAILURE_CODES = {
    "request": "invalid_request",
    "checkpoint": "checkpoint_error",
    "cancelled": "cancelled",
    "engine": "generation_failed",
}


class Refused(Exception):
    """A request the service will not take now: the HTTP status, an error code and a sentence."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


@dataclass
class Limits:
    max_queue: int = 32  # jobs waiting on the front; past it 429 with Retry-After
    per_owner: int = 8  # an owner's jobs queued or running at once


class JobView:
    """A page's view of one job of the service: the front's messages of the job, in order, each passed on after the
    service applied it to the job's row (what an SSE subscriber reads as JSON, the page reads as messages).
    `job_id` is the job's id in the store; thread-safe."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.job_id = ""
        self._events: SimpleQueue[Any] = SimpleQueue()

    def put(self, event: Any) -> None:
        self._events.put(event)

    def drain(self) -> list[Any]:
        """Every message waiting now."""
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except Empty:
                return events


@dataclass
class _Active:
    record: JobRecord
    handle: JobHandle
    live: dict[str, Any] = field(default_factory=dict)
    views: list[JobView] = field(default_factory=list)
    subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=list)
    deleting: bool = False
    progress_written_at: float = 0.0


def job_files(record: JobRecord) -> list[Path]:
    """The MP4, sidecar, thumbnail and spritesheet of a job (the last two made when asked for)."""
    video, sidecar = output_paths(record.out_path)
    return [video, sidecar, video.with_suffix(THUMBNAIL_SUFFIX), video.with_suffix(SPRITESHEET_SUFFIX)]


class VideoJobs:
    def __init__(
        self,
        front: EngineFront,
        store: JobStore,
        outputs_dir: Path,
        limits: Limits | None = None,
        on_end: Callable[[JobRecord], None] | None = None,
        shared: bool = False,
        inputs_quota: int = DEFAULT_QUOTA_BYTES,
    ) -> None:
        self.front, self.store, self.outputs_dir = front, store, Path(outputs_dir)
        self.inputs = ClientFiles(self.outputs_dir, store, inputs_quota)  # API jobs' input files, /v1/files
        # --shared-history: the page's History and the keyless API ("local") are one owner and one folder.
        self.shared = shared
        self.limits = limits or Limits()
        self.on_end = on_end  # webhooks and metrics: called on the follower thread with the final row
        self._active: dict[str, _Active] = {}
        self._lock = threading.RLock()
        self._stopping = False
        self._closed = threading.Event()
        self._durations: deque[float] = deque(maxlen=20)
        self._follower = threading.Thread(target=self._follow_loop, name="h3-api-jobs", daemon=True)

    # --- life ----------------------------------------------------------------------------------------------

    def start(self) -> dict[str, int]:
        """Recover the store's unfinished jobs, then follow jobs; what recovery did, by outcome."""
        counts = self.recover()
        self._follower.start()
        return counts

    def stop_taking(self) -> None:
        """Shutdown begins: jobs the front now cancels stay queued in the store, for the next start."""
        with self._lock:
            self._stopping = True

    def close(self, timeout: float = 5.0) -> None:
        self.stop_taking()
        self._closed.set()
        if self._follower.is_alive():
            self._follower.join(timeout)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._active)

    def live_of(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            active = self._active.get(job_id)
            return dict(active.live) if active is not None else None

    # --- jobs ----------------------------------------------------------------------------------------------

    def results_dir(self, owner: str) -> Path:
        if self.shared and owner == LOCAL_OWNER:
            return self.outputs_dir
        return self.outputs_dir / "api" / owner_key(owner)

    def outputs_problem(self, folder: Path) -> str | None:
        """Why a results folder cannot take a job now (made when missing; the page's sentence, no path), or None."""
        why = cannot_write(folder)
        if why is None:
            return None
        logger.error("the results folder %s refuses writes: %s", folder, why)
        words = outputs_refuse_writes(why)
        return f"{words[0].upper()}{words[1:]}"

    def ui_owner(self, results_dir: Path) -> str:
        """The store owner of a page's results folder ("ui:<folder>"; with --shared-history the keyless API's)."""
        if self.shared and Path(results_dir) == self.outputs_dir:
            return LOCAL_OWNER
        return "ui:" + Path(results_dir).relative_to(self.outputs_dir).as_posix()

    def retry_after(self) -> int:
        mean = sum(self._durations) / len(self._durations) if self._durations else 5.0
        return max(1, math.ceil(mean * (self.front.waiting + 1) / max(1, self.front.replicas)))

    def create(
        self,
        owner: str,
        resolved: ResolvedRequest,
        meta: dict[str, Any],
        source: str = "api",
        idempotency: tuple[str, str] | None = None,
        out_path: Path | None = None,
        job_id: str | None = None,
        view: JobView | None = None,
    ) -> tuple[JobRecord, bool]:
        """A new job (its row, then its place on the front), or with `idempotency` (key, body digest) the job that
        key made before (False: not new). Refused for a key reused with another body, a full queue, an owner at its
        limit, or a results folder that refuses writes (503, the page's sentence). `resolved`: the request as the
        front resolved it (`front.resolve`), which the job runs; `job_id` is the id its inputs folder was named by
        (`ClientFiles.job_folder`); `view` (the page's) receives the job's messages."""
        request, geometry = resolved.request, resolved.geometry
        assert geometry is not None  # resolved on the front's checkpoint facts
        with self._lock:
            if idempotency is not None:
                existing = self.store.by_idempotency_key(owner, idempotency[0])
                if existing is not None:
                    if existing.body_digest != idempotency[1]:
                        raise Refused(
                            409,
                            "idempotency_key_reused",
                            "This Idempotency-Key was used with another request body.",
                        )
                    return existing, False
            if self._stopping:
                raise Refused(503, "shutting_down", "The server is shutting down.")
            if source == "api" and self.front.waiting >= self.limits.max_queue:
                raise Refused(
                    429,
                    "queue_full",
                    f"The queue is full ({self.front.waiting} jobs waiting); try again later.",
                    self.retry_after(),
                )
            mine = sum(1 for active in self._active.values() if active.record.owner == owner)
            if source == "api" and mine >= self.limits.per_owner:
                raise Refused(
                    429,
                    "too_many_jobs",
                    f"You have {mine} jobs queued or running, the most allowed at once; wait for one to end.",
                    self.retry_after(),
                )
            job_id = job_id or new_job_id()
            if out_path is None:
                out_path = self.results_dir(owner) / stamped_output_name(request.task, job_id[-8:])
            meta = {**meta, "width": geometry.width, "height": geometry.height, "frames": geometry.frames}
            record = JobRecord(
                id=job_id,
                owner=owner,
                source=source,
                status="queued",
                created_at=now(),
                request=request.to_dict(),
                out_path=str(out_path),
                meta=meta,
                idempotency_key=idempotency[0] if idempotency else None,
                body_digest=idempotency[1] if idempotency else None,
            )
            problem = self.outputs_problem(Path(out_path).parent)
            if problem is not None:
                raise Refused(503, "outputs_unwritable", problem)
            try:
                self.store.insert(record)
            except (OSError, sqlite3.Error) as error:
                logger.error("job store: cannot record a new job: %s", error)
                raise Refused(503, "store_unavailable", "The job store cannot record the job now.") from None
            if view is not None:
                view.job_id = record.id
            self._submit(record, resolved, view)
            return record, True

    def _submit(
        self, record: JobRecord, resolved: ResolvedRequest | None = None, view: JobView | None = None
    ) -> None:
        """Queue a recorded job: its resolved request, or (recovery after a restart) its row's, resolved again."""
        try:
            handle = self.front.submit(resolved or from_dict(record.request), out_path=record.out_path)
        except (RequestError, OSError, RuntimeError) as error:
            logger.warning("job %s cannot be queued: %s", record.id, error)
            if isinstance(error, RequestError) and error.field == "out_path" or isinstance(error, OSError):
                problem = self.outputs_problem(Path(record.out_path).parent) or ENGINE_FAILURE_MESSAGE
                self._end(record, "failed", error_code="outputs_unwritable", error_message=problem)
            else:
                self._end(record, "failed", error_code="invalid_request", error_message=str(error))
            return
        with self._lock:
            self._active[record.id] = _Active(record, handle, {"progress": 0}, [] if view is None else [view])

    def cancel(self, job_id: str) -> None:
        """Stop a queued or running job (it ends failed, cancelled); nothing when it is not active."""
        with self._lock:
            active = self._active.get(job_id)
        if active is not None:
            self.front.cancel(active.handle)

    def delete(self, owner: str, job_id: str) -> bool:
        """Stop the job (queued or running) and remove its files; False when the owner has no such job."""
        with self._lock:
            record = self.store.get(job_id, owner)
            if record is None:
                return False
            active = self._active.get(job_id)
            if active is None and not record.terminal:
                # Recorded but not on the front (refused when it was queued, or the server is stopping).
                raise Refused(409, "job_not_cancellable", "This job cannot be cancelled now; try again.")
            self.store.update(job_id, deleted=True)
            if active is not None:
                active.deleting = True
                self.front.cancel(active.handle)
                return True
        _remove_files(record)
        return True

    def subscribe(self, job_id: str) -> asyncio.Queue | None:
        """A queue of the job's messages for the calling event loop (None when the job is not active)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_BUFFER)
        with self._lock:
            active = self._active.get(job_id)
            if active is None:
                return None
            active.subscribers.append((asyncio.get_running_loop(), queue))
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue) -> None:
        with self._lock:
            active = self._active.get(job_id)
            if active is not None:
                active.subscribers = [item for item in active.subscribers if item[1] is not queue]

    # --- recovery ------------------------------------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        counts = {"completed": 0, "requeued": 0, "rerun": 0, "failed": 0, "removed": 0}
        for record in self.store.unfinished():
            video, sidecar = output_paths(record.out_path)
            if record.deleted:
                _remove_files(record)
                self.store.update(
                    record.id, status="failed", error_code="cancelled", error_message="Deleted."
                )
                counts["removed"] += 1
            elif video.is_file() and sidecar.is_file():
                self._complete(record, _result_from_sidecar(video, sidecar))
                counts["completed"] += 1
            elif record.status == "in_progress" and record.attempts >= MAX_ATTEMPTS:
                self._end(record, "failed", error_code="interrupted", error_message=INTERRUPTED_MESSAGE)
                counts["failed"] += 1
            elif record.source == "ui" and record.owner.startswith(EPHEMERAL_UI_OWNER):
                # A page session's job: nobody can see its result after a restart, so it is not run again.
                self._end(record, "failed", error_code="interrupted", error_message=SESSION_GONE_MESSAGE)
                counts["failed"] += 1
            else:
                counts["rerun" if record.status == "in_progress" else "requeued"] += 1
                self.store.update(record.id, status="queued", progress=0)
                record.status, record.progress = "queued", 0
                self._submit(record)
        if any(counts.values()):
            logger.info("job store recovery: %s", ", ".join(f"{k} {v}" for k, v in counts.items() if v))
        self.inputs.sweep_orphans()
        return counts

    # --- following -----------------------------------------------------------------------------------------

    def _follow_loop(self) -> None:
        while True:
            with self._lock:
                actives = list(self._active.values())
            if self._closed.is_set() and not actives:
                return
            for active in actives:
                for event in active.handle.drain():
                    try:
                        self._on_event(active, event)
                    except Exception:
                        logger.exception(
                            "job %s: following %r failed", active.record.id, type(event).__name__
                        )
                    for view in active.views:
                        view.put(event)
            if self._closed.is_set() and all(active.handle.done for active in actives):
                # Shutdown: what the front ended has been read; jobs it still holds stay queued in the store.
                for active in actives:
                    for event in active.handle.drain():
                        self._on_event(active, event)
                return
            time.sleep(FOLLOW_INTERVAL_S)

    def _publish(self, active: _Active, message: dict[str, Any]) -> None:
        for loop, queue in list(active.subscribers):
            try:
                loop.call_soon_threadsafe(_offer, queue, message)
            except RuntimeError:  # that loop is closed
                pass

    def _on_event(self, active: _Active, event: Any) -> None:
        record, live = active.record, active.live
        if isinstance(event, JobQueued):
            live["queue_position"] = event.position
            self._publish(active, {"type": "queued", "position": event.position})
        elif isinstance(event, JobStarted):
            record.status, record.started_at = "in_progress", now()
            record.attempts += 1
            live.update(queue_position=None, width=event.width, height=event.height, frames=event.frames)
            self.store.update(
                record.id, status="in_progress", started_at=record.started_at, attempts=record.attempts
            )
            self._publish(active, {"type": "started", "video": self._object(active)})
        elif isinstance(event, StepProgress):
            progress = min(99, int(95 * event.step / max(1, event.total)))
            live.update(
                step=event.step, total_steps=event.total, eta_s=round(event.eta_s, 2), progress=progress
            )
            if time.monotonic() - active.progress_written_at >= PROGRESS_WRITE_INTERVAL_S:
                active.progress_written_at = time.monotonic()
                self.store.update(record.id, progress=progress)
            self._publish(
                active,
                {
                    "type": "progress",
                    "progress": progress,
                    "step": event.step,
                    "total": event.total,
                    "eta_s": live["eta_s"],
                },
            )
        elif isinstance(event, PreviewFrame):
            if active.subscribers:
                self._publish(
                    active, {"type": "preview", "step": event.step, "image": preview_data_url(event.rgb)}
                )
        elif isinstance(event, JobFinished):
            self._finished(active, event)
        elif isinstance(event, JobFailed):
            self._failed(active, event)

    def _object(self, active: _Active) -> dict[str, Any]:
        return video_object(active.record, active.live)

    def _drop(self, active: _Active) -> None:
        with self._lock:
            self._active.pop(active.record.id, None)

    def _finished(self, active: _Active, event: JobFinished) -> None:
        record = active.record
        self._drop(active)
        if active.deleting:
            self._deleted(active)
            return
        video = Path(event.video_path)
        thumbnail = write_thumbnail(video) if record.source == "api" else None  # the page shows the video
        result = {
            "video": event.video_path,
            "sidecar": event.sidecar_path,
            "thumbnail": None if thumbnail is None else str(thumbnail),
            "seed": event.seed,
            "width": event.width,
            "height": event.height,
            "frames": event.frames,
            "fps": event.fps,
            "timings_s": event.timings_s,
        }
        if record.started_at is not None:
            self._durations.append(max(0.0, now() - record.started_at))
        self._complete(record, result)
        self._publish(active, {"type": "done", "video": video_object(record)})

    def _failed(self, active: _Active, event: JobFailed) -> None:
        record = active.record
        self._drop(active)
        if active.deleting:
            self._deleted(active)
            return
        if event.kind == "cancelled" and self._stopping:
            # Shutdown cancelled it: it runs again at the next start.
            self.store.update(record.id, status="queued", progress=0)
            return
        self._end(
            record,
            "failed",
            error_code=FAILURE_CODES.get(event.kind, "generation_failed"),
            error_message=event.message,
        )
        self._publish(active, {"type": "done", "video": video_object(record)})

    def _deleted(self, active: _Active) -> None:
        _remove_files(active.record)
        self.store.update(
            active.record.id,
            status="failed",
            completed_at=now(),
            error_code="cancelled",
            error_message="Deleted.",
        )
        self._publish(active, {"type": "deleted", "id": active.record.id})

    def _complete(self, record: JobRecord, result: dict[str, Any]) -> None:
        record.result = result
        self._end(record, "completed", result=result, progress=100)

    def _end(self, record: JobRecord, status: str, **changes: Any) -> None:
        record.status, record.completed_at = status, now()
        for name, value in changes.items():
            setattr(record, name, value)
        self.store.update(record.id, status=status, completed_at=record.completed_at, **changes)
        if self.on_end is not None:
            try:
                self.on_end(record)
            except Exception:
                logger.exception("job %s: the end hooks failed", record.id)


def _offer(queue: asyncio.Queue, message: dict[str, Any]) -> None:
    terminal = message.get("type") in ("done", "deleted")
    while True:
        try:
            queue.put_nowait(message)
            return
        except asyncio.QueueFull:
            if not terminal:
                return  # a slow reader misses intermediate progress
            queue.get_nowait()


def _remove_files(record: JobRecord) -> None:
    """A job's results and its input files."""
    for path in job_files(record):
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("could not remove %s: %s", path, error)
    remove_folder(job_inputs(record))


def _result_from_sidecar(video: Path, sidecar_path: Path, thumbnail: bool = True) -> dict[str, Any]:
    sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
    geometry = sidecar.get("geometry", {})
    make_thumbnail, thumbnail = thumbnail, video.with_suffix(THUMBNAIL_SUFFIX)
    if make_thumbnail and not thumbnail.is_file():
        write_thumbnail(video)
    return {
        "video": str(video),
        "sidecar": str(sidecar_path),
        "thumbnail": str(thumbnail) if thumbnail.is_file() else None,
        "seed": sidecar.get("seed"),
        "width": geometry.get("width"),
        "height": geometry.get("height"),
        "frames": geometry.get("frames"),
        "fps": geometry.get("fps", 24),
        "timings_s": sidecar.get("timings_s", {}),
    }


PAGE_STORE_FOLDER = ".page-jobs"


def page_jobs(front: EngineFront, outputs_dir: Path) -> VideoJobs:
    """The job service of a page without the API: its store in the outputs folder (`PAGE_STORE_FOLDER`), started."""
    jobs = VideoJobs(front, JobStore.open(Path(outputs_dir) / PAGE_STORE_FOLDER), outputs_dir)
    jobs.start()
    return jobs
