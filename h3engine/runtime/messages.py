"""What the engine front tells a caller about one job: queue position, start, steps, previews, the outcome.

Contract: every message is a frozen dataclass whose fields are builtins (str, int, float, bool, None, dicts and
tuples of those) or a numpy array. Nothing here holds a torch tensor, a path object, a lock or a callback, so a
message pickles as it is and can later travel over a `multiprocessing` queue from an engine worker process to
the app process unchanged. Every job's stream ends with exactly one terminal message (`JobFinished`,
`JobFailed`), and nothing follows it.

Danger: a preview frame is the only large message (an RGB uint8 image, ~0.5 MB at the released size); the
front drops progress and preview messages rather than let a slow reader hold up the denoising loop, so a
reader must treat `StepProgress` and `PreviewFrame` as "latest known state", never as a complete log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FailureKind = Literal["request", "cancelled", "engine"]


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
    """An approximate RGB view of the newest latent frame after `step` (see h3engine.media.preview)."""

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
    """The job ended without a video. `message` is one human sentence, never a traceback.

    kind "request": the request or an input file is invalid (the engine's RequestError message, naming the field);
    "cancelled": the caller cancelled it; "engine": an internal failure (details are in the server log).
    """

    job_id: str
    kind: FailureKind
    message: str


JobEvent = JobQueued | JobStarted | StepProgress | PreviewFrame | JobFinished | JobFailed
TERMINAL_EVENTS = (JobFinished, JobFailed)
