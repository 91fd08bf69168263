"""The same request gets the same answer from every door (CLI, HTTP API, engine front, `Engine`): four places where
the doors used to disagree, each checked at every door that can meet it.

* A step-distilled checkpoint and a request without `steps`: every door runs the checkpoint's count (the CLI filled
  it in while the API and `Engine` refused "got 50"); an explicit other count is refused everywhere in one sentence.
* An explicit canvas: `--width 64 --height 32` and the API's `size=64x32` both run it (the API refused it); one
  that is not a multiple of the canvas step is refused by both with the checker's sentence.
* A request larger than the memory plan is refused when submitted, naming the field, before it queues (the front
  had no memory check: it waited in the queue and failed when it ran), at the front and through the API.
* A chained extend (`remix.windows` > 1) runs on a replica that takes one window a job: the front chains the
  windows (the worker rank refused it while `Engine.generate_to_file` chained it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _api_helpers import InProcessApi
from _refusals import api_refused, cli_refused, refused
from _remix_helpers import remix_request, write_sources

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.cli.main import main as cli_main
from h3engine.engine.engine import Engine
from h3engine.errors import RequestError
from h3engine.memory.engine_plan import MemoryRequest, gpu_plan
from h3engine.memory.plan import GIB, MemoryBudget
from h3engine.request.model import GenerationRequest
from h3engine.request.remix import Remix
from h3engine.runtime.front import EngineFront, EngineReplica
from h3engine.runtime.messages import JobFailed, JobFinished
from h3engine.serving.videos import api_param, request_from_fields

RUNGS = (999, 750, 500, 250)
PROMPT = "A kite over the dunes."


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("distilled") / "checkpoint", seed=0, dmd_steps=list(RUNGS)
    )


def _cli_resolved(checkpoint: Path, tmp_path: Path, monkeypatch, *flags: str) -> Any:
    """What the CLI resolved for `generate` with `flags` (the run itself stubbed out), or the RequestError text."""
    seen = []
    monkeypatch.setattr(
        "h3engine.cli.main._generate_in_process", lambda _c, _o, resolved, *rest: seen.append(resolved) or 0
    )
    arguments = ["generate", "--checkpoint", str(checkpoint), "--device", "cpu", "--prompt", PROMPT]
    code = cli_main([*arguments, "--duration", "4", "--out", str(tmp_path / "clip.mp4"), *flags])
    return seen[0] if code == 0 else code


def _api_resolved(front: Any, tmp_path: Path, **fields: str) -> Any:
    """What the API resolves for a body of `fields` (as POST /v1/videos does), or (its param, the RequestError)."""
    body = {"prompt": PROMPT, "seconds": "4", **fields}
    built = None
    try:
        built = request_from_fields(body, tmp_path / "inputs", front.facts)
        return front.resolve(built.request)
    except RequestError as error:
        return api_param(error, built, "size" in fields), error


def test_a_distilled_checkpoint_runs_its_steps_from_every_door(
    distilled, tmp_path, monkeypatch, capsys
) -> None:
    engine = Engine.from_checkpoint(distilled, device="cpu", dtype=torch.float32)
    front = EngineFront([engine], tmp_path / "outputs")
    try:
        bare = GenerationRequest(task="t2va", prompt=PROMPT, duration_seconds=4.0)
        assert engine.resolve(bare).request.steps == 4
        assert front.resolve(bare).request.steps == 4
        assert _api_resolved(front, tmp_path).request.steps == 4
        assert _cli_resolved(distilled, tmp_path, monkeypatch).request.steps == 4
        # An explicit other count: the same field and sentence everywhere (its wording: tests/test_dmd_rungs.py).
        too_many = GenerationRequest(task="t2va", prompt=PROMPT, duration_seconds=4.0, steps=50)
        with refused(RequestError, field="steps") as caught:
            engine.resolve(too_many)
        sentence = caught.value.problem
        assert sentence.endswith("got 50"), sentence
        with refused(RequestError, field="steps") as caught:
            front.resolve(too_many)
        assert caught.value.problem == sentence
        param, error = _api_resolved(front, tmp_path, steps="50")
        assert (param, error.field, error.problem) == ("steps", "steps", sentence)
        capsys.readouterr()
        assert _cli_resolved(distilled, tmp_path, monkeypatch, "--steps", "50") == 2
        assert cli_refused(capsys.readouterr().err, "steps") == sentence
    finally:
        front.shutdown()


def test_an_explicit_canvas_gets_one_answer(tiny_native, tmp_path, monkeypatch, capsys) -> None:
    engine = Engine.from_checkpoint(tiny_native, device="cpu")
    front = EngineFront([engine], tmp_path / "outputs")
    try:
        cli = _cli_resolved(tiny_native, tmp_path, monkeypatch, "--width", "64", "--height", "32")
        api = _api_resolved(front, tmp_path, size="64x32")
        assert (
            (cli.geometry.width, cli.geometry.height) == (api.geometry.width, api.geometry.height) == (64, 32)
        )
        step = front.facts.canvas_multiple
        assert 68 % step  # not a multiple of the canvas step
        # The checker's refusal (its wording: tests/test_request.py), the same at both doors.
        with refused(RequestError, field="width") as caught:
            front.resolve(
                GenerationRequest(task="t2va", prompt=PROMPT, duration_seconds=4.0, width=68, height=32)
            )
        sentence = caught.value.problem
        capsys.readouterr()
        assert _cli_resolved(tiny_native, tmp_path, monkeypatch, "--width", "68", "--height", "32") == 2
        assert cli_refused(capsys.readouterr().err, "width") == sentence
        param, error = _api_resolved(front, tmp_path, size="68x32")
        assert (param, error.field, error.problem) == ("size", "width", sentence)
    finally:
        front.shutdown()


class PlanOnly:
    """A replica whose facts carry a memory plan at the released shapes under an 8 GiB GPU budget; it runs
    nothing (a job that reached it would fail)."""

    def __init__(self, released: Path) -> None:
        layout = detect_layout(released)
        budget = MemoryBudget(8 * GIB, 1000 * GIB, "--gpu-memory", "--host-memory")
        plan = gpu_plan(layout, torch.bfloat16, MemoryRequest(), budget)
        self.facts = CheckpointFacts.from_layout(layout)
        self.facts = CheckpointFacts(**{**self.facts.__dict__, "memory_plan": plan})
        self.runs = 0

    def run(self, handle: Any, replica_index: int, preview_every: int) -> JobFailed:
        self.runs += 1
        return JobFailed(handle.job_id, "engine", "not run here")

    def partition_on_device(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def test_a_request_over_the_memory_plan_is_refused_before_it_queues(tmp_path) -> None:
    replica = PlanOnly(make_placeholder_checkpoint(tmp_path / "released"))
    front = EngineFront([replica], tmp_path / "outputs")
    try:
        with refused(RequestError, field="duration_seconds"):
            front.submit(GenerationRequest(task="t2va", prompt=PROMPT, duration_seconds=15))
        assert front.waiting == 0 and front.running == 0 and replica.runs == 0
        # The same refusal through the API: 400 naming `seconds`, nothing queued.
        with InProcessApi(front, tmp_path) as api:
            answer = api.post(json={"prompt": PROMPT, "seconds": "15"})
        assert answer.status_code == 400, answer.text
        api_refused(answer.json(), "seconds")
        assert front.waiting == 0 and replica.runs == 0
    finally:
        front.shutdown()


class OneWindowAJob(EngineReplica):
    """An in-process replica that, like a worker group, takes one window a job (and records each job's windows)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.windows: list[int] = []

    def run(self, handle: Any, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        self.windows.append(handle.request.remix.windows)
        assert handle.request.remix.windows == 1, "a worker group refuses a chained job"
        return super().run(handle, replica_index, preview_every)


def test_a_chained_extend_runs_a_window_a_job(tiny_native, tmp_path) -> None:
    (tmp_path / "sources").mkdir()
    sources = write_sources(tmp_path / "sources")
    replica = OneWindowAJob(Engine.from_checkpoint(tiny_native, device="cpu"))
    front = EngineFront([replica], tmp_path / "outputs")
    try:
        request = remix_request(Remix(mode="extend", source_video=str(sources["video"]), windows=2), steps=1)
        handle = front.submit(request, out_path=tmp_path / "outputs" / "chained.mp4")
        end = None
        while end is None or not isinstance(end, JobFinished | JobFailed):
            end = handle.next_event(timeout=120)
            assert end is not None, "no message in 120 s"
        assert isinstance(end, JobFinished), end
        assert replica.windows == [1, 1]
        assert Path(end.video_path) == tmp_path / "outputs" / "chained.mp4"
        assert sorted(path.name for path in (tmp_path / "outputs").iterdir()) == [
            "chained.json",
            "chained.mp4",
        ]
    finally:
        front.shutdown()
