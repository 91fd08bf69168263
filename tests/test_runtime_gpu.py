"""The resident worker runtime on GPUs: tiny generations through worker groups, cancel, a killed rank, shutdown.

On the session's tiny checkpoint, for each group (one rank per GPU: world size 1, and with two GPUs world size 2
as DiT Ulysses 2 and as tensor-parallel 2, NCCL):
1. Parity: T2VA, FL2VA and Ref2VA through the group (EngineFront + ProcessReplica) against the in-process engine on
   the first device, fp32 (max |group - engine| / max |engine| over video, audio and both latents), then T2VA
   in bf16, the released precision. Every job reports one progress message per step and its previews.
2. Cancel mid-run (a 1000-step request, cancelled at step 3): the job ends as cancelled within a few steps.
3. A rank killed with SIGKILL mid-run (the last rank): the job fails within 5 s with the message naming the rank;
   the next request succeeds on the restarted group.
4. Shutdown: no worker process is left, and the device memory in use (torch.cuda.mem_get_info, the whole GPU)
   returns to what it was before the group started (within 256 MiB).
tests/test_runtime_workers.py checks the same runtime on the CPU (gloo).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _runtime_helpers import (
    events_until_done,
    max_relative_errors,
    parity_requests,
    process_exists,
    wait_for_step,
)

from h3engine.engine.engine import Engine
from h3engine.engine.options import EngineOptions
from h3engine.models.parallel.groups import RuntimeLayout
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFailed, JobFinished, PreviewFrame, StepProgress
from h3engine.runtime.workers import ProcessReplica

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent

ASSETS = REPOSITORY_ROOT / "assets"
STEPS = 4
EVENT_TIMEOUT_S = 300.0
DEATH_REPORT_LIMIT_S = 5.0
# fp32 on a GPU: the convolutions run in TF32 by default and a split DiT sums in another order.
FP32_TOLERANCE = 1e-3
BF16_TOLERANCE = 1e-1  # a sanity bound: a split group rounds its bf16 partial sums differently
MEMORY_SLACK_BYTES = 256 << 20
REQUESTS = parity_requests(STEPS, seed=3)
# Canvases whose steps take tens of milliseconds on an H200 and about 0.3 s on two CPU cores: long against the
# front's reading delay, so the steps reported after a cancel count the ranks' steps, not the reader's lag.
LONG_CANVAS = {"cuda": (448, 256), "cpu": (112, 64)}
# Steps reported after a cancel: the one in flight, one sent but not yet read, and one of slack for fast steps.
MOST_STEPS_AFTER_CANCEL = 3


def memory_in_use(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free


def in_process_tensors(checkpoint: Path, device: str, dtype: torch.dtype, folder: Path) -> dict[str, Path]:
    engine = Engine.from_checkpoint(checkpoint, device=device, dtype=dtype)
    paths = {}
    for task, request in REQUESTS.items():
        if dtype != torch.float32 and task != "t2va":
            continue
        paths[task] = folder / f"engine-{task}-{str(dtype).removeprefix('torch.')}.safetensors"
        engine.generate_to_file(request, folder / f"engine-{task}.mp4", save_tensors_path=paths[task])
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return paths


def check_group(
    name: str,
    checkpoint: Path,
    devices: tuple[str, ...],
    layout: RuntimeLayout,
    references: dict[str, dict[str, Path]],
    folder: Path,
    problems: list[str],
) -> dict:
    report: dict = {"devices": list(devices), "layout": layout.describe()}
    memory_before = memory_in_use(devices[0])
    for dtype_name, tolerance in (("float32", FP32_TOLERANCE), ("bfloat16", BF16_TOLERANCE)):
        started = time.perf_counter()
        replica = ProcessReplica(checkpoint, devices, layout, EngineOptions(dtype=dtype_name))
        report[f"{dtype_name}_start_s"] = time.perf_counter() - started
        front = EngineFront([replica], folder, preview_every=2)
        try:
            for task, expected in references[dtype_name].items():
                tensors = folder / f"{name}-{task}-{dtype_name}.safetensors"
                started = time.perf_counter()
                events = events_until_done(
                    front.submit(REQUESTS[task], folder / f"{name}-{task}.mp4", tensors), EVENT_TIMEOUT_S
                )
                wall_s = time.perf_counter() - started
                if not isinstance(events[-1], JobFinished):
                    problems.append(f"{name} {task} {dtype_name}: {events[-1]}")
                    continue
                errors = max_relative_errors(tensors, expected)
                steps = [event.step for event in events if isinstance(event, StepProgress)]
                previews = [event.step for event in events if isinstance(event, PreviewFrame)]
                report[f"{task}_{dtype_name}"] = {
                    "max_relative_error": errors,
                    "wall_s": wall_s,
                    "steps": steps,
                }
                if max(errors.values()) > tolerance:
                    problems.append(f"{name} {task} {dtype_name}: errors {errors} above {tolerance}")
                if steps != list(range(1, STEPS + 1)) or previews != [2, 4]:
                    problems.append(f"{name} {task}: progress {steps}, previews {previews}")
            if dtype_name == "float32":
                report["cancel"] = check_cancel(front, devices[0], problems)
                report["kill"] = check_kill(name, front, replica, references, folder, problems)
        finally:
            workers = replica.worker_pids
            front.shutdown()
        left = [pid for pid in workers if process_exists(pid)]
        if left:
            problems.append(f"{name}: worker processes left after shutdown: {left}")
    report["memory_in_use_before_bytes"] = memory_before
    report["memory_in_use_after_bytes"] = memory_in_use(devices[0])
    if report["memory_in_use_after_bytes"] > memory_before + MEMORY_SLACK_BYTES:
        problems.append(
            f"{name}: device memory in use grew from {memory_before} to {report['memory_in_use_after_bytes']}"
        )
    return report


def long_request(device: str) -> GenerationRequest:
    width, height = LONG_CANVAS["cuda" if device.startswith("cuda") else "cpu"]
    return GenerationRequest(
        task="t2va", prompt="a long one", steps=1000, duration_seconds=15.0, width=width, height=height
    )


def check_cancel(front: EngineFront, device: str, problems: list[str]) -> dict:
    handle = front.submit(long_request(device))
    wait_for_step(handle, 3, EVENT_TIMEOUT_S)
    cancelled_at = time.perf_counter()
    front.cancel(handle)
    events = events_until_done(handle, EVENT_TIMEOUT_S)
    steps_after = [event.step for event in events if isinstance(event, StepProgress)]
    report = {"stop_s": time.perf_counter() - cancelled_at, "steps_reported_after_cancel": steps_after}
    cancelled = isinstance(events[-1], JobFailed) and events[-1].kind == "cancelled"
    if not cancelled or len(steps_after) > MOST_STEPS_AFTER_CANCEL:
        problems.append(f"cancel: {events[-1]}, steps after the cancel {steps_after}")
    return report


def check_kill(
    name: str,
    front: EngineFront,
    replica: ProcessReplica,
    references: dict[str, dict[str, Path]],
    folder: Path,
    problems: list[str],
) -> dict:
    handle = front.submit(long_request(replica.spec.devices[0]))
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    workers = replica.worker_pids
    victim = len(workers) - 1
    os.kill(workers[victim], signal.SIGKILL)
    killed_at = time.perf_counter()
    failed = events_until_done(handle, EVENT_TIMEOUT_S)[-1]
    report = {"report_s": time.perf_counter() - killed_at, "message": getattr(failed, "message", str(failed))}
    expected = f"A worker process died (rank {victim}, exit code -9); the worker group is restarting."
    if failed != JobFailed(handle.job_id, "engine", expected) or report["report_s"] > DEATH_REPORT_LIMIT_S:
        problems.append(f"kill: {failed} after {report['report_s']:.2f} s")
    left = [pid for pid in workers if process_exists(pid)]
    if left:
        problems.append(f"kill: processes of the old group left: {left}")
    started = time.perf_counter()
    tensors = folder / f"{name}-after-restart.safetensors"
    events = events_until_done(
        front.submit(REQUESTS["t2va"], folder / f"{name}-after-restart.mp4", tensors), EVENT_TIMEOUT_S
    )
    report["next_job_after_kill_s"] = time.perf_counter() - started
    if not isinstance(events[-1], JobFinished):
        problems.append(f"kill: the next job failed: {events[-1]}")
    else:
        errors = max_relative_errors(tensors, references["float32"]["t2va"])
        report["next_job_max_relative_error"] = errors
        if max(errors.values()) > FP32_TOLERANCE:
            problems.append(f"kill: the next job's errors {errors}")
    return report


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
GROUPS = [
    pytest.param(("cuda:0",), RuntimeLayout.choose(1), marks=pytest.mark.cuda, id="world1"),
    pytest.param(
        ("cuda:0", "cuda:1"),
        RuntimeLayout.choose(2, dit_sp=2),
        marks=[pytest.mark.cuda, needs_two_gpus],
        id="world2_sp2",
    ),
    pytest.param(
        ("cuda:0", "cuda:1"),
        RuntimeLayout.choose(2, dit_tp=2),
        marks=[pytest.mark.cuda, needs_two_gpus],
        id="world2_tp2",
    ),
]


@pytest.fixture(scope="module")
def references(tiny_native, tmp_path_factory) -> Callable[[str], dict[str, dict[str, Path]]]:
    """first device -> dtype name -> task -> the in-process engine's tensors, made when first asked for."""
    made: dict[str, dict[str, dict[str, Path]]] = {}

    def for_device(device: str) -> dict[str, dict[str, Path]]:
        if device not in made:
            folder = tmp_path_factory.mktemp(f"engine_{device.replace(':', '')}")
            made[device] = {
                name: in_process_tensors(tiny_native, device, dtype, folder)
                for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
            }
        return made[device]

    return for_device


