"""A memory plan in words: `plan_table` (the human table `plan-memory` prints), `plan_json` (its `--json` object)
and `summary_lines` (the few lines an engine logs at start). Reads the plan only; computes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from h3engine.memory.budget import GPU_MEMORY_ENV
from h3engine.memory.cost import EFFECTIVE_FLOPS_PER_SECOND
from h3engine.memory.types import GIB, MODELS

if TYPE_CHECKING:
    from h3engine.memory.plan import MemoryPlan


def gpu_budget_words(budget: Any) -> str:
    """ "--gpu-memory 2 GiB", "H3_GPU_MEMORY 2 GiB" or "the 22.1 GiB budget (free memory of ...)"."""
    value = f"{budget.gpu_bytes / GIB:g} GiB"
    for name in ("--gpu-memory", GPU_MEMORY_ENV):
        if budget.gpu_source.startswith(name):
            return f"{name} {value}"
    return f"the {budget.gpu_bytes / GIB:.1f} GiB budget ({budget.gpu_source})"


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / GIB:.2f}"


def plan_table(plan: MemoryPlan) -> list[str]:
    """The human form: a table of components, then the peaks, the traffic and a verdict."""
    lines = [f"design request: {plan.design_request}"]
    lines.append(
        f"budget: GPU {_budget(plan.budget.gpu_bytes, plan.budget.gpu_source)}; host "
        f"{_budget(plan.budget.host_bytes, plan.budget.host_source)}"
    )
    lines.append(f"profile {plan.profile}, {plan.weights} weights, serving partition {plan.partition}")
    header = ("component", "placement", "home", "GiB", "GPU GiB", "pinned GiB")
    rows = [header] + [
        (c.name, c.placement, c.home, _gib(c.bytes), _gib(c.gpu_bytes), _gib(c.host_bytes))
        for c in plan.components
    ]
    widths = [max(len(row[index]) for row in rows) for index in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2])]
        cells += [cell.rjust(width) for cell, width in zip(row[3:], widths[3:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    if plan.device_type != "cpu":
        lines.append(
            "peak GPU per phase: "
            + ", ".join(
                f"{phase} {value / GIB:.1f} GiB (working {plan.working[phase] / GIB:.1f})"
                for phase, value in plan.phase_peaks.items()
            )
        )
        lines.append(
            f"peak GPU: {plan.peak_gpu_bytes / GIB:.1f} GiB (the smallest plan needs {plan.minimum_gpu_bytes / GIB:.1f})"
        )
    if plan.device_type == "cpu":
        lines.append(
            f"peak host: {plan.peak_host_bytes / GIB:.1f} GiB (on the CPU the models and activations live there)"
        )
    else:
        lines.append(
            f"peak host: {plan.peak_host_bytes / GIB:.1f} GiB pinned (at least {plan.minimum_host_bytes / GIB:.1f} "
            f"with every home mapped); AdaLN home {plan.adaln_home}, other partition's DiT {plan.other_partition_home}"
        )
    if plan.device_type != "cpu":
        lines.append(
            f"moved host -> GPU: {plan.bytes_per_step / 1e9:.1f} GB per DiT step, {plan.bytes_per_request / 1e9:.1f} GB "
            f"per request besides; predicted {plan.seconds_lost_per_request:.1f} s per request over all-resident"
        )
        lines += _disk_and_step_lines(plan)
    lines.append("verdict: " + ("fits" if plan.fits else "does NOT fit"))
    return lines


def _disk_and_step_lines(plan: MemoryPlan) -> list[str]:
    """The disk reads, the predicted step time and the AdaLN tables' source, in words."""
    cost, context = plan.cost, plan.context
    rate = context.disk_bytes_per_second
    lines = [
        f"read from the disk ({rate / 1e9:.2f} GB/s): {cost.disk_bytes_per_step / 1e9:.1f} GB per DiT step, "
        f"{cost.disk_bytes_per_request / 1e9:.1f} GB per request besides (a new prompt: the text encoder)",
        f"predicted DiT step: {cost.step_seconds:.2f} s ({cost.compute_step_seconds:.2f} s of compute at "
        f"{EFFECTIVE_FLOPS_PER_SECOND / 1e12:.0f} TFLOP/s, the H200's); activation chunks "
        f"{plan.activation_chunks}",
    ]
    if context.adaln_cache:
        lines.append(
            "AdaLN tables: from their disk cache (the projections wait in the files, 0 GiB of host memory); the "
            f"first request of a schedule the cache lacks reads them: +{cost.first_request_seconds:.1f} s"
        )
    return lines


def _budget(size: int | None, source: str) -> str:
    return ("no limit" if size is None else f"{size / GIB:.1f} GiB") + (f" ({source})" if source else "")


