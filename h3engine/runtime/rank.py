"""One rank of a worker group: a process that holds its share of every model and serves jobs until told to stop.

`rank_main(rank, spec, commands, messages, cancel_job)` is the process target of h3engine.runtime.workers: it joins
the group's world, builds its `Engine` with a `ShardedLoader` and serves `RunJob` commands (`WorkerRank.serve`)
until `Stop` (h3engine.runtime.rank_process). Only rank 0 reports on jobs.

Failure: a bad request and a cancel are agreed by all ranks and end only the job; anything else raised during a job
leaves the ranks out of step, so the rank reports `RankFailed` and exits (the front starts a new group); see
h3engine.runtime.rank_jobs, whose steps this rank shares with the split layout's stage ranks.

Danger: every rank must make the same collective calls in the same order. The only branches on the rank are
around work without collectives (preparing, writing, reporting); each decision that changes the path (a bad
request, a cancel) is taken once and shared before anyone acts on it.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from h3engine.checkpoint.loader import ComponentSource
from h3engine.checkpoint.safetensors_io import DeferredReads
from h3engine.checkpoint.text_encoder_files import open_text_encoder_files
from h3engine.engine import trace
from h3engine.engine.model_store import ModelLoader
from h3engine.memory.sizes import RankShare
from h3engine.models.parallel.dit import load_dit_shard
from h3engine.models.parallel.groups import (
    create_control_group,
    create_dit_groups,
    create_encoder_groups,
    create_vae_group,
)
from h3engine.models.parallel.text_encoder import load_text_encoder_shard
from h3engine.models.parallel.vae import AUDIO_DECODE_RANK
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.runtime.job_protocol import RunJob, WorkerSpec
from h3engine.runtime.rank_jobs import JobRank, RankGroups
from h3engine.runtime.rank_process import Outbox, join_world, rank_engine, run_rank


def worker_groups(rank: int, spec: WorkerSpec) -> RankGroups:
    """This rank's place in every group of the worker group (collective over the world: the same calls in the same
    order on every rank)."""
    return RankGroups(
        rank,
        dit=create_dit_groups(spec.dit_layout),
        encoder=create_encoder_groups(spec.encoder_layout),
        vae=create_vae_group(spec.vae_layout),
        control=create_control_group(spec.world_size),
    )


class ShardedLoader(ModelLoader):
    """Builds this rank's share of each component for its `Engine` (see `rank_main`).

    The engine's requests-side methods (validate, prepare) are only called on rank 0, which holds both VAEs. A
    layout of one (no split) loads the component whole, as the single-process engine does, which also keeps the
    diffusers layout usable there.
    """

    def __init__(self, groups: RankGroups) -> None:
        self.groups = groups

    def text_encoder(
        self,
        folder: Path,
        device: torch.device,
        dtype: torch.dtype,
        deferred: DeferredReads | None = None,
        weights: Path | None = None,
    ) -> H3TextEncoder:
        if self.groups.encoder.tp.size == 1:
            return super().text_encoder(folder, device, dtype, deferred, weights)
        config, weight_files = open_text_encoder_files(folder, weights)
        return load_text_encoder_shard(weight_files, config, self.groups.encoder, dtype, device, deferred)

    def text_encoder_skeleton(self, folder: Path, weights: Path | None = None) -> H3TextEncoder:
        if self.groups.encoder.tp.size == 1:
            return super().text_encoder_skeleton(folder, weights)
        # Tensor-parallel ranks read a community file's quantized linears dequantized (`text_encoder`).
        return H3TextEncoder(open_text_encoder_files(folder, weights)[0])

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


class WorkerRank(JobRank):
    """A rank of a worker group: every job runs on all of its ranks, from preparing to writing."""

    def serve(self, job: RunJob) -> None:
        """Run one job on this rank; raises only on a failure that breaks the group.

        1. Rank 0 prepares the request (`JobRank.prepare`). The outcome, a `PreparedRequest` or None when rank 0 has
           already reported the job as ended, is broadcast over the control group: every rank runs the job with
           identical inputs, or none runs it.
        2. Every rank denoises (`JobRank.denoise`); text states and velocities move between ranks inside the sharded
           models' collectives. The ranks vote on cancelling before each step, so all of them stop before the same
           step and none is left in a collective.
        3. The VAE group decodes and its rank 0 writes the files and sends the job's end (`JobRank.finish`).
        """
        prepared, inputs = None, []
        if self.rank == 0 and (outcome := self.prepare(job)) is not None:
            prepared, inputs = outcome
        if self.groups.control.size > 1:
            shared = [prepared]
            dist.broadcast_object_list(shared, src=0, group=self.groups.control.process_group)
            prepared = shared[0]
        if prepared is None:
            return
        with trace.group_capture(self.rank, job.request, job.capture):  # `generate --capture`: rank 0 records
            denoised = self.denoise(job, prepared)
            if denoised is not None and self.groups.vae is not None:
                models, latents = denoised
                self.finish(job, models, latents, prepared.geometry, inputs)


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


def rank_main(
    rank: int, spec: WorkerSpec, commands: Connection, messages: Connection, cancel_job: Any
) -> None:
    """The process target of one rank: join the group, load this rank's shares, serve jobs until `Stop`.

    The front talks to the rank through two one-way pipes (`commands` in, `messages` out) and one shared integer
    (`cancel_job`). The rank joins the world (gloo on the CPU, NCCL on GPUs), creates every process group
    (`worker_groups`), loads its shards of the DiT and the text encoder (the video VAE on VAE-group ranks, the
    audio VAE on rank 0), says `RankReady` and serves commands in arrival order. It also exits as soon as the
    process that started it is gone.
    """

    def start(outbox: Outbox) -> WorkerRank:
        # The ranks of a CPU group share the machine's cores.
        on_cpu = torch.device(spec.devices[rank]).type == "cpu"
        device = join_world(rank, spec, max(1, (os.cpu_count() or 1) // spec.world_size) if on_cpu else None)
        groups = worker_groups(rank, spec)
        engine = rank_engine(spec, device, ShardedLoader(groups), rank_share(spec, rank))
        return WorkerRank(engine, groups, outbox, cancel_job)

    run_rank(rank, f"rank {rank}", commands, messages, start)
