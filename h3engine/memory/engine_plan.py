"""The memory plan of one engine (one rank), made before anything loads: what the flags ask for, turned into a plan.

`MemoryRequest` is what an engine is asked (profile, budgets as given, weight format, the rank's share of a worker
group): plain data that worker and stage specs carry to every rank. `plan_memory(layout, device, dtype, request)`
resolves the budget (h3engine.memory.budget), reads the checkpoint's sizes from headers (h3engine.memory.sizes) and
asks the planner (h3engine.memory.plan) for the plan that serves every request the engine accepts, or failing that
the default request; a budget no plan fits raises RequestError naming the flag and the minimum, and
`check_request_memory` refuses one request the plan cannot hold, naming what to change. On the CPU there is
no budget: `auto` and `resident` keep everything resident, `streamed` and `low-memory` still stream or move (the
same outputs; this is how their mechanisms are tested without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from h3engine.checkpoint.layout import CheckpointLayout
from h3engine.errors import RequestError
from h3engine.memory.budget import format_gib, resolve_budget
from h3engine.memory.placement import check_memory_profile, check_weights, profile_plan
from h3engine.memory.plan import MemoryBudget, MemoryPlan, check_request_fits, engine_shapes, plan_engine
from h3engine.memory.shapes import ReferenceSpec, request_shape
from h3engine.memory.sizes import RankShare, checkpoint_sizes

# The variable `--adaln-cache` falls back to (h3engine.sampling.adaln_tables reads it too).
ADALN_CACHE_ENV = "H3_ADALN_CACHE"


@dataclass(frozen=True)
class MemoryRequest:
    """An engine's memory flags: `--memory-profile`, `--gpu-memory` / `--host-memory` (GiB as given; None: the
    environment, else the default), `--weights`, `--adaln-cache` (a folder, "off", or None: the environment, else the
    engine's cache folder; h3engine.sampling.adaln_tables), and the share of the models this rank holds."""

    profile: str = "auto"
    gpu_memory: str | float | None = None
    host_memory: str | float | None = None
    weights: str = "bf16"
    share: RankShare = field(default_factory=RankShare)
    adaln_cache: str | None = None

    @property
    def caches_adaln_tables(self) -> bool:
        """Whether AdaLN tables are kept on disk (then the projections wait in the mapped files: see the planner)."""
        setting = self.adaln_cache if self.adaln_cache is not None else os.environ.get(ADALN_CACHE_ENV, "")
        return setting.strip().lower() != "off"

    def checked(self) -> MemoryRequest:
        check_memory_profile(self.profile)
        check_weights(self.weights)
        return self

    @classmethod
    def of(cls, memory: MemoryRequest | str) -> MemoryRequest:
        """`memory` as a request (a profile name: that profile, the default budgets), checked."""
        return (cls(profile=memory) if isinstance(memory, str) else memory).checked()

    @classmethod
    def from_options(cls, options: Any) -> MemoryRequest:
        """The request of h3engine.engine_options.EngineOptions (their memory fields)."""
        return cls(
            options.memory_profile,
            options.gpu_memory,
            options.host_memory,
            options.weights,
            adaln_cache=options.adaln_cache,
        )


def plan_memory(
    layout: CheckpointLayout, device: torch.device, dtype: torch.dtype, request: MemoryRequest
) -> MemoryPlan:
    """The plan an engine on `device` carries out (see the module docstring)."""
    request.checked()
    budget = resolve_budget(device, request.gpu_memory, request.host_memory)
    if device.type != "cuda":
        return replace(profile_plan(request.profile, request.weights), budget=budget, device_type=device.type)
    return gpu_plan(layout, dtype, request, budget)


def gpu_plan(
    layout: CheckpointLayout, dtype: torch.dtype, request: MemoryRequest, budget: MemoryBudget
) -> MemoryPlan:
    """The planner's plan for an engine on a GPU under `budget` (RequestError naming the budget that cannot hold
    it, and the minimum)."""
    sizes = checkpoint_sizes(layout, request.weights, request.share, dtype)
    plan = plan_engine(sizes, budget, request.profile, request.weights, "cuda", engine_shapes(sizes))
    if not plan.gpu_fits:
        raise RequestError(
            "--gpu-memory",
            f"{format_gib(budget.gpu_bytes)} ({budget.gpu_source}) cannot hold the models and one "
            f"{plan.design_request} request under --memory-profile {request.profile}: the smallest plan needs "
            f"{format_gib(plan.minimum_gpu_bytes)} (python -m h3engine plan-memory shows the plans)",
        )
    if not plan.host_fits:
        raise RequestError(
            "--host-memory",
            f"{format_gib(budget.host_bytes)} ({budget.host_source}) cannot hold what this plan keeps "
            f"in host memory even with every home in the mapped checkpoint files: it needs "
            f"{format_gib(plan.minimum_host_bytes)}; free host memory, raise --host-memory, or give the GPU a larger "
            "--gpu-memory so that less waits on the host",
        )
    return plan


def check_request_memory(
    plan: MemoryPlan,
    request: Any,
    canvas: tuple[int, int],
    prompt_tokens: int,
    probe: Callable[[Any], Any],
    duration_seconds: float | None = None,
) -> None:
    """RequestError (naming the field to change) when one validated `request` (h3engine.request.GenerationRequest,
    whose canvas is `canvas`: height, width) would not fit the plan's GPU budget; nothing to check without one (the
    CPU) or without the planner's sizes. `probe` gives a reference's `MediaInfo` (the resolved request's media
    facts, which probed each file once); `duration_seconds` is the resolved duration (default: the request's).
    Duck-typed: this layer sits below the request module."""
    if plan.sizes is None or plan.budget.gpu_bytes is None:
        return
    references = None
    if request.task == "ref2va":
        references = []
        for reference in request.references:
            info = probe(reference)
            seconds = None
            if info.duration_seconds is not None:
                seconds = max(0.0, info.duration_seconds - (reference.start_seconds or 0.0))
            aspect = (float(info.width), float(info.height)) if info.width and info.height else (16.0, 9.0)
            references.append(ReferenceSpec(reference.kind, seconds, aspect, info.has_audio))
    height, width = canvas
    shape = request_shape(
        plan.sizes,
        request.task,
        duration_seconds=request.duration_seconds if duration_seconds is None else duration_seconds,
        aspect_ratio=(float(width), float(height)),
        short_edge=request.short_edge,
        text_tokens=prompt_tokens,
        keyframes=tuple(keyframe.position for keyframe in request.keyframes),
        references=references,
        steps=request.steps,
        step_cache=getattr(request, "cache", "off") != "off",
    )
    check_request_fits(plan, shape)
