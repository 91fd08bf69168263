"""One start of the split layout's three stage groups (text encoder, DiT, VAE) and the tensor channels between
them, and how a job runs through them (h3engine.runtime.split.SplitReplica starts them again when they break).

`StageGroups` starts every group's ranks (h3engine.runtime.stages) with their channel ends, routes each group's
reports to the job they belong to, and watches for a rank that fails or dies and for a busy group silent past the
stall limit. `run_job` takes a job through its steps (prepare, encode, denoise, decode), each in ticket order
(`Turns`); when the groups break, the job the broken group ran fails and the others get `RETRY`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from h3engine.engine import trace
from h3engine.runtime.channel import TensorChannel
from h3engine.runtime.front import JobHandle
from h3engine.runtime.job_protocol import RankReady, RunJob, Stop
from h3engine.runtime.messages import (
    CANCELLED_MESSAGE,
    TERMINAL_EVENTS,
    FailureKind,
    JobFailed,
    JobFinished,
)
from h3engine.runtime.stages import (
    CHANNEL_ROUTES,
    CPU_ROUTES,
    Decode,
    Denoise,
    Encode,
    Prepare,
    Stage,
    StageDone,
    StageEnds,
    StageSpec,
    stage_main,
)
from h3engine.runtime.supervision import POLL_INTERVAL_S, Pace, ProgressWatch, Silence, StallPolicy
from h3engine.runtime.workers import FAILURE_SETTLE_S, STOP_GRACE_S, WorkerGroup

logger = logging.getLogger(__name__)

STAGES: tuple[Stage, ...] = ("vae", "encoder", "dit")
GROUP_NAMES = {"vae": "VAE", "encoder": "text-encoder", "dit": "DiT"}
# A job's steps in order, and the group each runs on.
STEPS = ("prepare", "encode", "denoise", "decode")
GROUP_OF_STEP: dict[str, Stage] = {"prepare": "vae", "encode": "encoder", "denoise": "dit", "decode": "vae"}
JOBS_IN_FLIGHT = 3  # one per group: encoding k+1, denoising k, decoding k-1
# Sends a consumer has not taken yet, per channel: the jobs in flight, and as many of cancelled ones.
CHANNEL_SLOTS = 2 * JOBS_IN_FLIGHT
CHANNEL_CLOSE_S = 2.0
RESTARTING = "the stage groups are restarting"


class Turns:
    """Tickets in arrival order; each step admits them one at a time, in ticket order, skipping tickets that left."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._issued = itertools.count()
        self._next = dict.fromkeys(STEPS, 0)
        self._left: set[int] = set()

    def ticket(self) -> int:
        with self._condition:
            return next(self._issued)

    def wait(self, step: str, ticket: int, timeout: float) -> bool:
        with self._condition:
            return self._condition.wait_for(lambda: self._next[step] == ticket, timeout)

    def done(self, step: str, ticket: int) -> None:
        with self._condition:
            self._next[step] = ticket + 1
            self._skip_left()

    def leave(self, ticket: int) -> None:
        with self._condition:
            self._left.add(ticket)
            self._skip_left()

    def _skip_left(self) -> None:
        for step, ticket in self._next.items():
            while ticket in self._left:
                ticket += 1
            self._next[step] = ticket
        self._condition.notify_all()


@dataclass(frozen=True)
class StageRecord:
    """When a group's rank 0 took a job's command and when it was done (time.monotonic())."""

    job_id: str
    stage: str
    started_at: float
    ended_at: float
    sent_bytes: int  # handed to the next groups (every consumer rank counted)


class Retry:
    """The groups restarted under a job none of them was running: it starts over."""


RETRY = Retry()


@dataclass(frozen=True)
class Breakdown:
    """What ended a start of the groups: the group, the job it ran (None: idle), and that job's end."""

    stage: Stage
    running: str | None
    kind: FailureKind
    message: str


