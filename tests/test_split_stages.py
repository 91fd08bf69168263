"""Split stage groups (`--stage-layout split`): the option, its checks, and generations through three groups.

What is checked:
* The option and its device flags are read by the CLI and the app and checked before anything starts, with errors
  naming the flag: an unknown layout, encoder / VAE devices without the split layout or disagreeing with the group
  sizes, more default ranks than the DiT's GPUs, FP8 with worker groups.
* A generation through the three groups (CPU, fp32, shared-memory channels) equals the colocated engine bit for bit
  (the saved video, audio and both latents) for T2VA, FL2VA (a keyframe) and Ref2VA (an image and an audio
  reference): at world size 1 against the in-process engine; at world sizes 2 and 4 (gloo) against a colocated group
  of two; each VAE rank but the first receives only the latent frames its tiles read.
* Three queued jobs: every group takes them in the same order; the encoder takes job k + 1 before the DiT is done
  denoising job k, and the VAE decodes job k - 1 while the DiT denoises job k (the ranks' own clocks).
* SIGKILL to the rank of each group while it holds a job: that job fails within a second naming the group, a job
  queued behind it starts over on the restarted groups (one JobStarted) and finishes, no old process or /dev/shm
  file is left; a group killed between jobs costs no job. A job cancelled in the DiT while the VAE decodes the job
  before it ends within a few steps and the other finishes; shutdown with a job running and the DiT's rank stopped
  (SIGSTOP) returns within seconds and leaves no process and no /dev/shm file.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _refusals import cli_refused, refused
from _runtime_helpers import events_until_done, parity_requests, process_exists, wait_for_step
from safetensors.torch import load_file

import app
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.options import EngineOptions, check_engine_options
from h3engine.errors import RequestError
from h3engine.models.parallel.groups import RuntimeLayout
from h3engine.models.parallel.vae import latent_frame_shares, rank_tiles
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront, JobHandle
from h3engine.runtime.messages import JobFailed, JobFinished, JobStarted, StepProgress
from h3engine.runtime.split import SplitReplica
from h3engine.runtime.stage_groups import STEPS as PIPELINE_STEPS
from h3engine.runtime.workers import ProcessReplica, stage_devices

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SEED = 11
STEPS = 2
EVENT_TIMEOUT_S = 180
REQUESTS = parity_requests(STEPS, SEED)
FP32 = EngineOptions(dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    """The session's tiny checkpoint of this module's seed."""
    return tiny_checkpoints("native", seed=SEED)


@pytest.fixture(scope="module")
def colocated_tensors(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """task -> the tensors of the in-process fp32 engine (world size 1, as many threads as a rank of one uses)."""
    folder = tmp_path_factory.mktemp("colocated")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
        paths = {}
        for task, request in REQUESTS.items():
            paths[task] = folder / f"{task}.safetensors"
            engine.generate_to_file(request, folder / f"{task}.mp4", save_tensors_path=paths[task])
    finally:
        torch.set_num_threads(threads)
    return paths


def submit_parity_requests(
    front: EngineFront, replica: SplitReplica, group_sizes: dict[str, int], folder: Path
) -> dict[str, JobHandle]:
    """Check each group's number of ranks, then queue every parity request, its tensors saved in `folder`."""
    assert {stage: len(pids) for stage, pids in replica.worker_pids.items()} == group_sizes
    return {
        task: front.submit(request, folder / f"{task}.mp4", folder / f"{task}.safetensors")
        for task, request in REQUESTS.items()
    }


def assert_bit_equal(got: Path, expected: Path) -> None:
    got_tensors, expected_tensors = load_file(got), load_file(expected)
    assert set(got_tensors) == set(expected_tensors) == {"video", "audio", "video_latents", "audio_latents"}
    for name, tensor in expected_tensors.items():
        assert torch.equal(got_tensors[name], tensor), name


# --------------------------------------------------------------------------------------------------------------
# The option (no process started)
# --------------------------------------------------------------------------------------------------------------