def plan_json(plan: MemoryPlan) -> dict[str, Any]:
    """The `--json` object."""
    shape = plan.shape
    return {
        "fits": plan.fits,
        "gpu_fits": plan.gpu_fits,
        "host_fits": plan.host_fits,
        "peak_gpu_bytes": plan.peak_gpu_bytes,
        "peak_host_bytes": plan.peak_host_bytes,
        "minimum_gpu_bytes": plan.minimum_gpu_bytes,
        "minimum_host_bytes": plan.minimum_host_bytes,
        "phase_peaks": dict(plan.phase_peaks),
        "working_bytes": dict(plan.working),
        "bytes_per_step": plan.bytes_per_step,
        "bytes_per_request": plan.bytes_per_request,
        "seconds_lost_per_request": round(plan.seconds_lost_per_request, 3),
        "disk_bytes_per_step": plan.cost.disk_bytes_per_step,
        "disk_bytes_per_request": plan.cost.disk_bytes_per_request,
        "disk_read_bytes_per_second": plan.context.disk_bytes_per_second,
        "predicted_step_seconds": round(plan.cost.step_seconds, 3),
        "predicted_compute_step_seconds": round(plan.cost.compute_step_seconds, 3),
        "first_request_extra_seconds": round(plan.cost.first_request_seconds, 3),
        "activation_chunks": plan.activation_chunks,
        "adaln_tables": "disk cache" if plan.context.adaln_cache else "computed each request",
        "host_pinned_bytes": dict(plan.host_pinned),
        "profile": plan.profile,
        "weights": plan.weights,
        "device": plan.device_type,
        "partition": plan.partition,
        "budget": {
            "gpu_bytes": plan.budget.gpu_bytes,
            "host_bytes": plan.budget.host_bytes,
            "gpu_source": plan.budget.gpu_source,
            "host_source": plan.budget.host_source,
        },
        "models": {
            name: {
                "layers": placement.layers,
                "other": placement.other,
                "home": placement.home,
                "resident_layers": placement.resident_layers,
                "ring_depth": placement.ring_depth,
                "file_layers": placement.mapped_layers,
            }
            for name, placement in plan.models.items()
        },
        "adaln_home": plan.adaln_home,
        "other_partition_home": plan.other_partition_home,
        "components": [
            {
                "name": component.name,
                "placement": component.placement,
                "bytes": component.bytes,
                "gpu_bytes": component.gpu_bytes,
                "host_bytes": component.host_bytes,
                "home": component.home,
            }
            for component in plan.components
        ],
        "design_request": plan.design_request,
        "request": {
            "task": shape.task,
            "height": shape.height,
            "width": shape.width,
            "frames": shape.frames,
            "text_rows": shape.text_rows,
            "video_rows": shape.video_rows,
            "audio_rows": shape.audio_rows,
            "condition_video_rows": shape.condition_video_rows,
            "condition_audio_rows": shape.condition_audio_rows,
            "sequence_rows": shape.sequence_rows,
            "steps": shape.steps,
        },
    }


# ----------------------------------------------------------------------------------------------------------------
# The log lines


def _one_decimal(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


def summary_lines(plan: MemoryPlan) -> list[str]:
    """`MemoryPlan.summary_lines`: the plan in a few lines, for the log at start."""
    budget = plan.budget
    if plan.sizes is None:
        # A plan made without the planner (the CPU, where there is no GPU budget): its placements only.
        lines = [f"memory plan ({plan.profile}, {plan.weights} weights, {plan.device_type}): no GPU budget"]
        return lines + [f"  {name}: {plan.models[name].describe()}" for name in MODELS]
    verdict = "fits" if plan.fits else "does NOT fit"
    lines = [
        f"memory plan ({plan.profile}, {plan.weights} weights, {plan.device_type}) for {plan.design_request}: "
        f"{verdict} in GPU {_budget_text(budget.gpu_bytes, budget.gpu_source)}, host "
        f"{_budget_text(budget.host_bytes, budget.host_source)}"
    ]
    partition = plan.sizes.partitions.get(plan.partition) if plan.sizes is not None else None
    for name in MODELS:
        size = partition.model(name) if partition is not None else None
        if size is not None and not size.total:
            continue
        num_layers = size.num_layers if size is not None and size.num_layers else None
        lines.append(f"  {name}: {plan.models[name].describe(num_layers)}")
    if plan.device_type != "cpu":
        lines.append(f"  dit AdaLN projections: host ({plan.adaln_home}), streamed once per request")
    lines.append(f"  other partition's DiT: {plan.other_partition_home}")
    if plan.device_type != "cpu":
        peaks = ", ".join(f"{phase} {_one_decimal(value)}" for phase, value in plan.phase_peaks.items())
        lines.append(
            f"  peak GPU {_one_decimal(plan.peak_gpu_bytes)} ({peaks}); smallest possible {_one_decimal(plan.minimum_gpu_bytes)}"
        )
    lines.append(
        f"  peak host {_one_decimal(plan.peak_host_bytes)} pinned (at least {_one_decimal(plan.minimum_host_bytes)} with every home "
        "mapped)"
    )
    if plan.device_type != "cpu":
        lines.append(
            f"  host -> GPU: {plan.bytes_per_step / 1e9:.1f} GB per DiT step, {plan.bytes_per_request / 1e9:.1f} GB per "
            f"request besides; about {plan.seconds_lost_per_request:.1f} s per request over the all-resident plan"
        )
        lines += [f"  {line}" for line in _disk_and_step_lines(plan)]
    return lines


def _budget_text(size: int | None, source: str) -> str:
    text = "no limit" if size is None else _one_decimal(size)
    return f"{text} ({source})" if source else text
