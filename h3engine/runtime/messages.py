"""What the engine front tells a caller about one job: queue position, start, steps, previews, the outcome.

Contract: every message is a frozen dataclass whose fields are builtins (str, int, float, bool, None, dicts and
tuples of those) or a numpy array. Nothing here holds a torch tensor, a path object, a lock or a callback, so a
message pickles as it is and can later travel over a `multiprocessing` queue from an engine worker process to
the app process unchanged. Every job's stream ends with exactly one terminal message (`JobFinished`,
`JobFailed`), and nothing follows it. Every kind of replica builds them the same way: `job_started`,
`step_reporter` (the engine's `on_step`), `job_finished` (read back from the sidecar) and `job_failed` (the one
place an exception becomes a failure: cancelled, a request error, out of memory, internal).

Danger: a preview frame is the only large message (an RGB uint8 image, ~0.5 MB at the released size); the
front drops progress and preview messages rather than let a slow reader hold up the denoising loop, so a
reader must treat `StepProgress` and `PreviewFrame` as "latest known state", never as a complete log.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from h3engine.engine.preview import latent_preview_rgb
from h3engine.errors import CheckpointError, GenerationCancelled, H3Error, public_text
from h3engine.media.outputs import OutputFiles
from h3engine.request.geometry import FPS, Geometry

if TYPE_CHECKING:
    from h3engine.engine.engine import Engine
    from h3engine.engine.pipeline import StepEvent

logger = logging.getLogger(__name__)

FailureKind = Literal["request", "checkpoint", "cancelled", "engine"]
ENGINE_FAILURE_MESSAGE = "The engine failed while generating this video; the details are in the server log."
CANCELLED_MESSAGE = "Cancelled."
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
SIZE_UNITS = ("bytes", "KB", "MB", "GB", "TB")


@dataclass(frozen=True)
class JobQueued:
    """The job waits for a free engine replica; `position` 1 means it is next."""

    job_id: str
    position: int


@dataclass(frozen=True)
class JobStarted:
    """A replica took the job; the geometry is the engine's own, for this checkpoint."""

    job_id: str
    replica: int
    queue_wait_s: float
    width: int
    height: int
    frames: int
    fps: int
    latent_frames: int


@dataclass(frozen=True)
class StepProgress:
    """After denoising step `step` of `total`; `eta_s` extrapolates the mean step time over the steps left."""

    job_id: str
    step: int
    total: int
    elapsed_s: float
    eta_s: float


@dataclass(frozen=True)
class PreviewFrame:
    """An approximate RGB view of the newest latent frame after `step` (see h3engine.engine.preview)."""

    job_id: str
    step: int
    rgb: np.ndarray = field(repr=False)  # [H, W, 3] uint8


@dataclass(frozen=True)
class JobFinished:
    """The MP4 and its JSON sidecar are complete on disk (written atomically by the engine)."""

    job_id: str
    video_path: str
    sidecar_path: str
    seed: int
    width: int
    height: int
    frames: int
    fps: int
    timings_s: dict[str, float]


@dataclass(frozen=True)
class JobFailed:
    """The job ended without a video. `message` is one human sentence without a server path, never a traceback.

    kind "request": the request or an input file is invalid (`error`: the RequestError, naming the field);
    "checkpoint": a checkpoint file failed to load when the job needed it (`error`: the CheckpointError, naming the
    file); "cancelled": the caller cancelled it; "engine": an internal failure (details are in the server log).
    """

    job_id: str
    kind: FailureKind
    message: str
    # The error that ended it, typed (RequestError, CheckpointError), for a door to present; None for the others.
    error: H3Error | None = field(default=None, compare=False)


JobEvent = JobQueued | JobStarted | StepProgress | PreviewFrame | JobFinished | JobFailed
TERMINAL_EVENTS = (JobFinished, JobFailed)


# --- the messages of one job, built the same way by every kind of replica ---------------------------------


def job_started(job_id: str, replica_index: int, submitted_at: float, geometry: Geometry) -> JobStarted:
    """`submitted_at` is the handle's `time.monotonic()` stamp (one clock for every process of the machine)."""
    return JobStarted(
        job_id,
        replica=replica_index,
        queue_wait_s=time.monotonic() - submitted_at,
        width=geometry.width,
        height=geometry.height,
        frames=geometry.frames,
        fps=FPS,
        latent_frames=geometry.latent_frames,
    )


