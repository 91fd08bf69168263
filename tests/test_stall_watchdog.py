"""The stall watchdog (`--stall-timeout`) and ending jobs of ranks that do not answer, on CPU ranks (gloo).

What is checked:
* The derived limit follows README's rule (a floor, the slowest step, the longest start) and an explicit one is
  exact; the slowest step is read from the steps' reports, also when some were dropped; the flag refuses anything
  but a positive number of seconds, naming it, in the CLI and the app.
* SIGSTOP on a rank of a two-rank worker group mid-job: that job fails within the limit with a sentence that says it
  stopped making progress and for how long; the group is killed (the stopped rank too) and restarted; a job queued
  behind it finishes on the new group; a staging file the killed rank 0 left in the outputs folder is removed and
  another process's is kept.
* Cancel with a frozen rank ends the job within the cancel grace, not the (long) stall limit; the next job finishes.
* Shutdown with a frozen rank mid-job returns within seconds and leaves no rank process.
* SIGSTOP on the DiT rank of split stage groups: only that job fails, naming the DiT group; the queued job finishes;
  a cancel with the DiT rank stopped ends its job within the cancel grace (shutdown: tests/test_split_stages.py).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from pathlib import Path

import pytest
from _refusals import cli_refused, refused
from _runtime_helpers import events_until_done, parity_requests, process_exists, wait_for_step

import app
from h3engine.cli.main import main
from h3engine.engine.options import EngineOptions
from h3engine.errors import RequestError
from h3engine.models.parallel.groups import RuntimeLayout
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFailed, JobFinished, StepProgress
from h3engine.runtime.split import SplitReplica
from h3engine.runtime.supervision import STALL_FLOOR_S, Pace, StallPolicy, checked_stall_timeout
from h3engine.runtime.workers import ProcessReplica

SEED = 11
STALL_S = 8.0
# A stalled job is reported within its limit and one poll of the pipes, plus what judging and killing take on a
# busy machine.
REPORT_MARGIN_S = 3.0
EVENT_TIMEOUT_S = 120
SHORT = parity_requests(2, SEED)["t2va"]
# Steps of about 0.4 s on two busy cores: the job is mid-step whenever a rank is frozen. Few enough steps that what
# the DiT prepares for all of them before the first (its modulation tables) stays well within the stall limit.
LONG_REQUEST = GenerationRequest(
    task="t2va", prompt="a long one", steps=100, duration_seconds=15.0, width=112, height=64
)
STALLED = re.compile(
    r"The job stopped making progress: no word from the (?P<who>.+) for (?P<seconds>\d+) s; "
    r"the (worker group is|stage groups are) restarting\."
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=SEED)


@pytest.fixture(scope="module")
def group(checkpoint, tmp_path_factory):
    """A two-rank CPU worker group behind a front; each test sets the stall policy it needs (`replica.stall`)."""
    replica = ProcessReplica(checkpoint, ("cpu", "cpu"), options=EngineOptions(dtype="float32"))
    front = EngineFront([replica], tmp_path_factory.mktemp("stall_outputs"))
    yield front, replica
    front.shutdown()


class Frozen:
    """SIGSTOP to `pid` for the block; SIGCONT after it, should the process still be there."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> float:
        os.kill(self.pid, signal.SIGSTOP)
        return time.monotonic()

    def __exit__(self, *exc_info: object) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def assert_stalled(failed: object, who: str, at_least_s: float) -> None:
    assert isinstance(failed, JobFailed) and failed.kind == "engine", failed
    match = STALLED.fullmatch(failed.message)
    assert match is not None and match["who"] == who, failed.message
    assert at_least_s <= int(match["seconds"]) <= at_least_s + REPORT_MARGIN_S, failed.message


# --------------------------------------------------------------------------------------------------------------
# The rule and the flag (no process started)
# --------------------------------------------------------------------------------------------------------------


def steps(job_id: str, *reports: tuple[int, float]) -> list[StepProgress]:
    return [StepProgress(job_id, step, 50, elapsed, 0.0) for step, elapsed in reports]


