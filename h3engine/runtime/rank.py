"""One rank of a worker group: a process that holds its share of every model and serves jobs until told to stop.

`rank_main(rank, spec, commands, messages, cancel_job)` is the spawn target of h3engine.runtime.workers: it joins
the group's world, builds its `Engine` with a `ShardedLoader` and serves `RunJob` commands (`serve_job`) until
`Stop`. Only rank 0 reports on jobs, through an `Outbox` that never makes the denoising loop wait.

Failure: a bad request and a cancel are agreed by all ranks and end only the job; anything else raised during a job
leaves the ranks out of step, so the rank reports `RankFailed` and exits (the front starts a new group).

Danger: every rank must make the same collective calls in the same order. The only branches on the rank are
around work without collectives (preparing, writing, reporting); each decision that changes the path (a bad
request, a cancel) is taken once and shared before anyone acts on it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import ComponentSource
from h3engine.checkpoint.safetensors_io import DeferredReads
from h3engine.checkpoint.text_encoder_files import open_text_encoder_files
from h3engine.engine import Engine
from h3engine.engine_options import resolve_dtype
from h3engine.errors import GenerationCancelled, H3Error
from h3engine.media.outputs import OutputFiles, input_records, staged
from h3engine.memory.engine_plan import MemoryRequest
from h3engine.memory.sizes import RankShare
from h3engine.model_store import ModelLoader
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.parallel.collectives import all_reduce_sum
from h3engine.parallel.dit import load_dit_shard
from h3engine.parallel.groups import (
    DiTGroups,
    EncoderGroups,
    EncoderLayout,
    GroupMembership,
    ParallelLayout,
    VAELayout,
    create_control_group,
    create_dit_groups,
    create_encoder_groups,
    create_vae_group,
    initialize_process_group,
)
from h3engine.parallel.text_encoder import load_text_encoder_shard
from h3engine.parallel.vae import AUDIO_DECODE_RANK
from h3engine.pipeline import (
    Mp4WriteError,
    PreparedRequest,
    decode_on_group,
    denoise_request,
    write_outputs,
)
from h3engine.request import GenerationRequest
from h3engine.runtime.checks import CheckpointFacts
from h3engine.runtime.front import (
    CANCELLED_MESSAGE,
    ENGINE_FAILURE_MESSAGE,
    EVENT_BUFFER_SIZE,
    JobHandle,
    output_failure_message,
    release_memory,
    settle_heap,
)
from h3engine.runtime.messages import JobFailed, job_finished, job_started, step_reporter

logger = logging.getLogger(__name__)

# Long enough for the slowest collective partner at the released size (rank 0 stitching the decoded video while
# the others wait in the next job's broadcast); a hung rank is the front's to detect, not this timeout's.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# `cancel_job` holds this when no job is to be cancelled (job numbers start at 0).
NO_JOB = -1
EXIT_START_FAILED = 2
EXIT_JOB_FAILED = 1
EXIT_PARENT_GONE = 3
OUTBOX_FLUSH_TIMEOUT_S = 5.0


# --- what the front and a rank say to each other (all picklable) -------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start; the layouts were validated against the checkpoint by the front."""

    checkpoint: str
    devices: tuple[str, ...]  # rank r computes on devices[r]
    dtype: str | None
    dit_layout: ParallelLayout
    encoder_layout: EncoderLayout
    vae_layout: VAELayout
    init_method: str  # the rendezvous of this incarnation of the group
    # The memory flags: every rank plans for its own share of the models under them (`rank_share`).
    memory: MemoryRequest = field(default_factory=MemoryRequest)

    @property
    def world_size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class RunJob:
    job_number: int  # unique within the replica; what `cancel_job` refers to
    job_id: str
    request: GenerationRequest
    out_path: str
    save_tensors_path: str | None
    submitted_at: float  # time.monotonic() of the submit, for JobStarted.queue_wait_s
    replica_index: int
    preview_every: int

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
        )


@dataclass(frozen=True)
class Stop:
    """Finish: leave the process groups and exit with code 0."""


@dataclass(frozen=True)
class RankReady:
    rank: int
    facts: CheckpointFacts | None  # rank 0 only


@dataclass(frozen=True)
class RankFailed:
    """The rank is about to exit: it could not start (job_number None) or it failed during a job.

    kind "checkpoint": an H3Error whose message names the file, key or flag; "internal": `message` is the error's
    type only (the traceback is in the rank's log on stderr); "channel": the same, for a tensor channel whose other
    end died or was closed (the echo of another group's failure, h3engine.runtime.split).
    """

    rank: int
    job_number: int | None
    kind: Literal["checkpoint", "internal", "channel"]
    message: str


