"""Units of the split stage layout, in-process (no process is started; threads are ordered by event waits).

What is checked: `Turns` admits each step's tickets one at a time in ticket order, each step on its own (a job may
prepare while an older one denoises), wakes the next ticket when a step is done or a ticket leaves, skips tickets
that left, and a wait whose turn does not come returns False; `FirstStartOnly` lets only a job's first `JobStarted`
through; `detach_tensors` / `attach_tensors` split a nested value into a small picklable skeleton and its tensors
by dotted path and rebuild it; `receive_job` drops older jobs' sends and refuses a newer one, naming both jobs.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _runtime_helpers import at_path

from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import JobHandle
from h3engine.runtime.messages import JobFinished, JobQueued, JobStarted, StepProgress
from h3engine.runtime.split import FirstStartOnly
from h3engine.runtime.stage_groups import STEPS, Turns
from h3engine.runtime.stages import TensorSlot, attach_tensors, detach_tensors, receive_job

# A due turn comes at once. A job's thread waits for its turn up to twice as long as the test waits for it, so a
# thread that was never woken (its wait timing out, then finding its turn) fails the test.
WAIT_S = 10.0


# --- turn-taking -----------------------------------------------------------------------------------------


class WaitSignallingCondition(threading.Condition):
    """A Condition that tells the test each time a thread starts waiting on it: the test then knows that a job's
    thread is blocked on its turn before it lets an older job go on."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Semaphore(0)

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.release()
        return super().wait(timeout)


def watched_turns() -> tuple[Turns, WaitSignallingCondition]:
    turns = Turns()
    condition = WaitSignallingCondition()
    turns._condition = condition  # before any ticket: every wait goes through it
    return turns, condition


def admitted_now(turns: Turns, step: str, ticket: int) -> bool:
    return turns.wait(step, ticket, timeout=0)


def test_each_step_admits_one_ticket_at_a_time_in_ticket_order() -> None:
    turns = Turns()
    first, second, third = turns.ticket(), turns.ticket(), turns.ticket()
    assert (first, second, third) == (0, 1, 2)
    for step in STEPS:
        assert admitted_now(turns, step, first)
        assert not admitted_now(turns, step, second) and not admitted_now(turns, step, third)
        turns.done(step, first)
        assert admitted_now(turns, step, second) and not admitted_now(turns, step, third)
        turns.done(step, second)
        assert admitted_now(turns, step, third)


def test_steps_take_turns_independently_so_jobs_overlap() -> None:
    turns = Turns()
    older, newer = turns.ticket(), turns.ticket()
    for step in ("prepare", "encode"):
        turns.done(step, older)
    # The older job denoises (not done yet): the newer one prepares and encodes meanwhile, then waits to denoise.
    assert admitted_now(turns, "denoise", older)
    for step in ("prepare", "encode"):
        assert admitted_now(turns, step, newer)
        turns.done(step, newer)
    assert not admitted_now(turns, "denoise", newer)
    turns.done("denoise", older)
    assert admitted_now(turns, "denoise", newer)


def test_blocked_jobs_are_woken_in_ticket_order_through_every_step() -> None:
    turns, condition = watched_turns()
    tickets = [turns.ticket() for _ in range(3)]
    admitted: list[tuple[str, int]] = []

    def run(ticket: int) -> None:
        for step in STEPS:
            assert turns.wait(step, ticket, 2 * WAIT_S), f"ticket {ticket} never got its {step} turn"
            admitted.append((step, ticket))
            turns.done(step, ticket)

    with ThreadPoolExecutor(2) as pool:
        # The newest job starts first; both newer jobs are blocked before the oldest takes any step.
        futures = [pool.submit(run, tickets[2]), pool.submit(run, tickets[1])]
        for _ in futures:
            assert condition.waiting.acquire(timeout=WAIT_S), "a job's thread never waited for its turn"
        run(tickets[0])
        for future in futures:
            future.result(timeout=WAIT_S)
    for step in STEPS:
        assert [ticket for taken, ticket in admitted if taken == step] == tickets, step


def test_a_job_that_leaves_before_its_turn_does_not_block_the_next() -> None:
    turns, condition = watched_turns()
    first, leaving, last = turns.ticket(), turns.ticket(), turns.ticket()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(turns.wait, "prepare", last, 2 * WAIT_S)
        assert condition.waiting.acquire(timeout=WAIT_S)
        turns.leave(leaving)  # cancelled while it waited: nothing moves yet, the first job still prepares
        assert not admitted_now(turns, "prepare", last)
        turns.done("prepare", first)
        assert waiting.result(timeout=WAIT_S) is True
    for step in STEPS[1:]:  # the ticket that left is skipped at every later step too
        turns.done(step, first)
        assert admitted_now(turns, step, last)


def test_a_job_that_leaves_in_the_middle_of_a_step_hands_it_on() -> None:
    turns, condition = watched_turns()
    failing, next_job, later = turns.ticket(), turns.ticket(), turns.ticket()
    turns.done("prepare", failing)
    turns.done("prepare", next_job)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(turns.wait, "encode", next_job, 2 * WAIT_S)
        assert condition.waiting.acquire(timeout=WAIT_S)
        turns.leave(failing)  # it failed while encoding: it never says done
        assert waiting.result(timeout=WAIT_S) is True
    # A step already past the ticket that left stays where it was.
    assert admitted_now(turns, "prepare", later) and not admitted_now(turns, "prepare", next_job)


def test_a_wait_whose_turn_does_not_come_times_out_and_says_so() -> None:
    turns = Turns()
    first, second = turns.ticket(), turns.ticket()
    started = time.monotonic()
    assert turns.wait("prepare", second, timeout=0.05) is False
    assert time.monotonic() - started >= 0.05
    assert turns.wait("prepare", first, timeout=0.05) is True


