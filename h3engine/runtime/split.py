"""The split stage layout behind the engine front: text-encoder, DiT and VAE groups with tensor channels between them.

`SplitReplica(checkpoint, devices, layout, encoder_devices, vae_devices, options)` checks the layout
against the checkpoint, starts the three groups (h3engine.runtime.stages, each its own world) and one tensor channel
(h3engine.runtime.channel) per producer and consumer rank, and waits until every rank has loaded. It is a pipelined
`Replica` of `EngineFront`: `jobs_in_flight` jobs at once, each going prepare (VAE) -> encode (encoder) -> denoise
(DiT) -> decode (VAE) and taking each step in arrival order (h3engine.runtime.stage_groups), so the encoder works
on job k+1 and the VAE decodes job k-1 while the DiT denoises job k. This process sends commands and reads small
reports only.

Failure: a rank that dies or fails in any group, or a busy group silent past the stall limit, fails the job that
group was running (naming the group); all three groups and their channels are then ended and started again
(channels can be handed to processes only when they start), and the other jobs in flight start over on the new
groups (their start is not announced again). Cancel: the job's number goes into every group's cancel slot.
`close()` stops every rank, then closes the channels, which removes what dead ranks left in /dev/shm.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from h3engine.engine.options import EngineOptions, engine_layout
from h3engine.memory.engine_plan import MemoryRequest
from h3engine.models.parallel.groups import RuntimeLayout
from h3engine.runtime.front import CANCELLED_BEFORE_START_MESSAGE, SHUTTING_DOWN_MESSAGE, JobHandle
from h3engine.runtime.job_protocol import RunJob
from h3engine.runtime.messages import JobFailed, JobFinished, JobStarted
from h3engine.runtime.stage_groups import JOBS_IN_FLIGHT, Retry, StageGroups, StageRecord
from h3engine.runtime.stages import Stage, StageSpec
from h3engine.runtime.supervision import POLL_INTERVAL_S, RestartingReplica, StallPolicy
from h3engine.runtime.workers import checked_layouts, stage_devices

logger = logging.getLogger(__name__)

STAGE_LOG_SIZE = 256


def validated_stage_specs(
    checkpoint: str | Path,
    layout: RuntimeLayout,
    devices: Sequence[str],
    encoder_devices: Sequence[str],
    vae_devices: Sequence[str],
    options: EngineOptions,
) -> dict[Stage, StageSpec]:
    """Each group's spec, its layout checked against every partition's DiT and text encoder (RequestError naming
    the flag)."""
    if not layout.split:
        raise ValueError("validated_stage_specs is for the split layout")
    checkpoint_layout = engine_layout(checkpoint, options)
    dit_layout, encoder_layout = checked_layouts(
        checkpoint_layout, devices, layout, MemoryRequest.from_options(options)
    )
    # CPU ranks: what a colocated rank of the DiT's world size would use, so that the CPU arithmetic is the same. GPU
    # ranks do host work only (loading, muxing): the three groups' processes share the cores, not oversubscribe them.
    processes = layout.world_size
    if str(devices[0]).startswith("cuda"):
        processes = len(devices) + len(encoder_devices) + len(vae_devices)
    threads = max(1, (os.cpu_count() or 1) // processes)
    common = dict(checkpoint=str(checkpoint_layout.root), options=options, cpu_threads=threads)
    return {
        "vae": StageSpec(stage="vae", devices=tuple(vae_devices), layout=layout.vae_layout(), **common),
        "encoder": StageSpec(
            stage="encoder", devices=tuple(encoder_devices), layout=encoder_layout, **common
        ),
        "dit": StageSpec(stage="dit", devices=tuple(devices), layout=dit_layout, **common),
    }


class FirstStartOnly:
    """Publishes a job's messages on its handle, but only its first `JobStarted`: a job that starts over on restarted
    groups has started once (its queue wait was measured then); its steps count again from 1."""

    def __init__(self, handle: JobHandle) -> None:
        self._handle = handle
        self._started = False

    def __call__(self, message: Any) -> None:
        if isinstance(message, JobStarted):
            if self._started:
                return
            self._started = True
        self._handle.publish(message)


class SplitReplica(RestartingReplica[StageGroups]):
    """An `EngineFront` replica whose engine is three stage groups (see the module's docstring).

    Start: a RequestError whose message starts with the flag for a layout the checkpoint cannot serve, a
    CheckpointError naming the file when the checkpoint is broken (nothing is left running either way).
    `partition_on_device()` is the DiT group's partition as of the last job started (jobs reach the DiT in the order
    they start), or the first partition after a start (h3engine.runtime.supervision).
    """

    jobs_in_flight = JOBS_IN_FLIGHT
    supervised = "stage groups"

    def __init__(
        self,
        checkpoint: str | Path,
        devices: Sequence[str],
        layout: RuntimeLayout,
        encoder_devices: Sequence[str] | None = None,
        vae_devices: Sequence[str] | None = None,
        options: EngineOptions = EngineOptions(),
        stall: StallPolicy = StallPolicy(),
    ) -> None:
        if encoder_devices is None or vae_devices is None:
            defaults = stage_devices(layout, devices, None, None)
            encoder_devices = encoder_devices or defaults[0]
            vae_devices = vae_devices or defaults[1]
        self.layout = layout
        self.specs = validated_stage_specs(checkpoint, layout, devices, encoder_devices, vae_devices, options)
        self.spec = self.specs["dit"]  # the replica's own devices are the DiT group's
        # The newest steps of the jobs, in the order reported (for tests and benchmarks: how the jobs overlapped).
        self.stage_log: deque[StageRecord] = deque(maxlen=STAGE_LOG_SIZE)
        self._start_first(stall)
        logger.info("stage groups ready (%s)", layout.describe())

    @property
    def worker_pids(self) -> dict[Stage, list[int]]:
        """Each group's rank processes (empty while the groups restart)."""
        with self._lock:
            return self._current.pids if self._current is not None else {}

    def _start_incarnation(self) -> StageGroups:
        return StageGroups(self.specs, self._replace, self.stage_log, self.stall, self.pace)

    def _serves(self, groups: StageGroups) -> bool:
        """Broken groups are ended by their report reader, which then replaces them; meanwhile jobs wait."""
        if groups.broken is None:
            return True
        if groups.ended.is_set():
            self._replace(groups)
        else:
            time.sleep(POLL_INTERVAL_S)
        return False

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        with self._job_in_flight():
            return self._run(handle, replica_index, preview_every)

    def _run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        publish = FirstStartOnly(handle)
        while True:
            if handle.cancel_requested:
                return JobFailed(handle.job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE)
            groups = self._ready(handle)
            if isinstance(groups, JobFailed):
                return groups
            job = RunJob.of(next(self._job_numbers), handle, replica_index, preview_every)
            self._started(handle)
            outcome = groups.run_job(handle, job, publish)
            if self._closed.is_set() and isinstance(outcome, (JobFailed, Retry)):
                return JobFailed(handle.job_id, "cancelled", SHUTTING_DOWN_MESSAGE)
            if not isinstance(outcome, Retry):
                return outcome


def start_replica(
    checkpoint: str | Path,
    devices: Sequence[str],
    layout: RuntimeLayout,
    options: EngineOptions,
    stall: StallPolicy = StallPolicy(),
) -> Any:
    """A worker-group replica for `layout` and the engine options (dtype, memory profile, the split layout's
    device flags) under the stall watchdog's `stall`: `SplitReplica` for the split layout, else a `ProcessReplica`."""
    from h3engine.runtime.workers import ProcessReplica

    if not layout.split:
        return ProcessReplica(checkpoint, devices, layout, options, stall)
    encoder, vae = stage_devices(layout, devices, options.encoder_devices, options.vae_devices)
    return SplitReplica(checkpoint, devices, layout, encoder, vae, options, stall)
