"""One rank of a split stage group (`--stage-layout split`): the text encoder, the DiT or the VAE group.

`stage_main(rank, spec, commands, messages, cancel_job, ends)` is the spawn target (h3engine.runtime.split starts
the groups, each its own world): the rank builds an `Engine` that loads only its stage's share (`StageLoader`),
attaches its ends of the tensor channels (h3engine.runtime.channel) and serves commands in arrival order:
* VAE group, `Prepare`: rank 0 validates, reads the inputs and encodes the conditioning; the presentation goes to
  every encoder rank, the rest of the prepared request to every DiT rank (shared memory: CPU data). `Decode`: every
  rank receives its frame share of the final latents (rank 0 all of them), decodes its tiles; rank 0 writes.
* encoder group, `Encode`: every rank encodes the presentation; rank 0 sends the text states to every DiT rank.
* DiT group, `Denoise`: every rank receives its inputs and denoises; rank 0 reports the steps and sends the final
  latents to the VAE ranks. The front sees skeletons (`detach_tensors`), timings and outcomes only.

Danger: a consumer takes its job's send by job number and drops older ones (jobs that ended between stages), so
each group must get its commands in job order. A failure other than the request's or a cancel ends the rank
(`RankFailed`), as in h3engine.runtime.rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch
import torch.distributed as dist

from h3engine.checkpoint.layout import detect_layout
from h3engine.engine import Engine
from h3engine.engine_options import resolve_dtype
from h3engine.errors import GenerationCancelled, H3Error
from h3engine.geometry import Geometry
from h3engine.media.outputs import OutputFiles, input_records, staged
from h3engine.memory.engine_plan import MemoryRequest
from h3engine.parallel import groups as parallel_groups
from h3engine.parallel.collectives import all_reduce_sum
from h3engine.parallel.vae import latent_frame_shares
from h3engine.pipeline import (
    DenoisedLatents,
    Mp4WriteError,
    decode_on_group,
    denoise_encoded,
    encode_text,
    write_outputs,
)
from h3engine.runtime.channel import (
    ChannelClosed,
    ChannelConsumer,
    ChannelPeerGone,
    ChannelProducer,
    TensorChannel,
)
from h3engine.runtime.checks import CheckpointFacts
from h3engine.runtime.front import CANCELLED_MESSAGE, ENGINE_FAILURE_MESSAGE, release_memory, settle_heap
from h3engine.runtime.messages import JobFailed, job_finished, job_started, step_reporter
from h3engine.runtime.rank import (
    COLLECTIVE_TIMEOUT,
    EXIT_JOB_FAILED,
    EXIT_START_FAILED,
    Outbox,
    RankFailed,
    RankGroups,
    RankReady,
    RunJob,
    ShardedLoader,
    Stop,
    _fail_and_exit,
    _report_output_failure,
    begin_rank_process,
)

logger = logging.getLogger(__name__)

Stage = Literal["encoder", "dit", "vae"]
# The channels between the groups, by what they carry: producer stage -> consumer stage.
CHANNEL_ROUTES: dict[str, tuple[Stage, Stage]] = {
    "presentation": ("vae", "encoder"),
    "prepared": ("vae", "dit"),
    "text": ("encoder", "dit"),
    "latents": ("dit", "vae"),
}
# What travels as CPU data (the prepared request is CPU tensors): shared memory even between GPU groups.
CPU_ROUTES = ("presentation", "prepared")
PRESENTATION_PREFIX = "presentation."


# --- specs, commands, reports ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageSpec:
    """Everything a rank of one stage group needs; the layout was validated against the checkpoint by the front."""

    stage: Stage
    checkpoint: str
    devices: tuple[str, ...]
    dtype: str | None
    layout: parallel_groups.ParallelLayout | parallel_groups.EncoderLayout | parallel_groups.VAELayout
    cpu_threads: (
        int  # per rank: on the CPU what a colocated rank would use; on GPUs the cores over all processes
    )
    init_method: str = ""
    memory: MemoryRequest = field(default_factory=MemoryRequest)

    @property
    def world_size(self) -> int:
        return len(self.devices)


@dataclass
class StageEnds:
    """The channels one rank uses: those it receives from by route, those it sends into (one per consumer rank)."""

    receive: dict[str, TensorChannel] = field(default_factory=dict)
    send: dict[str, list[TensorChannel]] = field(default_factory=dict)


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


@dataclass(frozen=True)
class StageDone:
    """A group's rank 0 finished its part of a job (the job's end comes as JobFinished / JobFailed)."""

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


# --- tensors out of and back into a prepared request ----------------------------------------------------------


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor was in a skeleton; `attach_tensors` puts it back by `name`."""

    name: str


