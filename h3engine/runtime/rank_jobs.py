"""The steps of a job that worker ranks (h3engine.runtime.rank) and stage ranks (h3engine.runtime.stages) share.

`JobRank` is one rank's engine, groups, outbox and cancel slot, with the shared steps: `prepare` (rank 0 alone
validates, announces the start, hashes the inputs and prepares), `denoise` (every rank, voting on cancelling with
`cancel_vote`), `finish` (the VAE group decodes; its rank 0 writes, commits and reports the end) and `end_job`,
where every exception raised by a job's step ends up: the job's end when it is this job's alone, else raised.

Danger: every rank of a group must make the same collective calls in the same order. A step that runs collectives
(denoising, a decode over several ranks) ends the job only on what all ranks agreed on (a cancel, by vote) or what
the group survives (out of memory in a group of one); anything else is raised, and the process reports
`RankFailed` (h3engine.runtime.rank_process) so that the front restarts the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.engine.engine import Engine
from h3engine.engine.pipeline import (
    DenoisedLatents,
    Models,
    Mp4WriteError,
    PreparedRequest,
    decode_on_group,
    denoise_encoded,
    denoise_request,
    remix_output,
    write_outputs,
)
from h3engine.errors import GenerationCancelled, RequestError
from h3engine.media.outputs import OutputFiles, input_records, staged
from h3engine.models.parallel.collectives import all_reduce_sum
from h3engine.models.parallel.groups import DiTGroups, EncoderGroups, GroupMembership
from h3engine.models.parallel.vae import AUDIO_DECODE_RANK
from h3engine.request.geometry import Geometry
from h3engine.runtime.job_protocol import RankOutOfMemory, RankReady, RunJob
from h3engine.runtime.messages import job_failed, job_finished, job_started, step_reporter
from h3engine.runtime.rank_process import Outbox


@dataclass(frozen=True)
class RankGroups:
    """This rank's place in every group of its world; `vae` is None when it sits the decode out."""

    rank: int
    dit: DiTGroups
    encoder: EncoderGroups
    vae: GroupMembership | None
    # The whole world: what cancel votes and the prepared request's broadcast go over.
    control: GroupMembership

    @property
    def hosts_audio_vae(self) -> bool:
        return self.vae is not None and self.vae.rank == AUDIO_DECODE_RANK


