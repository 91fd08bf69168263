"""The in-process engine front: a job queue in front of one or more engine replicas, one worker thread each.

Contract:
* `EngineFront(engines, outputs_dir)` starts one worker thread per `Engine` (a replica: its own models on its own
  device). Jobs run in submission order; at most `replicas` run at once.
* `submit(request)` returns a `JobHandle` at once. The handle yields the job's messages (h3engine.runtime.messages):
  `JobQueued` whenever its queue position changes, `JobStarted`, `StepProgress` after every denoising step,
  `PreviewFrame` every `preview_every` steps, then exactly one terminal `JobFinished` or `JobFailed`.
* `cancel(handle)` removes a waiting job at once; a running job stops at the engine's next step check (before
  every denoising step), its tensors are dropped and, on a GPU, the allocator cache is emptied, so the replica
  is free for the next job. Cancelling a finished job does nothing.
* `shutdown()` cancels everything and joins the workers.
* `check(request)` / `expected_geometry(request)` run the model-free checks of h3engine.runtime.checks; callers
  use them before `submit`, so an invalid request never takes a place in the queue. The worker validates again
  with the engine itself, and its RequestError becomes a `JobFailed(kind="request")` with the engine's message.

Why messages and not callbacks: the messages are plain picklable data, so when replicas move into worker processes
the same handle API can be fed from a multiprocessing queue instead of a thread. The engine's `on_step` callback
runs inside the denoising loop; it only formats small messages and puts them without blocking (a full buffer
drops progress and previews, never the terminal message), so a slow or vanished reader never stalls a GPU.

Danger: an `Engine` is not thread-safe; each one is only ever called from its own worker thread. Any exception
from the engine is caught in the worker (an internal one is logged with its traceback and reported as one short
sentence), so a bad job can never kill a replica's thread.
"""

from __future__ import annotations

import gc
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from h3engine.engine import Engine
from h3engine.errors import GenerationCancelled, H3Error
from h3engine.geometry import FPS, Geometry
from h3engine.media.preview import latent_preview_rgb
from h3engine.pipeline import StepEvent
from h3engine.request import GenerationRequest
from h3engine.runtime.checks import CheckpointFacts, check_request, expected_geometry
from h3engine.runtime.messages import (
    JobEvent,
    JobFailed,
    JobFinished,
    JobQueued,
    JobStarted,
    PreviewFrame,
    StepProgress,
)

logger = logging.getLogger(__name__)

DEFAULT_PREVIEW_EVERY = 5
# Messages a handle buffers for its reader; past that, progress and previews are dropped (the newest win later).
EVENT_BUFFER_SIZE = 64
ENGINE_FAILURE_MESSAGE = "The engine failed while generating this video; the details are in the server log."


class JobHandle:
    """One submitted job: read its messages with `next_event` / `drain`; cancel it through the front."""

    def __init__(self, job_id: str, request: GenerationRequest, out_path: Path) -> None:
        self.job_id = job_id
        self.request = request
        self.out_path = out_path
        self.submitted_at = time.monotonic()
        self._events: queue.Queue[JobEvent] = queue.Queue(maxsize=EVENT_BUFFER_SIZE)
        self._cancel_requested = threading.Event()
        self._done = threading.Event()

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

    def _publish(self, event: JobEvent) -> None:
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


