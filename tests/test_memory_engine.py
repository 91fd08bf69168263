"""What the engine does with a memory plan at its edges: a budget no plan fits is refused before anything loads
(naming the flag and the minimum), a request too large for the plan is refused at the input (naming the field), and
a job that runs out of GPU memory fails with one sentence naming the budget while the engine keeps serving.

The planner's own arithmetic is tested in tests/test_memory_plan.py; here its plans are made for a released-size
placeholder checkpoint (headers only, no weights read) as a GPU engine would make them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _refusals import refused
from _runtime_helpers import ASSETS, events_until_done

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.engine.engine import Engine
from h3engine.errors import RequestError
from h3engine.media.inputs import probe_media
from h3engine.memory.engine_plan import MemoryRequest, check_request_memory, gpu_plan
from h3engine.memory.plan import GIB, MemoryBudget
from h3engine.request.files import Reference
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFailed, JobFinished

EVENT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A placeholder checkpoint at the released shapes (sparse headers, about 1 MB)."""
    return make_placeholder_checkpoint(tmp_path_factory.mktemp("released") / "checkpoint")


def budget(gpu_gib: float, host_gib: float = 1000) -> MemoryBudget:
    return MemoryBudget(int(gpu_gib * GIB), int(host_gib * GIB), "--gpu-memory", "--host-memory")


def test_a_gpu_budget_no_plan_fits_is_refused_naming_the_flag_and_the_minimum(released) -> None:
    layout = detect_layout(released)
    with refused(RequestError, field="--gpu-memory") as caught:
        gpu_plan(layout, torch.bfloat16, MemoryRequest(), budget(2))
    # The budget given and the minimum that would fit (the plan's messages are made here, in engine_plan).
    assert re.match(r"2\.0 GiB .* the smallest plan needs \d+\.\d GiB", caught.value.problem), caught.value
    plan = gpu_plan(layout, torch.bfloat16, MemoryRequest(), budget(24))
    assert plan.fits and plan.peak_gpu_bytes <= 24 * GIB and plan.streams


def test_a_host_budget_no_plan_fits_is_refused_naming_the_flag(released) -> None:
    with refused(RequestError, field="--host-memory") as caught:
        gpu_plan(detect_layout(released), torch.bfloat16, MemoryRequest(), budget(24, host_gib=1))
    assert re.match(r"1\.0 GiB .* it needs \d+\.\d GiB", caught.value.problem), caught.value


def test_resident_is_refused_where_it_does_not_fit(released) -> None:
    with refused(RequestError, field="--gpu-memory", says="--memory-profile resident") as caught:
        gpu_plan(detect_layout(released), torch.bfloat16, MemoryRequest(profile="resident"), budget(48))
    assert caught.value.problem.startswith("48.0 GiB "), caught.value


def test_a_request_too_large_for_the_plan_is_refused_naming_what_to_change(released) -> None:
    layout = detect_layout(released)
    plan = gpu_plan(layout, torch.bfloat16, MemoryRequest(), budget(8))

    def check(request: GenerationRequest, canvas: tuple[int, int] = (768, 1344)) -> None:
        check_request_memory(plan, request, canvas, 64, probe_media)

    check(GenerationRequest(task="t2va", prompt="a fox", duration_seconds=5))
    # The request plan's wording: tests/test_memory_plan.py.
    with refused(RequestError, field="duration_seconds"):
        check(GenerationRequest(task="t2va", prompt="a fox", duration_seconds=15))
    references = (
        Reference("image", str(ASSETS / "ref2va" / "picture1.png")),
        Reference("audio", str(ASSETS / "ref2va" / "audio1.wav")),
    )
    ref2va = GenerationRequest(task="ref2va", prompt="<Picture 1> sings <Audio 1>", references=references)
    # A reference picture is read at a 2048-pixel short edge: thousands of rows more than T2VA, over 8 GiB here.
    with pytest.raises(RequestError) as caught:
        check(ref2va)
    assert caught.value.field in ("duration_seconds", "short_edge", "references"), caught.value
    roomier = gpu_plan(layout, torch.bfloat16, MemoryRequest(), budget(32))
    check_request_memory(roomier, ref2va, (768, 1344), 64, probe_media)


def test_a_job_out_of_gpu_memory_fails_naming_the_budget_and_the_engine_keeps_serving(
    tiny_native, tmp_path
) -> None:
    engine = Engine.from_checkpoint(tiny_native, device="cpu", gpu_memory=24)
    generate = engine.generate_to_file
    calls = []

    def out_of_memory_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return generate(*args, **kwargs)

    engine.generate_to_file = out_of_memory_once
    front = EngineFront([engine], tmp_path)
    try:
        request = GenerationRequest(task="t2va", prompt="a fox", duration_seconds=4, steps=2)
        failed = events_until_done(front.submit(request), EVENT_TIMEOUT_S)[-1]
        assert isinstance(failed, JobFailed) and failed.kind == "engine"
        assert failed.message.startswith(
            "The GPU ran out of memory during this job (cpu, memory profile auto"
        )
        assert "--gpu-memory" in failed.message and "plan-memory" in failed.message
        assert isinstance(events_until_done(front.submit(request), EVENT_TIMEOUT_S)[-1], JobFinished)
    finally:
        front.shutdown()