def test_the_derived_limit_is_the_longest_of_the_floor_the_slowest_step_and_the_start() -> None:
    pace = Pace()
    assert pace.stall_limit_s(StallPolicy()) == STALL_FLOOR_S
    # Steps of 2 s, then a report after two dropped ones: steps 4 to 6 took 105 s in all, 35 s each.
    for report in steps("a", (1, 2.0), (2, 4.0), (3, 6.0), (6, 111.0)):
        pace.step(report)
    assert pace.slowest_step_s == 35.0
    pace.step(steps("b", (1, 50.0))[0])  # a new job's first report: its first step took 50 s
    assert pace.slowest_step_s == 50.0
    assert pace.stall_limit_s(StallPolicy()) == 500.0
    pace.started(400.0)
    assert pace.stall_limit_s(StallPolicy()) == 800.0
    assert pace.stall_limit_s(StallPolicy(timeout_s=7.0)) == 7.0  # the flag's value, exactly
    assert pace.cancel_grace_s(StallPolicy(cancel_grace_s=10.0)) == 100.0  # two of the slowest steps


@pytest.mark.parametrize("value", [0.0, -5.0, float("inf"), float("nan")])
def test_the_flag_wants_a_positive_number_of_seconds(value, tmp_path, capsys) -> None:
    # The rule's wording here, once; the CLI and the app name the flag.
    with refused(RequestError, field="--stall-timeout", says="must be a positive number of seconds"):
        checked_stall_timeout(value)
    assert checked_stall_timeout(90.0) == 90.0 and checked_stall_timeout(None) is None
    arguments = ["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "o.mp4")]
    assert main([*arguments, "--device", "cpu", "--world-size", "2", "--stall-timeout", str(value)]) == 2
    cli_refused(capsys.readouterr().err, "--stall-timeout")
    config = app.parse_config(["--stall-timeout", str(value), "--outputs", str(tmp_path)], {})
    with pytest.raises(app.ConfigError, match="^--stall-timeout: "):  # no field but its text's: the flag
        app.check_before_loading(config)
    with pytest.raises(app.ConfigError, match="^--stall-timeout: invalid float value: 'soon'"):
        app.parse_config(["--stall-timeout", "soon"], {})
    assert app.parse_config([], {"H3_STALL_TIMEOUT": "42"}).stall_timeout == 42.0


# --------------------------------------------------------------------------------------------------------------
# A worker group
# --------------------------------------------------------------------------------------------------------------


def test_a_frozen_rank_fails_only_its_job_and_the_queued_one_runs_on_a_new_group(group) -> None:
    front, replica = group
    replica.stall = StallPolicy(timeout_s=STALL_S)
    held = front.submit(LONG_REQUEST)
    queued = front.submit(SHORT)
    wait_for_step(held, 2, EVENT_TIMEOUT_S)
    old_ranks = replica.worker_pids
    # What rank 0 would leave when killed while writing: its staging file beside the job's MP4 (and one of a live
    # process, this one, which must stay).
    killed_rank_leftover = held.out_path.with_name(
        f".{held.out_path.name}.{old_ranks[0]}-{secrets.token_hex(6)}.partial"
    )
    live_leftover = held.out_path.with_name(f".other.mp4.{os.getpid()}-{secrets.token_hex(6)}.partial")
    for leftover in (killed_rank_leftover, live_leftover):
        leftover.write_bytes(b"half a video")
    with Frozen(old_ranks[1]) as frozen_at:
        failed = events_until_done(held, EVENT_TIMEOUT_S)[-1]
        assert time.monotonic() - frozen_at <= STALL_S + REPORT_MARGIN_S
    assert_stalled(failed, "worker group", STALL_S)
    assert not any(process_exists(pid) for pid in old_ranks)  # the frozen rank too
    assert not killed_rank_leftover.exists() and live_leftover.exists()
    live_leftover.unlink()
    assert isinstance(events_until_done(queued, EVENT_TIMEOUT_S)[-1], JobFinished)
    assert not set(replica.worker_pids) & set(old_ranks)


def test_cancel_with_a_frozen_rank_ends_the_job_within_the_grace(group) -> None:
    front, replica = group
    replica.stall = StallPolicy(timeout_s=EVENT_TIMEOUT_S, cancel_grace_s=1.0)
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    old_ranks = replica.worker_pids
    with Frozen(old_ranks[0]):
        front.cancel(handle)
        cancelled_at = time.monotonic()
        grace = replica.pace.cancel_grace_s(replica.stall)
        failed = events_until_done(handle, EVENT_TIMEOUT_S)[-1]
        assert time.monotonic() - cancelled_at <= grace + REPORT_MARGIN_S
    assert isinstance(failed, JobFailed) and failed.kind == "cancelled", failed
    assert re.fullmatch(
        r"Cancelled; the worker group did not answer for \d+ s, so the worker group is restarting\.",
        failed.message,
    ), failed.message
    assert not any(process_exists(pid) for pid in old_ranks)
    assert isinstance(events_until_done(front.submit(SHORT), EVENT_TIMEOUT_S)[-1], JobFinished)


def test_shutdown_with_a_frozen_rank_returns_within_seconds(group) -> None:
    front, replica = group  # the last test of the group: it ends it
    replica.stall = StallPolicy()
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    ranks = replica.worker_pids
    with Frozen(ranks[1]):
        started = time.monotonic()
        front.shutdown()
        took = time.monotonic() - started
    assert took < 8.0, took
    assert events_until_done(handle, EVENT_TIMEOUT_S)[-1].kind == "cancelled"
    assert not any(process_exists(pid) for pid in ranks)


# --------------------------------------------------------------------------------------------------------------
# Split stage groups
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split(checkpoint, tmp_path_factory):
    layout = RuntimeLayout.choose(1, stages="split")
    stall = StallPolicy(timeout_s=STALL_S, cancel_grace_s=1.0)
    replica = SplitReplica(checkpoint, ("cpu",), layout, options=EngineOptions(dtype="float32"), stall=stall)
    front = EngineFront([replica], tmp_path_factory.mktemp("split_stall_outputs"))
    yield front, replica
    front.shutdown()


def test_a_frozen_stage_rank_fails_only_its_job(split) -> None:
    front, replica = split
    held = front.submit(LONG_REQUEST)
    wait_for_step(held, 2, EVENT_TIMEOUT_S)
    queued = front.submit(SHORT)
    old_pids = [pid for pids in replica.worker_pids.values() for pid in pids]
    with Frozen(replica.worker_pids["dit"][0]) as frozen_at:
        failed = events_until_done(held, EVENT_TIMEOUT_S)[-1]
        assert time.monotonic() - frozen_at <= STALL_S + REPORT_MARGIN_S
    assert_stalled(failed, "DiT group", STALL_S)
    # It started over on the new groups, which start once the old ones are gone.
    assert isinstance(events_until_done(queued, EVENT_TIMEOUT_S)[-1], JobFinished)
    assert not any(process_exists(pid) for pid in old_pids)


def test_cancel_with_a_frozen_stage_rank_ends_the_job_within_the_grace(split) -> None:
    front, replica = split
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    with Frozen(replica.worker_pids["dit"][0]):
        front.cancel(handle)
        cancelled_at = time.monotonic()
        grace = replica.pace.cancel_grace_s(replica.stall)
        failed = events_until_done(handle, EVENT_TIMEOUT_S)[-1]
        took = time.monotonic() - cancelled_at
    assert took <= grace + REPORT_MARGIN_S and grace + REPORT_MARGIN_S < STALL_S, (took, grace)
    assert isinstance(failed, JobFailed) and failed.kind == "cancelled", failed
    assert re.fullmatch(
        r"Cancelled; the DiT group did not answer for \d+ s, so the stage groups are restarting\.",
        failed.message,
    ), failed.message
