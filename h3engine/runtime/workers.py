"""Resident worker groups behind the engine front: one process per rank, forked from a server that has imported the
rank code (h3engine.runtime.rank_process.rank_context).

`ProcessReplica(checkpoint, devices, layout, options)` checks the layout against the checkpoint,
starts one group (h3engine.runtime.rank in a process per device) and waits until every rank has loaded its shards.
It is a `Replica` of `EngineFront`: the app and the CLI get the same `JobHandle` and messages as from an
in-process engine. A rank that dies, or a group silent past the stall limit (h3engine.runtime.supervision), fails
only the running job and the group restarts; `close()` leaves no process behind. `rank_devices(...)` and
`replica_device_groups(...)` turn the CLI's and the app's device flags into each rank's device, with errors that
name the flag.

Danger: a group's pipes and shared slot belong to one incarnation: after a failure nothing of the old group is
reused (a rank killed while writing may have left half a message in its pipe). NCCL wants one rank per GPU, so a
device appears once per group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import CheckpointLayout
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.text_encoder_files import open_text_encoder_files
from h3engine.engine.options import EngineOptions, engine_layout
from h3engine.errors import CheckpointError, RequestError
from h3engine.media.leftovers import WORKER_FOLDER_PREFIX, owned_temp_folder, remove_staging_files_of
from h3engine.memory.engine_plan import MemoryRequest
from h3engine.models.parallel.groups import EncoderLayout, ParallelLayout, RuntimeLayout
from h3engine.runtime.front import CANCELLED_BEFORE_START_MESSAGE, SHUTTING_DOWN_MESSAGE, JobHandle
from h3engine.runtime.job_protocol import NO_JOB, RankFailed, RankReady, RunJob, Stop, WorkerSpec
from h3engine.runtime.messages import TERMINAL_EVENTS, JobFailed, JobFinished
from h3engine.runtime.rank import rank_main
from h3engine.runtime.rank_process import in_front_environment, rank_context
from h3engine.runtime.supervision import (
    POLL_INTERVAL_S,
    ProgressWatch,
    RestartingReplica,
    Silence,
    StallPolicy,
)

logger = logging.getLogger(__name__)

# After the first sign of a failure, how long to keep listening before judging it: a rank that was killed makes
# its gloo partners fail a moment later, and the report should name the first cause, not the echoes.
FAILURE_SETTLE_S = 0.5
# Ranks asked to stop (idle: they leave their process groups) get this long before they are killed; a rank that
# SIGTERM did not end (a stopped process keeps the signal pending) gets SIGKILL after KILL_GRACE_S.
STOP_GRACE_S = 2.0
KILL_GRACE_S = 1.0
RESTARTING = "the worker group is restarting"


class WorkerStartError(RuntimeError):
    """A worker group did not come up (a rank died or failed while loading); the message says which and how."""


# --- devices and layouts ------------------------------------------------------------------------------------------


def _cuda_devices(flag: str, count: int) -> tuple[str, ...]:
    visible = torch.cuda.device_count()
    if count > visible:
        raise RequestError(
            flag, f"{count} GPUs asked for, but {visible} {'is' if visible == 1 else 'are'} visible"
        )
    return tuple(f"cuda:{index}" for index in range(count))


def _cuda_device_list(flag: str, text: str) -> tuple[str, ...]:
    """`0,1` or `cuda:0,cuda:1` -> ('cuda:0', 'cuda:1'), each GPU visible and listed once."""
    names = []
    for item in text.split(","):
        item = item.strip()
        index_text = item.removeprefix("cuda:")
        if not index_text.isdigit():
            raise RequestError(flag, f"expected GPU indices like 0,1 or cuda:0,cuda:1, got '{item}'")
        names.append(f"cuda:{int(index_text)}")
    visible = torch.cuda.device_count()
    for name in names:
        if int(name.removeprefix("cuda:")) >= visible:
            raise RequestError(flag, f"{name} is not one of the {visible} visible GPUs")
        if names.count(name) > 1:
            raise RequestError(flag, f"{name} is listed twice (a worker group has one rank per GPU)")
    return tuple(names)


def rank_devices(
    device: str | None, world_size: int | None, gpus: int | None, devices: str | None
) -> tuple[str, ...]:
    """The CLI's device flags -> the device of every rank (one entry: the in-process engine runs on it).

    `--gpus N`: cuda:0 .. cuda:N-1. `--devices 0,1`: those GPUs. `--world-size N`: N ranks on `--device` (cpu ranks
    use gloo; cuda means the first N GPUs). With none of them, one rank on `--device` (None: cuda when present).
    """
    if gpus is not None and devices is not None:
        raise RequestError("--gpus and --devices", "give one of them")
    if (gpus is not None or devices is not None) and device is not None and not device.startswith("cuda"):
        raise RequestError(
            "--device", f"is {device}, but --gpus and --devices choose GPUs; use --world-size for CPU ranks"
        )
    for flag, value in (("--gpus", gpus), ("--world-size", world_size)):
        if value is not None and value < 1:
            raise RequestError(flag, f"must be at least 1, got {value}")
    if gpus is not None:
        chosen = _cuda_devices("--gpus", gpus)
    elif devices is not None:
        chosen = _cuda_device_list("--devices", devices)
    else:
        count = world_size or 1
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            return ("cpu",) * count
        if count == 1:
            return (device,)
        if device != "cuda":
            raise RequestError(
                "--device", f"is {device}; with --world-size {count} give --device cuda (or cpu)"
            )
        return _cuda_devices("--world-size", count)
    if world_size is not None and world_size != len(chosen):
        raise RequestError(
            "--world-size", f"is {world_size}, which does not match the {len(chosen)} GPUs chosen"
        )
    return chosen


def replica_device_groups(devices: Sequence[str | None], world_size: int) -> list[tuple[str, ...]]:
    """The app's `--devices` and `--world-size` -> one tuple of rank devices per replica.

    Consecutive devices form a group (`cuda:0,cuda:1,cuda:2,cuda:3` with world size 2: two groups); `cpu` alone
    means `world_size` CPU ranks; no devices means the first `world_size` GPUs, or CPU ranks without a GPU.
    """
    if world_size < 1:
        raise RequestError("--world-size", f"must be at least 1, got {world_size}")
    if list(devices) in ([None], ["cpu"]):
        if devices[0] is None and torch.cuda.is_available():
            return [_cuda_devices("--world-size", world_size)]
        return [("cpu",) * world_size]
    names = _cuda_device_list("--devices", ",".join(str(name) for name in devices))
    if len(names) % world_size:
        raise RequestError(
            "--devices", f"{len(names)} GPUs do not split into worker groups of --world-size {world_size}"
        )
    return [names[start : start + world_size] for start in range(0, len(names), world_size)]


def stage_devices(
    layout: RuntimeLayout, dit_devices: Sequence[str], encoder_devices: str | None, vae_devices: str | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The split layout's text-encoder and VAE devices: `--encoder-devices` / `--vae-devices` when given, else the
    first `encoder_tp` / `vae_ranks` of the DiT group's devices (CPU ranks when the DiT runs on the CPU)."""
    chosen = []
    for flag, size_flag, size, text in (
        ("--encoder-devices", "--encoder-tp", layout.encoder_tp, encoder_devices),
        ("--vae-devices", "--vae-ranks", layout.vae_ranks, vae_devices),
    ):
        if text is not None:
            names = _cuda_device_list(flag, text)
            if len(names) != size:
                raise RequestError(flag, f"{len(names)} GPUs given, but {size_flag} {size} asks for {size}")
        elif dit_devices[0] == "cpu":
            names = ("cpu",) * size
        elif size > len(dit_devices):
            raise RequestError(
                size_flag,
                f"asks for {size} ranks, but the group shares the DiT's {len(dit_devices)} GPUs by default, one "
                f"rank per GPU; give {flag} with {size} GPUs",
            )
        else:
            names = tuple(dit_devices[:size])
        chosen.append(names)
    return chosen[0], chosen[1]