def test_split_layout_sizes_its_groups_from_the_profile_and_the_device_flags() -> None:
    split = check_engine_options(EngineOptions(stage_layout="split"), 4)
    assert split == RuntimeLayout(4, 2, 2, 4, 4, "split")
    # The encoder group is a world of its own: one tensor-parallel replica over its ranks.
    encoder_config = SimpleNamespace(
        text_config=SimpleNamespace(num_attention_heads=64, num_key_value_heads=8, intermediate_size=25600)
    )
    assert split.encoder_layout(encoder_config).world_size == 4
    # The encoder group need not divide the DiT group: it is a world of its own.
    assert check_engine_options(EngineOptions(stage_layout="split", encoder_tp=3), 2).encoder_tp == 3
    assert split.vae_layout().world_size == 4 and split.describe().startswith("split stages: DiT Ulysses 2")
    sized = check_engine_options(
        EngineOptions(stage_layout="split", encoder_devices="4,5", vae_devices="6"), 4
    )
    assert (sized.encoder_tp, sized.vae_ranks) == (2, 1)
    assert check_engine_options(EngineOptions(), 1) == RuntimeLayout(1, 1, 1, 1, 1, "colocated")


def test_gpu_stage_processes_share_the_cores_and_cpu_ranks_keep_the_colocated_count(checkpoint) -> None:
    # On one H200 the three processes' 16 threads each made loading 4.9x slower (303 s against 62 s shared).
    from h3engine.runtime.split import validated_stage_specs

    cores = os.cpu_count() or 1
    options = EngineOptions(stage_layout="split")
    layout = check_engine_options(options, 1)
    on_gpu = validated_stage_specs(checkpoint, layout, ["cuda:0"], ["cuda:0"], ["cuda:0"], options)
    assert {spec.cpu_threads for spec in on_gpu.values()} == {max(1, cores // 3)}
    layout = check_engine_options(options, 2)
    on_cpu = validated_stage_specs(checkpoint, layout, ["cpu"] * 2, ["cpu"] * 2, ["cpu"] * 2, options)
    assert {spec.cpu_threads for spec in on_cpu.values()} == {max(1, cores // 2)}  # as a colocated rank of 2


@pytest.mark.parametrize(
    ("options", "world_size", "field", "says"),
    [
        (
            EngineOptions(stage_layout="pipelined"),
            1,
            "--stage-layout",
            "expected colocated or split, got 'pipelined'",
        ),
        (EngineOptions(encoder_devices="1"), 2, "--encoder-devices", "only with --stage-layout split"),
        (
            EngineOptions(stage_layout="split", vae_devices="2,3", vae_ranks=1),
            2,
            "--vae-devices",
            "2 GPUs given, but --vae-ranks 1 asks for 1",
        ),
        (EngineOptions(stage_layout="split", fp8_linear=True), 1, "--fp8-linear", "one GPU only"),
        # The layout's flags only together make none: no one field (the layout's wording: test_runtime_workers.py).
        (EngineOptions(stage_layout="split", dit_sp=3), 2, "", "--dit-sp 3"),
    ],
    ids=["unknown", "devices-without-split", "count-mismatch", "fp8", "dit-layout"],
)
def test_bad_stage_options_are_refused_naming_the_flag(options, world_size, field, says) -> None:
    """The stage options' rules (made in h3engine.engine.options), with their wording."""
    with refused(RequestError, field=field, says=says):
        check_engine_options(options, world_size)


def test_stage_devices_default_to_the_dit_groups_and_name_the_flag() -> None:
    layout = RuntimeLayout.choose(2, stages="split")
    assert stage_devices(layout, ("cpu", "cpu"), None, None) == (("cpu", "cpu"), ("cpu", "cpu"))
    one = RuntimeLayout.choose(2, encoder_tp=1, vae_ranks=4, stages="split")
    assert stage_devices(one, ("cpu", "cpu"), None, None) == (("cpu",), ("cpu",) * 4)
    assert stage_devices(RuntimeLayout.choose(2, stages="split"), ("cuda:0", "cuda:1"), None, None) == (
        ("cuda:0", "cuda:1"),
        ("cuda:0", "cuda:1"),
    )
    with refused(
        RequestError,
        field="--vae-ranks",
        says="asks for 4 ranks, but the group shares the DiT's 2 GPUs by default",
    ):
        stage_devices(one, ("cuda:0", "cuda:1"), None, None)
    visible = torch.cuda.device_count()
    with refused(RequestError, field="--encoder-devices", says=f"cuda:{visible} is not one of the {visible}"):
        stage_devices(layout, ("cuda:0", "cuda:1"), f"0,{visible}", None)


def test_the_cli_and_the_app_read_the_option_and_refuse_a_bad_one(tmp_path, capsys) -> None:
    config = app.parse_config(["--stage-layout", "split", "--vae-devices", "0,1"], {})
    assert (config.engine.stage_layout, config.engine.vae_devices) == ("split", "0,1")
    assert app.parse_config([], {"H3_STAGE_LAYOUT": "split"}).engine.stage_layout == "split"
    bad = app.parse_config(
        [
            "--devices",
            "cpu",
            "--stage-layout",
            "split",
            "--encoder-devices",
            "0,1",
            "--outputs",
            str(tmp_path),
        ],
        {},
    )
    with pytest.raises(app.ConfigError, match="^--encoder-devices: cuda:"):
        app.check_before_loading(bad)
    arguments = ["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "x.mp4")]
    assert main([*arguments, "--device", "cpu", "--stage-layout", "sideways"]) == 2
    cli_refused(capsys.readouterr().err, "--stage-layout")


# --------------------------------------------------------------------------------------------------------------
# Generations through the three groups
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_world_1(checkpoint, tmp_path_factory):
    replica = SplitReplica(checkpoint, ("cpu",), RuntimeLayout.choose(1, stages="split"), options=FP32)
    front = EngineFront([replica], tmp_path_factory.mktemp("split_1"), preview_every=1)
    yield front, replica
    front.shutdown()


def test_split_world_1_equals_the_colocated_engine_bit_for_bit(
    split_world_1, colocated_tensors, tmp_path
) -> None:
    front, replica = split_world_1
    handles = submit_parity_requests(front, replica, {"vae": 1, "encoder": 1, "dit": 1}, tmp_path)
    for task, handle in handles.items():
        events = events_until_done(handle, EVENT_TIMEOUT_S)
        assert isinstance(events[-1], JobFinished), events[-1]
        assert [type(event) for event in events if isinstance(event, JobStarted)] == [JobStarted]
        assert [event.step for event in events if isinstance(event, StepProgress)] == [1, 2]
        assert_bit_equal(tmp_path / f"{task}.safetensors", colocated_tensors[task])
        assert set(events[-1].timings_s) >= {
            "conditioning_s",
            "text_encode_s",
            "denoise_s",
            "handoff_denoise_s",
        }


def test_the_cli_generates_through_split_groups(checkpoint, colocated_tensors, tmp_path) -> None:
    request = REQUESTS["t2va"]
    arguments = ["generate", "--checkpoint", str(checkpoint), "--prompt", request.prompt, "--seed", str(SEED)]
    arguments += ["--steps", str(STEPS), "--duration", "4", "--device", "cpu", "--dtype", "float32"]
    arguments += ["--stage-layout", "split", "--progress", "plain"]
    arguments += ["--out", str(tmp_path / "cli.mp4"), "--save-tensors", str(tmp_path / "cli.safetensors")]
    assert main(arguments) == 0
    assert_bit_equal(tmp_path / "cli.safetensors", colocated_tensors["t2va"])


# World sizes 2 and 4 (gloo): the DiT as Ulysses 2 and the encoder as tensor-parallel 2 in both, the VAE over 2 and
# over 4 ranks (the tiny DiT and encoder have 2 heads: 4 ranks cannot split them; the tiled decode splits any way
# bit for bit). The colocated reference is a worker group of two with the same DiT and encoder layouts: the same
# arithmetic, the same threads per rank.
SPLIT_LAYOUTS = {
    2: RuntimeLayout.choose(2, dit_sp=2, encoder_tp=2, vae_ranks=2, stages="split"),
    4: RuntimeLayout.choose(2, dit_sp=2, encoder_tp=2, vae_ranks=4, stages="split"),
}


@pytest.fixture(scope="module")
def colocated_world_2_tensors(checkpoint, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("colocated_2")
    replica = ProcessReplica(checkpoint, ("cpu", "cpu"), RuntimeLayout.choose(2, dit_sp=2), options=FP32)
    front = EngineFront([replica], folder)
    try:
        paths = {task: folder / f"{task}.safetensors" for task in REQUESTS}
        handles = [
            front.submit(request, folder / f"{task}.mp4", paths[task]) for task, request in REQUESTS.items()
        ]
        for handle in handles:
            assert isinstance(events_until_done(handle, EVENT_TIMEOUT_S)[-1], JobFinished)
    finally:
        front.shutdown()
    return paths


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_equals_the_colocated_group_bit_for_bit(
    checkpoint, colocated_world_2_tensors, world_size, tmp_path
) -> None:
    layout = SPLIT_LAYOUTS[world_size]
    replica = SplitReplica(checkpoint, ("cpu", "cpu"), layout, options=FP32)
    front = EngineFront([replica], tmp_path)
    try:
        sizes = {"vae": layout.vae_ranks, "encoder": 2, "dit": 2}
        handles = submit_parity_requests(front, replica, sizes, tmp_path)
        for task, handle in handles.items():
            assert isinstance(events_until_done(handle, EVENT_TIMEOUT_S)[-1], JobFinished)
            assert_bit_equal(tmp_path / f"{task}.safetensors", colocated_world_2_tensors[task])
        # The DiT's rank 0 sends VAE rank 0 all the latents, every other VAE rank only its frames.
        saved = load_file(tmp_path / "t2va.safetensors")
        video_bytes = saved["video_latents"].numel() * 4
        whole = video_bytes + saved["audio_latents"].numel() * 4
        sent = next(
            r.sent_bytes
            for r in replica.stage_log
            if r.job_id == handles["t2va"].job_id and r.stage == "denoise"
        )
        assert whole < sent < whole + (layout.vae_ranks - 1) * video_bytes
    finally:
        front.shutdown()


def test_each_vae_rank_receives_only_the_latent_frames_its_tiles_read(checkpoint) -> None:
    engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    models = engine.store.models_for_task("t2va")
    video_vae = models.video_vae
    geometry = engine.geometry_for(dataclasses.replace(REQUESTS["t2va"], duration_seconds=15.0))
    shape = torch.Size(
        (1, models.dit.config.video_in_channels, geometry.latent_frames, geometry.latent_h, geometry.latent_w)
    )
    plan = video_vae.plan_decode(shape)
    shares = latent_frame_shares(video_vae, shape, 4)
    assert len(shares) == 4 and shares[0][0] == 0 and max(stop for _, stop in shares) == shape[2]
    assert any(stop - start < shape[2] for start, stop in shares if stop > start)  # a shard, not everything
    for rank, (start, stop) in enumerate(shares):
        for index in rank_tiles(video_vae, plan, 4, rank):
            first, last = plan.tiles[index].frames
            assert start <= min(first, shape[2] - 1) and min(last, shape[2]) <= stop


# --------------------------------------------------------------------------------------------------------------
# Pipelining, failures, cancel (one group of each size 1, shared by the tests below)
# --------------------------------------------------------------------------------------------------------------

# 15 s at the tiny canvas: each stage takes a visible share of a second on two busy CPU cores.
PIPELINED_REQUEST = dataclasses.replace(REQUESTS["t2va"], duration_seconds=15.0)


def test_queued_jobs_overlap_their_stages(split_world_1, tmp_path) -> None:
    """While the DiT denoises job k, the encoder takes job k + 1 and the VAE decodes job k - 1."""
    front, replica = split_world_1
    handles = [front.submit(PIPELINED_REQUEST, tmp_path / f"job{index}.mp4") for index in range(3)]
    for handle in handles:
        assert isinstance(events_until_done(handle, EVENT_TIMEOUT_S)[-1], JobFinished)
    records = {(record.job_id, record.stage): record for record in replica.stage_log}
    steps = [{stage: records[handle.job_id, stage] for stage in PIPELINE_STEPS} for handle in handles]
    # Every group takes the jobs in one order (the order their threads took their turns: submission order but for
    # a race between the front's threads).
    steps.sort(key=lambda job: job["prepare"].started_at)
    for stage in PIPELINE_STEPS:
        assert [job[stage].started_at for job in steps] == sorted(job[stage].started_at for job in steps)
    for previous, current, following in [(None, steps[0], steps[1]), (steps[0], steps[1], steps[2])]:
        assert following["encode"].started_at < current["denoise"].ended_at
        if previous is not None:
            assert previous["decode"].started_at < current["denoise"].ended_at
            assert current["denoise"].started_at < previous["decode"].ended_at


# Steps of about 0.3 s on two busy cores: long against the front's reading delay.
LONG_REQUEST = GenerationRequest(
    task="t2va", prompt="a long one", steps=1000, duration_seconds=15.0, width=112, height=64
)
DEATH_REPORT_LIMIT_S = 1.0


def shared_memory_files_of(pids: list[int]) -> list[str]:
    return [path.name for pid in pids for path in Path("/dev/shm").glob(f"torch_{pid}_*")]


def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def split_for_failures(checkpoint, tmp_path_factory):
    replica = SplitReplica(checkpoint, ("cpu",), RuntimeLayout.choose(1, stages="split"), options=FP32)
    front = EngineFront([replica], tmp_path_factory.mktemp("split_failures"))
    yield front, replica
    front.shutdown()


@pytest.mark.parametrize("stage", ["dit", "encoder", "vae"])
def test_a_killed_process_fails_only_the_job_its_group_held(split_for_failures, stage, tmp_path) -> None:
    """SIGKILL to a group's rank while it holds a job: that job fails within a second naming the group; a job queued
    behind it (already started where the killed group is not the VAE) starts over on the restarted groups without a
    second JobStarted and finishes; nothing of the old groups is left."""
    front, replica = split_for_failures
    wait_until(lambda: replica.worker_pids, 120)
    old_pids = replica.worker_pids
    victim = old_pids[stage][0]
    if stage == "dit":
        held = front.submit(LONG_REQUEST, tmp_path / "held.mp4")
        wait_for_step(held, 1, EVENT_TIMEOUT_S)
    else:
        # Stopped, the rank keeps the command it gets: it holds the job when it dies.
        os.kill(victim, signal.SIGSTOP)
        held = front.submit(REQUESTS["t2va"], tmp_path / "held.mp4")
        if stage == "encoder":  # once prepared, its encode is sent
            wait_until(lambda: any(isinstance(event, JobStarted) for event in held.drain()), EVENT_TIMEOUT_S)
        time.sleep(0.5)
    queued = front.submit(REQUESTS["t2va"], tmp_path / "queued.mp4")
    queued_events = []
    if (
        stage != "vae"
    ):  # the queued job is prepared (it has started) before the kill; the VAE cannot prepare it
        while not any(isinstance(event, JobStarted) for event in queued_events):
            queued_events.append(queued.next_event(timeout=EVENT_TIMEOUT_S))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    failed = events_until_done(held, EVENT_TIMEOUT_S)[-1]
    assert time.monotonic() - killed_at <= DEATH_REPORT_LIMIT_S
    group = {"dit": "DiT", "encoder": "text-encoder", "vae": "VAE"}[stage]
    assert isinstance(failed, JobFailed) and failed.kind == "engine", failed
    assert failed.message.startswith(f"A worker process died (rank 0, exit code -9) in the {group} group")
    queued_events += events_until_done(queued, EVENT_TIMEOUT_S)
    assert isinstance(queued_events[-1], JobFinished), queued_events[-1]
    # It started over on the new groups, but started once: one JobStarted.
    assert len([event for event in queued_events if isinstance(event, JobStarted)]) == 1
    every_old_pid = [pid for pids in old_pids.values() for pid in pids]
    assert not any(process_exists(pid) for pid in every_old_pid)
    assert not set(every_old_pid) & {pid for pids in replica.worker_pids.values() for pid in pids}
    assert shared_memory_files_of(every_old_pid) == []


def test_a_group_that_dies_between_jobs_costs_no_job(split_for_failures, tmp_path) -> None:
    front, replica = split_for_failures
    wait_until(lambda: replica.worker_pids, 120)
    old_pids = replica.worker_pids
    os.kill(old_pids["encoder"][0], signal.SIGKILL)
    wait_until(lambda: replica.worker_pids and replica.worker_pids != old_pids, 120)
    assert isinstance(events_until_done(front.submit(REQUESTS["t2va"]), EVENT_TIMEOUT_S)[-1], JobFinished)


def test_cancel_while_another_job_is_being_decoded(split_for_failures, tmp_path) -> None:
    """A job cancelled in the DiT while the VAE decodes the job before it: it ends as cancelled within a few steps,
    before that decode is done, and the decoded job finishes."""
    front, replica = split_for_failures
    decoding = front.submit(PIPELINED_REQUEST, tmp_path / "decoding.mp4")
    # Enough steps to be cancelled during, few enough that their AdaLN tables are made at once.
    cancelled = front.submit(dataclasses.replace(LONG_REQUEST, steps=60), tmp_path / "cancelled.mp4")
    wait_until(
        lambda: any(r.job_id == decoding.job_id and r.stage == "denoise" for r in replica.stage_log), 120
    )
    time.sleep(0.3)  # its decode has begun
    front.cancel(cancelled)
    events = events_until_done(cancelled, EVENT_TIMEOUT_S)
    cancelled_at = time.monotonic()
    assert isinstance(events[-1], JobFailed) and events[-1].kind == "cancelled", events[-1]
    assert max([event.step for event in events if isinstance(event, StepProgress)], default=0) <= 4
    assert isinstance(events_until_done(decoding, EVENT_TIMEOUT_S)[-1], JobFinished)
    decode = next(r for r in replica.stage_log if r.job_id == decoding.job_id and r.stage == "decode")
    assert decode.started_at < cancelled_at < decode.ended_at
    assert not (tmp_path / "cancelled.mp4").exists()


def test_shutdown_leaves_no_process_and_no_shared_memory(checkpoint, tmp_path) -> None:
    """Also with the DiT's rank stopped (SIGSTOP) mid-job: the job ends and shutdown returns within seconds."""
    replica = SplitReplica(checkpoint, ("cpu",), RuntimeLayout.choose(1, stages="split"), options=FP32)
    front = EngineFront([replica], tmp_path)
    running = front.submit(LONG_REQUEST)
    wait_for_step(running, 1, EVENT_TIMEOUT_S)
    pids = [pid for stage_pids in replica.worker_pids.values() for pid in stage_pids]
    os.kill(replica.worker_pids["dit"][0], signal.SIGSTOP)
    started = time.monotonic()
    front.shutdown()
    assert time.monotonic() - started < 8.0
    assert events_until_done(running, EVENT_TIMEOUT_S)[-1] == JobFailed(
        running.job_id, "cancelled", "The app is shutting down."
    )
    assert not any(process_exists(pid) for pid in pids)
    assert shared_memory_files_of(pids) == []