def detach_tensors(value: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """`value` with every tensor (in dataclasses, tuples, lists and dicts) replaced by a `TensorSlot`, and the
    tensors by their dotted path: the skeleton pickles small, the tensors travel through a channel."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(item: Any, where: str) -> Any:
        if isinstance(item, torch.Tensor):
            tensors[where] = item
            return TensorSlot(where)
        return _rebuild(item, where, walk)

    return walk(value, path), tensors


def attach_tensors(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The skeleton with its slots filled from `tensors`; a slot with no tensor stays a `TensorSlot`."""

    def walk(item: Any, where: str) -> Any:
        if isinstance(item, TensorSlot):
            return tensors.get(item.name, item)
        return _rebuild(item, where, walk)

    return walk(skeleton, "")


def _rebuild(item: Any, where: str, walk: Callable[[Any, str], Any]) -> Any:
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        rebuilt = copy.copy(item)  # no __init__: frozen and validating dataclasses are rebuilt as they are
        for name, value in vars(item).items():
            object.__setattr__(rebuilt, name, walk(value, f"{where}.{name}".lstrip(".")))
        return rebuilt
    if isinstance(item, (tuple, list)):
        return type(item)(walk(value, f"{where}.{index}".lstrip(".")) for index, value in enumerate(item))
    if isinstance(item, dict):
        return {key: walk(value, f"{where}.{key}".lstrip(".")) for key, value in item.items()}
    return item


def receive_job(consumer: ChannelConsumer, job_number: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This job's tensors from `consumer`, copied onto `device` (the slot is released at once); sends of earlier
    jobs, which ended between stages, are dropped."""
    while True:
        tag, tensors = consumer.receive(timeout=math.inf)
        if tag == job_number:
            copies = {name: tensor.to(device, copy=True) for name, tensor in tensors.items()}
            if device.type == "cuda" and any(tensor.device != device for tensor in tensors.values()):
                # A copy from another GPU runs on this device's stream, which the release's event does not cover.
                torch.cuda.current_stream(device).synchronize()
            consumer.release(tag)
            return copies
        consumer.release(tag)
        if tag > job_number:
            raise RuntimeError(f"{consumer._channel.describe}: job {tag} arrived before job {job_number}")


# --- this rank's models ---------------------------------------------------------------------------------------


class AbsentComponent(torch.nn.Module):
    """A component another stage group holds: only its config (the DiT's patch and channels) is here."""

    def __init__(self, config: Any = None) -> None:
        super().__init__()
        self.config = config

    def verify_tokenizer(self, tokenizer: Any) -> None:
        """Checked where the text encoder lives."""


class StageLoader(ShardedLoader):
    """`ShardedLoader` for one stage: the stage's own shares; the others absent (the VAE group's DiT config)."""

    def __init__(self, stage: Stage, groups: RankGroups) -> None:
        super().__init__(groups)
        self.stage = stage

    def text_encoder(
        self, folder: Any, device: torch.device, dtype: torch.dtype, deferred: Any = None
    ) -> Any:
        if self.stage != "encoder":
            return AbsentComponent()
        return super().text_encoder(folder, device, dtype, deferred)

    def dit(
        self, source: Any, device: torch.device, dtype: torch.dtype, deferred: Any = None
    ) -> torch.nn.Module:
        return (
            super().dit(source, device, dtype, deferred)
            if self.stage == "dit"
            else AbsentComponent(source.config)
        )


def _stage_groups(rank: int, spec: StageSpec) -> RankGroups:
    """This rank's groups in its stage's world (collective: every rank of the stage makes the same calls)."""
    alone = parallel_groups.GroupMembership.alone()
    dit = parallel_groups.DiTGroups(parallel_groups.ParallelLayout(1), 0, alone, alone)
    encoder = parallel_groups.EncoderGroups(parallel_groups.EncoderLayout(1), 0, alone)
    vae = None
    if spec.stage == "dit":
        dit = parallel_groups.create_dit_groups(spec.layout)
    elif spec.stage == "encoder":
        encoder = parallel_groups.create_encoder_groups(spec.layout)
    else:
        vae = parallel_groups.create_vae_group(spec.layout)
    return RankGroups(rank, dit, encoder, vae, parallel_groups.create_control_group(spec.world_size))


def _start(rank: int, spec: StageSpec) -> tuple[Engine, RankGroups]:
    device = torch.device(spec.devices[rank])
    torch.set_num_threads(spec.cpu_threads)
    if spec.world_size > 1:
        parallel_groups.initialize_process_group(
            rank, spec.world_size, spec.init_method, device, timeout=COLLECTIVE_TIMEOUT
        )
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    groups = _stage_groups(rank, spec)
    loader = StageLoader(spec.stage, groups)
    dtype = resolve_dtype(spec.dtype, device)
    # A stage rank plans as if it held every model whole: an overestimate, its stage's models being its only load.
    engine = Engine(detect_layout(spec.checkpoint), device, dtype, spec.memory, loader=loader)
    return engine, groups


# --- serving --------------------------------------------------------------------------------------------------


@dataclass
class StageRank:
    """One rank's engine, groups, channel ends and the reports it owes the front."""

    spec: StageSpec
    engine: Engine
    groups: RankGroups
    outbox: Outbox
    cancel_job: Any
    consumers: dict[str, ChannelConsumer]
    producers: dict[str, list[ChannelProducer]]
    # VAE rank 0: the input records of each prepared job (hashed before generating), until its decode.
    inputs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    command_started: float = 0.0
    command_sent_bytes: int = 0

    def report(self, job: RunJob, stage: str, timings: dict[str, float], **details: Any) -> None:
        """Rank 0's `StageDone` for the command being served."""
        started, ended, sent = self.command_started, time.monotonic(), self.command_sent_bytes
        self.outbox.post(
            StageDone(
                job.job_id, stage, timings, started_at=started, ended_at=ended, sent_bytes=sent, **details
            )
        )

    @property
    def rank(self) -> int:
        return self.groups.rank

    def cancelled(self, job: RunJob) -> Callable[[], bool]:
        """`should_cancel` agreed by the whole group (a vote over its control group; a group of one asks itself)."""

        def should_cancel() -> bool:
            votes = torch.tensor([int(self.cancel_job.value == job.job_number)])
            return bool(all_reduce_sum(votes, self.groups.control).item())

        return should_cancel

    def send(self, route: str, tensors: Mapping[str, torch.Tensor], job: RunJob) -> float:
        """Every consumer rank of `route` gets `tensors`; the seconds it took."""
        started = time.perf_counter()
        for producer in self.producers[route]:
            producer.send(tensors, tag=job.job_number, timeout=math.inf)
        self.command_sent_bytes += len(self.producers[route]) * sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
        return time.perf_counter() - started

    def serve(self, command: Prepare | Encode | Denoise | Decode) -> None:
        self.command_started, self.command_sent_bytes = time.monotonic(), 0
        if isinstance(command, Prepare):
            if self.rank == 0:
                self.prepare(command.job)
        elif isinstance(command, Encode):
            self.encode(command.job, command.skeleton)
        elif isinstance(command, Denoise):
            self.denoise(command.job, command.skeleton, command.frame_shares)
        else:
            self.decode(command)

    def prepare(self, job: RunJob) -> None:
        """VAE rank 0: what rank 0 of a colocated group prepares, then handed to the encoder and DiT groups."""
        engine, request, outbox = self.engine, job.request, self.outbox
        try:
            engine.validate(request)
            outbox.post(
                job_started(job.job_id, job.replica_index, job.submitted_at, engine.geometry_for(request))
            )
            inputs = input_records(request)
            prepared = engine.prepare(request, lambda: self.cancel_job.value == job.job_number)
        except GenerationCancelled:
            outbox.post(JobFailed(job.job_id, "cancelled", CANCELLED_MESSAGE))
            return
        except H3Error as error:
            outbox.post(JobFailed(job.job_id, "request", str(error)))
            return
        except Exception:
            logger.exception("job %s could not be prepared", job.job_id)
            outbox.post(JobFailed(job.job_id, "engine", ENGINE_FAILURE_MESSAGE))
            return
        skeleton, tensors = detach_tensors(prepared)
        presentation = {name: t for name, t in tensors.items() if name.startswith(PRESENTATION_PREFIX)}
        # The DiT reads the row tags of the presentation, not its tokens or pixels.
        for_dit = {
            name: tensor
            for name, tensor in tensors.items()
            if name not in presentation or name == "presentation.row_tags"
        }
        handoff_s = self.send("presentation", presentation, job) + self.send("prepared", for_dit, job)
        geometry = prepared.geometry
        models = engine.store.models_for_task(request.task)
        latent_shape = (
            1,
            models.dit.config.video_in_channels,
            geometry.latent_frames,
            geometry.latent_h,
            geometry.latent_w,
        )
        shares = latent_frame_shares(models.video_vae, torch.Size(latent_shape), self.spec.world_size)
        self.inputs = {
            number: records for number, records in self.inputs.items() if number > job.job_number - 8
        }
        self.inputs[job.job_number] = inputs
        timings = {"handoff_prepare_s": handoff_s}
        self.report(
            job, "prepare", timings, skeleton=skeleton, latent_shape=latent_shape, frame_shares=tuple(shares)
        )

    def encode(self, job: RunJob, skeleton: Any) -> None:
        """Every encoder rank encodes (tensor-parallel); rank 0 hands the states to every DiT rank."""
        started = time.perf_counter()
        received = receive_job(self.consumers["presentation"], job.job_number, torch.device("cpu"))
        handoff_s = time.perf_counter() - started
        prepared = attach_tensors(skeleton, received)
        models = self.engine.store.models_for_task(job.request.task)
        with torch.inference_mode():
            text_states, text_encode_s = encode_text(models, prepared.presentation, self.engine.device)
        if self.rank == 0:
            handoff_s += self.send("text", {"text_states": text_states}, job)
            timings = {"text_encode_s": text_encode_s, "handoff_encode_s": handoff_s}
            self.report(job, "encode", timings)

    def denoise(self, job: RunJob, skeleton: Any, frame_shares: tuple[tuple[int, int], ...]) -> None:
        """Every DiT rank denoises the request; rank 0 reports the steps and hands the latents to the VAE ranks."""
        started = time.perf_counter()
        received = receive_job(self.consumers["prepared"], job.job_number, torch.device("cpu"))
        text_states = receive_job(self.consumers["text"], job.job_number, self.engine.device)["text_states"]
        handoff_s = time.perf_counter() - started
        prepared = attach_tensors(skeleton, received)
        models = self.engine.models_for(job.request)
        on_step = None
        if self.rank == 0:
            on_step = step_reporter(job.job_id, prepared.geometry, job.preview_every, self.outbox.offer)
        try:
            with torch.inference_mode():
                latents = denoise_encoded(
                    models, prepared, text_states, self.engine.device, on_step, self.cancelled(job)
                )
        except GenerationCancelled:
            if self.rank == 0:
                self.outbox.post(JobFailed(job.job_id, "cancelled", CANCELLED_MESSAGE))
            return
        if self.rank != 0:
            return
        video, audio = latents.video_latents, latents.audio_latents
        started = time.perf_counter()
        for vae_rank, producer in enumerate(self.producers["latents"]):
            start, stop = frame_shares[vae_rank]
            share = {"video": video, "audio": audio} if vae_rank == 0 else {"video": video[:, :, start:stop]}
            producer.send(share, tag=job.job_number, timeout=math.inf)
            self.command_sent_bytes += sum(
                tensor.numel() * tensor.element_size() for tensor in share.values()
            )
        handoff_s += time.perf_counter() - started
        timings = {**latents.timings, "handoff_denoise_s": handoff_s}
        self.report(job, "denoise", timings)

    def decode(self, command: Decode) -> None:
        """Every VAE rank decodes its tiles of the job's latents; rank 0 writes the files and reports the end."""
        job = command.job
        received = receive_job(self.consumers["latents"], job.job_number, self.engine.device)
        video = received["video"]
        if self.rank != 0:
            # Only this rank's frames came: the others are never read by its tiles.
            start, stop = command.frame_shares[self.rank]
            full = torch.zeros(command.latent_shape, dtype=video.dtype, device=video.device)
            full[:, :, start:stop] = video
            video = full
        models = self.engine.store.models_for_task(job.request.task)
        vae = self.groups.vae
        files = OutputFiles.beside(job.out_path, job.save_tensors_path)
        with staged(files) if self.rank == 0 else contextlib.nullcontext() as staging:
            mp4_written = vae.size == 1
            try:
                if vae.size > 1 and self.cancelled(job)():
                    raise GenerationCancelled("generation cancelled")
                with torch.inference_mode():
                    decoded = decode_on_group(
                        models,
                        video,
                        received.get("audio"),
                        vae,
                        staging.files.video if mp4_written else None,
                        lambda: self.cancel_job.value == job.job_number,
                    )
            except GenerationCancelled:
                if self.rank == 0:
                    self.outbox.post(JobFailed(job.job_id, "cancelled", CANCELLED_MESSAGE))
                return
            except Mp4WriteError as error:
                _report_output_failure(job, error.__cause__ or error, self.outbox)
                return
            if decoded is None:
                return
            try:
                output = DenoisedLatents(video, received["audio"], dict(command.timings)).output(*decoded)
                record = self.engine.record(job.request)
                inputs = self.inputs.pop(job.job_number, [])
                write_outputs(staging, job.request, inputs, output, command.geometry, record, mp4_written)
                self.report(job, "decode", {})
                self.outbox.post(job_finished(job.job_id, staging.commit()))
            except Exception as error:
                _report_output_failure(job, error, self.outbox)


# --- the process ----------------------------------------------------------------------------------------------


def _attach(ends: StageEnds) -> tuple[dict[str, ChannelConsumer], dict[str, list[ChannelProducer]]]:
    consumers = {route: channel.consumer() for route, channel in ends.receive.items()}
    producers = {route: [channel.producer() for channel in channels] for route, channels in ends.send.items()}
    return consumers, producers


def _close(consumers: dict[str, ChannelConsumer], producers: dict[str, list[ChannelProducer]]) -> None:
    """Consumers first (a producer waits until its consumer let go before it frees its buffers)."""
    for consumer in consumers.values():
        consumer.close()
    for channels in producers.values():
        for producer in channels:
            producer.close()


def stage_main(
    rank: int, spec: StageSpec, commands: Connection, messages: Connection, cancel_job: Any, ends: StageEnds
) -> None:
    """The spawn target of one rank of a stage group: load, attach the channels, serve commands until `Stop`."""
    outbox = begin_rank_process(messages, f"{spec.stage} rank {rank}")
    try:
        engine, groups = _start(rank, spec)
        consumers, producers = _attach(ends)
    except H3Error as error:
        _fail_and_exit(outbox, RankFailed(rank, None, "checkpoint", str(error)), EXIT_START_FAILED)
    except Exception as error:
        logger.exception("%s rank %d could not start", spec.stage, rank)
        _fail_and_exit(outbox, RankFailed(rank, None, "internal", type(error).__name__), EXIT_START_FAILED)
    facts = CheckpointFacts.from_engine(engine) if rank == 0 and spec.stage == "vae" else None
    settle_heap()
    outbox.post(RankReady(rank, facts))
    state = StageRank(spec, engine, groups, outbox, cancel_job, consumers, producers)
    while True:
        try:
            command = commands.recv()
        except EOFError:
            break
        if isinstance(command, Stop):
            break
        try:
            state.serve(command)
        except Exception as error:
            logger.exception("%s rank %d failed during job %s", spec.stage, rank, command.job.job_id)
            kind = "channel" if isinstance(error, (ChannelPeerGone, ChannelClosed)) else "internal"
            report = RankFailed(rank, command.job.job_number, kind, type(error).__name__)
            _fail_and_exit(outbox, report, EXIT_JOB_FAILED)
        finally:
            release_memory(engine.device)
    _close(consumers, producers)
    if dist.is_initialized():
        dist.destroy_process_group()
    outbox.close()
