"""The front's partition preference (h3engine.runtime.front: `next_job_index`, `MAX_PASSED_OVER`), with fake replicas.

What is checked: a replica holding FL2VA takes the oldest t2va/fl2va job before older ref2va ones; a passed-over job
is taken once it was passed over `MAX_PASSED_OVER` times, even while matching jobs keep arriving; a replica that does
not say (None, or no method) is served in submission order; queue positions after a reorder are submission order; a
waiting job can still be cancelled, also one already passed over; two replicas holding different partitions each take
their own jobs; a pipelined replica's next job is judged by the partition of the jobs it already has in flight. And
the process replicas' bookkeeping (`RestartingReplica.partition_on_device`): the first partition, then the last
started job's, then the first again after a restart; `EngineReplica` reads its model store's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import CanvasRules
from h3engine.engine.resolved import ResolvedRequest
from h3engine.request.files import MediaFacts
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import (
    CANCELLED_BEFORE_START_MESSAGE,
    MAX_PASSED_OVER,
    EngineFront,
    EngineReplica,
    JobHandle,
    next_job_index,
)
from h3engine.runtime.messages import JobFailed, JobFinished, JobQueued
from h3engine.runtime.supervision import RestartingReplica

WAIT_S = 10.0
PARTITION = {"t2va": "fl2va", "fl2va": "fl2va", "ref2va": "ref2va"}


def wait_until(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class GatedReplica:
    """Each job (named by its prompt) runs until the test releases it. It reports `partition` as held: set at
    construction, and (unless `pinned`) moved to each job's partition when the job starts, as a real replica does."""

    def __init__(
        self,
        partition: str | None,
        pinned: bool = False,
        jobs_in_flight: int = 1,
        reports: bool = True,
    ) -> None:
        # The facts of a small undistilled checkpoint: the front resolves each job on them before queueing it.
        self.facts = CheckpointFacts(
            tasks=("t2va", "fl2va", "ref2va"), canvas=CanvasRules(32, 32 * 56), vae_spatial_ratio=4, patch=2
        )
        self.partition = partition
        self.pinned = pinned
        self.jobs_in_flight = jobs_in_flight
        if reports:
            self.partition_on_device = lambda: self.partition
        self.ran: list[str] = []
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _gate(self, name: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(name, threading.Event())

    def release(self, name: str) -> None:
        self._gate(name).set()

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        with self._lock:
            self.ran.append(handle.request.prompt)
            if not self.pinned:
                self.partition = PARTITION.get(handle.request.task, self.partition)
        assert self._gate(handle.request.prompt).wait(WAIT_S), f"{handle.request.prompt} was never released"
        # Any terminal message will do: the front only needs the job to end.
        return JobFailed(handle.job_id, "request", "a fake job")

    def close(self) -> None:
        pass


class Queue:
    """A front over fake replicas, and the jobs submitted to it by name."""

    def __init__(self, replicas: list[GatedReplica], folder: Path) -> None:
        self.replicas = replicas
        self.front = EngineFront(replicas, folder / "outputs")
        self.handles: dict[str, JobHandle] = {}

    def submit(self, task: str, name: str) -> JobHandle:
        # Only the order is judged here: each job is taken as resolved (a queue of bare prompts of every task).
        request = GenerationRequest(task=task, prompt=name)
        resolved = ResolvedRequest(request, (), MediaFacts(lambda entry: None), 4.0, None, None)
        self.handles[name] = self.front.submit(resolved)
        return self.handles[name]

    def occupy(self) -> None:
        """One blocking job per replica worker thread, each taken, so that what is submitted next waits."""
        slots = sum(replica.jobs_in_flight for replica in self.replicas)
        for number in range(slots):
            self.submit("t2va", f"blocker {number}")
        wait_until(lambda: sum(len(replica.ran) for replica in self.replicas) == slots)

    def release_and_wait(self, name: str, replica: GatedReplica, taken: int) -> None:
        """Release job `name`, then wait until `replica` has taken `taken` jobs in all."""
        replica.release(name)
        wait_until(lambda: len(replica.ran) >= taken)

    def positions(self, *names: str) -> dict[str, int]:
        """The last position announced to each of these jobs since the last call (read after a take or a cancel)."""
        positions = {}
        for name in names:
            queued = [event for event in self.handles[name].drain() if isinstance(event, JobQueued)]
            if queued:
                positions[name] = queued[-1].position
        return positions


@pytest.fixture()
def make_queue(tmp_path):
    made: list[Queue] = []

    def make(*replicas: GatedReplica) -> Queue:
        made.append(Queue(list(replicas), tmp_path))
        return made[-1]

    yield make
    for queue in made:
        for replica in queue.replicas:
            for name in queue.handles:
                replica.release(name)
        queue.front.shutdown(timeout=WAIT_S)


def test_a_replica_holding_fl2va_takes_the_t2va_job_before_an_older_ref2va_one(make_queue) -> None:
    replica = GatedReplica("fl2va")
    queue = make_queue(replica)
    queue.occupy()
    for task, name in (("ref2va", "ref 1"), ("t2va", "t2va"), ("ref2va", "ref 2"), ("fl2va", "fl2va")):
        queue.submit(task, name)
    for taken in range(2, 6):
        queue.release_and_wait(replica.ran[-1], replica, taken)
    assert replica.ran[1] == "t2va"
    if MAX_PASSED_OVER >= 2:
        # ref 1 was passed over twice (by t2va and fl2va); then the replica holds ref2va and ref 2 matches.
        assert replica.ran == ["blocker 0", "t2va", "fl2va", "ref 1", "ref 2"]
    assert replica.ran.index("ref 1") < replica.ran.index("ref 2")


def test_a_passed_over_job_is_taken_after_max_passes_even_while_matching_jobs_keep_coming(make_queue) -> None:
    replica = GatedReplica("fl2va", pinned=True)  # it would always prefer t2va jobs
    queue = make_queue(replica)
    queue.occupy()
    queue.submit("ref2va", "ref")
    queue.submit("t2va", "t2va 0")
    queue.submit("t2va", "t2va 1")
    running, arrived = "blocker 0", 2
    for taken in range(2, MAX_PASSED_OVER + 10):
        queue.release_and_wait(running, replica, taken)
        running = replica.ran[-1]
        if running == "ref":
            break
        queue.submit("t2va", f"t2va {arrived}")  # a matching job is always waiting
        arrived += 1
    # Taken after exactly MAX_PASSED_OVER younger jobs; never passed over more than that.
    assert replica.ran[1:] == [f"t2va {number}" for number in range(MAX_PASSED_OVER)] + ["ref"]
    assert queue.handles["ref"].passed_over == MAX_PASSED_OVER
    assert all(handle.passed_over <= MAX_PASSED_OVER for handle in queue.handles.values())


@pytest.mark.parametrize("reports", [True, False], ids=["says None", "no method"])
def test_a_replica_that_does_not_say_its_partition_is_served_in_submission_order(make_queue, reports) -> None:
    replica = GatedReplica(None, pinned=True, reports=reports)
    queue = make_queue(replica)
    queue.occupy()
    names = ["ref 1", "t2va", "ref 2", "fl2va"]
    for task, name in zip(("ref2va", "t2va", "ref2va", "fl2va"), names, strict=True):
        queue.submit(task, name)
    for taken, name in enumerate(["blocker 0", *names[:-1]], start=2):
        queue.release_and_wait(name, replica, taken)
    assert replica.ran == ["blocker 0", *names]
    assert all(handle.passed_over == 0 for handle in queue.handles.values())


def test_positions_after_a_reorder_are_the_submission_order_of_the_jobs_left(make_queue) -> None:
    replica = GatedReplica("fl2va")
    queue = make_queue(replica)
    queue.occupy()
    for task, name in (("ref2va", "ref 1"), ("t2va", "t2va"), ("ref2va", "ref 2"), ("fl2va", "fl2va")):
        queue.submit(task, name)
    waiting = ("ref 1", "t2va", "ref 2", "fl2va")
    assert queue.positions(*waiting) == {"ref 1": 1, "t2va": 2, "ref 2": 3, "fl2va": 4}
    queue.release_and_wait("blocker 0", replica, 2)
    assert replica.ran[-1] == "t2va"
    assert queue.positions(*waiting) == {"ref 1": 1, "ref 2": 2, "fl2va": 3}
    queue.release_and_wait("t2va", replica, 3)
    assert replica.ran[-1] == "fl2va"
    assert queue.positions(*waiting) == {"ref 1": 1, "ref 2": 2}


def test_a_waiting_job_can_be_cancelled_also_after_it_was_passed_over(make_queue) -> None:
    replica = GatedReplica("fl2va")
    queue = make_queue(replica)
    queue.occupy()
    for task, name in (("ref2va", "ref 1"), ("t2va", "t2va 1"), ("ref2va", "ref 2"), ("t2va", "t2va 2")):
        queue.submit(task, name)
    queue.release_and_wait("blocker 0", replica, 2)
    assert replica.ran[-1] == "t2va 1" and queue.handles["ref 1"].passed_over == 1
    waiting = ("ref 1", "ref 2", "t2va 2")
    assert queue.positions(*waiting) == {"ref 1": 1, "ref 2": 2, "t2va 2": 3}

    queue.front.cancel(queue.handles["ref 1"])
    assert queue.handles["ref 1"].drain()[-1] == JobFailed(
        queue.handles["ref 1"].job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE
    )
    assert queue.positions(*waiting) == {"ref 2": 1, "t2va 2": 2}
    queue.front.cancel(queue.handles["t2va 2"])  # the job this replica would prefer next
    queue.release_and_wait("t2va 1", replica, 3)
    replica.release("ref 2")
    wait_until(lambda: queue.front.waiting == 0 and queue.front.running == 0)
    assert replica.ran == ["blocker 0", "t2va 1", "ref 2"]


def test_two_replicas_holding_different_partitions_each_take_their_own_jobs(make_queue) -> None:
    fl2va, ref2va = GatedReplica("fl2va", pinned=True), GatedReplica("ref2va", pinned=True)
    queue = make_queue(fl2va, ref2va)
    queue.occupy()
    for task, name in (("ref2va", "ref 1"), ("t2va", "t2va"), ("ref2va", "ref 2"), ("fl2va", "fl2va")):
        queue.submit(task, name)
    queue.release_and_wait(fl2va.ran[0], fl2va, 2)
    queue.release_and_wait(ref2va.ran[0], ref2va, 2)
    queue.release_and_wait(fl2va.ran[1], fl2va, 3)
    queue.release_and_wait(ref2va.ran[1], ref2va, 3)
    assert fl2va.ran[1:] == ["t2va", "fl2va"]
    assert ref2va.ran[1:] == ["ref 1", "ref 2"]


def test_a_pipelined_replica_judges_by_the_partition_of_the_jobs_it_has_in_flight(make_queue) -> None:
    # Its report lags (pinned at fl2va, as before a just-taken job has started); the jobs it holds are ref2va.
    replica = GatedReplica("fl2va", pinned=True, jobs_in_flight=2)
    queue = make_queue(replica)
    queue.submit("ref2va", "ref 0")
    queue.submit("ref2va", "ref 1")
    wait_until(lambda: len(replica.ran) == 2)
    queue.submit("t2va", "t2va")
    queue.submit("ref2va", "ref 2")
    queue.release_and_wait("ref 1", replica, 3)  # "ref 0" is still in flight
    assert replica.ran[-1] == "ref 2"


def test_next_job_index_rule() -> None:
    def jobs(*tasks_and_passes: tuple[str, int]) -> list[JobHandle]:
        made = []
        for number, (task, passes) in enumerate(tasks_and_passes):
            handle = JobHandle(str(number), GenerationRequest(task=task, prompt=""), Path(f"{number}.mp4"))
            handle.passed_over = passes
            made.append(handle)
        return made

    assert next_job_index(jobs(("ref2va", 0), ("t2va", 0)), "fl2va") == 1
    assert next_job_index(jobs(("ref2va", 0), ("t2va", 0)), None) == 0
    assert next_job_index(jobs(("ref2va", 0), ("ref2va", 0)), "fl2va") == 0  # none matches: the oldest
    assert next_job_index(jobs(("ref2va", 0), ("a future task", 0)), "fl2va") == 1  # no partition: matches
    assert next_job_index(jobs(("ref2va", MAX_PASSED_OVER), ("t2va", 0)), "fl2va") == 0
    assert next_job_index(jobs(("ref2va", MAX_PASSED_OVER - 1), ("t2va", 0)), "fl2va") == 1


# --- the replicas' own reports -------------------------------------------------------------------------------


class FakeIncarnation:
    def wait_ready(self, abort: threading.Event) -> object:
        return SimpleNamespace(first_partition="fl2va")

    def kill(self) -> None:
        pass

    def stop(self) -> None:
        pass


class FakeProcessReplica(RestartingReplica[FakeIncarnation]):
    def __init__(self) -> None:
        self._start_first()

    def _start_incarnation(self) -> FakeIncarnation:
        return FakeIncarnation()

    def _serves(self, current: FakeIncarnation) -> bool:
        return True


def test_a_process_replica_reports_the_first_partition_then_the_last_started_jobs_then_the_first() -> None:
    replica = FakeProcessReplica()
    try:
        assert replica.partition_on_device() == "fl2va"
        replica._started(JobHandle("a", GenerationRequest(task="ref2va", prompt=""), Path("a.mp4")))
        assert replica.partition_on_device() == "ref2va"
        replica._started(JobHandle("b", GenerationRequest(task="a future task", prompt=""), Path("b.mp4")))
        assert replica.partition_on_device() == "ref2va"  # a task of no partition leaves the DiT where it is
        replica._replace(replica._current)
        assert replica.partition_on_device() == "fl2va"  # the new incarnation loads the first partition
        replica._restart.join(WAIT_S)
        assert replica._current is not None and replica.partition_on_device() == "fl2va"
    finally:
        replica.close()


def test_an_engine_replica_reports_its_model_stores_partition() -> None:
    replica = EngineReplica.__new__(EngineReplica)  # no engine to load: only the store is read
    replica.engine = SimpleNamespace(store=SimpleNamespace(partition_on_device="ref2va"))
    assert replica.partition_on_device() == "ref2va"
    replica.engine = SimpleNamespace(store=SimpleNamespace(partition_on_device=None))  # before any partition
    assert replica.partition_on_device() is None
