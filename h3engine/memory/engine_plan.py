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

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from h3engine.checkpoint.layout import CheckpointLayout
from h3engine.errors import RequestError
from h3engine.memory.budget import format_gib, resolve_budget
from h3engine.memory.disk import disk_read_rate, parse_gbps
from h3engine.memory.placement import check_memory_profile, check_weights, profile_plan
from h3engine.memory.plan import MemoryPlan, PlanContext, engine_shapes, plan_engine
from h3engine.memory.request_plan import check_request_fits
from h3engine.memory.shapes import DEFAULT_STEPS, ReferenceSpec, RequestShape, request_shape
from h3engine.memory.sizes import RankShare, checkpoint_sizes, stored_weights
from h3engine.memory.types import MemoryBudget

logger = logging.getLogger(__name__)

# The variable `--adaln-cache` falls back to (h3engine.engine.sampling.adaln_tables reads it too).
ADALN_CACHE_ENV = "H3_ADALN_CACHE"
# The most activation chunks one may ask for (past the DiT's 56 heads only the rows split further).
MAX_ACTIVATION_CHUNKS = 256


@dataclass(frozen=True)
class MemoryRequest:
    """An engine's memory flags: `--memory-profile`, `--gpu-memory` / `--host-memory` (GiB as given; None: the
    environment, else the default), `--weights`, `--adaln-cache` (a folder, "off", or None: the environment, else the
    engine's cache folder; h3engine.engine.sampling.adaln_tables), and the share of the models this rank holds."""

    profile: str = "auto"
    gpu_memory: str | float | None = None
    host_memory: str | float | None = None
    weights: str = "bf16"
    share: RankShare = field(default_factory=RankShare)
    adaln_cache: str | None = None
    disk_read_gbps: str | float | None = (
        None  # the disk's read rate as given (None: measured once, then kept)
    )
    activation_chunks: str | int | None = None  # "auto" (None), "off" or a count (h3engine.models.dit_chunks)

    @property
    def caches_adaln_tables(self) -> bool:
        """Whether AdaLN tables are kept on disk (then the projections wait in the mapped files: see the planner)."""
        setting = self.adaln_cache if self.adaln_cache is not None else os.environ.get(ADALN_CACHE_ENV, "")
        return setting.strip().lower() != "off"

    def checked(self) -> MemoryRequest:
        check_memory_profile(self.profile)
        check_weights(self.weights)
        parse_activation_chunks(self.activation_chunks)
        if self.disk_read_gbps is not None:
            parse_gbps(self.disk_read_gbps)
        return self

    @property
    def chunks(self) -> int | None:
        """The activation chunks asked for (None: the plan decides)."""
        return parse_activation_chunks(self.activation_chunks)

    @classmethod
    def of(cls, memory: MemoryRequest | str) -> MemoryRequest:
        """`memory` as a request (a profile name: that profile, the default budgets), checked."""
        return (cls(profile=memory) if isinstance(memory, str) else memory).checked()

    @classmethod
    def from_options(cls, options: Any) -> MemoryRequest:
        """The request of h3engine.engine.options.EngineOptions (their memory fields)."""
        return cls(
            options.memory_profile,
            options.gpu_memory,
            options.host_memory,
            options.weights,
            adaln_cache=options.adaln_cache,
            disk_read_gbps=options.disk_read_gbps,
            activation_chunks=options.activation_chunks,
        )