def job_finished(job_id: str, written: OutputFiles) -> JobFinished:
    """The terminal message of a job whose files are on disk, read back from its sidecar."""
    sidecar = json.loads(written.sidecar.read_text(encoding="utf-8"))
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


def job_failed(
    job_id: str, error: BaseException, engine: Engine, during: str, outputs_folder: Path
) -> JobFailed:
    """The terminal message of a job that `error` ended: a cancel, a request error (its message names the field or
    file), running out of GPU memory (the engine's budget and what to change), a full disk (`output_failure_message`)
    or an internal failure (logged with its traceback; `during` says where, e.g. "while preparing")."""
    if isinstance(error, GenerationCancelled):
        return JobFailed(job_id, "cancelled", CANCELLED_MESSAGE)
    if isinstance(error, CheckpointError):
        logger.error("job %s failed %s: %s", job_id, during, error)
        return JobFailed(job_id, "checkpoint", public_text(error), error)
    if isinstance(error, H3Error):
        return JobFailed(job_id, "request", public_text(error), error)
    logger.error("job %s failed %s", job_id, during, exc_info=error)
    if isinstance(error, torch.OutOfMemoryError):
        return JobFailed(job_id, "engine", engine.placement.out_of_memory_message())
    return JobFailed(job_id, "engine", output_failure_message(error, outputs_folder))


def output_failure_message(error: BaseException, outputs_folder: Path) -> str:
    """The sentence for a job that `error` ended while it ran: a full disk (an OSError ENOSPC or EDQUOT anywhere in
    the error's chain, e.g. under the MP4 writer's error) says so with the space left on the outputs folder's disk;
    an OSError on a path in the outputs folder is `outputs_refuse_writes`; anything else is
    `ENGINE_FAILURE_MESSAGE`. No server path: a browser reads it."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            words = disk_full_text(outputs_folder)
            return f"{words[0].upper()}{words[1:]}; free some space, then try again."
        if isinstance(cause, OSError) and _in_folder(cause.filename, outputs_folder):
            words = outputs_refuse_writes(cause.strerror or type(cause).__name__)
            return f"{words[0].upper()}{words[1:]}"
        cause = cause.__cause__ or cause.__context__
    return ENGINE_FAILURE_MESSAGE


def outputs_refuse_writes(why: str) -> str:
    """'the outputs folder refuses writes (Not a directory); ...': the page's and the API's words for an outputs
    folder that cannot be written, `why` being what the system said (never a path)."""
    return f"the outputs folder refuses writes ({why}); the details are in the server log."


def _in_folder(filename: object, folder: Path) -> bool:
    if not isinstance(filename, str | bytes | os.PathLike):
        return False
    path = Path(os.fsdecode(filename))
    return path.is_relative_to(folder) or path.absolute().is_relative_to(Path(folder).absolute())


def disk_full_text(outputs_folder: Path) -> str:
    """'the disk of the outputs folder is full (1.5 GB free)' (without the space where it cannot tell)."""
    free = free_space(outputs_folder)
    left = f" ({size_text(free)} free)" if free is not None else ""
    return f"the disk of the outputs folder is full{left}"


def free_space(folder: Path) -> int | None:
    """The bytes free on the disk holding `folder` (or its nearest existing parent); None when it cannot tell."""
    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def size_text(size: int) -> str:
    """Bytes in powers of 1024, as the app's upload limit counts: '0 bytes', '512.0 KB', '1.5 GB'."""
    value, unit = float(size), 0
    while value >= 1024 and unit < len(SIZE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{size} bytes" if unit == 0 else f"{value:.1f} {SIZE_UNITS[unit]}"


def step_reporter(
    job_id: str, geometry: Geometry, preview_every: int, publish: Callable[[JobEvent], None]
) -> Callable[[StepEvent], None]:
    """The engine's `on_step`: a `StepProgress` every step, a `PreviewFrame` every `preview_every` steps and at the
    last one. `publish` must not block (it drops what its reader cannot take)."""
    previews_enabled = True

    def on_step(event: StepEvent) -> None:
        nonlocal previews_enabled
        eta_s = event.elapsed_s / event.step * (event.total - event.step)
        publish(StepProgress(job_id, event.step, event.total, event.elapsed_s, eta_s))
        wants_preview = event.step % preview_every == 0 or event.step == event.total
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
            logger.exception("job %s: live preview failed; previews are off for this job", job_id)
            previews_enabled = False
            return
        publish(PreviewFrame(job_id, event.step, rgb))

    return on_step
