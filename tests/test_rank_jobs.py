"""What worker ranks and stage ranks share (h3engine.runtime.rank_jobs, .rank_process), in this process.

What is checked:
* The exception ladder (`messages.job_failed`): a cancel, a request error, running out of GPU memory and anything
  else each become their own `JobFailed`; only the last two are logged with their traceback.
* `JobRank.end_job`: a step a rank did alone ends the job on any error; a collective step ends it only on a cancel
  or out of memory in a group of one, raises `RankOutOfMemory` in a larger group and anything else as it is; an MP4
  writer's failure is reported as its cause; only rank 0 reports.
* The cancel vote: true on every rank when any rank's slot holds this job's number, false for another job's.
* `JobRank.prepare`: the start is announced before preparing; a bad request ends the job before it starts, and a
  cancel slot set while preparing ends it as cancelled.
* `JobRank.finish`: rank 0 commits the files after `before_commit` and then reports the end; a failure writing is
  this job's alone (reported, no staging file left); a VAE group of several that votes to cancel decodes nothing.
* A rank's engine plans under the engine options its spec carries whole (dtype, memory flags, its share); a
  rank's outbox delivers what was posted in order when closed; `Stop` or a closed pipe ends the command loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed

from h3engine.engine.options import EngineOptions
from h3engine.engine.pipeline import DenoisedLatents, Mp4WriteError
from h3engine.errors import GenerationCancelled, RequestError
from h3engine.memory.engine_plan import MemoryRequest
from h3engine.memory.sizes import RankShare
from h3engine.models.parallel.groups import EncoderLayout, GroupMembership, ParallelLayout, VAELayout
from h3engine.request.model import GenerationRequest
from h3engine.runtime import rank_jobs, rank_process
from h3engine.runtime.job_protocol import NO_JOB, RankOutOfMemory, RunJob, Stop, WorkerSpec
from h3engine.runtime.messages import (
    CANCELLED_MESSAGE,
    ENGINE_FAILURE_MESSAGE,
    JobFailed,
    JobFinished,
    JobStarted,
    job_failed,
)
from h3engine.runtime.rank_jobs import JobRank, RankGroups

OUT_OF_MEMORY_MESSAGE = "--gpu-memory: 10 GiB did not hold this request; lower the resolution"
GEOMETRY = SimpleNamespace(width=64, height=48, frames=9, latent_frames=3)
DELIVERY_TIMEOUT_S = 5.0


class FakeEngine:
    """The parts of an `Engine` the shared steps call; `prepare` runs `on_prepare(should_cancel)`."""

    def __init__(self, on_prepare: Any = None, problem: Exception | None = None) -> None:
        self.placement = SimpleNamespace(out_of_memory_message=lambda: OUT_OF_MEMORY_MESSAGE)
        self.device = torch.device("cpu")
        self._on_prepare = on_prepare
        self._problem = problem

    def resolved(self, request: Any) -> Any:
        """The request as resolved (the door's, or resolved here): the memory check that may refuse it."""
        if self._problem is not None:
            raise self._problem
        return SimpleNamespace(request=getattr(request, "request", request), geometry=GEOMETRY)

    def prepare(self, request: GenerationRequest, should_cancel: Any) -> Any:
        return self._on_prepare(should_cancel) if self._on_prepare else "prepared"

    def record(self, request: GenerationRequest) -> dict[str, Any]:
        return {}


class Posted:
    """An outbox that keeps what was posted or offered."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def post(self, message: Any) -> None:
        self.messages.append(message)

    offer = post


def member(size: int, rank: int = 0) -> GroupMembership:
    return GroupMembership(None, size, rank)


def job_rank(
    rank: int = 0, size: int = 1, engine: Any = None, vae: GroupMembership | None = None, slot: int = NO_JOB
) -> JobRank:
    groups = RankGroups(rank, dit=None, encoder=None, vae=vae, control=member(size, rank))  # type: ignore[arg-type]
    return JobRank(engine or FakeEngine(), groups, Posted(), SimpleNamespace(value=slot))  # type: ignore[arg-type]


def run_job(folder: Path | None = None, number: int = 7) -> RunJob:
    out = folder / "out.mp4" if folder is not None else Path("out.mp4")
    request = GenerationRequest(task="t2va", prompt="a fox")
    return RunJob(number, f"job-{number}", request, str(out), None, 0.0, 0, 5)


def raised(error: Exception) -> Exception:
    """`error` as it is when caught: raised, with a traceback."""
    try:
        raise error
    except Exception as caught:
        return caught


# --- the ladder -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind", "message", "logged"),
    [
        (GenerationCancelled("generation cancelled"), "cancelled", CANCELLED_MESSAGE, False),
        (
            RequestError("seed", "must be at least 0, got -1"),
            "request",
            "seed: must be at least 0, got -1",
            False,
        ),
        (torch.OutOfMemoryError("CUDA out of memory"), "engine", OUT_OF_MEMORY_MESSAGE, True),
        (KeyError("video"), "engine", ENGINE_FAILURE_MESSAGE, True),
    ],
    ids=["cancelled", "request", "out-of-memory", "internal"],
)
def test_the_ladder_maps_each_error_to_its_report(error, kind, message, logged, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="h3engine.runtime.messages"):
        report = job_failed("job-1", raised(error), FakeEngine(), "while testing", Path("outputs"))
    assert report == JobFailed("job-1", kind, message)
    tracebacks = [record for record in caplog.records if record.exc_info is not None]
    assert len(tracebacks) == (1 if logged else 0)
    if logged:
        assert tracebacks[0].getMessage() == "job job-1 failed while testing"


# --- end_job ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), torch.OutOfMemoryError("CUDA"), RequestError("x", "bad")]
)
def test_a_step_done_alone_ends_the_job_on_any_error(error) -> None:
    rank = job_rank(size=2)
    rank.end_job(run_job(), raised(error), "while preparing", alone=True)
    assert rank.outbox.messages == [
        job_failed("job-7", error, rank.engine, "", Path(run_job().out_path).parent)
    ]


def test_a_collective_step_ends_the_job_on_an_agreed_cancel_reported_by_rank_0_only() -> None:
    first, second = job_rank(rank=0, size=2), job_rank(rank=1, size=2)
    for rank in (first, second):
        rank.end_job(run_job(), raised(GenerationCancelled("cancelled")), "while denoising", alone=False)
    assert first.outbox.messages == [JobFailed("job-7", "cancelled", CANCELLED_MESSAGE)]
    assert second.outbox.messages == []


def test_out_of_memory_in_a_collective_step_ends_the_job_alone_and_breaks_a_larger_group() -> None:
    alone = job_rank(size=1)
    alone.end_job(run_job(), raised(torch.OutOfMemoryError("CUDA")), "while denoising", alone=False)
    assert alone.outbox.messages == [JobFailed("job-7", "engine", OUT_OF_MEMORY_MESSAGE)]
    grouped = job_rank(size=2)
    with pytest.raises(RankOutOfMemory, match="^--gpu-memory: 10 GiB"):
        grouped.end_job(run_job(), raised(torch.OutOfMemoryError("CUDA")), "while denoising", alone=False)
    assert grouped.outbox.messages == []


@pytest.mark.parametrize("size", [1, 2])
def test_any_other_error_in_a_collective_step_is_raised_as_it_is(size) -> None:
    rank = job_rank(size=size)
    error = raised(KeyError("video"))
    with pytest.raises(KeyError) as caught:
        rank.end_job(run_job(), error, "while denoising", alone=False)
    assert caught.value is error and rank.outbox.messages == []


@pytest.mark.parametrize(
    ("cause", "expected"),
    [
        (
            OSError(28, "No space left on device"),
            JobFailed("job-7", "engine", "The disk of the outputs folder is full ("),
        ),
        (
            RequestError("out_path", "folder is gone"),
            JobFailed("job-7", "request", "out_path: folder is gone"),
        ),
    ],
)
def test_an_mp4_writers_failure_is_the_jobs_alone_and_reported_as_its_cause(cause, expected) -> None:
    rank = job_rank(size=2)
    try:
        raise Mp4WriteError("writing the MP4 failed") from cause
    except Mp4WriteError as error:
        rank.end_job(run_job(), error, "while decoding", alone=False)
    [message] = rank.outbox.messages
    assert (message.job_id, message.kind) == (expected.job_id, expected.kind)
    assert message.message.startswith(expected.message)


# --- the cancel vote --------------------------------------------------------------------------------------------


def test_the_cancel_vote_is_true_on_every_rank_when_any_slot_holds_the_job(monkeypatch) -> None:
    partner_votes = 0

    def all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
        tensor += partner_votes  # what the other rank of the group voted

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    job = run_job(number=7)
    for slot, partner_votes, expected in [
        (NO_JOB, 0, False),
        (6, 0, False),  # another job's number
        (7, 0, True),  # this rank saw the cancel
        (NO_JOB, 1, True),  # only its partner did
    ]:
        assert job_rank(size=2, slot=slot).cancel_vote(job)() is expected, (slot, partner_votes)


def test_a_group_of_one_votes_alone_and_work_done_alone_checks_its_own_slot() -> None:
    job = run_job(number=3)
    assert job_rank(slot=3).cancel_vote(job)() and not job_rank(slot=2).cancel_vote(job)()
    assert job_rank(size=2, slot=3).own_cancel_check(job)()
    assert not job_rank(size=2, slot=NO_JOB).own_cancel_check(job)()


# --- prepare ----------------------------------------------------------------------------------------------------


def test_prepare_announces_the_start_and_returns_the_prepared_request() -> None:
    rank = job_rank()
    assert rank.prepare(run_job()) == ("prepared", [])
    [started] = rank.outbox.messages
    assert isinstance(started, JobStarted) and (started.width, started.height) == (64, 48)


def test_a_bad_request_ends_the_job_before_it_starts() -> None:
    rank = job_rank(engine=FakeEngine(problem=RequestError("prompt", "must not be empty")))
    assert rank.prepare(run_job()) is None
    assert rank.outbox.messages == [JobFailed("job-7", "request", "prompt: must not be empty")]


def test_a_remix_of_chained_windows_is_refused_as_one_job() -> None:
    """A job is one window (the front runs a chained extend a window a job): `windows` > 1 ends it naming the field, not silently
    as one window."""
    from h3engine.request.remix import Remix

    remix = Remix(mode="extend", source_video="clip.mp4", windows=2)
    job = dataclasses.replace(run_job(), request=GenerationRequest(task="t2va", prompt="a fox", remix=remix))
    rank = job_rank()
    assert rank.prepare(job) is None
    [failed] = rank.outbox.messages
    assert failed.kind == "request" and failed.message.startswith(
        "remix.windows: a worker group runs one window"
    )


def test_a_cancel_while_preparing_ends_the_job_as_cancelled() -> None:
    def prepare(should_cancel: Any) -> str:
        rank.cancel_job.value = 7  # the front cancels the job while rank 0 reads its inputs
        if should_cancel():
            raise GenerationCancelled("generation cancelled")
        return "prepared"

    rank = job_rank(engine=FakeEngine(on_prepare=prepare))
    assert rank.prepare(run_job(number=7)) is None
    started, ended = rank.outbox.messages
    assert isinstance(started, JobStarted) and ended == JobFailed("job-7", "cancelled", CANCELLED_MESSAGE)


# --- finish -----------------------------------------------------------------------------------------------------

LATENTS = DenoisedLatents(torch.zeros(1, 2, 3, 2, 2), torch.zeros(2, 2, 4), {"denoise_s": 1.0})


def decoded(*args: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    return torch.zeros(9, 48, 64, 3), torch.zeros(2, 100), {"decode_s": 0.5}


def write_sidecar(staging: Any, request: Any, inputs: Any, output: Any, *rest: Any) -> None:
    sidecar = {"seed": 1, "geometry": {"width": 64, "height": 48, "frames": 9, "fps": 24}}
    staging.files.sidecar.write_text(json.dumps({**sidecar, "timings_s": output.timings}))


def test_finish_commits_the_files_after_before_commit_and_then_reports_the_end(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(rank_jobs, "decode_on_group", decoded)
    monkeypatch.setattr(rank_jobs, "write_outputs", write_sidecar)
    rank = job_rank(vae=member(1))
    seen_before_commit = []

    def before_commit() -> None:
        seen_before_commit.append(sorted(path.name for path in tmp_path.iterdir()))

    rank.finish(run_job(tmp_path), None, LATENTS, GEOMETRY, [], before_commit=before_commit)  # type: ignore[arg-type]
    assert seen_before_commit and "out.json" not in seen_before_commit[0]
    [finished] = rank.outbox.messages
    assert isinstance(finished, JobFinished) and finished.timings_s == {"denoise_s": 1.0, "decode_s": 0.5}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.json", "out.mp4"]


def test_a_failure_writing_is_the_jobs_alone_and_leaves_no_staging_file(monkeypatch, tmp_path) -> None:
    def full_disk(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rank_jobs, "decode_on_group", decoded)
    monkeypatch.setattr(rank_jobs, "write_outputs", full_disk)
    rank = job_rank(size=2, vae=member(2))
    rank.finish(run_job(tmp_path), None, LATENTS, GEOMETRY, [])  # type: ignore[arg-type]
    [failed] = rank.outbox.messages
    assert failed.kind == "engine" and failed.message.startswith("The disk of the outputs folder is full (")
    assert list(tmp_path.iterdir()) == []


def test_a_vae_group_that_votes_to_cancel_first_decodes_nothing(monkeypatch, tmp_path) -> None:
    def never(*args: Any) -> None:
        raise AssertionError("decoded a cancelled job")

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: tensor.add_(1))
    monkeypatch.setattr(rank_jobs, "decode_on_group", never)
    rank = job_rank(size=2, vae=member(2))
    rank.finish(run_job(tmp_path), None, LATENTS, GEOMETRY, [], vote_first=True)  # type: ignore[arg-type]
    assert rank.outbox.messages == [JobFailed("job-7", "cancelled", CANCELLED_MESSAGE)]
    assert list(tmp_path.iterdir()) == []


# --- the process ------------------------------------------------------------------------------------------------


def test_a_rank_engine_plans_under_the_options_its_spec_carries_whole(monkeypatch) -> None:
    options = EngineOptions(dtype="float32", memory_profile="low-memory", host_memory="12", weights="fp8")
    spec = WorkerSpec(
        checkpoint="/checkpoint",
        devices=("cpu", "cpu"),
        options=options,
        dit_layout=ParallelLayout(2, dit_sp=2),
        encoder_layout=EncoderLayout(2),
        vae_layout=VAELayout(2),
    )
    spec = pickle.loads(pickle.dumps(spec))  # what a spawned rank receives
    built: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        rank_process,
        "engine_layout",
        lambda checkpoint, options: f"layout of {checkpoint} under {options.dtype}",
    )
    monkeypatch.setattr(rank_process, "Engine", lambda *args, loader: built.append(args))
    share = RankShare(dit_sp=2)
    rank_process.rank_engine(spec, torch.device("cpu"), loader=None, share=share)  # type: ignore[arg-type]
    memory = MemoryRequest("low-memory", None, "12", "fp8", share)
    assert built == [("layout of /checkpoint under float32", torch.device("cpu"), torch.float32, memory)]


def test_the_outbox_delivers_what_was_posted_in_order_when_closed() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = rank_process.Outbox(writer)
    for number in range(3):
        outbox.post(JobFailed(f"job-{number}", "engine", ENGINE_FAILURE_MESSAGE))
    outbox.close()
    received = []
    while len(received) < 3 and reader.poll(
        DELIVERY_TIMEOUT_S
    ):  # a lost message fails here, it does not hang
        received.append(reader.recv())
    assert [message.job_id for message in received] == ["job-0", "job-1", "job-2"]
    assert not reader.poll()
    reader.close()
    writer.close()


def test_stop_or_a_closed_pipe_ends_the_command_loop() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    job = run_job()
    writer.send(job)
    writer.send(Stop())
    assert rank_process._next_command(reader) == job
    assert rank_process._next_command(reader) is None
    writer.close()
    assert rank_process._next_command(reader) is None
    reader.close()


def _write_environment(path: str, names: list[str]) -> None:
    """A rank-process target: write what it sees of `names` in its environment, and its temp folder."""
    import os
    import tempfile

    seen = {name: os.environ.get(name) for name in names}
    Path(path).write_text(json.dumps({"environment": seen, "temp": tempfile.gettempdir()}))


def test_a_rank_runs_under_the_environment_its_front_has_when_it_starts_it(tmp_path, monkeypatch) -> None:
    """Ranks fork from a server started once (rank_process.rank_context); what the front sets or unsets after that
    must reach the next rank as it would with spawn, TMPDIR included."""
    context = rank_process.rank_context()
    report = tmp_path / "seen.json"
    names = ["H3_TEST_SET_LATER", "H3_TEST_UNSET_LATER"]
    monkeypatch.setenv("H3_TEST_UNSET_LATER", "gone")

    def start_rank() -> dict:
        process = context.Process(
            target=rank_process.in_front_environment,
            args=(dict(os.environ), _write_environment, str(report), names),
        )
        process.start()
        process.join(60)
        assert process.exitcode == 0
        return json.loads(report.read_text())

    start_rank()  # the server is running from here on
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("H3_TEST_SET_LATER", "now")
    monkeypatch.delenv("H3_TEST_UNSET_LATER")
    monkeypatch.setenv("TMPDIR", str(temp))
    seen = start_rank()
    assert seen == {
        "environment": {"H3_TEST_SET_LATER": "now", "H3_TEST_UNSET_LATER": None},
        "temp": str(temp),
    }


def test_under_a_temp_folder_too_deep_for_a_unix_socket_ranks_are_spawned(monkeypatch) -> None:
    """The fork server's socket lives under TMPDIR; a path it cannot bind falls back to spawn, not to an error."""
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/" + "deep/" * 20 + "pymp-12345678")
    assert rank_process.rank_context().get_start_method() == "spawn"
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/tmp/pymp-12345678")
    assert rank_process.rank_context().get_start_method() == "forkserver"