class RankOutOfMemory(Exception):
    """A rank of a group of several ran out of GPU memory during a job; the message says the budget and what to
    change (the group restarts: its partners may be waiting in a collective)."""


# --- this rank's groups and engine --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankGroups:
    """This rank's place in every group of the worker group; `vae` is None when it sits the decode out."""

    rank: int
    dit: DiTGroups
    encoder: EncoderGroups
    vae: GroupMembership | None
    control: GroupMembership

    @classmethod
    def create(cls, rank: int, spec: WorkerSpec) -> RankGroups:
        # Collective over the world: the same calls in the same order on every rank.
        return cls(
            rank,
            dit=create_dit_groups(spec.dit_layout),
            encoder=create_encoder_groups(spec.encoder_layout),
            vae=create_vae_group(spec.vae_layout),
            control=create_control_group(spec.world_size),
        )

    @property
    def hosts_audio_vae(self) -> bool:
        return self.vae is not None and self.vae.rank == AUDIO_DECODE_RANK


class ShardedLoader(ModelLoader):
    """Builds this rank's share of each component for its `Engine` (see `rank_main`).

    The engine's requests-side methods (validate, prepare) are only called on rank 0, which holds both VAEs. A
    layout of one (no split) loads the component whole, as the single-process engine does, which also keeps the
    diffusers layout usable there.
    """

    def __init__(self, groups: RankGroups) -> None:
        self.groups = groups

    def text_encoder(
        self, folder: Path, device: torch.device, dtype: torch.dtype, deferred: DeferredReads | None = None
    ) -> H3TextEncoder:
        if self.groups.encoder.tp.size == 1:
            return super().text_encoder(folder, device, dtype, deferred)
        config, weight_files = open_text_encoder_files(folder)
        return load_text_encoder_shard(weight_files, config, self.groups.encoder, dtype, device, deferred)

    def dit(
        self,
        source: ComponentSource,
        device: torch.device,
        dtype: torch.dtype,
        deferred: DeferredReads | None = None,
    ) -> torch.nn.Module:
        if self.groups.dit.sp.size == 1 and self.groups.dit.tp.size == 1:
            return super().dit(source, device, dtype, deferred)
        return load_dit_shard(source.files, source.config, self.groups.dit, dtype, device, deferred)

    def video_vae(
        self, source: ComponentSource, device: torch.device, deferred: DeferredReads | None = None
    ) -> torch.nn.Module | None:
        return super().video_vae(source, device, deferred) if self.groups.vae is not None else None

    def audio_vae(
        self, source: ComponentSource, device: torch.device, deferred: DeferredReads | None = None
    ) -> torch.nn.Module | None:
        return super().audio_vae(source, device, deferred) if self.groups.hosts_audio_vae else None


# --- messages to the front ----------------------------------------------------------------------------------------


class Outbox:
    """Messages to the front, sent by a background thread that owns the pipe, so that posting never blocks.

    `offer` drops the message when `EVENT_BUFFER_SIZE` are already waiting (progress and previews: the newest state
    wins later); `post` always queues (starts, outcomes, reports). `close` sends what is queued (up to a timeout)
    and stops the thread.
    """

    _CLOSE = object()

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._send_loop, name="h3-outbox", daemon=True)
        self._thread.start()

    def offer(self, message: Any) -> None:
        if self._queue.qsize() < EVENT_BUFFER_SIZE:
            self._queue.put(message)

    def post(self, message: Any) -> None:
        self._queue.put(message)

    def close(self, timeout: float = OUTBOX_FLUSH_TIMEOUT_S) -> None:
        self._queue.put(self._CLOSE)
        self._thread.join(timeout)

    def _send_loop(self) -> None:
        while (message := self._queue.get()) is not self._CLOSE:
            try:
                self._connection.send(message)
            except OSError:
                return  # the front is gone; the parent watch ends this process


