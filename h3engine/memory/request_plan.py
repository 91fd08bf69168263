"""One request under an engine's plan: its peak, the DiT layers it keeps resident and its ring, and whether it fits.

The plan (h3engine.memory.plan) fixes the homes for the engine's life; each request is judged and placed on its own:
`request_peak_bytes(plan, shape, resident_layers, ring_depth)` its peak GPU bytes, `request_dit_plan(plan, shape,
lowest)` the most leading DiT layers it leaves room for (and the shallow ring where it fits only so), and
`check_request_fits(plan, shape)` refuses one that does not fit even with no resident layer and the shallow ring,
naming what to change. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from h3engine.errors import RequestError
from h3engine.memory.peaks import phase_peaks
from h3engine.memory.plan import RING_DEPTHS, MemoryPlan, most_resident_layers
from h3engine.memory.shapes import RequestShape, partition_for_task, reshaped
from h3engine.memory.types import GIB, MemoryBudget, ModelPlacement
from h3engine.memory.working import phase_working
from h3engine.request.limits import MIN_DURATION_SECONDS

if TYPE_CHECKING:
    from h3engine.memory.sizes import PartitionSizes


def _request_working(plan: MemoryPlan, shape: RequestShape) -> tuple[PartitionSizes, dict[str, int]]:
    partition = partition_for_task(plan.sizes, shape.task)
    context = plan.context
    working = phase_working(
        partition,
        shape,
        plan.sizes.share,
        plan.weights,
        plan.device_type,
        context.chunks(plan.budget, plan.models),
        context.adaln_cache,
    )
    return partition, working


def _with_dit(
    plan: MemoryPlan, resident_layers: int | None, ring_depth: int | None
) -> dict[str, ModelPlacement]:
    """The plan's placements, its streamed DiT with these resident layers and ring depth (None: the plan's)."""
    models = dict(plan.models)
    dit = models["dit"]
    if dit.layers == "streamed":
        models["dit"] = replace(
            dit,
            resident_layers=dit.resident_layers if resident_layers is None else resident_layers,
            ring_depth=dit.ring_depth if ring_depth is None else ring_depth,
        )
    return models


def request_peak_bytes(
    plan: MemoryPlan, shape: RequestShape, resident_layers: int | None = None, ring_depth: int | None = None
) -> int:
    """The peak GPU bytes of one request of `shape` under `plan`'s placements (0 on the CPU), its DiT keeping
    `resident_layers` leading layers on the GPU and a ring of `ring_depth` (None: the plan's)."""
    if plan.device_type == "cpu":
        return 0
    if plan.sizes is None:
        raise ValueError("this plan was not made by the planner (it has no sizes)")
    partition, working = _request_working(plan, shape)
    models = _with_dit(plan, resident_layers, ring_depth)
    return max(
        phase_peaks(models, partition, shape, working, plan.device_type, plan.context.kept_schedules).values()
    )


def request_dit_plan(plan: MemoryPlan, shape: RequestShape, lowest: int = 0) -> tuple[int, int]:
    """(resident layers, ring depth) of the DiT for one request of `shape` under `plan`: the plan's ring, or the
    shallowest one where the plan's leaves no room even with `lowest` resident layers (the fewest its homes allow);
    then the most leading layers the request leaves room for. The plan's own when its DiT does not stream."""
    dit = plan.models["dit"]
    if dit.layers != "streamed" or plan.device_type == "cpu" or plan.sizes is None:
        return dit.resident_layers, dit.ring_depth
    partition, working = _request_working(plan, shape)
    depth = dit.ring_depth
    if request_peak_bytes(plan, shape, lowest, depth) > plan.budget.gpu_bytes:
        depth = min(min(RING_DEPTHS), depth)
    models = _with_dit(plan, None, depth)
    most = most_resident_layers(
        models,
        partition,
        shape,
        working,
        plan.budget.gpu_bytes,
        plan.device_type,
        plan.context.kept_schedules,
    )
    return max(lowest, min(most, partition.dit.num_layers - 1)), depth


def request_resident_layers(plan: MemoryPlan, shape: RequestShape, lowest: int = 0) -> int:
    """The most leading DiT layers a request of `shape` leaves room for on the GPU under `plan` (`request_dit_plan`)."""
    return request_dit_plan(plan, shape, lowest)[0]


def _budget_flag(budget: MemoryBudget) -> str:
    source = budget.gpu_source
    for name in ("--gpu-memory", "H3_GPU_MEMORY"):
        if source.startswith(name):
            return name
    return "the GPU's free memory"


def check_request_fits(plan: MemoryPlan, shape: RequestShape) -> None:
    """Raise RequestError when one request of `shape` would not fit `plan`'s GPU budget, naming the field to change:
    `duration_seconds` when a shorter request fits (the longest whole second that does), else `short_edge` (the
    largest canvas multiple that does), else `references` / `keyframes` / `prompt`."""
    limit = plan.budget.gpu_bytes
    if limit is None or plan.device_type == "cpu":
        return
    lowest = plan.lowest_resident_layers  # a request may stream the DiT layers the plan keeps resident
    shallow = min(
        min(RING_DEPTHS), plan.models["dit"].ring_depth or min(RING_DEPTHS)
    )  # and take the shallowest ring
    peak = request_peak_bytes(plan, shape, lowest, shallow)
    if peak <= limit:
        return
    sizes = plan.sizes
    over = f"at this plan, over the {limit / GIB:.1f} GiB budget ({_budget_flag(plan.budget)})"
    seconds = shape.duration_seconds
    candidate = math.ceil(seconds) - 1
    while candidate >= MIN_DURATION_SECONDS:
        if (
            request_peak_bytes(
                plan, reshaped(sizes, shape, duration_seconds=float(candidate)), lowest, shallow
            )
            <= limit
        ):
            raise RequestError(
                "duration_seconds",
                f"a {seconds:g} s request needs about {peak / GIB:.1f} GiB {over}; ask for "
                f"{candidate} s or less, or raise --gpu-memory",
            )
        candidate -= 1
    partition = partition_for_task(sizes, shape.task)
    multiple = partition.video_config.spatial_compression_ratio * partition.dit_config.patch_size[-1]
    edge = min(shape.height, shape.width)
    smaller = (edge // multiple - 1) * multiple
    while smaller >= multiple:
        try:
            variant = reshaped(sizes, shape, short_edge=smaller)
        except ValueError:
            break
        if request_peak_bytes(plan, variant, lowest, shallow) <= limit:
            raise RequestError(
                "short_edge",
                f"a {edge}-pixel short edge needs about {peak / GIB:.1f} GiB {over}; ask for "
                f"{smaller} or less, or raise --gpu-memory",
            )
        smaller -= multiple
    field_name = {"ref2va": "references", "fl2va": "keyframes"}.get(shape.task, "prompt")
    raise RequestError(
        field_name,
        f"this request needs about {peak / GIB:.1f} GiB {over}, even at its shortest and smallest; "
        "raise --gpu-memory",
    )