@pytest.mark.parametrize(("devices", "layout"), GROUPS)
def test_worker_group_matches_the_engine_cancels_survives_a_killed_rank_and_shuts_down(
    devices: tuple[str, ...], layout: RuntimeLayout, references, tiny_native, tmp_path
) -> None:
    problems: list[str] = []
    name = "_".join(devices).replace(":", "")
    report = check_group(name, tiny_native, devices, layout, references(devices[0]), tmp_path, problems)
    print(json.dumps(report, indent=2, sort_keys=True))
    assert not problems, "\n".join(problems)


@pytest.mark.cuda
def test_split_stage_groups_on_one_gpu_equal_colocated(tmp_path) -> None:
    """`--stage-layout split` with the three groups on cuda:0 (the tensor channel's CUDA IPC hand-offs) against the
    in-process engine on it, through the CLI: the saved tensors are identical."""
    from safetensors.torch import load_file

    from h3engine.checkpoint.tiny import make_tiny_checkpoint
    from h3engine.cli.main import main

    checkpoint = make_tiny_checkpoint(tmp_path / "checkpoint", seed=11)
    saved = {}
    for layout in ("colocated", "split"):
        saved[layout] = tmp_path / f"{layout}.safetensors"
        arguments = [
            "generate",
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            "A kite over the sea.",
            "--seed",
            "3",
        ]
        arguments += ["--steps", "2", "--duration", "4", "--gpus", "1", "--stage-layout", layout]
        arguments += ["--out", str(tmp_path / f"{layout}.mp4"), "--save-tensors", str(saved[layout])]
        assert main([*arguments, "--progress", "plain"]) == 0
    split, colocated = load_file(saved["split"]), load_file(saved["colocated"])
    assert set(split) == set(colocated) == {"video", "audio", "video_latents", "audio_latents"}
    for name, tensor in colocated.items():
        assert torch.equal(split[name], tensor), name
