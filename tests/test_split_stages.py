"""Split stage groups (`--stage-layout split`): the option, its checks, and generations through three groups.

What is checked:
* The option and its device flags are read by the CLI and the app and checked before anything starts, with errors
  naming the flag: an unknown layout, encoder / VAE devices without the split layout or disagreeing with the group
  sizes, more default ranks than the DiT's GPUs, FP8 with worker groups.
* A generation through the three groups (CPU, fp32, shared-memory channels) equals the colocated engine bit for bit
  (the saved video, audio and both latents) for T2VA, FL2VA (a keyframe) and Ref2VA (an image and an audio
  reference): at world size 1 against the in-process engine; at world sizes 2 and 4 (gloo) against a colocated group
  of two; each VAE rank but the first receives only the latent frames its tiles read.
* Three queued jobs: every group takes them in submission order; the encoder has encoded job k + 1 before the DiT
  is done denoising job k, and the VAE decodes job k - 1 while the DiT denoises job k (the ranks' own clocks).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _runtime_helpers import events_until_done, parity_requests
from safetensors.torch import load_file

import app
from h3engine.cli import main
from h3engine.engine import Engine
from h3engine.engine_options import EngineOptions, check_engine_options
from h3engine.errors import RequestError
from h3engine.parallel.groups import RuntimeLayout
from h3engine.parallel.vae import latent_frame_shares, rank_tiles
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFinished, JobStarted, StepProgress
from h3engine.runtime.split import STEPS as PIPELINE_STEPS
from h3engine.runtime.split import SplitReplica
from h3engine.runtime.workers import ProcessReplica, stage_devices

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SEED = 11
STEPS = 2
EVENT_TIMEOUT_S = 180
REQUESTS = parity_requests(STEPS, SEED)


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


@pytest.mark.parametrize(
    ("options", "world_size", "message"),
    [
        (
            EngineOptions(stage_layout="pipelined"),
            1,
            "^--stage-layout: expected colocated or split, got 'pipelined'$",
        ),
        (EngineOptions(encoder_devices="1"), 2, r"^--encoder-devices: only with --stage-layout split"),
        (
            EngineOptions(stage_layout="split", vae_devices="2,3", vae_ranks=1),
            2,
            "^--vae-devices: 2 GPUs given, but --vae-ranks 1 asks for 1",
        ),
        (EngineOptions(stage_layout="split", fp8_linear=True), 1, "^--fp8-linear: .* one GPU only"),
        (EngineOptions(stage_layout="split", dit_sp=3), 2, "^--dit-sp 3 does not divide the 2 GPUs"),
    ],
    ids=["unknown", "devices-without-split", "count-mismatch", "fp8", "dit-layout"],
)
def test_bad_stage_options_are_refused_naming_the_flag(options, world_size, message) -> None:
    with pytest.raises(RequestError, match=message):
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
    with pytest.raises(RequestError, match=r"^--vae-ranks 4: the group shares the DiT's 2 GPUs by default"):
        stage_devices(one, ("cuda:0", "cuda:1"), None, None)
    visible = torch.cuda.device_count()
    with pytest.raises(
        RequestError, match=rf"^--encoder-devices: cuda:{visible} is not one of the {visible}"
    ):
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
    assert (
        capsys.readouterr().err.strip()
        == "error: --stage-layout: expected colocated or split, got 'sideways'"
    )


# --------------------------------------------------------------------------------------------------------------
# Generations through the three groups
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_world_1(checkpoint, tmp_path_factory):
    replica = SplitReplica(checkpoint, ("cpu",), RuntimeLayout.choose(1, stages="split"), dtype="float32")
    front = EngineFront([replica], tmp_path_factory.mktemp("split_1"), preview_every=1)
    yield front, replica
    front.shutdown()


def test_split_world_1_equals_the_colocated_engine_bit_for_bit(
    split_world_1, colocated_tensors, tmp_path
) -> None:
    front, replica = split_world_1
    assert {stage: len(pids) for stage, pids in replica.worker_pids.items()} == {
        "vae": 1,
        "encoder": 1,
        "dit": 1,
    }
    handles = {
        task: front.submit(request, tmp_path / f"{task}.mp4", tmp_path / f"{task}.safetensors")
        for task, request in REQUESTS.items()
    }
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
    replica = ProcessReplica(checkpoint, ("cpu", "cpu"), RuntimeLayout.choose(2, dit_sp=2), dtype="float32")
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
    replica = SplitReplica(checkpoint, ("cpu", "cpu"), layout, dtype="float32")
    front = EngineFront([replica], tmp_path)
    try:
        assert {stage: len(pids) for stage, pids in replica.worker_pids.items()} == {
            "vae": layout.vae_ranks,
            "encoder": 2,
            "dit": 2,
        }
        handles = {
            task: front.submit(request, tmp_path / f"{task}.mp4", tmp_path / f"{task}.safetensors")
            for task, request in REQUESTS.items()
        }
        for task, handle in handles.items():
            assert isinstance(events_until_done(handle, EVENT_TIMEOUT_S)[-1], JobFinished)
            assert_bit_equal(tmp_path / f"{task}.safetensors", colocated_world_2_tensors[task])
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
    """While the DiT denoises job k, the encoder has already encoded job k + 1 and the VAE decodes job k - 1."""
    front, replica = split_world_1
    handles = [front.submit(PIPELINED_REQUEST, tmp_path / f"job{index}.mp4") for index in range(3)]
    for handle in handles:
        assert isinstance(events_until_done(handle, EVENT_TIMEOUT_S)[-1], JobFinished)
    records = {(record.job_id, record.stage): record for record in replica.stage_log}
    steps = [{stage: records[handle.job_id, stage] for stage in PIPELINE_STEPS} for handle in handles]
    for stage in PIPELINE_STEPS:  # every group takes the jobs in submission order
        assert [job[stage].started_at for job in steps] == sorted(job[stage].started_at for job in steps)
    for previous, current, following in [(None, steps[0], steps[1]), (steps[0], steps[1], steps[2])]:
        assert following["encode"].ended_at < current["denoise"].ended_at
        if previous is not None:
            assert previous["decode"].started_at < current["denoise"].ended_at
            assert current["denoise"].started_at < previous["decode"].ended_at