def parse_activation_chunks(value: str | int | None) -> int | None:
    """`--activation-chunks auto|off|N` -> None (the plan decides), 1 or N; RequestError naming the flag."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    if str(value).strip().lower() == "off":
        return 1
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_ACTIVATION_CHUNKS:
        raise RequestError(
            "--activation-chunks",
            f"expected auto, off or a whole number 1-{MAX_ACTIVATION_CHUNKS}, got '{value}'",
        )
    return int(text)


def plan_memory(
    layout: CheckpointLayout,
    device: torch.device,
    dtype: torch.dtype,
    request: MemoryRequest,
    cache_folder: Path | None = None,
) -> MemoryPlan:
    """The plan an engine on `device` carries out (see the module docstring); `cache_folder` keeps the disk's
    measured read rate."""
    request.checked()
    if request.weights != "fp8" and stored_weights(layout) == "fp8":
        logger.info("%s stores its large linears in FP8: they run as --weights fp8", layout.root)
        request = replace(request, weights="fp8")
    budget = resolve_budget(device, request.gpu_memory, request.host_memory)
    if device.type != "cuda":
        plan = replace(profile_plan(request.profile, request.weights), budget=budget, device_type=device.type)
        return cpu_file_homes(plan, layout, dtype, request)
    return gpu_plan(layout, dtype, request, budget, cache_folder)


def plan_context(
    root: str | Path, request: MemoryRequest, cache_folder: Path | None, device_type: str = "cuda"
) -> PlanContext:
    """What the planner needs besides the budget: the AdaLN cache, the read rate of the disk `root` (a checkpoint
    folder) is on, the activation chunks."""
    given = parse_gbps(request.disk_read_gbps) if request.disk_read_gbps is not None else None
    rate, _ = disk_read_rate(root, cache_folder, given)
    return PlanContext(
        device_type=device_type,
        adaln_cache=request.caches_adaln_tables,
        disk_bytes_per_second=rate,
        activation_chunks=request.chunks,
    )


def gpu_plan(
    layout: CheckpointLayout,
    dtype: torch.dtype,
    request: MemoryRequest,
    budget: MemoryBudget,
    cache_folder: Path | None = None,
) -> MemoryPlan:
    """The planner's plan for an engine on a GPU under `budget` (RequestError naming the budget that cannot hold
    it, and the minimum)."""
    sizes = checkpoint_sizes(layout, request.weights, request.share, dtype)
    context = plan_context(layout.root, request, cache_folder)
    plan = plan_engine(sizes, budget, request.profile, request.weights, "cuda", engine_shapes(sizes), context)
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
) -> RequestShape | None:
    """RequestError (naming the field to change) when one validated `request` would not fit the plan's GPU budget
    even with the fewest DiT layers resident; returns its memory shape (None without a GPU budget, on the CPU, or
    without the planner's sizes: nothing to check). `request` is an h3engine.request.model.GenerationRequest whose canvas
    is `canvas` (height, width); `probe` gives a reference's `MediaInfo` (the resolved request's media facts, which
    probed each file once); `duration_seconds` is the resolved duration (default: the request's). Duck-typed: this
    layer sits below the request module."""
    if plan.sizes is None or plan.budget.gpu_bytes is None:
        return None
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
        steps=DEFAULT_STEPS if request.steps is None else request.steps,
        step_cache=request.cache != "off",
    )
    check_request_fits(plan, shape)
    return shape


# The order in which a CPU engine's streamed models move their homes to the files when host memory is short (as on
# a GPU: the once-per-request streams first, the DiT's layers last).
CPU_FILE_HOME_ORDER = ("text_encoder", "video_vae", "dit")


def cpu_file_homes(
    plan: MemoryPlan, layout: CheckpointLayout, dtype: torch.dtype, request: MemoryRequest
) -> MemoryPlan:
    """On the CPU (no GPU budget: models run from host memory) the `streamed` profile keeps each streamed model's
    layer images in host memory while the host budget holds them, and reads the rest from the files at each visit
    (CPU_FILE_HOME_ORDER), so that an engine runs with less host memory than its models take."""
    if request.profile != "streamed" or plan.budget.host_bytes is None:
        return plan
    sizes = checkpoint_sizes(layout, request.weights, request.share, dtype)
    partition = next(iter(sizes.partitions.values()))
    images = {
        name: partition.model(name).layers_total
        for name, placement in plan.models.items()
        if placement.layers == "streamed"
    }
    models = dict(plan.models)
    for name in CPU_FILE_HOME_ORDER:
        if sum(images.values()) <= plan.budget.host_bytes:
            break
        if name in images:
            models[name] = replace(models[name], home="mapped")
            images[name] = 0
    return replace(plan, models=models)
