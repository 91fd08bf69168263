"""The resident worker runtime on the CPU (gloo): groups of two rank processes behind the engine front.

What is compared:
* A whole generation through a worker group equals the single-process `Engine` generation (fp32, the saved
  tensors: video, audio and both latents, max |group - single| / max |single| <= 1e-5) for T2VA, FL2VA (a keyframe
  PNG) and Ref2VA (an image and an audio reference), with the DiT split by Ulysses (SP2) and by tensor parallelism
  (TP2); the text encoder runs TP2 and the decode is split over both ranks in each. Each job reports its start
  with the engine's geometry, one progress message per step and a preview every two steps.
* A bad request (a missing keyframe file) fails alone, with the engine's message, and the group keeps serving;
  cancel mid-run stops within one step; a rank killed with SIGKILL mid-request (rank 0 and rank 1) fails that job
  within 5 s with the message naming the rank and its exit code, the old processes are gone, and the next request
  on the restarted group equals the single-process generation again.
* Shutdown with a job running cancels it and leaves no worker process; SIGTERM to a CLI run on two CPU ranks ends
  the CLI (exit code 143) and every process it started, and writes no output. (The ranks of a front process that
  is killed outright end by themselves: tests/test_outputs_and_cancel.py.)
* (The app with `--world-size 2`, serving through the HTTP API and stopping on SIGTERM within 10 s with a rank
  stopped: tests/test_app_endings.py.)
* Layout flags and device flags are checked before any process starts, with errors naming the flag.
A CUDA variant (skipped without a GPU) runs the same parity check on real GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _app_helpers import descendants
from _lora_helpers import RandomLora, random_lora, write_lora
from _refusals import refused
from _runtime_helpers import (
    events_until_done,
    max_relative_errors,
    parity_requests,
    process_exists,
    still_running,
    wait_for_step,
)

from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.options import EngineOptions
from h3engine.errors import RequestError
from h3engine.media.mux import probe_mp4
from h3engine.models.parallel.groups import PROFILES, RuntimeLayout
from h3engine.request.files import Keyframe
from h3engine.request.model import GenerationRequest, LoraChoice
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFailed, JobFinished, JobStarted, PreviewFrame, StepProgress
from h3engine.runtime.workers import ProcessReplica, rank_devices

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPOSITORY_ROOT / "assets"
SEED = 11
# Measured on CPU (torch 2.14.1, gloo, two busy cores), largest over the four tensors: SP2 3.0e-6 (audio; the
# video 1.5e-6, the latents 2e-7), TP2 of the same order. The split GEMMs and attention sum in another order.
TOLERANCE = 1e-5
EVENT_TIMEOUT_S = 120
DEATH_REPORT_LIMIT_S = 5.0
PREVIEW_EVERY = 2
STEPS = 3
LAYOUTS = {
    "sp2": RuntimeLayout.choose(2, dit_sp=2),
    "tp2": RuntimeLayout.choose(2, dit_tp=2),
    # The VAE on rank 0 alone: it writes the MP4 while it decodes (pipeline.decode with a path).
    "sp2_vae1": RuntimeLayout.choose(2, dit_sp=2, vae_ranks=1),
}
COMPARED_LAYOUTS = ["sp2", "tp2"]
REQUESTS = parity_requests(STEPS, SEED)
FP32 = EngineOptions(dtype="float32")
# Steps of about 0.3 s on two busy cores: long against the front's reading delay, short for the test.
LONG_REQUEST = GenerationRequest(
    task="t2va", prompt="a long one", steps=1000, duration_seconds=15.0, width=112, height=64
)


# --------------------------------------------------------------------------------------------------------------
# Helpers and fixtures
# --------------------------------------------------------------------------------------------------------------


def child_processes(pid: int) -> dict[int, str]:
    """pid -> command line of every living child of `pid`, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as cmdline:
                command = cmdline.read().replace("\0", " ")
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children[int(entry)] = command
    return children


