"""One rank of a split stage group (`--stage-layout split`): the text encoder, the DiT or the VAE group.

`stage_main(rank, spec, commands, messages, cancel_job, ends)` is the process target (h3engine.runtime.split starts
the groups, each its own world): the rank builds an `Engine` that loads only its stage's share (`StageLoader`),
attaches its ends of the tensor channels (h3engine.runtime.channel) and serves commands in arrival order:
* VAE group, `Prepare`: rank 0 prepares (h3engine.runtime.rank_jobs, as a worker group's rank 0 does); the
  presentation goes to every encoder rank, the rest (a remix's held rows too) to every DiT rank (shared memory: CPU
  data); a remix's plan stays on rank 0. `Decode`: every rank receives its frame share of the final latents (rank 0
  all of them) and decodes its tiles; rank 0 splices a remix's sources in and writes.
* encoder group, `Encode`: every rank encodes the presentation; rank 0 sends the text states to every DiT rank.
* DiT group, `Denoise`: every rank receives its inputs and denoises; rank 0 reports the steps and sends the final
  latents to the VAE ranks. The front sees skeletons (`detach_tensors`), timings and outcomes only.

Danger: a consumer takes its job's send by job number and drops older ones (jobs that ended between stages), so
each group must get its commands in job order. Failures end a job or the rank as in h3engine.runtime.rank_jobs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.engine import trace
from h3engine.engine.conditioning.remix import RemixPlan
from h3engine.engine.pipeline import DenoisedLatents, encode_text
from h3engine.models.parallel import groups as parallel_groups
from h3engine.models.parallel.vae import latent_frame_shares
from h3engine.runtime.channel import ChannelConsumer, ChannelProducer
from h3engine.runtime.job_protocol import (
    Decode,
    Denoise,
    Encode,
    Prepare,
    RankReady,
    RunJob,
    Stage,
    StageDone,
    StageEnds,
    StageSpec,
    job_of,
)
from h3engine.runtime.rank import ShardedLoader
from h3engine.runtime.rank_jobs import JobRank, RankGroups
from h3engine.runtime.rank_process import Outbox, join_world, rank_engine, run_rank

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
# How many prepared jobs' input records VAE rank 0 keeps for their decode (the jobs in flight, with room to spare).
KEPT_INPUT_RECORDS = 8


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
        self, folder: Any, device: torch.device, dtype: torch.dtype, deferred: Any = None, weights: Any = None
    ) -> Any:
        if self.stage != "encoder":
            return AbsentComponent()
        return super().text_encoder(folder, device, dtype, deferred, weights)

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


# --- serving --------------------------------------------------------------------------------------------------


@dataclass
class StageRank(JobRank):
    """One stage rank: the shared job steps, its spec, its channel ends and the reports it owes the front."""

    spec: StageSpec
    consumers: dict[str, ChannelConsumer]
    producers: dict[str, list[ChannelProducer]]
    # VAE rank 0: the input records of each prepared job (hashed before generating), until its decode.
    inputs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    # VAE rank 0: the plan of each prepared remix (the sources its output keeps), until its decode.
    remixes: dict[int, RemixPlan] = field(default_factory=dict)
    command_started: float = 0.0
    command_sent_bytes: int = 0
    # `generate --capture`: what rank 0 recorded during the command being served (trace.stage_capture), and that
    # command's step.
    captured: list[dict[str, Any]] = field(default_factory=list)
    step: str = ""

    def ready(self) -> RankReady:
        """The VAE group's rank 0 prepares requests: it tells the front the checkpoint's facts."""
        preparing = self.rank == 0 and self.spec.stage == "vae"
        return RankReady(self.rank, CheckpointFacts.from_engine(self.engine) if preparing else None)

    def close(self) -> None:
        """Consumers first (a producer waits until its consumer let go before it frees its buffers)."""
        for consumer in self.consumers.values():
            consumer.close()
        for channels in self.producers.values():
            for producer in channels:
                producer.close()

    def report(self, job: RunJob, stage: str, timings: dict[str, float], **details: Any) -> None:
        """Rank 0's `StageDone` for the command being served."""
        started, ended, sent = self.command_started, time.monotonic(), self.command_sent_bytes
        details.setdefault("captured", list(self.captured))
        self.outbox.post(
            StageDone(
                job.job_id, stage, timings, started_at=started, ended_at=ended, sent_bytes=sent, **details
            )
        )

    def end_job(self, job: RunJob, error: Exception, during: str, alone: bool) -> None:
        """`JobRank.end_job`; with `generate --capture`, rank 0 first leaves what the step recorded for the index
        (the step sends no report, and the front writes the index once it hears of the end)."""
        if self.rank == 0 and job.capture is not None:
            trace.keep_unreported(job.capture, self.step, self.captured)
        super().end_job(job, error, during, alone)

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
        # `generate --capture`: rank 0 records what the step crosses (files "encode_000_...") for its report.
        self.step, capture = type(command).__name__.lower(), job_of(command).capture
        with trace.stage_capture(self.step, self.rank, capture) as self.captured:
            if isinstance(command, Prepare):
                if self.rank == 0:
                    self.prepare_and_hand_off(command.job)
            elif isinstance(command, Encode):
                self.encode(command.job, command.skeleton)
            elif isinstance(command, Denoise):
                self.denoise_and_hand_off(command.job, command.skeleton, command.frame_shares)
            else:
                self.decode(command)

    def prepare_and_hand_off(self, job: RunJob) -> None:
        """VAE rank 0: prepare the request (`JobRank.prepare`), then hand it to the encoder and DiT groups."""
        outcome = self.prepare(job)
        if outcome is None:
            return
        prepared, inputs = outcome
        # A remix's plan stays here for the decode (the other groups need only its held rows, in `prepared.held`):
        # the sources it keeps (an extend's frames) travel nowhere.
        remix, prepared = prepared.remix, dataclasses.replace(prepared, remix=None)
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
        models = self.engine.store.models_for_task(job.request.task)
        latent_shape = (
            1,
            models.dit.config.video_in_channels,
            geometry.latent_frames,
            geometry.latent_h,
            geometry.latent_w,
        )
        shares = latent_frame_shares(models.video_vae, torch.Size(latent_shape), self.spec.world_size)
        oldest_kept = job.job_number - KEPT_INPUT_RECORDS
        self.inputs = {number: records for number, records in self.inputs.items() if number > oldest_kept}
        self.inputs[job.job_number] = inputs
        self.remixes = {number: plan for number, plan in self.remixes.items() if number > oldest_kept}
        if remix is not None:
            self.remixes[job.job_number] = remix
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

    def denoise_and_hand_off(
        self, job: RunJob, skeleton: Any, frame_shares: tuple[tuple[int, int], ...]
    ) -> None:
        """Every DiT rank denoises the request; rank 0 reports the steps and hands the latents to the VAE ranks."""
        started = time.perf_counter()
        received = receive_job(self.consumers["prepared"], job.job_number, torch.device("cpu"))
        text_states = receive_job(self.consumers["text"], job.job_number, self.engine.device)["text_states"]
        handoff_s = time.perf_counter() - started
        prepared = attach_tensors(skeleton, received)
        denoised = self.denoise(job, prepared, text_states)
        if denoised is None or self.rank != 0:
            return
        _, latents = denoised
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
        self.report(job, "denoise", timings, step_cache=latents.step_cache)

    def decode(self, command: Decode) -> None:
        """Every VAE rank decodes its tiles of the job's latents; rank 0 writes the files and reports the end
        (`JobRank.finish`, after a vote of this group on cancelling: the DiT's votes did not include it)."""
        job = command.job
        received = receive_job(self.consumers["latents"], job.job_number, self.engine.device)
        video = received["video"]
        if self.rank != 0:
            # Only this rank's frames came: the others are never read by its tiles.
            start, stop = command.frame_shares[self.rank]
            full = torch.zeros(command.latent_shape, dtype=video.dtype, device=video.device)
            full[:, :, start:stop] = video
            video = full
        # The audio latents go to rank 0 alone, which alone decodes them (and splices a remix's sources in).
        remix = self.remixes.pop(job.job_number, None)
        # Decodes come in job order: the plan of an older job (one that ended before its decode) is dropped.
        self.remixes = {number: plan for number, plan in self.remixes.items() if number > job.job_number}
        latents = DenoisedLatents(
            video, received.get("audio"), dict(command.timings), command.step_cache, remix
        )
        models = self.engine.store.models_for_task(job.request.task)
        inputs = self.inputs.pop(job.job_number, [])
        self.finish(
            job,
            models,
            latents,
            command.geometry,
            inputs,
            vote_first=True,
            before_commit=lambda: self.report(job, "decode", {}),
        )


# --- the process ----------------------------------------------------------------------------------------------


def stage_main(
    rank: int, spec: StageSpec, commands: Connection, messages: Connection, cancel_job: Any, ends: StageEnds
) -> None:
    """The process target of one rank of a stage group: load, attach the channels, serve commands until `Stop`."""

    def start(outbox: Outbox) -> StageRank:
        device = join_world(rank, spec, spec.cpu_threads)
        groups = _stage_groups(rank, spec)
        # A stage rank plans as if it held every model whole: an overestimate, its stage's models being its only
        # load.
        engine = rank_engine(spec, device, StageLoader(spec.stage, groups))
        consumers = {route: channel.consumer() for route, channel in ends.receive.items()}
        producers = {route: [channel.producer() for channel in sends] for route, sends in ends.send.items()}
        return StageRank(engine, groups, outbox, cancel_job, spec, consumers, producers)

    run_rank(rank, f"{spec.stage} rank {rank}", commands, messages, start)
