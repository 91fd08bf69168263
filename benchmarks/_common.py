"""What the benchmark scripts share: device labels for result file names, device synchronization, versions."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_checkpoint_source(parser: argparse.ArgumentParser) -> None:
    """--checkpoint DIR | --placeholder (the default) | --tiny: what a benchmark loads."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", default=None, help="a checkpoint folder (the released one)")
    source.add_argument(
        "--placeholder",
        action="store_true",
        help="a placeholder checkpoint of the released shapes in a temporary folder (the default)",
    )
    source.add_argument(
        "--tiny", action="store_true", help="a tiny random-weight checkpoint (CPU smoke test)"
    )


def enforce_budget(device: torch.device, budget_gib: float | None) -> dict[str, Any]:
    """Cap this process's CUDA caching allocator at the budget (before anything is allocated)."""
    if device.type != "cuda" or budget_gib is None:
        return {"budget_bytes": None, "total_bytes": None, "fraction": None}
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, budget_gib * (1 << 30) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"budget_bytes": int(budget_gib * (1 << 30)), "total_bytes": total, "fraction": fraction}


def device_label(device: torch.device) -> str:
    """The device's name as a file-name fragment, e.g. NVIDIA_H200 (cpu on the CPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (host timers are meaningless without it); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sustained_ms(
    run: Callable[[], object], seconds: float, between: Callable[[], object] | None = None
) -> float:
    """Milliseconds per call of `run` on a GPU that has reached its power limit, as inside a forward (short do_bench
    bursts run at higher clocks): calls back to back for `seconds` (each followed by `between`, untimed, when given),
    the median (upper, for an even count) over the second half."""
    times = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        if between is not None:
            between()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median_high(times[len(times) // 2 :])


def package_version(name: str) -> str | None:
    """An installed distribution's version, or None when it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# Kernel-name fragments that place a CUDA kernel in one of the forward's cost groups (first match wins).
KERNEL_GROUPS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "cublas")),
    ("torch_elementwise", ("at::native", "elementwise", "reduce_kernel", "cat_", "copy")),
    ("fused_ops", ("_kernel",)),  # our Triton kernels are named *_kernel
)


def kernel_group(name: str) -> str:
    """The cost group of a CUDA kernel by its name: one of KERNEL_GROUPS' names, or other."""
    lowered = name.lower()
    for group, fragments in KERNEL_GROUPS:
        if any(fragment in lowered for fragment in fragments):
            return group
    return "other"


def kernel_profile(run: Callable[[], object], device: torch.device, top: int = 25) -> dict[str, object]:
    """Where one call of `run` spends GPU time: kernel time per group, the busiest kernels, and the idle time
    between kernels (the span from the first kernel's start to the last one's end, minus the busy union)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        run()
        synchronize(device)
    kernels = [
        (event.name, event.time_range.start, event.time_range.end)
        for event in profiler.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    if not kernels:
        return {"kernels": 0}
    kernels.sort(key=lambda kernel: kernel[1])
    busy_us, covered_until = 0.0, kernels[0][1]
    for _, start, end in kernels:
        busy_us += max(0.0, end - max(start, covered_until))
        covered_until = max(covered_until, end)
    span_us = kernels[-1][2] - kernels[0][1]
    by_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        by_name.setdefault(name, []).append(end - start)
    groups: dict[str, float] = {}
    for name, durations in by_name.items():
        group = kernel_group(name)
        groups[group] = groups.get(group, 0.0) + sum(durations) / 1000.0
    busiest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "kernels": len(kernels),
        "span_ms": span_us / 1000.0,
        "busy_ms": busy_us / 1000.0,
        "idle_ms": (span_us - busy_us) / 1000.0,
        "group_ms": groups,
        "top_kernels": [
            {
                "name": name[:160],
                "group": kernel_group(name),
                "calls": len(durations),
                "total_ms": sum(durations) / 1000.0,
                "mean_ms": sum(durations) / len(durations) / 1000.0,
            }
            for name, durations in busiest
        ],
    }


def prepared_shape(prepared: Any) -> dict[str, Any]:
    """A prepared request's canvas, frames, latent grid and packed rows per modality."""
    geometry = prepared.geometry
    layout = prepared.conditions.layout(prepared.presentation.row_tags, geometry)
    return {
        "height": geometry.height,
        "width": geometry.width,
        "frames": geometry.frames,
        "latent_frames": geometry.latent_frames,
        "latent_h": geometry.latent_h,
        "latent_w": geometry.latent_w,
        "text_rows": layout.num_text_rows,
        "video_rows": layout.num_target_video_rows,
        "audio_rows": layout.num_target_audio_rows,
        "sequence_rows": layout.sequence_length,
    }
