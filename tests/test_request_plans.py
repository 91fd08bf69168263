"""A request does not pay for a larger one: the engine's plan fixes the homes, and each request keeps as many DiT
layers resident on the GPU as it leaves room for (h3engine.memory.request_plan.request_dit_plan), re-planned between
requests (h3engine.memory.placement.Placement.prepare_request), with the same outputs whatever the count.

At the released size (a placeholder's headers): a 15 s request keeps fewer layers than a 5 s one under the same plan,
and is refused only when it does not fit with none. On the CPU, a tiny engine runs 5 s, 15 s, 5 s requests while the
count follows each one (the planner's count is replaced there: tiny layers are a few kB beside the working memory).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from _runtime_helpers import parity_requests

from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.engine.engine import Engine
from h3engine.memory import placement as placement_module
from h3engine.memory.placement import Placement
from h3engine.memory.plan import GIB, MemoryBudget, PlanContext, plan_engine, plan_for_shape
from h3engine.memory.request_plan import (
    check_request_fits,
    request_dit_plan,
    request_peak_bytes,
    request_resident_layers,
)
from h3engine.memory.shapes import TYPICAL_PROMPT_TOKENS, engine_shapes, request_shape
from h3engine.memory.sizes import checkpoint_sizes

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):  # noqa: ANN201 - CheckpointSizes
    return checkpoint_sizes(make_placeholder_checkpoint(tmp_path_factory.mktemp("released") / "checkpoint"))


def _budget(gpu_gib: float, host_gib: float = 1000) -> MemoryBudget:
    return MemoryBudget(int(gpu_gib * GIB), int(host_gib * GIB), "--gpu-memory", "--host-memory")


def test_a_longer_request_keeps_fewer_resident_layers_under_the_same_plan(bf16) -> None:
    context = PlanContext(adaln_cache=True)
    plan = plan_engine(bf16, _budget(24, 32), "auto", "bf16", "cuda", engine_shapes(bf16), context)
    assert plan.fits and plan.models["dit"].layers == "streamed" and plan.lowest_resident_layers == 0
    short, long = (
        request_shape(bf16, "t2va", duration_seconds=seconds, text_tokens=TYPICAL_PROMPT_TOKENS)
        for seconds in (5.0, 15.0)
    )
    counts = {shape.duration_seconds: request_resident_layers(plan, shape) for shape in (short, long)}
    assert counts[5.0] > counts[15.0] >= 0, counts
    for shape in (short, long):
        count = request_resident_layers(plan, shape)
        assert request_peak_bytes(plan, shape, count) <= plan.budget.gpu_bytes
        if count < bf16.partitions["fl2va"].dit.num_layers - 1:  # one more would not fit
            assert request_peak_bytes(plan, shape, count + 1) > plan.budget.gpu_bytes
    check_request_fits(plan, long)  # served, with fewer resident layers


def test_a_request_that_fits_only_with_the_shallow_ring_gets_it(bf16) -> None:
    context = PlanContext(adaln_cache=True)
    plan = plan_engine(bf16, _budget(24, 32), "auto", "bf16", "cuda", engine_shapes(bf16), context)
    plan = dataclasses.replace(
        plan, models={**plan.models, "dit": dataclasses.replace(plan.models["dit"], ring_depth=3)}
    )
    shape = request_shape(bf16, "t2va", duration_seconds=15.0, text_tokens=TYPICAL_PROMPT_TOKENS)
    # A budget between the request's peaks with no resident layer at the deep and at the shallow ring.
    deep, shallow = (request_peak_bytes(plan, shape, 0, depth) for depth in (3, 2))
    assert shallow < deep
    tight = dataclasses.replace(plan, budget=MemoryBudget((deep + shallow) // 2, plan.budget.host_bytes))
    assert request_dit_plan(tight, shape) == (0, 2)
    check_request_fits(tight, shape)
    assert request_dit_plan(plan, shape)[1] == 3


def test_the_plan_for_a_short_request_costs_it_nothing_for_a_long_one(bf16) -> None:
    """The homes a plan keeps do not depend on the request it re-plans for: a 5 s request under the engine's plan
    keeps as many resident layers as the plan made for 5 s requests alone."""
    context = PlanContext(adaln_cache=True)
    engine_plan = plan_engine(bf16, _budget(24, 32), "auto", "bf16", "cuda", engine_shapes(bf16), context)
    short = request_shape(bf16, "t2va", duration_seconds=5.0, text_tokens=TYPICAL_PROMPT_TOKENS)
    alone = plan_for_shape(bf16, _budget(24, 32), short, "auto", "cuda", context)
    if engine_plan.models == alone.models:
        assert request_resident_layers(engine_plan, short) == alone.models["dit"].resident_layers
    else:
        assert request_resident_layers(engine_plan, short) >= engine_plan.models["dit"].resident_layers


class ReplanningEngine(Engine):
    """A tiny CPU engine whose DiT streams with 2 of its 3 layers resident under a plan with a GPU budget (so that
    each request is planned), the count per request replaced by `counts[duration]`."""

    counts: dict[float, int] = {}

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        sizes = checkpoint_sizes(self.layout, dtype=self.dtype)
        shape = request_shape(sizes, "t2va", duration_seconds=4.0)
        plan = plan_for_shape(sizes, MemoryBudget(1 << 40, None), shape, "streamed", "cuda")
        dit = dataclasses.replace(plan.models["dit"], resident_layers=2, ring_depth=2)
        # Unchunked: chunked fp32 GEMMs on the CPU round differently (tests/test_activation_chunks.py).
        context = dataclasses.replace(plan.context, activation_chunks=1)
        return Placement(
            dataclasses.replace(plan, models={**plan.models, "dit": dit}, context=context), device
        )


def test_a_5s_request_after_a_15s_one_re_plans_and_computes_the_same(
    tiny_checkpoints, monkeypatch, caplog
) -> None:
    checkpoint: Path = tiny_checkpoints("native", seed=5)
    resident = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32, adaln_cache="off")
    engine = ReplanningEngine.from_checkpoint(
        checkpoint, device="cpu", dtype=torch.float32, adaln_cache="off"
    )
    counts = {4.0: (2, 2), 15.0: (0, 3)}
    asked = []

    def count(plan, shape, lowest: int = 0) -> tuple[int, int]:
        asked.append((shape.duration_seconds, lowest))
        return counts[shape.duration_seconds]

    monkeypatch.setattr(placement_module, "request_dit_plan", count)
    stream = engine.placement.stream_of(engine.store.models_for_task("t2va").dit)
    assert stream.first == 2 and stream.lowest_resident == 0
    base = parity_requests(steps=2, seed=3)["t2va"]
    seen = []
    with caplog.at_level(logging.INFO, logger="h3engine.memory.placement"):
        for seconds in (4.0, 15.0, 4.0):
            request = dataclasses.replace(base, duration_seconds=seconds)
            got, _ = engine.generate(request)
            expected, _ = resident.generate(request)
            for name in OUTPUTS:
                assert torch.equal(getattr(got, name), getattr(expected, name)), (seconds, name)
            seen.append((stream.first, stream.ring_depth))
    assert seen == [(2, 2), (0, 3), (2, 2)] and [duration for duration, _ in asked] == [4.0, 15.0, 4.0]
    assert all(lowest == 0 for _, lowest in asked)
    changes = [
        record.getMessage() for record in caplog.records if "DiT layers resident" in record.getMessage()
    ]
    assert len(changes) == 2 and "keeps 0 DiT layers resident" in changes[0]
    assert "with a ring of 3 (the previous request: 2, ring of 2)" in changes[0]


class WarmPartitions(Engine):
    """Everything resident, both DiT partitions with a host home; "the device" copies are CPU clones."""

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        from h3engine.memory.plan import resident_plan

        plan = dataclasses.replace(resident_plan(), other_partition_home="pinned")
        return Placement(plan, device, transfer=torch.clone)


def test_the_other_partition_loads_in_the_background_so_the_first_switch_reads_no_file(
    tiny_checkpoints,
) -> None:
    checkpoint = tiny_checkpoints("native", seed=5)
    events = []
    engine = WarmPartitions.from_checkpoint(checkpoint, device="cpu", on_load=events.append)
    assert [event.partition for event in events if event.component == "dit"] == ["fl2va", "fl2va"]
    assert engine.store.preload_other_partitions() and not engine.store.preload_other_partitions()
    engine.store._preload.join()
    assert (
        len([key for key in engine.store._modules if key[0] == "dit"]) == 2
    )  # both DiTs, before any request
    events.clear()
    resident = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")
    requests = parity_requests(steps=1, seed=2)
    for task in ("ref2va", "t2va", "ref2va"):
        got, _ = engine.generate(requests[task])
        expected, _ = resident.generate(requests[task])
        for name in OUTPUTS:
            assert torch.equal(getattr(got, name), getattr(expected, name)), (task, name)
    assert not [event for event in events if event.component == "dit"]  # no switch loaded a DiT


def test_no_background_load_without_room_for_both_partitions(tiny_checkpoints) -> None:
    engine = Engine.from_checkpoint(tiny_checkpoints("native", seed=5), device="cpu", adaln_cache="off")
    assert not engine.placement.keeps_partitions_warm and not engine.store.preload_other_partitions()