# --- the first-start filter ------------------------------------------------------------------------------


def test_only_a_jobs_first_start_reaches_its_handle() -> None:
    handle = JobHandle("job", GenerationRequest(task="t2va", prompt=""), Path("job.mp4"))
    publish = FirstStartOnly(handle)
    first_start = JobStarted("job", 0, 1.5, width=64, height=64, frames=9, fps=24, latent_frames=3)
    # The job starts, takes a step, starts over on restarted groups (its steps count from 1 again) and finishes.
    messages = [
        JobQueued("job", position=1),
        first_start,
        StepProgress("job", step=1, total=4, elapsed_s=0.1, eta_s=0.3),
        replace(first_start, queue_wait_s=9.0),
        StepProgress("job", step=1, total=4, elapsed_s=0.1, eta_s=0.3),
        replace(first_start, queue_wait_s=12.0),
        JobFinished("job", "job.mp4", "job.json", 7, 64, 64, 9, 24, {"total_s": 1.0}),
    ]
    for message in messages:
        publish(message)
    assert handle.drain() == [messages[0], first_start, messages[2], messages[4], messages[6]]


# --- tensor skeletons ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckedShare:
    """Frozen, and its __init__ refuses anything but a tensor: a skeleton must be rebuilt without calling it."""

    values: torch.Tensor
    label: str

    def __post_init__(self) -> None:
        if not isinstance(self.values, torch.Tensor):
            raise TypeError("values must be a tensor")


@dataclass
class NestedJob:
    share: CheckedShare
    rows: list[Any]
    pair: tuple[torch.Tensor, torch.Tensor]
    extras: dict[str, Any]
    nothing: None = None


def nested_job() -> NestedJob:
    return NestedJob(
        share=CheckedShare(torch.arange(6, dtype=torch.float32).reshape(2, 3), "video"),
        rows=[torch.ones(2, dtype=torch.bfloat16), None, "text", 3],
        pair=(torch.tensor([1, 2], dtype=torch.int64), torch.tensor([True, False])),
        extras={
            "mask": torch.zeros(4, dtype=torch.uint8),
            "deep": {"big": torch.randn(256, 256)},
            "no": None,
        },
    )


DOTTED_PATHS = ["share.values", "rows.0", "pair.0", "pair.1", "extras.mask", "extras.deep.big"]


def test_a_skeleton_holds_slots_by_dotted_path_and_no_tensor_data() -> None:
    job = nested_job()
    skeleton, tensors = detach_tensors(job)
    assert list(tensors) == DOTTED_PATHS
    assert tensors["extras.deep.big"] is job.extras["deep"]["big"]
    assert all(at_path(skeleton, path) == TensorSlot(path) for path in DOTTED_PATHS)
    assert isinstance(job.share.values, torch.Tensor)  # the value itself is left as it was
    assert len(pickle.dumps(skeleton)) < 2_000 < tensors["extras.deep.big"].nbytes
    # The same paths for another value of the same shape (the consumer finds its tensors by them); a prefix leads.
    assert list(detach_tensors(nested_job())[1]) == DOTTED_PATHS
    assert list(detach_tensors(nested_job(), "job")[1]) == [f"job.{path}" for path in DOTTED_PATHS]


def test_a_skeleton_and_its_tensors_rebuild_the_value() -> None:
    job = nested_job()
    skeleton, tensors = detach_tensors(job)
    rebuilt = attach_tensors(pickle.loads(pickle.dumps(skeleton)), tensors)
    assert type(rebuilt) is NestedJob and type(rebuilt.share) is CheckedShare
    assert isinstance(rebuilt.rows, list) and isinstance(rebuilt.pair, tuple)
    assert rebuilt.rows[1:] == [None, "text", 3] and rebuilt.share.label == "video"
    assert rebuilt.nothing is None and rebuilt.extras["no"] is None
    for path, tensor in tensors.items():
        assert at_path(rebuilt, path) is tensor, path
    assert at_path(attach_tensors(skeleton, {}), "pair.1") == TensorSlot(
        "pair.1"
    )  # a slot with no tensor stays


# --- receiving a job's tensors ---------------------------------------------------------------------------


class FakeConsumer:
    """A `ChannelConsumer`'s receive and release over sends queued in advance; records what was released."""

    def __init__(self, *sends: tuple[int, dict[str, torch.Tensor]]) -> None:
        self.sends = deque(sends)
        self.released: list[int] = []
        # receive_job names the channel through the consumer's private `_channel`.
        self._channel = SimpleNamespace(describe="latents to vae rank 0")

    def receive(self, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        return self.sends.popleft()

    def release(self, tag: int) -> None:
        self.released.append(tag)


def test_receive_job_drops_older_jobs_and_copies_its_own() -> None:
    own = torch.arange(4.0)
    consumer = FakeConsumer((1, {"video": torch.ones(1)}), (2, {"video": torch.ones(2)}), (3, {"video": own}))
    received = receive_job(consumer, 3, torch.device("cpu"))
    assert torch.equal(received["video"], own) and received["video"].data_ptr() != own.data_ptr()
    assert consumer.released == [1, 2, 3] and not consumer.sends


def test_receive_job_refuses_a_newer_job_naming_both() -> None:
    consumer = FakeConsumer((2, {"video": torch.zeros(1)}), (5, {"video": torch.ones(1)}))
    with pytest.raises(RuntimeError, match=r"^latents to vae rank 0: job 5 arrived before job 3$"):
        receive_job(consumer, 3, torch.device("cpu"))
    assert consumer.released == [2, 5]