class StageGroups:
    """One start of the three groups and the channels between them; jobs run through it until it breaks.

    Stalls: each group with a command outstanding has a `ProgressWatch`, started again when it takes a job after
    being idle or moves on to its next job; the watch of a group whose current job was cancelled allows the cancel
    grace only. The report reader checks them: the group silent past its limit for longest is the stalled one.
    """

    def __init__(
        self,
        specs: dict[Stage, StageSpec],
        on_break: Callable[[StageGroups], None],
        log: deque[StageRecord],
        stall: StallPolicy,
        pace: Pace,
    ) -> None:
        self._on_break = on_break
        self._log = log
        self.channels: dict[str, list[TensorChannel]] = {}
        for route, (producer, consumer) in CHANNEL_ROUTES.items():
            device = "cpu" if route in CPU_ROUTES else specs[producer].devices[0]
            self.channels[route] = [
                TensorChannel(device, CHANNEL_SLOTS, f"{route} to {consumer} rank {rank}")
                for rank in range(specs[consumer].world_size)
            ]
        self.groups: dict[Stage, WorkerGroup] = {}
        self.turns = Turns()
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.Queue[Any]] = {}
        self._publishers: dict[str, Callable[[Any], None]] = {}  # a job's start, steps and previews go here
        # Per group, the jobs whose command was sent and not yet done, in order: the first is the one it runs.
        self._outstanding: dict[Stage, list[str]] = {stage: [] for stage in STAGES}
        self._watches = {stage: ProgressWatch(stall, pace) for stage in STAGES}
        self._heads: dict[Stage, str | None] = dict.fromkeys(STAGES)
        self._cancelled: set[str] = set()  # jobs whose cancel went into the groups' slots
        self.broken: Breakdown | None = None
        self._stopping = threading.Event()
        self.ended = threading.Event()  # every rank has ended and the channels are closed
        try:
            for stage, spec in specs.items():
                ends = [self._ends(stage, rank) for rank in range(spec.world_size)]
                self.groups[stage] = WorkerGroup(spec, stage_main, [(end,) for end in ends], f"h3-{stage}")
        except BaseException:
            self.kill()
            raise
        self._reader = threading.Thread(target=self._read_reports, name="h3-stage-reports", daemon=True)

    def _ends(self, stage: Stage, rank: int) -> StageEnds:
        ends = StageEnds()
        for route, (producer, consumer) in CHANNEL_ROUTES.items():
            if consumer == stage:
                ends.receive[route] = self.channels[route][rank]
            if producer == stage and rank == 0:
                ends.send[route] = self.channels[route]
        return ends

    def wait_ready(self, abort: threading.Event) -> Any:
        """Wait until every rank of every group has loaded; the VAE group's rank 0 checkpoint facts."""
        facts = self.groups["vae"].wait_ready(abort)
        for stage in ("encoder", "dit"):
            self.groups[stage].wait_ready(abort)
        self._reader.start()
        return facts

    @property
    def pids(self) -> dict[Stage, list[int]]:
        return {stage: group.pids for stage, group in self.groups.items()}

    # --- reports ----------------------------------------------------------------------------------------

    def _read_reports(self) -> None:
        while not self._stopping.is_set() and self.broken is None:
            try:  # one wait over every group, so that a report is routed as soon as it comes
                wait([item for group in self.groups.values() for item in group.waitables()], POLL_INTERVAL_S)
            except (OSError, ValueError):
                pass  # torn down under us: judged below
            for stage, group in self.groups.items():
                try:
                    messages = group.receive(0.0)
                except (OSError, ValueError):
                    messages = []
                for message in messages:
                    self._route(stage, message)
                if group.broken() and not self._stopping.is_set():
                    self._break(stage, group)
                    return
            stalled = self._stalled()
            if stalled is not None and not self._stopping.is_set():
                self._stall(*stalled)
                return

    def _route(self, stage: Stage, message: Any) -> None:
        with self._lock:
            self._watches[stage].heard(message)
        job_id = getattr(message, "job_id", None)
        if job_id is None or isinstance(message, RankReady):
            return
        with self._lock:
            # A step's report ends that group's work on the job; the job's end ends every group's.
            if isinstance(message, TERMINAL_EVENTS):
                finished = list(self._outstanding.values())
            elif isinstance(message, StageDone):
                finished = [self._outstanding[GROUP_OF_STEP[message.stage]]]
            else:
                finished = []
            for jobs in finished:
                if job_id in jobs:
                    jobs.remove(job_id)
            self._follow_heads()
            inbox, publish = self._inboxes.get(job_id), self._publishers.get(job_id)
        if isinstance(message, StageDone):
            self._log.append(
                StageRecord(
                    message.job_id, message.stage, message.started_at, message.ended_at, message.sent_bytes
                )
            )
        if isinstance(message, (StageDone, *TERMINAL_EVENTS)):
            if inbox is not None:
                inbox.put(message)
        elif publish is not None:
            publish(message)  # start, steps, previews

    def _follow_heads(self) -> None:
        """Each group's watch follows the job it runs (the caller holds the lock)."""
        for stage, jobs in self._outstanding.items():
            head = jobs[0] if jobs else None
            if head != self._heads[stage]:
                self._heads[stage] = head
                self._watches[stage].restart()
            if head is not None and head in self._cancelled:
                self._watches[stage].cancelled()

    def _stalled(self) -> tuple[Stage, Silence] | None:
        """The busy group silent past its limit for longest, and its silence; None while none is."""
        with self._lock:
            silences = [
                (stage, silence)
                for stage in STAGES
                if self._outstanding[stage] and (silence := self._watches[stage].overdue()) is not None
            ]
        return max(silences, key=lambda found: found[1].seconds, default=None)

    def _stall(self, stage: Stage, silence: Silence) -> None:
        with self._lock:
            running = self._outstanding[stage][0]
        failed = silence.job_failed(running, f"{GROUP_NAMES[stage]} group", RESTARTING)
        self._end_broken(Breakdown(stage, running, failed.kind, failed.message))

    def _break(self, stage: Stage, group: WorkerGroup) -> None:
        group.failure_description()  # lets the group settle
        stage = self._cause(stage)
        description = self.groups[stage].failure_description()
        with self._lock:
            running = self._outstanding[stage][0] if self._outstanding[stage] else None
        message = f"{description} in the {GROUP_NAMES[stage]} group; {RESTARTING}."
        self._end_broken(Breakdown(stage, running, "engine", message))

    def _end_broken(self, breakdown: Breakdown) -> None:
        """Tell the jobs, end every group, then hand the groups back for a restart."""
        with self._lock:
            self.broken = breakdown
            inboxes = list(self._inboxes.values())
        if breakdown.running is None:
            logger.error("%s (while idle)", breakdown.message)
        else:
            logger.error("job %s: %s", breakdown.running, breakdown.message)
        for inbox in inboxes:
            inbox.put(None)  # wake the job threads: the failed job is reported before the groups are ended
        self.kill()
        self._on_break(self)  # only now: new groups must not load while the old ones still hold the memory

    def _cause(self, noticed: Stage) -> Stage:
        """The group whose failure came first. A rank that died without a report (killed, crashed in native code)
        is the cause before any report, and a report of a channel peer gone or closed (kind "channel") is the echo
        of another group's death, which a rank may notice (through /proc) before this process can reap the dead
        one: for up to `FAILURE_SETTLE_S` an echo waits for its cause."""
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while True:
            for group in self.groups.values():
                group.receive(0.0)
            silent = [
                stage
                for stage, group in self.groups.items()
                if set(group.exit_codes()) - {failure.rank for failure in group.failures}
            ]
            first_hand = [
                stage
                for stage, group in self.groups.items()
                if any(failure.kind != "channel" for failure in group.failures)
            ]
            if silent or first_hand:
                return (silent or first_hand)[0]
            if time.monotonic() >= deadline:
                return noticed
            time.sleep(POLL_INTERVAL_S / 5)

    # --- one job ----------------------------------------------------------------------------------------

    def run_job(
        self, handle: JobHandle, job: RunJob, publish: Callable[[Any], None]
    ) -> JobFinished | JobFailed | Retry:
        """Run the job through the groups; its start, steps and previews go to `publish` as they come."""
        ticket = self.turns.ticket()
        inbox: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._inboxes[job.job_id], self._publishers[job.job_id] = inbox, publish
        self.groups["vae"].writes_into(handle.out_path, handle.save_tensors_path)
        done: dict[str, StageDone] = {}
        try:
            outcome = self._steps(handle, job, ticket, inbox, done)
        finally:
            self.turns.leave(ticket)
            with self._lock:
                for table in (self._inboxes, self._publishers):
                    table.pop(job.job_id, None)
        if job.capture is not None and not isinstance(outcome, Retry):  # `generate --capture`: the one index
            failed = None if isinstance(outcome, JobFinished) else f"{outcome.kind}: {outcome.message}"
            parts = [done[step].captured for step in STEPS if step in done]
            unreported = tuple(step for step in STEPS if step not in done)
            trace.finish_stage_captures(job.capture, job.request, parts, failed, unreported)
        return outcome

    def _steps(
        self, handle: JobHandle, job: RunJob, ticket: int, inbox: queue.Queue[Any], done: dict[str, StageDone]
    ) -> JobFinished | JobFailed | Retry:
        outcome = self._step("prepare", Prepare(job), handle, job, ticket, inbox, done, wait_for="prepare")
        if outcome is not None:
            return outcome
        prepared = done["prepare"]
        outcome = self._step("encode", Encode(job, prepared.skeleton), handle, job, ticket, inbox, done)
        if outcome is not None:
            return outcome
        command = Denoise(job, prepared.skeleton, prepared.frame_shares)
        outcome = self._step("denoise", command, handle, job, ticket, inbox, done, wait_for="denoise")
        if outcome is None:
            outcome = self._await(handle, job, inbox, done, "encode")
        if outcome is not None:
            return outcome
        timings = {**done["denoise"].timings, **done["encode"].timings, **done["prepare"].timings}
        # The colocated engine's sidecar order: conditioning and text encoding first.
        first = {name: timings.pop(name) for name in ("conditioning_s", "text_encode_s") if name in timings}
        timings = {**first, **timings}
        geometry = prepared.skeleton.geometry
        command = Decode(
            job, geometry, prepared.latent_shape, prepared.frame_shares, timings, done["denoise"].step_cache
        )
        outcome = self._step("decode", command, handle, job, ticket, inbox, done)
        # Its report comes just before the job's end: wait for the end.
        return outcome if outcome is not None else self._await_end(handle, job, inbox, done)

    def _step(
        self,
        step: str,
        command: Any,
        handle: JobHandle,
        job: RunJob,
        ticket: int,
        inbox: queue.Queue[Any],
        done: dict[str, StageDone],
        wait_for: str | None = None,
    ) -> JobFinished | JobFailed | Retry | None:
        """Wait for the step's turn, send its command, and (with `wait_for`) wait for its report; None: go on."""
        while not self.turns.wait(step, ticket, POLL_INTERVAL_S):
            outcome = self._interrupted(handle, job)
            if outcome is not None:
                return outcome
        outcome = self._interrupted(handle, job)
        if outcome is not None:
            return outcome
        stage = GROUP_OF_STEP[step]
        with self._lock:
            self._outstanding[stage].append(job.job_id)
            self._follow_heads()
        try:
            self.groups[stage].send_to_all(command)
        except OSError:
            pass  # the group is gone: the report reader says how
        self.turns.done(step, ticket)
        return None if wait_for is None else self._await(handle, job, inbox, done, wait_for)

    def _await(
        self, handle: JobHandle, job: RunJob, inbox: queue.Queue[Any], done: dict[str, StageDone], wanted: str
    ) -> JobFinished | JobFailed | Retry | None:
        """Wait until the `wanted` step's report came (None) or the job ended."""
        while wanted not in done:
            outcome = self._next_report(handle, job, inbox, done)
            if outcome is not None:
                return outcome
        return None

    def _await_end(
        self, handle: JobHandle, job: RunJob, inbox: queue.Queue[Any], done: dict[str, StageDone]
    ) -> JobFinished | JobFailed | Retry:
        while (outcome := self._next_report(handle, job, inbox, done)) is None:
            pass
        return outcome

    def _next_report(
        self, handle: JobHandle, job: RunJob, inbox: queue.Queue[Any], done: dict[str, StageDone]
    ) -> JobFinished | JobFailed | Retry | None:
        """Forward a cancel, take the job's next report within `POLL_INTERVAL_S` into `done`; the job's end when it
        came (or the groups broke), else None."""
        if handle.cancel_requested:
            self._forward_cancel(job)
        try:
            message = inbox.get(timeout=POLL_INTERVAL_S)
        except queue.Empty:
            message = None
        if isinstance(message, TERMINAL_EVENTS):
            return message
        if isinstance(message, StageDone):
            done[message.stage] = message
        elif self.broken is not None or self._stopping.is_set():
            return self._broken_outcome(job)
        return None

    def _forward_cancel(self, job: RunJob) -> None:
        """The job's number into every group's cancel slot (once); the groups running it get the cancel grace."""
        with self._lock:
            if job.job_id in self._cancelled:
                return
            self._cancelled.add(job.job_id)
            for group in self.groups.values():
                group.cancel_job.value = job.job_number
            self._follow_heads()

    def _interrupted(self, handle: JobHandle, job: RunJob) -> JobFailed | Retry | None:
        if self.broken is not None or self._stopping.is_set():
            return self._broken_outcome(job)
        if handle.cancel_requested:
            return JobFailed(job.job_id, "cancelled", CANCELLED_MESSAGE)
        return None

    def _broken_outcome(self, job: RunJob) -> JobFailed | Retry:
        """The job that the broken group ran fails; the others start over (the replica's shutdown: they end)."""
        breakdown = self.broken
        if breakdown is None or breakdown.running != job.job_id:
            return RETRY
        return JobFailed(job.job_id, breakdown.kind, breakdown.message)

    # --- the end ----------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Every rank is asked to stop first (a producer waits for its consumer, in another group), then joined
        (all within one `STOP_GRACE_S`)."""
        self._stopping.set()
        for group in self.groups.values():
            try:
                group.send_to_all(Stop())
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for group in self.groups.values():
            group.stop(deadline)
        self._close_channels()
        self.ended.set()

    def kill(self) -> None:
        self._stopping.set()
        for group in self.groups.values():
            group.kill()
        self._close_channels()
        self.ended.set()

    def _close_channels(self) -> None:
        for channels in self.channels.values():
            for channel in channels:
                channel.close(timeout=CHANNEL_CLOSE_S)