def checked_layouts(
    checkpoint: CheckpointLayout, devices: Sequence[str], layout: RuntimeLayout, memory: MemoryRequest | str
) -> tuple[ParallelLayout, EncoderLayout]:
    """The DiT and text-encoder layouts, checked against every partition's models, and the memory flags (a profile
    name or a `MemoryRequest`; RequestError naming the flag); `devices` are the DiT's."""
    MemoryRequest.of(memory)
    if layout.world_size != len(devices):
        raise RequestError(
            "devices", f"the layout is for {layout.world_size} ranks, but {len(devices)} devices were given"
        )
    try:
        for paths in checkpoint.partitions.values():
            dit_layout = layout.dit_layout(dit_source(checkpoint, paths, torch.bfloat16).config)
            encoder_layout = layout.encoder_layout(open_text_encoder_files(paths.text_encoder)[0])
    except ValueError as error:  # names the flags, which only together make no layout
        raise RequestError("", str(error)) from None
    return dit_layout, encoder_layout


def validated_spec(
    checkpoint: CheckpointLayout, devices: Sequence[str], layout: RuntimeLayout, options: EngineOptions
) -> WorkerSpec:
    """The layout checked against every partition's DiT and text encoder, and the options' memory flags (every rank
    plans for its own share under them; RequestError naming the flag)."""
    dit_layout, encoder_layout = checked_layouts(
        checkpoint, devices, layout, MemoryRequest.from_options(options)
    )
    return WorkerSpec(
        checkpoint=str(checkpoint.root),
        devices=tuple(devices),
        options=options,
        dit_layout=dit_layout,
        encoder_layout=encoder_layout,
        vae_layout=layout.vae_layout(),
    )