@dataclass
class JobRank:
    """One rank's engine, groups, messages to the front and cancel slot (the job number to cancel), with the steps
    of a job that every kind of rank shares."""

    engine: Engine
    groups: RankGroups
    outbox: Outbox
    cancel_job: Any  # a shared integer (multiprocessing RawValue) the front writes

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def ready(self) -> RankReady:
        """The rank that prepares requests (rank 0) tells the front the checkpoint's facts."""
        return RankReady(self.rank, CheckpointFacts.from_engine(self.engine) if self.rank == 0 else None)

    def close(self) -> None:
        """Release what the rank holds besides its engine (nothing here)."""

    # --- cancelling ---------------------------------------------------------------------------------------------

    def own_cancel_check(self, job: RunJob) -> Callable[[], bool]:
        """`should_cancel` for work this rank does alone (rank 0's preparation, a VAE group of one's decode)."""
        return lambda: self.cancel_job.value == job.job_number

    def cancel_vote(self, job: RunJob) -> Callable[[], bool]:
        """`should_cancel` for work the whole group does: true on every rank when any of them saw this job's number
        in its slot (a sum over the control group; a group of one asks itself)."""

        def should_cancel() -> bool:
            votes = torch.tensor([int(self.cancel_job.value == job.job_number)])
            return bool(all_reduce_sum(votes, self.groups.control).item())

        return should_cancel

    # --- the steps ----------------------------------------------------------------------------------------------

    def prepare(self, job: RunJob) -> tuple[PreparedRequest, list[dict[str, Any]]] | None:
        """Rank 0 alone: validate the request, announce `JobStarted`, record the input files (hashed before
        generating, so the sidecar names the bytes the conditioning was read from) and prepare the request; None
        when the job ended here (its end is reported)."""
        engine, request = self.engine, job.request
        try:
            if request.remix is not None and request.remix.windows > 1:
                # A job is one window: the engine front runs a chained extend as a job a window.
                raise RequestError(
                    "remix.windows", "a worker group runs one window a job: submit one per window"
                )
            # Resolved at its door; the engine adds its memory check when the front knew no plan.
            resolved = engine.resolved(job.resolved or request)
            self.outbox.post(job_started(job.job_id, job.replica_index, job.submitted_at, resolved.geometry))
            inputs = input_records(request)
            return engine.prepare(resolved, self.own_cancel_check(job)), inputs
        except Exception as error:
            self.end_job(job, error, "while preparing", alone=True)
            return None

    def denoise(
        self, job: RunJob, prepared: PreparedRequest, text_states: torch.Tensor | None = None
    ) -> tuple[Models, DenoisedLatents] | None:
        """Every rank of the group denoises `prepared` with the request's adapters (its slice of them), voting on
        cancelling before each step and once more after the last (`cancel_vote`), so all of them stop before the same
        step; rank 0 reports the steps and previews. `text_states`: what a split encoder group made (None: encoded
        here first). The models and the final latents, or None when the job ended here (`end_job`)."""
        models = self.engine.models_for(job.request)
        on_step = None
        if self.rank == 0:
            on_step = step_reporter(job.job_id, prepared.geometry, job.preview_every, self.outbox.offer)
        should_cancel = self.cancel_vote(job)
        try:
            with torch.inference_mode():
                if text_states is None:
                    latents = denoise_request(models, prepared, self.device, on_step, should_cancel)
                else:
                    latents = denoise_encoded(
                        models, prepared, text_states, self.device, on_step, should_cancel
                    )
        except Exception as error:
            self.end_job(job, error, "while denoising", alone=False)
            return None
        return models, latents

    def finish(
        self,
        job: RunJob,
        models: Models,
        latents: DenoisedLatents,
        geometry: Geometry,
        inputs: list[dict[str, Any]],
        vote_first: bool = False,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Every rank of the VAE group decodes `latents` (its tiles; the audio on rank 0); rank 0 writes every file
        into staging files (`pipeline.write_outputs`), runs `before_commit`, commits them together (they appear only
        then) and sends `JobFinished`.

        `vote_first`: the group votes on cancelling before it decodes (a split VAE group, which the denoising's
        votes did not include). A VAE group of one writes the MP4 while it decodes and checks its own cancel slot
        between windows; a larger one leaves the MP4 to `write_outputs`."""
        vae = self.groups.vae
        if vae is None:
            raise ValueError(f"rank {self.rank} holds no video decoder and cannot finish a job")
        # A remix writes its MP4 after splicing its sources into the decoded output (pipeline.remix_output).
        mp4_written = vae.size == 1 and latents.remix is None
        files = OutputFiles.beside(job.out_path, job.save_tensors_path)
        with staged(files) if self.rank == 0 else contextlib.nullcontext() as staging:
            try:
                if vote_first and vae.size > 1 and self.cancel_vote(job)():
                    raise GenerationCancelled("generation cancelled")
                with torch.inference_mode():
                    decoded = decode_on_group(
                        models,
                        latents.video_latents,
                        latents.audio_latents,
                        vae,
                        staging.files.video if mp4_written else None,
                        self.own_cancel_check(job),
                    )
            except Exception as error:
                self.end_job(job, error, "while decoding", alone=False)
                return
            if decoded is None:
                return  # not VAE rank 0: its part is done
            # From here on rank 0 works alone, so a failure is this job's only: it is reported, the group stays up.
            try:
                output = latents.output(*decoded)
                if latents.remix is not None:
                    output, mp4_written = remix_output(latents.remix, output, staging.files.video), True
                record = self.engine.record(job.request)
                write_outputs(staging, job.request, inputs, output, geometry, record, mp4_written)
                if before_commit is not None:
                    before_commit()
                self.outbox.post(job_finished(job.job_id, staging.commit()))
            except Exception as error:
                self.end_job(job, error, "while writing its outputs", alone=True)

    # --- the one way a job's exception ends it ------------------------------------------------------------------

    def end_job(self, job: RunJob, error: Exception, during: str, alone: bool) -> None:
        """End `job` on `error` (rank 0 reports it: `messages.job_failed`), or raise when the group cannot go on.

        `alone`: the step ran on this rank without collectives, so any failure is this job's only. Otherwise only a
        cancel (agreed by vote) ends the job; running out of memory does in a group of one, and in a larger group
        raises `RankOutOfMemory` (partners may wait in a collective this rank will never join: the group has to
        go); anything else is raised as it is. An MP4 writer's failure (a VAE group of one's file) is this rank's
        alone, reported as its cause.
        """
        if isinstance(error, Mp4WriteError):
            error, alone = error.__cause__ if isinstance(error.__cause__, Exception) else error, True
        if not alone and isinstance(error, torch.OutOfMemoryError) and self.groups.control.size > 1:
            raise RankOutOfMemory(self.engine.placement.out_of_memory_message()) from error
        if not (alone or isinstance(error, (GenerationCancelled, torch.OutOfMemoryError))):
            raise error
        if self.rank == 0:
            self.outbox.post(job_failed(job.job_id, error, self.engine, during, Path(job.out_path).parent))