class EngineFront:
    def __init__(
        self,
        engines: Sequence[Engine],
        outputs_dir: str | Path,
        preview_every: int = DEFAULT_PREVIEW_EVERY,
    ) -> None:
        if not engines:
            raise ValueError("EngineFront needs at least one engine replica")
        if preview_every < 1:
            raise ValueError(f"preview_every must be >= 1, got {preview_every}")
        self.outputs_dir = Path(outputs_dir)
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        self.preview_every = preview_every
        self.facts = CheckpointFacts.from_engine(engines[0])
        self._engines = list(engines)
        self._pending: list[JobHandle] = []
        self._running: dict[int, JobHandle] = {}
        self._condition = threading.Condition()
        self._stopping = False
        self._workers = [
            threading.Thread(
                target=self._worker_loop, args=(replica, engine), name=f"h3-replica-{replica}", daemon=True
            )
            for replica, engine in enumerate(self._engines)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def replicas(self) -> int:
        return len(self._engines)

    @property
    def waiting(self) -> int:
        with self._condition:
            return len(self._pending)

    @property
    def running(self) -> int:
        with self._condition:
            return len(self._running)

    # --- checks that need no engine ---------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> list[str]:
        return check_request(request, self.facts)

    def expected_geometry(self, request: GenerationRequest) -> Geometry:
        return expected_geometry(request, self.facts)

    # --- jobs -------------------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> JobHandle:
        job_id = secrets.token_hex(4)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        handle = JobHandle(job_id, request, self.outputs_dir / f"{stamp}-{request.task}-{job_id}.mp4")
        with self._condition:
            if self._stopping:
                raise RuntimeError("the engine front is shut down")
            self._pending.append(handle)
            handle._publish(JobQueued(job_id, position=len(self._pending)))
            self._condition.notify()
        return handle

    def cancel(self, handle: JobHandle) -> None:
        handle._cancel_requested.set()
        with self._condition:
            if handle not in self._pending:
                return  # running: the worker sees the flag before the next step; finished: nothing to do
            self._pending.remove(handle)
            self._announce_positions()
        handle._finish(JobFailed(handle.job_id, "cancelled", "Cancelled before it started."))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        with self._condition:
            self._stopping = True
            waiting, self._pending = self._pending, []
            for handle in self._running.values():
                handle._cancel_requested.set()
            self._condition.notify_all()
        for handle in waiting:
            handle._cancel_requested.set()
            handle._finish(JobFailed(handle.job_id, "cancelled", "The app is shutting down."))
        for worker in self._workers:
            worker.join(timeout)

    # --- workers ----------------------------------------------------------------------------------------

    def _announce_positions(self) -> None:
        for position, handle in enumerate(self._pending, start=1):
            handle._publish(JobQueued(handle.job_id, position))

    def _take(self, replica: int) -> JobHandle | None:
        with self._condition:
            while not self._pending and not self._stopping:
                self._condition.wait()
            if self._stopping:
                return None
            handle = self._pending.pop(0)
            self._running[replica] = handle
            self._announce_positions()
            return handle

    def _worker_loop(self, replica: int, engine: Engine) -> None:
        while (handle := self._take(replica)) is not None:
            try:
                handle._finish(self._run(replica, engine, handle))
            finally:
                with self._condition:
                    del self._running[replica]
                _release_memory(engine.device)

    def _run(self, replica: int, engine: Engine, handle: JobHandle) -> JobFinished | JobFailed:
        job_id = handle.job_id
        if handle.cancel_requested:
            return JobFailed(job_id, "cancelled", "Cancelled before it started.")
        try:
            engine.validate(handle.request)
            geometry = engine.geometry_for(handle.request)
            handle._publish(
                JobStarted(
                    job_id,
                    replica=replica,
                    queue_wait_s=time.monotonic() - handle.submitted_at,
                    width=geometry.width,
                    height=geometry.height,
                    frames=geometry.frames,
                    fps=FPS,
                    latent_frames=geometry.latent_frames,
                )
            )
            written = engine.generate_to_file(
                handle.request,
                handle.out_path,
                on_step=self._step_reporter(handle, geometry),
                should_cancel=lambda: handle.cancel_requested,
            )
            sidecar = json.loads(written.sidecar.read_text(encoding="utf-8"))
        except GenerationCancelled:
            return JobFailed(job_id, "cancelled", "Cancelled.")
        except H3Error as error:
            return JobFailed(job_id, "request", str(error))
        except Exception:
            logger.exception("job %s failed in engine replica %d", job_id, replica)
            return JobFailed(job_id, "engine", ENGINE_FAILURE_MESSAGE)
        return JobFinished(
            job_id,
            video_path=str(written.video),
            sidecar_path=str(written.sidecar),
            seed=int(sidecar["seed"]),
            width=int(sidecar["geometry"]["width"]),
            height=int(sidecar["geometry"]["height"]),
            frames=int(sidecar["geometry"]["frames"]),
            fps=int(sidecar["geometry"]["fps"]),
            timings_s={name: float(value) for name, value in sidecar["timings_s"].items()},
        )

    def _step_reporter(self, handle: JobHandle, geometry: Geometry) -> Callable[[StepEvent], None]:
        previews_enabled = True

        def on_step(event: StepEvent) -> None:
            nonlocal previews_enabled
            eta_s = event.elapsed_s / event.step * (event.total - event.step)
            handle._publish(StepProgress(handle.job_id, event.step, event.total, event.elapsed_s, eta_s))
            wants_preview = event.step % self.preview_every == 0 or event.step == event.total
            if not (previews_enabled and wants_preview and event.video_rows is not None):
                return
            try:
                rgb = latent_preview_rgb(
                    event.video_rows,
                    geometry.latent_frames,
                    geometry.latent_h,
                    geometry.latent_w,
                    geometry.patch,
                )
            except Exception:
                # A preview is a nicety: never let it abort the generation it is watching.
                logger.exception("job %s: live preview failed; previews are off for this job", handle.job_id)
                previews_enabled = False
                return
            handle._publish(PreviewFrame(handle.job_id, event.step, rgb))

        return on_step


def _release_memory(device: torch.device) -> None:
    # A cancelled or failed job's tensors die with its frames; collect them now and give cached GPU blocks back
    # so the next job (or another process) sees the memory as free.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
