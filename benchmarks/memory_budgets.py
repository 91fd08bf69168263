"""Step time and peak GPU / host memory of the engine under memory budgets; the partition switch; whole requests.

Per budget (`--budgets` GiB, 120 = resident) and weight format (`--weights bf16,fp8`), one child process (forked from
a server that has imported the engine) enforces the budget (`set_per_process_memory_fraction`; `--host-limit`: a cgroup
v2 memory.max where the machine allows) before the engine loads, runs a warm-up, the timed 768p / 5 s T2VA request and
that request again (AdaLN tables computed, then cached), and records the plan and its cost, step times (device clock),
GPU and host peaks, page cache, disk reads, the layer streams' counters and whether the latents equal the resident
run's (FP8: their error against bf16). Runs go R B B R per budget. `--switch`: T2VA -> Ref2VA -> T2VA; `--whole-request
50,8`: whole requests. The JSON is rewritten after each child (`--resume`, `--time-limit`). Method: benchmarks/NOTES.md.

    python -m benchmarks.memory_budgets --placeholder --device cuda:0 --weights bf16 --budgets 120,24,16 \\
        --time-limit 570 --output-dir DIR            # then again with --resume DIR/memory_budgets_...json
    python -m benchmarks.memory_budgets --checkpoint DIR --budgets 120,24 --host-limit 64 --host-memory 48 \\
        --drop-caches --adaln-cache off --disk-read-gbps 1.9 --activation-chunks 4   # DIR: a --real-bytes placeholder
    python -m benchmarks.memory_budgets --tiny --device cpu --budgets 120,24 --weights bf16,fp8 --switch --real-bytes
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import hashlib
import importlib
import itertools
import json
import logging
import os
import platform
import re
import signal
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    RESULTS_DIR,
    add_checkpoint_source,
    enforce_budget,
    package_version,
    prepared_shape,
    synchronize,
)
from h3engine.memory.report import summary_lines
from h3engine.runtime.rank_process import in_front_environment, rank_context

REPO_ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MIB = 1 << 20
RESIDENT_GIB = 120  # the budget that means "the resident engine"
DEFAULT_BUDGETS = "120,80,48,32,24,16"
TARGETS = {24: 1.10, 16: 1.25}  # the step-time ratios to the resident engine
STREAMED_MODELS = ("dit", "text_encoder", "video_vae")  # the models whose layers a plan may stream
PROMPT = (
    "A red fox runs across a snowy field at dawn while the camera slowly pans to the left; "
    "the wind hisses through the grass and a crow calls twice in the distance."
)
REF2VA_IMAGE = REPO_ROOT / "assets" / "ref2va" / "picture1.png"
REF2VA_PROMPT = (
    "subject_definitions:\n<Subject 1> is the teal robot in <Picture 1>.\n\ndetailed_description:\n"
    "[Shot 1] <Subject 1> walks into a cafe, stops at the counter and waves to the barista."
)
# A first guess at a child's seconds for --time-limit before one of its kind has finished (released size).
DEFAULT_CHILD_ESTIMATE_S = {"budget": 175.0, "switch": 360.0, "whole": 480.0}
# Where --host-limit makes each child's cgroup (v2, memory controller) and where --drop-caches writes; tests point them
# at folders of their own.
CGROUP_ROOT = Path("/sys/fs/cgroup")
DROP_CACHES_PATH = Path("/proc/sys/vm/drop_caches")
CGROUP_NUMBERS = itertools.count()
# The pipeline's timing of a request's AdaLN tables by where they came from
# (h3engine.engine.sampling.denoise_steps.ADALN_TIMING).
ADALN_TIMINGS = {"adaln_tables_computed_s": "computed", "adaln_tables_cached_s": "cache"}
KILLED_FOR_MEMORY = "killed for memory"
FP8_NOTE = (
    "relative L2 of the final latents (video, audio) of --weights fp8 against bf16 at the same budget, same request "
    "and seed; on random or placeholder weights this says nothing about picture quality"
)
NOTES = [
    "step_s: median of the timed request's DiT steps after the first (device clock); the first step also opens the "
    "layer rings and finishes streaming the AdaLN projections",
    "nvidia-smi figures include the CUDA context and anything allocated outside torch's caching allocator, which "
    "set_per_process_memory_fraction does not limit; process figures are null where nvidia-smi cannot see this "
    "process id (a container's PID namespace): the whole GPU's figure then stands for it",
    "copied_bytes_per_step: host -> device bytes of the DiT's ring over the timed request / steps (it includes the "
    "layers the ring prefetched beyond the last step)",
    "host peaks are VmHWM (peak resident set) per window, reset at its start through /proc/self/clear_refs; torch's "
    "pinned host allocator is reported on its own (pinned_host_bytes_at_end)",
    "a placeholder checkpoint draws a tensor's values whenever it is read: a home the plan maps (read from the "
    "checkpoint files at every visit) then costs host time a real checkpoint's page cache would not; such runs say "
    "so in `caveats`",
    "--switch and --whole-request run with the first of --weights",
    "disk.stream_read_bytes_per_step: bytes the layer streams (every streamed model) read from the checkpoint files "
    "over the timed request / its steps (the DiT's alone: dit_read_bytes_per_step, against the plan's "
    "predicted_disk_bytes_per_step); disk.block_device_read_bytes: /proc/self/io read_bytes over the timed request, "
    "the process's block-device reads (page-cache hits not counted)",
    "page_cache: the cgroup's `file` bytes at the end where --host-limit is enforced, else the change of Cached in "
    "/proc/meminfo from before the load to the end (the whole machine's); rss_peak_bytes: the largest VmHWM of the "
    "spans",
    "first request / later request: the timed request (its AdaLN tables computed, each child having a cache folder "
    "of its own unless --adaln-cache names one) and the same request again (`later`, tables from the cache)",
    "host_limit: a cgroup v2 memory.max per child (page cache charged) where the machine allows; pages a child did "
    "not bring into memory itself (the page cache before it started, its forked imports) are charged elsewhere: "
    "--drop-caches makes its reads its own",
    FP8_NOTE,
]


# --------------------------------------------------------------------------------------------------------------
# Arguments


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_checkpoint_source(parser)
    parser.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"GiB, {RESIDENT_GIB} = resident")
    parser.add_argument("--weights", default="bf16,fp8", help="weight formats, bf16 and/or fp8")
    parser.add_argument("--steps", type=int, default=2, help="steps of the timed request")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of video")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--host-memory",
        type=float,
        default=None,
        help="each engine's host budget, GiB (default: the machine's)",
    )
    parser.add_argument(
        "--host-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="run each child in a cgroup v2 with memory.max = GIB (page cache charged; root and cgroup2 with the "
        "memory controller needed, else recorded as not enforced)",
    )
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="sync and drop the page cache before each child (root), so that reads come from the disk",
    )
    parser.add_argument(
        "--real-bytes",
        nargs="?",
        const=",".join(STREAMED_MODELS),
        default=None,
        metavar="COMPONENTS",
        help="the placeholder made for the run (released or --tiny shapes) holds its drawn values as real bytes for "
        f"these components (default: {','.join(STREAMED_MODELS)}), so layers read from the files measure the disk",
    )
    parser.add_argument(
        "--adaln-cache",
        default=None,
        metavar="DIR|off",
        help="the engines' AdaLN table cache (default: a folder per child in the run's temporary folder, so that "
        "its first request computes the tables and the later one reads them)",
    )
    parser.add_argument(
        "--disk-read-gbps", default=None, help="the engines' disk read rate, GB/s (default: measured)"
    )
    parser.add_argument(
        "--activation-chunks", default=None, help="the engines' activation chunks: auto (default), off or N"
    )
    parser.add_argument("--switch", action="store_true", help="time T2VA -> Ref2VA -> T2VA (two variants)")
    parser.add_argument("--switch-budget", type=float, default=24.0, help="GPU budget of --switch, GiB")
    parser.add_argument(
        "--disk-host-memory",
        type=float,
        default=None,
        help="host budget of the switch's disk variant (default: the largest whose plan sends the other partition "
        "to disk)",
    )
    parser.add_argument(
        "--whole-request", default="", help="step counts of whole requests, e.g. 50,8 (empty: none)"
    )
    parser.add_argument(
        "--whole-budgets", default=f"24,{RESIDENT_GIB}", help="budgets of --whole-request, GiB"
    )
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    parser.add_argument("--resume", default=None, help="a result file whose configurations are skipped")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="start no child that would end later (s)"
    )
    parser.add_argument(
        "--child-timeout", type=float, default=3600.0, help="seconds before a child is killed"
    )
    parser.add_argument(
        "--latents-dir",
        default=None,
        help="keep the final latents of the first run of each (weights, budget) here, the FP8 error's operands "
        "(default: a temporary folder, removed at the end)",
    )
    parser.add_argument(
        "--cpu-threads", type=int, default=1, help="torch threads of each child on the CPU (default 1)"
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's mode: one JSON spec
    args = parser.parse_args(argv)
    if args.real_bytes is not None:
        from h3engine.checkpoint.placeholder import parse_components

        if args.checkpoint is not None:
            parser.error(
                "--real-bytes: makes the run's placeholder; for --checkpoint write one with python -m h3engine "
                "make-placeholder-checkpoint DIR --real-bytes ..."
            )
        try:
            args.real_bytes = ",".join(parse_components(args.real_bytes))
        except ValueError as error:
            parser.error(f"--real-bytes: {error}")
    if args.host_limit is not None and not args.host_limit > 0:
        parser.error(f"--host-limit: expected GiB > 0, got {args.host_limit}")
    return args


def parse_numbers(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def gib_key(value: float) -> str:
    """A budget as a JSON key and run-id part: 24 -> "24", 23.5 -> "23.5"."""
    return f"{value:g}"


# --------------------------------------------------------------------------------------------------------------
# The child: one configuration in its own process


def die_with_parent(parent_pid: int) -> None:
    """A child whose benchmark is killed (the GPU machine's command limit) must not keep the GPU: ask Linux for a
    SIGKILL when its parent dies (the fork server, which leaves when the benchmark does), and leave at once if the
    benchmark is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os._exit(3)


def host_status() -> dict[str, int | None]:
    """VmHWM, VmRSS, VmLck and VmPin of this process in bytes (None where /proc does not say)."""
    fields = {"VmHWM": None, "VmRSS": None, "VmLck": None, "VmPin": None}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                fields[name] = int(value.split()[0]) * 1024
    return fields


def reset_host_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: "5" into clear_refs); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def pinned_host_bytes(cuda: bool) -> dict[str, int] | None:
    """torch's pinned host allocator: bytes it holds now and at its peak (None without CUDA or the API)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not cuda or stats is None:
        return None
    try:
        values = stats()
    except RuntimeError:
        return None
    wanted = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current", "active_bytes.peak")
    return {name: int(values[name]) for name in wanted if name in values}


def meminfo_bytes(name: str) -> int | None:
    """A /proc/meminfo field in bytes (None where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field == name:
                return int(value.split()[0]) * 1024
    return None


def process_read_bytes() -> int | None:
    """/proc/self/io read_bytes: what this process (all its threads) made the block devices read."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/io").read_text().splitlines():
            field, _, value = line.partition(":")
            if field == "read_bytes":
                return int(value)
    return None


def _why(error: OSError) -> str:
    return error.strerror or str(error)


def make_cgroup(name: str, limit_bytes: int, root: Path | None = None) -> tuple[Path | None, str | None]:
    """(a new cgroup `root/name` with memory.max = `limit_bytes`, None) or (None, why it cannot be): cgroup v2 must be
    mounted at `root` (CGROUP_ROOT) with the memory controller, which is enabled for children where it is not yet."""
    root = CGROUP_ROOT if root is None else root
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError as error:
        return None, f"no cgroup v2 at {root} (cgroup.controllers: {_why(error)})"
    if "memory" not in controllers:
        return (
            None,
            f"the memory controller is not available at {root} (controllers: {' '.join(controllers)})",
        )
    subtree = root / "cgroup.subtree_control"
    try:
        if "memory" not in subtree.read_text().split():
            subtree.write_text("+memory")
    except OSError as error:
        return None, f"cannot enable the memory controller in {subtree} ({_why(error)})"
    folder = root / name
    try:
        folder.mkdir()
        (folder / "memory.max").write_text(str(limit_bytes))
        # No swap beside the limit (where the kernel accounts it): over the limit is reclaim or the OOM killer.
        if (folder / "memory.swap.max").exists():
            (folder / "memory.swap.max").write_text("0")
    except OSError as error:
        remove_cgroup(folder)
        return None, f"cannot make {folder} with memory.max ({_why(error)})"
    return folder, None


def join_cgroup(folder: Path) -> str | None:
    """(The child, before it loads anything.) Move this process into `folder`; None, or why it could not."""
    try:
        (folder / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as error:
        return f"cannot join {folder} ({_why(error)})"
    return None


def cgroup_number(folder: Path, name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int((folder / name).read_text().split()[0])
    return None


def cgroup_fields(folder: Path, name: str) -> dict[str, int]:
    """The "key value" lines of a cgroup file (memory.stat, memory.events); {} where it cannot be read."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in (folder / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                fields[key] = int(value)
    return fields


def remove_cgroup(folder: Path, wait_s: float = 5.0) -> str | None:
    """Remove a cgroup made by `make_cgroup`; None, or why not. The kernel's folder goes with rmdir once its last
    process is gone (EBUSY for a moment after it exits); plain files in it (a test's stand-in tree) are removed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            folder.rmdir()
            return None
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno == errno.ENOTEMPTY:
                for entry in folder.iterdir():
                    with contextlib.suppress(OSError):
                        entry.unlink()  # a cgroup's own files refuse this: only a stand-in's go
            if time.monotonic() > deadline:
                return f"{folder} not removed ({_why(error)})"
            time.sleep(0.1)


def drop_caches(path: Path | None = None) -> dict[str, Any]:
    """Write back dirty pages and drop the page cache (3: page cache, dentries and inodes) where permitted."""
    path = DROP_CACHES_PATH if path is None else path
    os.sync()
    try:
        path.write_text("3")
    except OSError as error:
        return {"done": False, "why": f"{path}: {_why(error)}"}
    return {"done": True}


def nvidia_smi_now() -> tuple[float, float]:
    """(MiB this process uses, MiB the whole GPU uses) now by nvidia-smi; 0 for what it does not say."""
    from benchmarks.stage_layouts import nvidia_smi

    def number(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            return 0.0

    gpu = sum(number(line) for line in nvidia_smi("--query-gpu=memory.used"))
    process = 0.0
    for line in nvidia_smi("--query-compute-apps=pid,used_memory"):
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            process = max(process, number(used))
    return process, gpu


class Windows:
    """Seconds and peak memory of named spans of one child: CUDA allocator peaks (reset at the start of each),
    nvidia-smi peaks (a MemorySampler of benchmarks.stage_layouts per span), host VmHWM (reset through clear_refs)
    and pinned host bytes at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.spans: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        sampler = None
        synchronize(self.device)
        if self.cuda:
            from benchmarks.stage_layouts import MemorySampler

            torch.cuda.reset_peak_memory_stats(self.device)
            sampler = MemorySampler([os.getpid()], gpu=True)
        host_reset = reset_host_peak()
        started = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            seconds = time.perf_counter() - started
            figures: dict[str, Any] = {"seconds": seconds}
            if sampler is not None:
                # One more sample at the end: a span shorter than the sampling period has no other.
                process_now, gpu_now = nvidia_smi_now()
                process_peak = max(sampler.stop().get(os.getpid(), 0.0), process_now)
                figures["max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
                figures["max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
                # 0 means never seen: nvidia-smi cannot see this PID (a container's PID namespace).
                figures["nvidia_smi_process_peak_mib"] = process_peak or None
                figures["nvidia_smi_gpu_peak_mib"] = max(sampler.peak_gpu_used_mib, gpu_now) or None
            else:
                figures.update(
                    dict.fromkeys(
                        (
                            "max_reserved_bytes",
                            "max_allocated_bytes",
                            "nvidia_smi_process_peak_mib",
                            "nvidia_smi_gpu_peak_mib",
                        )
                    )
                )
            status = host_status()
            figures["host_peak_bytes"] = status["VmHWM"]
            figures["host_peak_since"] = "span start" if host_reset else "process start"
            figures["host_status_at_end"] = status
            figures["pinned_host_bytes_at_end"] = pinned_host_bytes(self.cuda)
            self.spans[name] = figures


class StepRecorder:
    """Each DiT step's device time (benchmarks.e2e.StepTimer) and the pipeline's own `StepEvent.elapsed_s`."""

    def __init__(self, device: torch.device) -> None:
        from benchmarks.e2e import StepTimer

        self.timer = StepTimer(device)
        self.elapsed_s: list[float] = []

    def should_cancel(self) -> bool:
        return self.timer.before_step()

    def on_step(self, event: Any) -> None:
        self.timer.after_step(event)
        self.elapsed_s.append(event.elapsed_s)


def step_summary(seconds: list[float]) -> float | None:
    """The step time a configuration is judged by: the median of the steps after the first (the only one if one)."""
    if not seconds:
        return None
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def make_request(spec: dict[str, Any], steps: int, task: str = "t2va") -> Any:
    from h3engine.engine.lora.library import TURBO_TABLE
    from h3engine.request.files import Reference
    from h3engine.request.model import GenerationRequest

    shifts = {}
    if steps == TURBO_TABLE.steps:
        shifts = {"flow_shift": TURBO_TABLE.flow_shift, "audio_flow_shift": TURBO_TABLE.audio_flow_shift}
    references = (Reference("image", str(REF2VA_IMAGE)),) if task == "ref2va" else ()
    return GenerationRequest(
        task=task,
        prompt=REF2VA_PROMPT if task == "ref2va" else spec["prompt"],
        duration_seconds=spec["duration"],
        aspect_ratio="16:9",
        seed=spec["seed"],
        steps=steps,
        references=references,
        **shifts,
    )


def request_shape(engine: Any, request: Any) -> dict[str, Any]:
    """The exact shape the request runs at: canvas, frames, latent grid and packed rows per modality."""
    prepared = engine.prepare(request)
    layout = prepared.conditions.layout(prepared.presentation.row_tags, prepared.geometry)
    return {
        "task": request.task,
        **prepared_shape(prepared),
        "audio_latents": prepared.geometry.audio_latents,
        "condition_video_rows": layout.num_condition_video_rows,
    }


def run_request(
    engine: Any, request: Any, device: torch.device, mp4_path: Path | None = None
) -> tuple[Any, dict[str, Any]]:
    """`Engine.generate` with its steps timed; returns the output and the figures."""
    steps = StepRecorder(device)
    started = time.perf_counter()
    output, _ = engine.generate(
        request, on_step=steps.on_step, should_cancel=steps.should_cancel, mp4_path=mp4_path
    )
    synchronize(device)
    wall_s = time.perf_counter() - started
    step_s = steps.timer.seconds()
    return output, {
        "steps": request.steps,
        "flow_shifts": [request.flow_shift, request.audio_flow_shift],
        "wall_s": wall_s,
        "step_s": step_summary(step_s),
        "steps_s": step_s,
        "step_event_elapsed_s": steps.elapsed_s,
        "adaln_tables": next((ADALN_TIMINGS[key] for key in ADALN_TIMINGS if key in output.timings), None),
        "timings_s": dict(output.timings),
    }


def stream_counters(engine: Any, models: Any) -> dict[str, dict[str, int] | None]:
    """Each streamable model's LayerStream counters now (None: not streamed under this plan)."""
    counters = {}
    for name in STREAMED_MODELS:
        module = getattr(models, name, None)
        stream = engine.placement.stream_of(module) if module is not None else None
        counters[name] = (
            None
            if stream is None
            else {
                "visits": stream.visits,
                "restarts": stream.restarts,
                "copied_bytes": stream.copied_bytes,
                "read_bytes": stream.read_bytes,
                "layer_reads": stream.layer_reads,
                "waited_reads": stream.waited_reads,
                "most_reads_ahead": stream.most_reads_ahead,
                "host_bytes": stream.host_bytes,
                "host_ring_buffers": stream.host_ring_buffers,
                "host_ring_bytes": stream.host_ring_bytes,
                "file_home_layers": sum(stream.home_is_file),
                "ring_depth": stream.depth,
                "slot_bytes": stream.slot_bytes,
                "layers": len(stream.layers),
            }
        )
    return counters


COUNTED = ("visits", "restarts", "copied_bytes", "read_bytes", "layer_reads", "waited_reads")


def stream_deltas(
    before: dict[str, dict[str, int] | None], after: dict[str, dict[str, int] | None], steps: int
) -> dict[str, dict[str, Any] | None]:
    deltas: dict[str, dict[str, Any] | None] = {}
    for name, now in after.items():
        then = before.get(name)
        if now is None or then is None:
            deltas[name] = None
            continue
        delta = {key: now[key] - then[key] for key in COUNTED}
        deltas[name] = {
            **delta,
            "copied_bytes_per_step": delta["copied_bytes"] / steps if name == "dit" else None,
            "read_bytes_per_step": delta["read_bytes"] / steps if name == "dit" else None,
            **{key: value for key, value in now.items() if key not in COUNTED},  # sizes, and a maximum
        }
    return deltas


def disk_figures(engine: Any, streams: dict[str, dict[str, Any] | None], steps: int, io: int | None) -> dict:
    """The timed request's reads from the checkpoint files against the plan's prediction (see NOTES)."""
    read = sum(stream["read_bytes"] for stream in streams.values() if stream is not None)
    dit = streams.get("dit")
    cost = engine.plan.cost
    return {
        "stream_read_bytes_per_step": read / steps,
        "dit_read_bytes_per_step": None if dit is None else dit["read_bytes"] / steps,
        "predicted_disk_bytes_per_step": cost.disk_bytes_per_step,
        "predicted_disk_bytes_per_request": cost.disk_bytes_per_request,
        "disk_bytes_per_second": engine.plan.context.disk_bytes_per_second,
        "block_device_read_bytes": io,
    }


def plan_record(engine: Any) -> dict[str, Any]:
    plan = engine.plan
    return {
        "summary_lines": summary_lines(plan),
        "profile": plan.profile,
        "weights": plan.weights,
        "fits": plan.fits,
        "predicted_peak_gpu_bytes": plan.peak_gpu_bytes,
        "predicted_peak_host_bytes": plan.peak_host_bytes,
        "predicted_phase_peaks": dict(plan.phase_peaks),
        "bytes_per_step": plan.bytes_per_step,
        "bytes_per_request": plan.bytes_per_request,
        "seconds_lost_per_request": plan.seconds_lost_per_request,
        "adaln_home": plan.adaln_home,
        "other_partition_home": plan.other_partition_home,
        "cost": dataclasses.asdict(plan.cost),
        "predicted_step_s": plan.cost.step_seconds,
        "context": dataclasses.asdict(plan.context),
        "activation_chunks": plan.activation_chunks,
        "host_pinned": dict(plan.host_pinned),
        "working": dict(plan.working),
        "budget": dataclasses.asdict(plan.budget),
        "models": {name: dataclasses.asdict(placement) for name, placement in plan.models.items()},
        "placements": engine.placement.describe(),
    }


def caveats(spec: dict[str, Any], engine: Any) -> list[str]:
    """What makes a run's times unlike the released checkpoint's: layers a placeholder's hole files (no real bytes)
    hand out at every visit, drawing their values on the host."""
    plan = engine.plan
    from_files = [
        name
        for name, placement in plan.models.items()
        if placement.home == "mapped" or (placement.layers == "streamed" and placement.mapped_layers > 0)
    ]
    from_files += ["dit AdaLN projections"] if plan.adaln_home == "mapped" else []
    holes = [name for name in from_files if name.split()[0] not in spec.get("real_bytes", ())]
    if spec.get("placeholder") and holes:
        return [
            f"placeholder checkpoint whose hole files this plan reads layers from ({', '.join(holes)}): their values "
            "are drawn on the host at every visit, so these figures measure the CPU drawing values, not the disk "
            "(--real-bytes writes them)"
        ]
    return []


def latents_digest(output: Any) -> str:
    digest = hashlib.sha256()
    for tensor in (output.video_latents, output.audio_latents):
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_latents(output: Any, path: str | None) -> None:
    if path is not None:
        torch.save({"video": output.video_latents.cpu(), "audio": output.audio_latents.cpu()}, path)


def budget_checks(limit: dict[str, Any], spans: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Whether every span stayed under the budget: by peak reserved bytes, and by nvidia-smi (with the context)."""
    budget = limit["budget_bytes"]
    if budget is None:
        return None
    reserved = max(span["max_reserved_bytes"] or 0 for span in spans.values())
    smi = [
        span["nvidia_smi_process_peak_mib"] or span["nvidia_smi_gpu_peak_mib"]
        for span in spans.values()
        if span["nvidia_smi_process_peak_mib"] or span["nvidia_smi_gpu_peak_mib"]
    ]
    smi_peak = max(smi) * MIB if smi else None
    return {
        "peak_reserved_bytes": reserved,
        "reserved_within_budget": reserved <= budget,
        "nvidia_smi_peak_bytes": smi_peak,
        "nvidia_smi_within_budget": None if smi_peak is None else smi_peak <= budget,
        "nvidia_smi_minus_reserved_bytes": None if smi_peak is None else smi_peak - reserved,
    }


def machine_id(device: torch.device) -> str:
    """What tells one lease's machine from another's: the boot id and, on a GPU, its UUID."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    if device.type == "cuda":
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        return f"{platform.node()}:{boot}:{uuid}"
    return f"{platform.node()}:{boot}"


def engine_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine options every child passes (`--adaln-cache`, `--disk-read-gbps`, `--activation-chunks`)."""
    return {name: spec[name] for name in ("adaln_cache", "disk_read_gbps", "activation_chunks")}


def load_engine(spec: dict[str, Any], device: torch.device, host_memory: float | None = None) -> Any:
    from h3engine.engine.engine import Engine

    return Engine.from_checkpoint(
        spec["checkpoint"],
        device,
        memory_profile=spec["profile"],
        gpu_memory=spec["gpu_memory"],
        host_memory=host_memory if host_memory is not None else spec["host_memory"],
        weights=spec["weights"],
        **engine_options(spec),
    )


def measure_budget(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One configuration: load under the budget, warm up, time the request."""
    # The resident engine peaks at ~121 GiB (README's e2e runs): it runs on the whole GPU, uncapped.
    limit = enforce_budget(device, None if spec["budget_gib"] == RESIDENT_GIB else spec["budget_gib"])
    windows = Windows(device)
    cached_before = meminfo_bytes("Cached")
    with windows.span("load"):
        engine = load_engine(spec, device)
    request = make_request(spec, spec["steps"])
    shape = request_shape(engine, request)
    models = engine.store.models_for_task(request.task)
    loaded = stream_counters(engine, models)
    with windows.span("warm_up"):
        _, warm_up = run_request(engine, dataclasses.replace(request, steps=1), device)
    before = stream_counters(engine, models)
    # The text encoder runs here only: the later requests reuse the prompt's encoding.
    warm_up["streams"] = stream_deltas(loaded, before, 1)
    io_before = process_read_bytes()
    with windows.span("timed"):
        output, timed = run_request(engine, request, device)
    io_after = process_read_bytes()
    after = stream_counters(engine, models)
    streams = stream_deltas(before, after, request.steps)
    save_latents(output, spec.get("latents_path"))
    # The same request again: its AdaLN tables now come from the cache the first one filled.
    with windows.span("later"):
        later_output, later = run_request(engine, request, device)
    later["streams"] = stream_deltas(after, stream_counters(engine, models), request.steps)
    later["latents_equal_to_first"] = latents_digest(later_output) == latents_digest(output)
    cached_after = meminfo_bytes("Cached")
    io = None if io_before is None or io_after is None else io_after - io_before
    plan = engine.plan
    return {
        "limit": limit,
        "plan": plan_record(engine),
        "load_s": windows.spans["load"]["seconds"],
        "load_timings_s": dict(engine.store.load_timings),
        "shape": shape,
        "warm_up": warm_up,
        "timed": timed,
        "later": later,
        "step_s": timed["step_s"],
        "later_step_s": later["step_s"],
        "adaln_tables": {"first": timed["adaln_tables"], "later": later["adaln_tables"]},
        "predicted_step_s": plan.cost.step_seconds,
        "predicted_compute_step_s": plan.cost.compute_step_seconds,
        "predicted_first_request_extra_s": plan.cost.first_request_seconds,
        "disk": disk_figures(engine, streams, request.steps, io),
        "rss_peak_bytes": max(
            (span["host_peak_bytes"] or 0 for span in windows.spans.values()), default=None
        ),
        "page_cache": {
            "bytes": None if cached_before is None or cached_after is None else cached_after - cached_before,
            "source": "change of Cached in /proc/meminfo from before the load to the end (the whole machine's)",
        },
        "memory": windows.spans,
        "checks": budget_checks(limit, windows.spans),
        "streams": streams,
        "restarts": sum(stream["restarts"] for stream in streams.values() if stream is not None),
        "caveats": caveats(spec, engine),
        "latents_sha256": latents_digest(output),
    }


def disk_host_budget(spec: dict[str, Any], device: torch.device) -> tuple[float | None, str]:
    """The largest host budget (to 1/16 GiB) whose plan fits and sends the other partition's DiT to "disk", found by
    bisection over plans (configs and headers only, ~1 s each at the released size), and how it was found; None
    where no such budget exists (the other partition too small to matter, as in a tiny checkpoint)."""
    from h3engine.checkpoint.layout import detect_layout
    from h3engine.errors import RequestError
    from h3engine.memory.budget import resolve_budget
    from h3engine.memory.engine_plan import MemoryRequest, plan_memory

    layout = detect_layout(spec["checkpoint"])

    def home(host_gib: float) -> str | None:
        request = MemoryRequest(spec["profile"], spec["gpu_memory"], f"{host_gib:.4f}", spec["weights"])
        try:
            return plan_memory(layout, device, torch.bfloat16, request).other_partition_home
        except RequestError:
            return None  # no plan fits this host budget

    # Invariant: home(low) is None or "disk" (too small to fit, or disk); home(high) keeps the partition warm.
    low, high = 0.0, (resolve_budget(device, spec["gpu_memory"], None).host_bytes or 0) / GIB
    if home(high) in (None, "disk"):
        low = high
    while high - low > 1 / 16:
        middle = (low + high) / 2
        if home(middle) in (None, "disk"):
            low = middle
        else:
            high = middle
    if low > 0 and home(low) == "disk":
        return (
            low,
            "searched: the largest host budget (to 1/16 GiB) whose plan sends the other partition to disk",
        )
    return None, "no host budget gives a plan that fits with the other partition on disk"


def load_with_partition_on_disk(spec: dict[str, Any], device: torch.device) -> Any:
    """An `Engine` whose plan sends the other DiT partition to "disk" whatever the host budget, everything else as
    planned: the disk variant where no host budget makes the planner choose it."""
    from h3engine.engine.engine import Engine

    class PartitionOnDisk(Engine):
        def _make_placement(self, memory_profile: str, device: torch.device) -> Any:
            placement = super()._make_placement(memory_profile, device)
            placement.plan = dataclasses.replace(placement.plan, other_partition_home="disk")
            return placement

    return PartitionOnDisk.from_checkpoint(
        spec["checkpoint"],
        device,
        memory_profile=spec["profile"],
        gpu_memory=spec["gpu_memory"],
        host_memory=spec["host_memory"],
        weights=spec["weights"],
        **engine_options(spec),
    )


def measure_switch(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """T2VA (1 step) -> Ref2VA (1 step) -> T2VA with both partitions; each switch timed on its own."""
    limit = enforce_budget(device, spec["budget_gib"])
    host_memory, host_source = (
        spec["host_memory"],
        "as given" if spec["host_memory"] is not None else "default",
    )
    forced = False
    if spec["variant"] == "disk" and device.type == "cuda" and host_memory is None:
        host_memory, host_source = disk_host_budget(spec, device)
        if host_memory is None:
            forced, host_source = True, f"{host_source}: the plan's other_partition_home forced to disk"
    windows = Windows(device)
    with windows.span("load"):
        if forced:
            engine = load_with_partition_on_disk(spec, device)
        else:
            engine = load_engine(spec, device, host_memory)
    sequence = []
    with windows.span("sequence"):
        for task in ("t2va", "ref2va", "t2va"):
            request = make_request(spec, 1, task)
            was = engine.store.partition_on_device
            synchronize(device)
            started = time.perf_counter()
            engine.store.models_for_task(task)
            synchronize(device)
            switch_s = time.perf_counter() - started
            _, figures = run_request(engine, request, device)
            sequence.append(
                {
                    "task": task,
                    "partition_before": was,
                    "partition_after": engine.store.partition_on_device,
                    "switch_s": switch_s,
                    "request": figures,
                }
            )
    return {
        "limit": limit,
        "host_memory_gib": host_memory,
        "host_memory_source": host_source,
        "other_partition_home_forced": forced,
        "plan": plan_record(engine),
        "load_s": windows.spans["load"]["seconds"],
        "sequence": sequence,
        "caveats": caveats(spec, engine),
        "to_ref2va_s": sequence[1]["switch_s"],
        "back_to_t2va_s": sequence[2]["switch_s"],
        "memory": windows.spans,
        "checks": budget_checks(limit, windows.spans),
    }


def measure_whole(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Whole requests (MP4 included) at one budget, one per step count, after a warm-up."""
    # The resident engine peaks at ~121 GiB (README's e2e runs): it runs on the whole GPU, uncapped.
    limit = enforce_budget(device, None if spec["budget_gib"] == RESIDENT_GIB else spec["budget_gib"])
    windows = Windows(device)
    with windows.span("load"):
        engine = load_engine(spec, device)
    with windows.span("warm_up"):
        _, warm_up = run_request(engine, make_request(spec, 1), device)
    requests = []
    for steps in spec["whole_steps"]:
        request = make_request(spec, steps)
        mp4 = Path(spec["scratch_dir"]) / f"whole_{steps}.mp4"
        with windows.span(f"request_{steps}_steps"):
            _, figures = run_request(engine, request, device, mp4_path=mp4)
        figures["mp4_bytes"] = mp4.stat().st_size if mp4.exists() else None
        mp4.unlink(missing_ok=True)
        requests.append(figures)
    return {
        "limit": limit,
        "plan": plan_record(engine),
        "load_s": windows.spans["load"]["seconds"],
        "warm_up": warm_up,
        "requests": requests,
        "caveats": caveats(spec, engine),
        "memory": windows.spans,
        "checks": budget_checks(limit, windows.spans),
    }


MEASURES = {"budget": measure_budget, "switch": measure_switch, "whole": measure_whole}


def child_main(spec_text: str) -> None:
    """The `--one` mode: run one configuration and write its record to `spec["record_path"]`."""
    spec = json.loads(spec_text)
    die_with_parent(spec["parent_pid"])
    # Into the host limit's cgroup before anything is loaded: what it allocates and reads from here on is charged there.
    cgroup = Path(spec["cgroup"]) if spec.get("cgroup") else None
    join_error = join_cgroup(cgroup) if cgroup is not None else None
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if not cuda:
        # Tiny models: threads cost more than they give, and children on a shared CPU would fight over cores.
        torch.set_num_threads(spec["cpu_threads"])
    import h3engine.engine  # noqa: F401  (imported before the load window opens: its import is no load time)

    record: dict[str, Any] = {
        "run_id": spec["run_id"],
        "pid": os.getpid(),
        "machine": machine_id(device),
        # The parent never touches CUDA (its context would sit on the GPU beside every child): children say.
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "device_total_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
    }
    if cgroup is not None:
        record["cgroup_join_error"] = join_error
    try:
        record.update(MEASURES[spec["kind"]](spec, device))
        record["outcome"] = "done"
    except Exception as error:  # a budget that does not fit, out of memory: recorded, the run goes on
        record["outcome"] = "error"
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
    if cgroup is not None and join_error is None:
        # Now, while this process still holds its memory (after it exits, anon is gone and only the page cache stays).
        record["cgroup_stat"] = cgroup_fields(cgroup, "memory.stat")
    Path(spec["record_path"]).write_text(json.dumps(record, default=str))


# --------------------------------------------------------------------------------------------------------------
# The parent: run order, children, derived figures


def on_cpu(args: argparse.Namespace) -> bool:
    return torch.device(args.device).type == "cpu"


def profile_for(cpu: bool, budget_gib: float) -> tuple[str, float | None]:
    """(memory profile, gpu_memory) of a budget: resident at 120; on a GPU `auto` under the budget, on the CPU
    `streamed` (no budget there)."""
    if budget_gib == RESIDENT_GIB:
        return "resident", None
    if cpu:
        return "streamed", None
    return "auto", budget_gib


def budget_runs(budgets: list[float], weights: list[str]) -> list[dict[str, Any]]:
    """The run order: per weight format R B1 B1 R B2 B2 R ... (R resident; each B measured twice, the first next to
    the resident run before it, the second next to the one after it: A B B A)."""
    others = [budget for budget in budgets if budget != RESIDENT_GIB]
    interleaved = RESIDENT_GIB in budgets
    order = [RESIDENT_GIB] if interleaved else []
    for budget in others:
        order += [budget, budget, RESIDENT_GIB] if interleaved else [budget]
    runs: list[dict[str, Any]] = []
    for weight in weights:
        counts: dict[float, int] = {}
        ids = []
        for budget in order:
            ids.append(f"budget:{weight}:{gib_key(budget)}:{counts.get(budget, 0)}")
            counts[budget] = counts.get(budget, 0) + 1
        for position, (budget, run_id) in enumerate(zip(order, ids, strict=True)):
            run = {"kind": "budget", "run_id": run_id, "weights": weight, "budget_gib": budget}
            if interleaved and budget != RESIDENT_GIB:
                before = order[position - 1] == RESIDENT_GIB
                run["neighbour"] = ids[position - 1 if before else position + 1]
            runs.append(run)
    return runs


def planned_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    weights = [name.strip() for name in args.weights.split(",") if name.strip()]
    runs = budget_runs(parse_numbers(args.budgets), weights)
    if args.switch:
        for variant in ("warm_host", "disk"):
            runs.append(
                {
                    "kind": "switch",
                    "run_id": f"switch:{variant}",
                    "variant": variant,
                    "weights": weights[0],
                    "budget_gib": args.switch_budget,
                    "host_memory": args.disk_host_memory if variant == "disk" else args.host_memory,
                }
            )
    steps = [int(value) for value in parse_numbers(args.whole_request)]
    if steps:
        for budget in parse_numbers(args.whole_budgets):
            runs.append(
                {
                    "kind": "whole",
                    "run_id": f"whole:{weights[0]}:{gib_key(budget)}",
                    "weights": weights[0],
                    "budget_gib": budget,
                    "whole_steps": steps,
                }
            )
    cpu = on_cpu(args)
    for run in runs:
        if run["kind"] == "switch":
            run["profile"], run["gpu_memory"] = "auto", None if cpu else run["budget_gib"]
        else:
            run["profile"], run["gpu_memory"] = profile_for(cpu, run["budget_gib"])
        run.setdefault("host_memory", args.host_memory)
        if run["kind"] == "budget" and run["run_id"].endswith(":0"):
            run["keep_latents"] = True  # the first run of each (weights, budget): the FP8 error's operands
    return runs


def child_entry(spec_text: str) -> None:
    """A child's body, named by module (not `__main__`) so that the fork server finds it."""
    importlib.import_module("benchmarks.memory_budgets").child_main(spec_text)


def run_child(
    run: dict[str, Any],
    args: argparse.Namespace,
    checkpoint: str,
    work: Path,
    latents: Path,
    facts: dict[str, Any],
) -> dict[str, Any]:
    """Run one configuration in a child process and return its record (an error record if it died)."""
    name = run["run_id"].replace(":", "_")
    spec = {
        **run,
        "checkpoint": checkpoint,
        "device": args.device,
        # On the CPU there is no GPU budget to enforce.
        "budget_gib": None if on_cpu(args) else run["budget_gib"],
        "steps": args.steps,
        "duration": args.duration,
        "prompt": PROMPT,
        "seed": args.seed,
        "record_path": str(work / f"{name}.json"),
        "latents_path": str(latents / f"{name}.pt") if run.get("keep_latents") else None,
        "scratch_dir": str(work),
        "parent_pid": os.getpid(),
        "cpu_threads": args.cpu_threads,
        "placeholder": facts["placeholder"],
        "real_bytes": facts["real_bytes"],
        # A folder per child by default: each child's first request computes its tables, the later one reads them.
        "adaln_cache": args.adaln_cache or str(work / "adaln" / name),
        "disk_read_gbps": args.disk_read_gbps,
        "activation_chunks": args.activation_chunks,
        "cgroup": None,
    }
    extra: dict[str, Any] = {}
    if args.drop_caches:
        extra["drop_caches"] = drop_caches()
    cgroup = None
    if args.host_limit is not None:
        cgroup, why = make_cgroup(
            f"h3-bench-{os.getpid()}-{next(CGROUP_NUMBERS)}", int(args.host_limit * GIB)
        )
        spec["cgroup"] = None if cgroup is None else str(cgroup)
        extra["host_limit"] = {"gib": args.host_limit, "enforced": False, "why": why}
    try:
        returncode, wall_s, current_peak = start_child(spec, run["run_id"], args.child_timeout, cgroup)
        if cgroup is not None:
            peak = cgroup_number(cgroup, "memory.peak")
            events = cgroup_fields(cgroup, "memory.events")
            stat_after_exit = cgroup_fields(cgroup, "memory.stat")
    finally:
        removal = remove_cgroup(cgroup) if cgroup is not None else None
    record_path = Path(spec["record_path"])
    if record_path.exists():
        record = json.loads(record_path.read_text())
        record_path.unlink()
    else:
        record = {
            "run_id": run["run_id"],
            "outcome": "no record",
            "error": f"the child wrote no record (exit {returncode})",
        }
    if cgroup is not None:
        # Killed by its cgroup's OOM killer: a result (this budget does not fit the limit), not a crash.
        killed = bool(events.get("oom_kill")) and returncode == -signal.SIGKILL
        join_error = record.pop(
            "cgroup_join_error", None if killed else "the child did not say whether it joined"
        )
        stat = record.pop("cgroup_stat", None)
        stat_source = "memory.stat before the child exited"
        if stat is None:
            stat, stat_source = stat_after_exit, "memory.stat after the child ended (its anon memory gone)"
        extra["host_limit"] = {
            "gib": args.host_limit,
            "enforced": join_error is None,
            **({"why": join_error} if join_error is not None else {}),
            "cgroup": str(cgroup),
            # memory.peak from kernel 5.19; else the largest memory.current the parent saw (every 0.5 s).
            "peak_bytes": peak if peak is not None else current_peak,
            "peak_source": "memory.peak" if peak is not None else "memory.current sampled every 0.5 s",
            "file_bytes": stat.get("file"),
            "anon_bytes": stat.get("anon"),
            "stat_source": stat_source,
            "oom_kills": events.get("oom_kill"),
            "removed": removal is None,
            **({"removal_error": removal} if removal is not None else {}),
        }
        if join_error is None and stat.get("file") is not None and "page_cache" in record:
            record["page_cache"] = {
                "bytes": stat["file"],
                "source": "the cgroup's memory.stat file at the end",
            }
        if killed:
            record = {
                "run_id": run["run_id"],
                "outcome": KILLED_FOR_MEMORY,
                "error": f"{KILLED_FOR_MEMORY}: the OOM killer of its cgroup (memory.max {args.host_limit:g} GiB)",
            }
    return {**run, **record, **extra, "budget_gib": run["budget_gib"], "child_wall_s": wall_s}


def start_child(
    spec: dict[str, Any], name: str, timeout: float, cgroup: Path | None
) -> tuple[int | str | None, float, int | None]:
    """Run the child and wait for it: (its exit code, or why it was killed; seconds; the largest memory.current of its
    cgroup seen meanwhile)."""
    # Forked from the server the engine's ranks start from (torch and the engine imported: a child starts in a
    # fraction of a second, not after seconds of imports), under this process's environment; still a process of
    # its own (allocator, CUDA context, host peak). The server never touches CUDA.
    child = rank_context().Process(
        target=in_front_environment,
        args=(dict(os.environ), child_entry, json.dumps(spec)),
        name=name,
    )
    started = time.perf_counter()
    child.start()
    current_peak = None
    while child.is_alive() and time.perf_counter() - started < timeout:
        child.join(min(0.5, max(0.0, timeout - (time.perf_counter() - started))))
        current = cgroup_number(cgroup, "memory.current") if cgroup is not None else None
        if current is not None:
            current_peak = max(current_peak or 0, current)
    returncode: int | str | None = child.exitcode
    if child.is_alive():
        child.kill()
        child.join()
        returncode = f"killed after {timeout:.0f} s"
    return returncode, time.perf_counter() - started, current_peak


def relative_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float((candidate.double() - reference).norm() / reference.norm().clamp_min(1e-30))


def derive(result: dict[str, Any], latents: Path) -> None:
    """Figures across configurations: equality with the resident run, FP8 error, interleaved ratios."""
    records = [record for record in result["configurations"] if "error" not in record]
    by_id = {record["run_id"]: record for record in records}
    for record in records:
        resident = by_id.get(f"budget:{record['weights']}:{gib_key(RESIDENT_GIB)}:0")
        record["equal_to_resident"] = (
            None if resident is None else record["latents_sha256"] == resident["latents_sha256"]
        )
        if record["weights"] == "fp8" and record.get("fp8_error_vs_bf16") is None:
            record["fp8_error_vs_bf16"] = fp8_error(record, latents)
    ratios: dict[str, dict[str, Any]] = {}
    for record in records:
        neighbour = by_id.get(record.get("neighbour", ""))
        if neighbour is None or not record["step_s"] or not neighbour["step_s"]:
            continue
        entry = ratios.setdefault(record["weights"], {}).setdefault(
            gib_key(record["budget_gib"]), {"pairs": []}
        )
        entry["pairs"].append(
            {
                "run": record["run_id"],
                "resident_run": neighbour["run_id"],
                "step_s": record["step_s"],
                "resident_step_s": neighbour["step_s"],
                "ratio": record["step_s"] / neighbour["step_s"],
                "same_machine": record["machine"] == neighbour["machine"],
            }
        )
    for per_weight in ratios.values():
        for budget, entry in per_weight.items():
            kept = [pair["ratio"] for pair in entry["pairs"] if pair["same_machine"]]
            entry["median"] = statistics.median(kept) if kept else None
            # The targets are the GPU's; on the CPU every budget is the same streamed profile.
            target = None if result["device"] == "cpu" else TARGETS.get(int(float(budget)))
            entry["target"] = target
            entry["meets_target"] = (
                None if target is None or entry["median"] is None else entry["median"] <= target
            )
    result["ratios"] = ratios
    result["fp8_error"] = {
        "note": FP8_NOTE,
        "per_configuration": {
            record["run_id"]: record["fp8_error_vs_bf16"]
            for record in records
            if record["weights"] == "fp8" and record.get("fp8_error_vs_bf16") is not None
        },
    }


def fp8_error(record: dict[str, Any], latents: Path) -> dict[str, float] | None:
    """The FP8 run's latents against the first bf16 run at the same budget, where both are in `latents`."""
    name = record["run_id"].replace(":", "_")
    reference = latents / f"budget_bf16_{gib_key(record['budget_gib'])}_0.pt"
    candidate = latents / f"{name}.pt"
    if not reference.exists() or not candidate.exists():
        return None
    ours, theirs = torch.load(candidate), torch.load(reference)
    return {
        "reference_run": f"budget:bf16:{gib_key(record['budget_gib'])}:0",
        "video_latents": relative_l2(ours["video"], theirs["video"]),
        "audio_latents": relative_l2(ours["audio"], theirs["audio"]),
    }


def describe_checkpoint(args: argparse.Namespace) -> str:
    if args.checkpoint is not None:
        return args.checkpoint
    if args.tiny and args.real_bytes is None:
        return "tiny (random weights, h3engine.checkpoint.tiny)"
    shapes = "tiny" if args.tiny else "released"
    if args.real_bytes:
        return (
            f"placeholder ({shapes} shapes, h3engine.checkpoint.placeholder; {args.real_bytes} written as real bytes, "
            "the rest drawn at load)"
        )
    return f"placeholder ({shapes} shapes, weights drawn at load: h3engine.checkpoint.placeholder)"


def make_checkpoint(args: argparse.Namespace, folder: Path) -> str:
    if args.checkpoint is not None:
        return str(Path(args.checkpoint).resolve())
    if args.tiny and args.real_bytes is None:
        from h3engine.checkpoint.tiny import make_tiny_checkpoint

        return str(make_tiny_checkpoint(folder / "tiny", seed=0))
    from h3engine.checkpoint.placeholder import make_placeholder_checkpoint

    real_bytes = args.real_bytes.split(",") if args.real_bytes else ()
    return str(
        make_placeholder_checkpoint(folder / "placeholder", seed=0, tiny=args.tiny, real_bytes=real_bytes)
    )


def checkpoint_facts(checkpoint: str) -> dict[str, Any]:
    """Whether the checkpoint is a placeholder and which components' files (first partition) hold real bytes, from
    their headers: a hole file carries a placeholder seed (its values drawn at every read), a real-bytes one not."""
    from h3engine.checkpoint.layout import detect_layout
    from h3engine.checkpoint.safetensors_io import read_header

    paths = next(iter(detect_layout(checkpoint).partitions.values()))
    placeholder, real_bytes = False, []
    for name in ("dit", "text_encoder", "video_vae", "audio_vae"):
        folder = Path(getattr(paths, name))
        files = [folder] if folder.is_file() else sorted(folder.rglob("*.safetensors"))
        infos = [info for path in files for info in read_header(path).values()]
        placeholder = placeholder or any(info.placeholder_seed is not None or info.drawn for info in infos)
        if infos and all(info.placeholder_seed is None for info in infos):
            real_bytes.append(name)
    return {"placeholder": placeholder, "real_bytes": real_bytes}


def engine_version() -> str | None:
    """h3engine's own version where it is not installed as a distribution (run from the repository)."""
    try:
        from h3engine import __version__
    except ImportError:
        return None
    return __version__


def git_commit() -> str | None:
    """The checkout's commit, "+dirty" with uncommitted changes; None where there is no git history."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        status = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def new_result(args: argparse.Namespace) -> dict[str, Any]:
    gpu = not on_cpu(args)
    return {
        "benchmark": "memory_budgets",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": None if gpu else "cpu",  # a GPU's name and size come from the first child
        "device_total_bytes": None,
        "host_memory_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "h3engine": package_version("h3engine") or engine_version(),
            "git_commit": git_commit(),
            "flash_attn_4": package_version("flash-attn-4"),
            "triton": package_version("triton"),
            "transformers": package_version("transformers"),
        },
        "checkpoint": describe_checkpoint(args),
        "settings": {
            "request": {
                "task": "t2va",
                "prompt": PROMPT,
                "aspect_ratio": "16:9",
                "duration_seconds": args.duration,
                "steps": args.steps,
                "warm_up_steps": 1,
                "seed": args.seed,
            },
            "device": args.device,
            "checkpoint": describe_checkpoint(args),
            "cpu_threads": args.cpu_threads if on_cpu(args) else None,
            "host_memory_gib": args.host_memory,
            "host_limit_gib": args.host_limit,
            "drop_caches": args.drop_caches,
            "engine_options": {
                "adaln_cache": args.adaln_cache or "a folder per child in the run's temporary folder",
                "disk_read_gbps": args.disk_read_gbps,
                "activation_chunks": args.activation_chunks,
            },
        },
        # Which components' files hold real bytes (from their headers, once the checkpoint is made).
        "real_bytes": None,
        "warnings": [],
        "budget_mapping": (
            {gib_key(RESIDENT_GIB): "resident", "other": "streamed (the CPU has no budget)"}
            if not gpu
            else {
                gib_key(RESIDENT_GIB): "resident, no gpu_memory, uncapped (it peaks at ~121 GiB)",
                "other": "auto with gpu_memory = budget; set_per_process_memory_fraction(budget / total)",
            }
        ),
        "shape": None,
        "run_order": [],
        "configurations": [],
        "ratios": {},
        "fp8_error": {},
        "switch": [],
        "whole_request": [],
        "notes": NOTES,
        "invocations": [],
    }


def resumed_result(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    result = json.loads(path.read_text())
    expected = new_result(args)["settings"]
    if result.get("settings") != expected:
        raise SystemExit(
            f"--resume {path}: its settings {result.get('settings')} differ from this run's {expected}"
        )
    return result


def result_path(output_dir: Path, device_name: str) -> Path:
    label = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return output_dir / f"memory_budgets_{label}_{datetime.date.today().strftime('%Y%m%d')}.json"


SECTION = {"budget": "configurations", "switch": "switch", "whole": "whole_request"}


def warn(result: dict[str, Any], line: str) -> None:
    """A warning printed now and kept in the JSON's `warnings` (once)."""
    warnings = result.setdefault("warnings", [])
    if line not in warnings:
        warnings.append(line)
        print(f"warning: {line}", flush=True)


def summary_line(record: dict[str, Any]) -> str:
    if "error" in record:
        return f"{record['run_id']}: {record['error']}"
    if record["kind"] == "switch":
        return (
            f"{record['run_id']}: to Ref2VA {record['to_ref2va_s']:.2f} s, back to T2VA "
            f"{record['back_to_t2va_s']:.2f} s (other partition: {record['plan']['other_partition_home']})"
        )
    if record["kind"] == "whole":
        done = ", ".join(f"{r['steps']} steps {r['wall_s']:.1f} s" for r in record["requests"])
        return f"{record['run_id']}: {done}"
    timed = record["memory"]["timed"]
    reserved = timed["max_reserved_bytes"]
    adaln = record["adaln_tables"]
    return (
        f"{record['run_id']}: step {record['step_s']:.3f} s (predicted {record['predicted_step_s']:.3f} s; later "
        f"{record['later_step_s']:.3f} s), load {record['load_s']:.1f} s, "
        f"reserved {'-' if reserved is None else f'{reserved / GIB:.1f} GiB'}, host peak "
        f"{(timed['host_peak_bytes'] or 0) / GIB:.1f} GiB, read {record['disk']['stream_read_bytes_per_step'] / MIB:.1f} "
        f"MiB/step, AdaLN tables {adaln['first']} then {adaln['later']}, restarts {record['restarts']}"
    )


def main(argv: list[str] | None = None) -> Path | None:
    args = parse_arguments(argv)
    if args.one is not None:
        child_main(args.one)
        return None
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.resume is not None:
        result = resumed_result(args, Path(args.resume))
        path: Path | None = output_dir / Path(args.resume).name
    else:
        result = new_result(args)
        path = None  # named after the GPU, which the first child reports
    done = {
        record["run_id"]
        for section in SECTION.values()
        for record in result[section]
        # A child its cgroup's OOM killer ended is a result too: a resumed run does not try it again.
        if "error" not in record or record.get("outcome") == KILLED_FOR_MEMORY
    }
    runs = planned_runs(args)
    if args.host_limit is not None and args.host_memory is None:
        warn(
            result,
            "--host-limit without --host-memory: the engines plan for the machine's MemAvailable, which the cgroup's "
            "memory.max does not change",
        )
    result["run_order"] = list(dict.fromkeys([*result["run_order"], *(run["run_id"] for run in runs)]))
    invocation = {"started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "ran": []}
    result["invocations"].append(invocation)
    began = time.perf_counter()
    longest: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="memory_budgets_") as temporary:
        work = Path(temporary)
        checkpoint = None  # made when the first child needs it (a resumed run may need none)
        facts: dict[str, Any] = {}
        latents = Path(args.latents_dir) if args.latents_dir else work / "latents"
        latents.mkdir(parents=True, exist_ok=True)

        def out_of_time(run: dict[str, Any]) -> bool:
            if args.time_limit is None:
                return False
            estimate = longest.get(run["kind"], DEFAULT_CHILD_ESTIMATE_S[run["kind"]])
            if time.perf_counter() - began + estimate <= args.time_limit:
                return False
            invocation["stopped_before"] = run["run_id"]
            print(f"--time-limit: stopping before {run['run_id']} (~{estimate:.0f} s)", flush=True)
            return True

        for run in runs:
            if run["run_id"] in done:
                continue
            if out_of_time(run):
                break
            if checkpoint is None:
                made = time.perf_counter()
                checkpoint = make_checkpoint(args, work)
                facts = checkpoint_facts(checkpoint)
                invocation["checkpoint_made_s"] = time.perf_counter() - made
                result["real_bytes"] = facts["real_bytes"]
                if out_of_time(run):  # writing real bytes at the released size takes minutes
                    break
            record = run_child(run, args, checkpoint, work, latents, facts)
            for caveat in record.get("caveats", []):
                warn(result, f"{run['run_id']}: {caveat}")
            longest[run["kind"]] = max(longest.get(run["kind"], 0.0), record["child_wall_s"])
            section = result[SECTION[run["kind"]]]
            section[:] = [old for old in section if old["run_id"] != run["run_id"]] + [record]
            if result["shape"] is None and record.get("shape"):
                result["shape"] = record["shape"]
            if result["device"] is None and record.get("device_name"):
                result["device"] = record["device_name"]
                result["device_total_bytes"] = record["device_total_bytes"]
            invocation["ran"].append(run["run_id"])
            derive(result, latents)
            path = path or result_path(output_dir, result["device"] or args.device)
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
            print(summary_line(record), flush=True)
        derive(result, latents)
        invocation["seconds"] = time.perf_counter() - began
        path = path or result_path(output_dir, result["device"] or args.device)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for weight, per_budget in result["ratios"].items():
        for budget, entry in per_budget.items():
            median = entry["median"]
            print(f"{weight} {budget} GiB: step-time ratio {'-' if median is None else f'{median:.3f}'}")
    print(path)
    return path


if __name__ == "__main__":
    main()