# --- one incarnation of a worker group ----------------------------------------------------------------------------


class WorkerGroup:
    """The rank processes of one start of a group, their pipes and their shared cancel slot.

    Rank r runs `target(r, spec, commands, messages, cancel_job, *rank_args[r])` (default: `rank_main`, no extra
    arguments); `spec` is any frozen dataclass with `world_size` and `init_method` (a split stage's spec too).
    """

    def __init__(
        self,
        spec: Any,
        target: Callable[..., None] = rank_main,
        rank_args: Sequence[tuple[Any, ...]] | None = None,
        name: str = "h3-rank",
    ) -> None:
        context = rank_context()
        self._store_dir = owned_temp_folder(WORKER_FOLDER_PREFIX)
        spec = dataclasses.replace(spec, init_method=f"file://{self._store_dir / 'store'}")
        self.cancel_job = context.RawValue("q", NO_JOB)
        self.processes: list[Any] = []
        self._commands: list[Connection] = []
        self._message_pipes: list[Connection] = []  # the ranks' pipes still open
        self.failures: list[RankFailed] = []
        # Where its ranks were given files to write: a killed rank's staging files there go with it (`_kill`).
        self.output_folders: set[Path] = set()
        # The job thread (after a failure) and the shutdown may both end the group; one at a time.
        self._ending = threading.Lock()
        try:
            for rank in range(spec.world_size):
                command_reader, command_writer = context.Pipe(duplex=False)
                message_reader, message_writer = context.Pipe(duplex=False)
                extra = tuple(rank_args[rank]) if rank_args is not None else ()
                process = context.Process(
                    target=in_front_environment,
                    args=(
                        dict(os.environ),
                        target,
                        rank,
                        spec,
                        command_reader,
                        message_writer,
                        self.cancel_job,
                        *extra,
                    ),
                    name=f"{name}-{rank}",
                    daemon=True,
                )
                process.start()
                # The rank holds these ends now; without our copies, a dead rank reads as the end of its pipe.
                command_reader.close()
                message_writer.close()
                self.processes.append(process)
                self._commands.append(command_writer)
                self._message_pipes.append(message_reader)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def waitables(self) -> list[Any]:
        """What `multiprocessing.connection.wait` can wait on for this group: its open pipes and the sentinels of
        its living ranks (a dead one's stays ready and would turn every wait into a spin)."""
        return self._message_pipes + [
            process.sentinel for process in self.processes if process.exitcode is None
        ]

    def receive(self, timeout: float) -> list[Any]:
        """Every message that arrives within `timeout` (returns early once one has); `RankFailed` is also kept."""
        received = []
        ready = wait(self.waitables(), timeout)
        for connection in [item for item in ready if item in self._message_pipes]:
            try:
                while connection.poll():
                    received.append(connection.recv())
            except (EOFError, OSError):
                self._message_pipes.remove(connection)  # that rank is gone; its sentinel tells how
        self.failures += [message for message in received if isinstance(message, RankFailed)]
        return received

    def exit_codes(self) -> dict[int, int]:
        """rank -> exit code, for every rank that has ended."""
        return {
            rank: process.exitcode
            for rank, process in enumerate(self.processes)
            if process.exitcode is not None
        }

    def broken(self) -> bool:
        return bool(self.failures) or bool(self.exit_codes())

    def failure_description(self) -> str:
        """The first cause of a failure, judged after `FAILURE_SETTLE_S` more of listening.

        A rank that died without a report (killed, crashed in native code) is the cause before any report: the
        reports of its partners are usually their collectives failing because of it.
        """
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while time.monotonic() < deadline and len(self.exit_codes()) < len(self.processes):
            self.receive(timeout=max(0.0, deadline - time.monotonic()))
        reported = {failure.rank for failure in self.failures}
        silent_deaths = {rank: code for rank, code in self.exit_codes().items() if rank not in reported}
        if silent_deaths:
            rank = min(silent_deaths)
            return f"A worker process died (rank {rank}, exit code {silent_deaths[rank]})"
        if self.failures:
            first = self.failures[0]
            return f"Worker rank {first.rank} failed with {first.message}"
        return "The worker group stopped answering"

    def send_to_all(self, command: Any) -> None:
        for connection in self._commands:
            connection.send(command)

    def writes_into(self, *paths: str | Path | None) -> None:
        """Its ranks are about to write these files (staging files beside them until they commit)."""
        self.output_folders.update(Path(path).parent for path in paths if path is not None)

    def stop(self, deadline: float | None = None) -> None:
        """Ask every rank to finish, wait for them until `deadline` (time.monotonic(); default: `STOP_GRACE_S` from
        now), kill what is left."""
        with self._ending:
            try:
                self.send_to_all(Stop())
            except OSError:
                pass  # a rank is gone already: the kill below ends the rest
            if deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            self._kill()

    def kill(self) -> None:
        """End every rank now (SIGTERM, then SIGKILL after `KILL_GRACE_S`) and reap them."""
        with self._ending:
            self._kill()

    def _kill(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        deadline = time.monotonic() + KILL_GRACE_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join(KILL_GRACE_S)
                if process.exitcode is None:  # in an uninterruptible system call: it ends when that returns
                    logger.error("%s (pid %d) did not end on SIGKILL", process.name, process.pid)
        shutil.rmtree(self._store_dir, ignore_errors=True)
        remove_staging_files_of(self.pids, self.output_folders)

    def wait_ready(self, abort: threading.Event) -> CheckpointFacts:
        """Wait until every rank has loaded its shards; rank 0's checkpoint facts."""
        ready: dict[int, CheckpointFacts | None] = {}
        while len(ready) < len(self.processes):
            if abort.is_set():
                raise WorkerStartError("the worker group was stopped while starting")
            for message in self.receive(POLL_INTERVAL_S):
                if isinstance(message, RankReady):
                    ready[message.rank] = message.facts
            if self.failures:
                failure = self.failures[0]
                if failure.kind == "checkpoint":
                    raise CheckpointError(failure.message)
                raise WorkerStartError(
                    f"worker rank {failure.rank} failed while starting ({failure.message}); see its log above"
                )
            exited = self.exit_codes()
            if exited and not self._messages_pending():
                rank = min(exited)
                raise WorkerStartError(
                    f"worker rank {rank} exited while starting (exit code {exited[rank]}); see its log above"
                )
        return ready[0]

    def _messages_pending(self) -> bool:
        """True while a pipe still has unread data (a rank's last words arrive before its exit is noticed)."""
        return any(connection.poll() for connection in self._message_pipes)


# --- the replica --------------------------------------------------------------------------------------------------


class ProcessReplica(RestartingReplica[WorkerGroup]):
    """An `EngineFront` replica whose engine is a resident worker group.

    Start: a RequestError whose message starts with the flag for a layout or memory profile the checkpoint cannot
    serve; a CheckpointError naming the file when the checkpoint is broken. Every rank's engine runs under the memory
    profile (h3engine.memory.placement).

    A job: the command goes to every rank; rank 0's messages come back through its pipe and are published on the
    handle as they arrive (the pipes are read every `POLL_INTERVAL_S`). A cancel writes the job's number into the
    group's shared slot, which the ranks vote on before every step.

    A rank that dies (killed, out of memory, an exception) fails the running job with `JobFailed(kind="engine")`
    naming the rank and its exit code (or its error type) and saying that the group is restarting; the rest of the
    group is killed (its processes end, and with them their GPU memory) and a new group starts in the background. The
    next job waits for it; a waiting job can still be cancelled. A group that sends nothing for the stall limit, or
    after a cancel for the cancel grace (`stall`, h3engine.runtime.supervision), is killed and restarted the same
    way, its job failed with a sentence saying so. `close()` (the front's shutdown) sends `Stop` to every rank,
    waits `STOP_GRACE_S`, then kills what is left and joins everything (a group still running a job is killed at
    once). A killed group's staging files in the outputs folder go with it (h3engine.media.leftovers). The ranks also end
    by themselves when this process dies. The rendezvous is a FileStore in a fresh temporary folder per incarnation
    (`h3-workers-PID-*`), removed when the group ends; a new `ProcessReplica` removes those of dead processes
    (h3engine.media.leftovers).

    `partition_on_device()` tells the front which DiT partition the ranks hold: the last started job's, or the first
    partition after a start (h3engine.runtime.supervision).
    """

    supervised = "worker group"

    def __init__(
        self,
        checkpoint: str | Path,
        devices: Sequence[str],
        layout: RuntimeLayout | None = None,
        options: EngineOptions = EngineOptions(),
        stall: StallPolicy = StallPolicy(),
    ) -> None:
        layout = layout if layout is not None else RuntimeLayout.choose(len(devices))
        self.layout = layout
        self.spec = validated_spec(engine_layout(checkpoint, options), devices, layout, options)
        self._start_first(stall)
        logger.info("worker group ready on %s (%s)", ", ".join(devices), layout.describe())

    @property
    def worker_pids(self) -> list[int]:
        """The rank processes of the current group (empty while it restarts)."""
        with self._lock:
            return self._current.pids if self._current is not None else []

    def _start_incarnation(self) -> WorkerGroup:
        return WorkerGroup(self.spec)

    def _serves(self, group: WorkerGroup) -> bool:
        """A group that broke while idle (a rank killed between jobs) is replaced here, costing no job."""
        if not group.broken():
            return True
        logger.error("%s while idle; %s", group.failure_description(), RESTARTING)
        group.kill()
        self._replace(group)
        return False

    # --- jobs -------------------------------------------------------------------------------------------

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        if handle.cancel_requested:
            return JobFailed(handle.job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE)
        with self._job_in_flight():
            group = self._ready(handle)
            if isinstance(group, JobFailed):
                return group
            return self._run_on(group, handle, replica_index, preview_every)

    def _run_on(
        self, group: WorkerGroup, handle: JobHandle, replica_index: int, preview_every: int
    ) -> JobFinished | JobFailed:
        """Send the job to every rank and relay rank 0's messages until its end, a failure or a stall."""
        job_number = next(self._job_numbers)
        job = RunJob.of(job_number, handle, replica_index, preview_every)
        self._started(handle)
        group.writes_into(handle.out_path, handle.save_tensors_path)
        watch = ProgressWatch(self.stall, self.pace)
        try:
            group.send_to_all(job)
        except OSError:
            return self._fail(group, handle)
        cancel_forwarded = False
        while True:
            if handle.cancel_requested and not cancel_forwarded:
                group.cancel_job.value = job_number
                cancel_forwarded = True
                watch.cancelled()
            try:
                messages = group.receive(POLL_INTERVAL_S)
            except (OSError, ValueError):
                messages = []  # the group was torn down under us (close): judged below
            for message in messages:
                watch.heard(message)
                if getattr(message, "job_id", None) != handle.job_id:
                    continue
                if isinstance(message, TERMINAL_EVENTS):
                    return message
                handle.publish(message)
            if group.broken():
                return self._fail(group, handle)
            silence = watch.overdue()
            if silence is not None:
                return self._fail(group, handle, silence)

    def _fail(self, group: WorkerGroup, handle: JobHandle, silence: Silence | None = None) -> JobFailed:
        """Judge the failure (a rank's, or the group's `silence`), kill the group, start a new one in the
        background; the job's terminal message."""
        description = group.failure_description() if silence is None else None
        group.kill()
        self._replace(group)
        if self._closed.is_set():
            return JobFailed(handle.job_id, "cancelled", SHUTTING_DOWN_MESSAGE)
        if silence is not None:
            failed = silence.job_failed(handle.job_id, self.supervised, RESTARTING)
            logger.error("job %s: %s", handle.job_id, failed.message)
            return failed
        logger.error("job %s: %s; %s", handle.job_id, description, RESTARTING)
        return JobFailed(handle.job_id, "engine", f"{description}; {RESTARTING}.")