def _exit_with_parent() -> None:
    """End this process as soon as the one that spawned it is gone (killed or crashed without cleaning up)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="h3-parent-watch", daemon=True).start()


# --- one job ------------------------------------------------------------------------------------------------------


def _prepare_on_first_rank(
    engine: Engine, groups: RankGroups, job: RunJob, outbox: Outbox, cancel_job: Any
) -> tuple[PreparedRequest | None, list[dict[str, Any]]]:
    """Rank 0 prepares the request and every rank receives the result; None (everywhere) ends the job here."""
    prepared, inputs = None, []
    if groups.rank == 0:
        request = job.request
        try:
            engine.validate(request)
            geometry = engine.geometry_for(request)
            outbox.post(job_started(job.job_id, job.replica_index, job.submitted_at, geometry))
            # Hashed before generating, so the sidecar names the bytes the conditioning was read from.
            inputs = input_records(request)
            prepared = engine.prepare(request, _own_cancel_check(cancel_job, job.job_number))
        except GenerationCancelled:
            outbox.post(JobFailed(job.job_id, "cancelled", CANCELLED_MESSAGE))
        except H3Error as error:
            outbox.post(JobFailed(job.job_id, "request", str(error)))
        except Exception:
            logger.exception("job %s could not be prepared", job.job_id)
            outbox.post(JobFailed(job.job_id, "engine", ENGINE_FAILURE_MESSAGE))
    if groups.control.size > 1:
        shared = [prepared]
        dist.broadcast_object_list(shared, src=0, group=groups.control.process_group)
        prepared = shared[0]
    return prepared, inputs


def _own_cancel_check(cancel_job: Any, job_number: int) -> Callable[[], bool]:
    """`should_cancel` for work one rank does alone (rank 0's preparation, a VAE group of one's decode)."""
    return lambda: cancel_job.value == job_number


def _cancel_vote(groups: RankGroups, cancel_job: Any, job_number: int) -> Callable[[], bool]:
    """`should_cancel` for every rank: true on all of them when any of them saw this job's number."""

    def should_cancel() -> bool:
        votes = torch.tensor([int(cancel_job.value == job_number)])
        return bool(all_reduce_sum(votes, groups.control).item())

    return should_cancel


def serve_job(engine: Engine, groups: RankGroups, job: RunJob, outbox: Outbox, cancel_job: Any) -> None:
    """Run one job on this rank; raises only on a failure that breaks the group.

    1. Rank 0 validates the request, announces `JobStarted`, hashes the input files and prepares the request (reads
       the files, builds the text encoder's input, encodes the conditioning with its VAEs). The outcome, a
       `PreparedRequest` or None when rank 0 has already reported the request as failed, is broadcast over the
       control group: every rank runs the job with identical inputs, or none runs it.
    2. Every rank denoises; text states and velocities move between ranks inside the sharded models' collectives.
       Before each step the ranks vote on cancelling (rank r says yes when `cancel_job` holds this job's number; a
       sum over the control group), so all of them stop before the same step and none is left in a collective.
    3. The ranks vote once more after the last step; the VAE group decodes (tiles split over its ranks, the audio
       on rank 0; a VAE group of one checks its own cancel slot between windows); rank 0 writes the MP4, the
       tensors and the sidecar into staging files (`pipeline.write_outputs`), commits them together and sends the
       terminal message.
    """
    prepared, inputs = _prepare_on_first_rank(engine, groups, job, outbox, cancel_job)
    if prepared is None:
        return
    request = job.request
    models = engine.models_for(request)  # every rank applies the request's LoRAs (its slice of them)
    on_step = None
    if groups.rank == 0:
        on_step = step_reporter(job.job_id, prepared.geometry, job.preview_every, outbox.offer)
    # Rank 0 writes every file into staging files; they appear only when it commits them (after the sidecar).
    files = OutputFiles.beside(job.out_path, job.save_tensors_path)
    with staged(files) if groups.rank == 0 else contextlib.nullcontext() as staging:
        try:
            with torch.inference_mode():
                should_cancel = _cancel_vote(groups, cancel_job, job.job_number)
                latents = denoise_request(models, prepared, engine.device, on_step, should_cancel)
                decoded = None
                # A VAE group of one writes the MP4 while it decodes; a larger one leaves it to write_outputs.
                mp4_written = groups.vae is not None and groups.vae.size == 1
                if groups.vae is not None:
                    decoded = decode_on_group(
                        models,
                        latents.video_latents,
                        latents.audio_latents,
                        groups.vae,
                        staging.files.video if mp4_written else None,
                        _own_cancel_check(cancel_job, job.job_number),
                    )
        except GenerationCancelled:
            if groups.rank == 0:
                outbox.post(JobFailed(job.job_id, "cancelled", CANCELLED_MESSAGE))
            return
        except torch.OutOfMemoryError as error:
            if groups.control.size > 1:
                # Partners may wait in a collective this rank will never join: the group has to go.
                raise RankOutOfMemory(engine.placement.out_of_memory_message()) from error
            logger.exception("job %s ran out of GPU memory", job.job_id)
            outbox.post(JobFailed(job.job_id, "engine", engine.placement.out_of_memory_message()))
            return
        except Mp4WriteError as error:  # the file of a VAE group of one: this rank's failure alone
            _report_output_failure(job, error.__cause__ or error, outbox)
            return
        if decoded is None:
            return  # not rank 0: its part is done
        # From here on rank 0 works alone, so a failure is this job's only: it is reported, the group stays up.
        try:
            output = latents.output(*decoded)
            record = engine.record(request)
            write_outputs(staging, request, inputs, output, prepared.geometry, record, mp4_written)
            outbox.post(job_finished(job.job_id, staging.commit()))
        except Exception as error:
            _report_output_failure(job, error, outbox)


