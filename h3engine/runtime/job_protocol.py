"""What the front and its rank processes say to each other: the specs ranks start from, commands and reports.

A worker group's ranks (h3engine.runtime.rank) take `RunJob`; the ranks of split stage groups
(h3engine.runtime.stages) take one command per step of a job (`Prepare`, `Encode`, `Denoise`, `Decode`), each
carrying its `RunJob`. Both kinds answer `RankReady` once loaded, `RankFailed` before they exit, and end on `Stop`;
a stage group's rank 0 also reports `StageDone` after each step. A job's own messages (start, steps, end) are
h3engine.runtime.messages'.

Contract: everything here pickles (it crosses a pipe to a rank process): no tensors, no open files, no callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.engine.options import EngineOptions
from h3engine.models.parallel.groups import EncoderLayout, ParallelLayout, VAELayout
from h3engine.request.geometry import Geometry
from h3engine.request.model import GenerationRequest
from h3engine.runtime.channel import TensorChannel

if TYPE_CHECKING:
    from h3engine.runtime.front import JobHandle

# A rank's cancel slot holds this when no job is to be cancelled (job numbers start at 0).
NO_JOB = -1

Stage = Literal["encoder", "dit", "vae"]


# --- specs: what a rank starts from -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """What every rank of a group starts from; its layouts were validated against the checkpoint by the front."""

    checkpoint: str
    devices: tuple[str, ...]  # rank r computes on devices[r]
    options: EngineOptions  # the engine flags, whole: each rank reads its dtype and memory flags from them
    init_method: str = (
        ""  # the rendezvous of this incarnation of the group (h3engine.runtime.workers sets it)
    )

    @property
    def world_size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(RankSpec):
    """A rank of a worker group: it holds its share of every model (`rank_share` in h3engine.runtime.rank)."""

    dit_layout: ParallelLayout
    encoder_layout: EncoderLayout
    vae_layout: VAELayout


@dataclass(frozen=True, kw_only=True)
class StageSpec(RankSpec):
    """A rank of one split stage group, a world of its own."""

    stage: Stage
    layout: ParallelLayout | EncoderLayout | VAELayout
    # Per rank: on the CPU what a colocated rank would use; on GPUs the cores shared over all the stage processes.
    cpu_threads: int


@dataclass
class StageEnds:
    """The channels one stage rank uses: those it receives from by route, those it sends into (one per consumer
    rank)."""

    receive: dict[str, TensorChannel] = field(default_factory=dict)
    send: dict[str, list[TensorChannel]] = field(default_factory=dict)


# --- commands -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunJob:
    """One job: the whole of it for a worker rank, the job that a stage command is a step of."""

    job_number: int  # unique within the replica; what the cancel slot refers to
    job_id: str
    request: GenerationRequest
    out_path: str
    save_tensors_path: str | None
    submitted_at: float  # time.monotonic() of the submit, for JobStarted.queue_wait_s
    replica_index: int
    preview_every: int
    # A CaptureSpec (h3engine.engine.trace): rank 0 records the job's boundaries there (`generate --capture`).
    capture: Any = None
    # The request as its door resolved it (h3engine.engine.resolved.ResolvedRequest; None: rank 0 resolves it).
    resolved: Any = None

    @classmethod
    def of(cls, job_number: int, handle: JobHandle, replica_index: int, preview_every: int) -> RunJob:
        """The command for the front's job `handle` (its paths as text: the rank reads them)."""
        tensors = str(handle.save_tensors_path) if handle.save_tensors_path is not None else None
        return cls(
            job_number,
            handle.job_id,
            handle.request,
            str(handle.out_path),
            tensors,
            handle.submitted_at,
            replica_index,
            preview_every,
            handle.capture,
            handle.resolved,
        )


@dataclass(frozen=True)
class Stop:
    """Finish: leave the process groups and exit with code 0."""


@dataclass(frozen=True)
class Prepare:
    job: RunJob


@dataclass(frozen=True)
class Encode:
    job: RunJob
    skeleton: Any  # the prepared request without its tensors


@dataclass(frozen=True)
class Denoise:
    job: RunJob
    skeleton: Any
    frame_shares: tuple[tuple[int, int], ...]  # the latent frames each VAE rank reads (rank 0 gets them all)


@dataclass(frozen=True)
class Decode:
    job: RunJob
    geometry: Geometry
    latent_shape: tuple[int, ...]  # the video latents [1, C, T, h, w]
    frame_shares: tuple[tuple[int, int], ...]
    timings: dict[str, float]  # the earlier stages'
    step_cache: dict[str, Any] | None = None  # the denoise stage's step-cache record (None: cache "off")


JobCommand = RunJob | Prepare | Encode | Denoise | Decode


def job_of(command: JobCommand) -> RunJob:
    """The job a command works on."""
    return command if isinstance(command, RunJob) else command.job


# --- reports ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReady:
    rank: int
    facts: (
        CheckpointFacts | None
    )  # the rank that prepares requests only (rank 0, of the VAE group when split)


@dataclass(frozen=True)
class RankFailed:
    """The rank is about to exit: it could not start (job_number None) or it failed during a job.

    kind "checkpoint": an H3Error whose message names the file, key or flag; "internal": `message` is the error's
    type only (the traceback is in the rank's log on stderr), or a `RankOutOfMemory`'s sentence; "channel": the
    error's type, for a tensor channel whose other end died or was closed (the echo of another group's failure,
    h3engine.runtime.split).
    """

    rank: int
    job_number: int | None
    kind: Literal["checkpoint", "internal", "channel"]
    message: str


class RankOutOfMemory(Exception):
    """A rank of a group of several ran out of GPU memory during a job; the message says the budget and what to
    change (the group restarts: its partners may be waiting in a collective)."""


@dataclass(frozen=True)
class StageDone:
    """A stage group's rank 0 finished its part of a job (the job's end comes as JobFinished / JobFailed)."""

    job_id: str
    stage: str  # "prepare", "encode", "denoise", "decode" (just before the job's end)
    timings: dict[str, float] = field(default_factory=dict)
    skeleton: Any = None  # prepare: the prepared request without its tensors
    latent_shape: tuple[int, ...] = ()
    frame_shares: tuple[tuple[int, int], ...] = ()
    # time.monotonic() (one clock for every process of the machine) when the rank took the command and when it
    # was done: what the pipelining of consecutive jobs is judged by.
    started_at: float = 0.0
    ended_at: float = 0.0
    sent_bytes: int = 0  # what rank 0 handed to the next groups for this step (every consumer rank counted)
    step_cache: dict[str, Any] | None = None  # denoise: the step cache's record (None: cache "off")
    # `generate --capture`: the entries this step recorded (trace.stage_capture), for the index the front writes.
    captured: list[dict[str, Any]] = field(default_factory=list)