def workers_of_this_process() -> dict[int, str]:
    """The rank processes this process started: the children of its multiprocessing fork server (the server itself,
    like the resource tracker, is one per parent process and ends with it; it is not a worker)."""
    servers = [pid for pid, command in child_processes(os.getpid()).items() if "forkserver" in command]
    return {pid: command for server in servers for pid, command in child_processes(server).items()}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=SEED)


@pytest.fixture(scope="module")
def single_process_tensors(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """task -> the tensors of the single-process fp32 engine's generation."""
    folder = tmp_path_factory.mktemp("single_process")
    engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    paths = {}
    for task, request in REQUESTS.items():
        paths[task] = folder / f"{task}.safetensors"
        engine.generate_to_file(request, folder / f"{task}.mp4", save_tensors_path=paths[task])
    return paths


class WorkerGroups:
    """Two-rank CPU worker groups behind fronts, one per layout name, started on first use."""

    def __init__(self, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.checkpoint, self.tmp_path_factory = checkpoint, tmp_path_factory
        self.started: dict[str, tuple[EngineFront, ProcessReplica]] = {}

    def get(self, name: str) -> tuple[EngineFront, ProcessReplica]:
        if name not in self.started:
            replica = ProcessReplica(self.checkpoint, ("cpu", "cpu"), LAYOUTS[name], options=FP32)
            front = EngineFront([replica], self.tmp_path_factory.mktemp(name), preview_every=PREVIEW_EVERY)
            self.started[name] = (front, replica)
        return self.started[name]

    def take(self, name: str) -> tuple[EngineFront, ProcessReplica]:
        """The group, no longer shared: the caller shuts it down."""
        group = self.get(name)
        del self.started[name]
        return group


@pytest.fixture(scope="module")
def groups(checkpoint, tmp_path_factory):
    worker_groups = WorkerGroups(checkpoint, tmp_path_factory)
    yield worker_groups
    for front, _ in worker_groups.started.values():
        front.shutdown()


def generate_and_compare(front: EngineFront, task: str, expected: Path, folder: Path) -> list:
    tensors = folder / f"{task}-group.safetensors"
    events = events_until_done(front.submit(REQUESTS[task], folder / f"{task}.mp4", tensors), EVENT_TIMEOUT_S)
    assert isinstance(events[-1], JobFinished), events[-1]
    errors = max_relative_errors(tensors, expected)
    assert max(errors.values()) <= TOLERANCE, errors
    return events


# --------------------------------------------------------------------------------------------------------------
# Layouts and devices (no process started)
# --------------------------------------------------------------------------------------------------------------


def test_layout_profiles_and_flag_errors() -> None:
    assert PROFILES[4] == (2, 2, 4, 4)  # the released four-GPU profile
    assert RuntimeLayout.choose(4) == RuntimeLayout(4, dit_sp=2, dit_tp=2, encoder_tp=4, vae_ranks=4)
    assert RuntimeLayout.choose(4, dit_sp=4) == RuntimeLayout(4, 4, 1, 4, 4)  # the Ulysses-4 alternative
    assert RuntimeLayout.choose(8, dit_tp=4) == RuntimeLayout(8, 2, 4, 8, 8)
    assert RuntimeLayout.choose(1) == RuntimeLayout(1, 1, 1, 1, 1)
    assert RuntimeLayout.choose(2, vae_ranks=1) == RuntimeLayout(2, 2, 1, 2, 1)
    for flags, message in [
        (dict(dit_sp=3), r"^--dit-sp 3 does not divide the 4 GPUs"),
        (dict(dit_sp=4, dit_tp=2), r"^--dit-sp 4 x --dit-tp 2 = 8 ranks, but the worker group has 4"),
        (dict(encoder_tp=3), r"^--encoder-tp 3 does not divide the 4 GPUs"),
        (dict(vae_ranks=5), r"^--vae-ranks 5 is more than the 4 GPUs"),
        (dict(dit_tp=0), r"^--dit-tp must be a positive integer, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            RuntimeLayout.choose(4, **flags)


def test_layouts_are_checked_against_the_checkpoint_before_any_process_starts(checkpoint) -> None:
    before = workers_of_this_process()
    # The tiny DiT has 2 heads: the four-GPU profile's 2 x 2 cannot split them.
    # The flags only together make no layout: the error names them, under no one field.
    with refused(RequestError, field="", names=("--dit-sp 2", "--dit-tp 2", "2 attention heads")):
        ProcessReplica(checkpoint, ("cpu",) * 4)
    assert workers_of_this_process() == before


def test_rank_devices_follow_the_cli_flags() -> None:
    assert rank_devices("cpu", None, None, None) == ("cpu",)
    assert rank_devices("cpu", 3, None, None) == ("cpu", "cpu", "cpu")
    assert rank_devices("cuda:1", None, None, None) == ("cuda:1",)
    # The device flags' rules (made in h3engine.runtime.workers; their wording is checked here).
    with refused(RequestError, field="--gpus and --devices", says="give one of them"):
        rank_devices(None, None, 2, "0,1")
    with refused(RequestError, field="--device", says="is cpu, but --gpus and --devices choose GPUs"):
        rank_devices("cpu", None, 2, None)
    with refused(RequestError, field="--devices", says="expected GPU indices"):
        rank_devices(None, None, None, "0,x")
    with refused(RequestError, field="--world-size", says="must be at least 1"):
        rank_devices("cpu", 0, None, None)
    if torch.cuda.device_count() < 8:
        with refused(RequestError, field="--gpus") as caught:
            rank_devices(None, None, 8, None)
        assert re.match(r"8 GPUs asked for, but \d+ (is|are) visible", caught.value.problem), caught.value


def test_cli_refuses_a_bad_layout_with_exit_code_2(checkpoint, tmp_path, capsys) -> None:
    arguments = [
        "generate",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "x",
        "--out",
        str(tmp_path / "x.mp4"),
    ]
    arguments += ["--device", "cpu", "--world-size", "2", "--dit-sp", "3"]
    assert main(arguments) == 2
    assert capsys.readouterr().err.strip() == "error: --dit-sp 3 does not divide the 2 GPUs (divisors: 1, 2)"


# --------------------------------------------------------------------------------------------------------------
# Generations through worker groups
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout_name", COMPARED_LAYOUTS)
@pytest.mark.parametrize("task", list(REQUESTS))
def test_generations_equal_the_single_process_engine(
    groups, single_process_tensors, layout_name, task, tmp_path
) -> None:
    front, _ = groups.get(layout_name)
    expected_geometry = front.resolve(REQUESTS[task]).geometry
    events = generate_and_compare(front, task, single_process_tensors[task], tmp_path)

    started = [event for event in events if isinstance(event, JobStarted)]
    assert len(started) == 1
    assert (started[0].width, started[0].height, started[0].frames) == (
        expected_geometry.width,
        expected_geometry.height,
        expected_geometry.frames,
    )
    assert [event.step for event in events if isinstance(event, StepProgress)] == [1, 2, 3]
    assert [event.step for event in events if isinstance(event, PreviewFrame)] == [2, 3]
    finished = events[-1]
    assert Path(finished.video_path) == tmp_path / f"{task}.mp4" and Path(finished.sidecar_path).is_file()


@pytest.fixture(scope="module")
def lora_generation(
    checkpoint, tmp_path_factory, single_process_tensors
) -> tuple[GenerationRequest, Path, list]:
    """A T2VA request with two LoRAs (fused-QKV and kohya files, one of them at a negative strength), its
    single-process tensors and the adapters its sidecar lists."""
    folder = tmp_path_factory.mktemp("loras")
    engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    config = engine.store.dit_config("fl2va")
    loras = []
    for layout, seed, strength in (("original", 41, 0.8), ("kohya", 42, -0.5)):
        lora = random_lora(config, seed)
        path = folder / f"{layout}.safetensors"
        write_lora(
            path, RandomLora({m: d * 0.02 for m, d in lora.down.items()}, lora.up, lora.alpha), layout, config
        )
        loras.append(LoraChoice(str(path), strength))
    request = dataclasses.replace(REQUESTS["t2va"], loras=tuple(loras))
    files = engine.generate_to_file(
        request, folder / "single.mp4", save_tensors_path=folder / "single.safetensors"
    )
    assert min(max_relative_errors(files.tensors, single_process_tensors["t2va"]).values()) > 1e-2
    return request, files.tensors, json.loads(files.sidecar.read_text())["adapters"]


@pytest.mark.parametrize("layout_name", COMPARED_LAYOUTS)
def test_a_request_with_loras_equals_the_single_process_engine(
    groups, lora_generation, layout_name, tmp_path
) -> None:
    """Each rank applies the request's LoRAs (a TP rank its slice); the sidecar lists them as one process does."""
    request, expected, adapters = lora_generation
    front, _ = groups.get(layout_name)
    tensors = tmp_path / "group.safetensors"
    finished = events_until_done(front.submit(request, tmp_path / "lora.mp4", tensors), EVENT_TIMEOUT_S)[-1]
    assert isinstance(finished, JobFinished), finished
    errors = max_relative_errors(tensors, expected)
    assert max(errors.values()) <= TOLERANCE, errors
    sidecar = json.loads(Path(finished.sidecar_path).read_text())
    assert sidecar["adapters"] == adapters and [a["strength"] for a in adapters] == [0.8, -0.5]
    assert [a["target"] for a in adapters] == ["transformer"] * 2


def test_a_vae_rank_alone_writes_the_mp4_while_it_decodes(groups, single_process_tensors, tmp_path) -> None:
    front, _ = groups.get("sp2_vae1")
    events = generate_and_compare(front, "t2va", single_process_tensors["t2va"], tmp_path)
    finished = events[-1]
    timings = json.loads(Path(finished.sidecar_path).read_text())["timings_s"]
    assert {"video_decode_s", "mux_s", "mux_after_decode_s"} <= set(timings), timings
    assert probe_mp4(finished.video_path)["frame_count"] == front.resolve(REQUESTS["t2va"]).geometry.frames


def test_a_bad_request_fails_only_itself(groups, tmp_path) -> None:
    """Rank 0 finds the missing file; the others learn it from the broadcast and skip the job (no hang)."""
    front, replica = groups.get("sp2")
    workers = replica.worker_pids
    # A file that went away after the request was resolved (a missing one is refused at submit).
    missing = tmp_path / "missing.png"
    shutil.copyfile(ASSETS / "fl2va" / "first.png", missing)
    request = GenerationRequest(
        task="fl2va", prompt="x", steps=2, duration_seconds=4.0, keyframes=(Keyframe(str(missing), "first"),)
    )
    resolved = front.resolve(request)
    missing.unlink()
    failed = events_until_done(front.submit(resolved), EVENT_TIMEOUT_S)[-1]
    assert failed.kind == "request" and missing.name in failed.message, failed
    assert isinstance(events_until_done(front.submit(REQUESTS["t2va"]), EVENT_TIMEOUT_S)[-1], JobFinished)
    assert replica.worker_pids == workers


def test_cancel_mid_run_stops_within_one_step(groups) -> None:
    front, _ = groups.get("sp2")
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    front.cancel(handle)
    after_cancel = events_until_done(handle, EVENT_TIMEOUT_S)
    assert after_cancel[-1] == JobFailed(handle.job_id, "cancelled", "Cancelled.")
    # The step in flight when the cancel landed, plus at most one already sent but not yet read here.
    assert len([event for event in after_cancel if isinstance(event, StepProgress)]) <= 2


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_worker_fails_only_its_job_and_the_group_restarts(
    groups, single_process_tensors, victim, tmp_path
) -> None:
    front, replica = groups.get("sp2")
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    old_workers = replica.worker_pids
    os.kill(old_workers[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    failed = events_until_done(handle, EVENT_TIMEOUT_S)[-1]
    assert time.monotonic() - killed_at < DEATH_REPORT_LIMIT_S
    assert failed == JobFailed(
        handle.job_id,
        "engine",
        f"A worker process died (rank {victim}, exit code -9); the worker group is restarting.",
    )
    assert not any(process_exists(pid) for pid in old_workers)

    generate_and_compare(front, "t2va", single_process_tensors["t2va"], tmp_path)
    new_workers = replica.worker_pids
    assert len(new_workers) == 2 and not set(new_workers) & set(old_workers)


def test_shutdown_cancels_the_running_job_and_leaves_no_worker_process(groups) -> None:
    front, replica = groups.take("tp2")
    workers = replica.worker_pids
    assert set(workers) <= set(workers_of_this_process())
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 1, EVENT_TIMEOUT_S)
    front.shutdown()
    assert events_until_done(handle, EVENT_TIMEOUT_S)[-1] == JobFailed(
        handle.job_id, "cancelled", "Cancelled."
    )
    assert not any(process_exists(pid) for pid in workers)
    assert not set(workers_of_this_process()) & set(workers)


@pytest.mark.slow
def test_sigterm_ends_a_cli_run_and_every_process_it_started(checkpoint, tmp_path) -> None:
    out = tmp_path / "terminated.mp4"
    command = [sys.executable, "-m", "h3engine", "generate", "--checkpoint", str(checkpoint), "--prompt", "x"]
    command += ["--out", str(out), "--device", "cpu", "--world-size", "2", "--dit-tp", "2", "--steps", "1000"]
    command += ["--duration", "15", "--width", "112", "--height", "64", "--progress", "json"]
    cli = subprocess.Popen(
        command, cwd=REPOSITORY_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        events = []
        for line in cli.stdout:
            events.append(json.loads(line))
            if events[-1]["event"] == "step" and events[-1]["step"] >= 2:
                break
        assert events and events[-1]["event"] == "step", events
        started = descendants(cli.pid)
        assert len(started) >= 2, started  # the two ranks (and Python's resource tracker)
        cli.send_signal(signal.SIGTERM)
        rest_out, rest = cli.communicate(timeout=60)
        assert cli.returncode == 143, rest
    finally:
        if cli.poll() is None:
            cli.kill()
    assert rest.strip().endswith("terminated")
    assert json.loads(rest_out.splitlines()[-1])["exit_code"] == 143
    assert still_running(started) == []
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------------------
# On GPUs
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_a_worker_group_on_cuda_equals_the_in_process_engine(checkpoint, tmp_path) -> None:
    """One rank per GPU (up to two, NCCL with two), fp32: the same T2VA as the in-process engine on cuda:0."""
    devices = tuple(f"cuda:{index}" for index in range(min(2, torch.cuda.device_count())))
    engine = Engine.from_checkpoint(checkpoint, device="cuda:0", dtype=torch.float32)
    expected = tmp_path / "in_process.safetensors"
    engine.generate_to_file(REQUESTS["t2va"], tmp_path / "in_process.mp4", save_tensors_path=expected)
    del engine
    torch.cuda.empty_cache()
    front = EngineFront([ProcessReplica(checkpoint, devices, options=FP32)], tmp_path)
    try:
        tensors = tmp_path / "group.safetensors"
        events = events_until_done(
            front.submit(REQUESTS["t2va"], tmp_path / "group.mp4", tensors), EVENT_TIMEOUT_S
        )
        assert isinstance(events[-1], JobFinished), events[-1]
        # The GPU's fp32 kernels differ between one and two ranks in summation order (and TF32 convolutions).
        errors = max_relative_errors(tensors, expected)
        assert max(errors.values()) <= 1e-3, errors
    finally:
        front.shutdown()