def _report_output_failure(job: RunJob, error: BaseException, outbox: Outbox) -> None:
    """A failure writing a job's files (rank 0's alone: the group stays up): a request error names its cause."""
    if isinstance(error, H3Error):
        outbox.post(JobFailed(job.job_id, "request", str(error)))
    else:
        logger.error("job %s: writing the outputs failed", job.job_id, exc_info=error)
        outbox.post(JobFailed(job.job_id, "engine", output_failure_message(error, Path(job.out_path).parent)))


# --- the process --------------------------------------------------------------------------------------------------


def _start(rank: int, spec: WorkerSpec) -> tuple[Engine, RankGroups]:
    device = torch.device(spec.devices[rank])
    if device.type == "cpu":
        # The ranks of a CPU group share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    if spec.world_size > 1:
        initialize_process_group(rank, spec.world_size, spec.init_method, device, timeout=COLLECTIVE_TIMEOUT)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    groups = RankGroups.create(rank, spec)
    dtype = resolve_dtype(spec.dtype, device)
    loader = ShardedLoader(groups)
    memory = replace(spec.memory, share=rank_share(spec, rank))
    engine = Engine(detect_layout(spec.checkpoint), device, dtype, memory, loader=loader)
    return engine, groups


def rank_share(spec: WorkerSpec, rank: int) -> RankShare:
    """What rank `rank` of the group holds (its shards of the DiT and the text encoder, which VAEs): what it plans
    its memory for."""
    return RankShare(
        dit_tp=spec.dit_layout.dit_tp,
        dit_sp=spec.dit_layout.dit_sp,
        encoder_tp=spec.encoder_layout.encoder_tp,
        holds_video_vae=rank < spec.vae_layout.vae_ranks,
        holds_audio_vae=rank == AUDIO_DECODE_RANK,
    )


def begin_rank_process(messages: Connection, label: str) -> Outbox:
    """What every rank process does first: leave Ctrl-C to the front (a terminal sends it to the whole process
    group; only the front decides when ranks stop), end with its parent, log under `label`; its outbox."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s")
    return Outbox(messages)


def _fail_and_exit(outbox: Outbox, report: RankFailed, exit_code: int) -> None:
    outbox.post(report)
    outbox.close()
    # No orderly teardown: partners may be stuck in a collective with this rank, and the process groups' shutdown
    # could wait for them. The operating system frees the memory (GPU memory included) with the process.
    os._exit(exit_code)


def rank_main(
    rank: int, spec: WorkerSpec, commands: Connection, messages: Connection, cancel_job: Any
) -> None:
    # Ctrl-C in a terminal reaches the whole process group; only the front decides when ranks stop.
    """The spawn target of one rank: join the group, load this rank's shares, serve jobs until `Stop`.

    The front talks to the rank through two one-way pipes (`commands` in, `messages` out) and one shared integer
    (`cancel_job`). The rank joins the world (gloo on the CPU, NCCL on GPUs), creates every process group
    (`RankGroups.create`), loads its shards of the DiT and the text encoder (the video VAE on VAE-group ranks, the
    audio VAE on rank 0), says `RankReady` and serves commands in arrival order. It also exits as soon as the
    process that started it is gone.
    """
    outbox = begin_rank_process(messages, f"rank {rank}")
    try:
        engine, groups = _start(rank, spec)
    except H3Error as error:
        _fail_and_exit(outbox, RankFailed(rank, None, "checkpoint", str(error)), EXIT_START_FAILED)
    except Exception as error:
        logger.exception("rank %d could not start", rank)
        _fail_and_exit(outbox, RankFailed(rank, None, "internal", type(error).__name__), EXIT_START_FAILED)
    settle_heap()
    outbox.post(RankReady(rank, CheckpointFacts.from_engine(engine) if rank == 0 else None))

    while True:
        try:
            command = commands.recv()
        except EOFError:
            break  # the front closed its end without a Stop: nothing more will come
        if isinstance(command, Stop):
            break
        try:
            serve_job(engine, groups, command, outbox, cancel_job)
        except Exception as error:
            logger.exception("rank %d failed during job %s", rank, command.job_id)
            message = str(error) if isinstance(error, RankOutOfMemory) else type(error).__name__
            _fail_and_exit(outbox, RankFailed(rank, command.job_number, "internal", message), EXIT_JOB_FAILED)
        finally:
            release_memory(engine.device)
    if dist.is_initialized():
        dist.destroy_process_group()
    outbox.close()
