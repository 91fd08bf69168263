"""The end-to-end benchmark (benchmarks.e2e) in its tiny CPU mode: the JSON it writes holds every field, with
positive times and finite outputs, for a K-of-N extrapolated run and for a resident run of every step."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks import e2e
from h3engine.media.mux import probe_mp4
from h3engine.models.video_vae import DECODE_BATCH_TILES


def run_tiny(e2e, output_dir: Path, *options: str) -> dict:
    path = e2e.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--seconds",
            "0.9",
            "--text-rows",
            "24",
            "--output-dir",
            str(output_dir),
            *options,
        ]
    )
    # A step count other than the released 50 and an adapter name the file too, so no run overwrites another's.
    assert path.parent == output_dir and re.fullmatch(
        r"e2e_cpu_\d{8}_tiny(_\d+steps)?(_lora\d+)?(_turbo)?\.json", path.name
    )
    return json.loads(path.read_text())


def check_common_fields(result: dict, steps: int, timed_steps: int, turbo: bool = False) -> None:
    assert result["config"] == "tiny" and result["task"] == "t2va" and result["device"] == "cpu"
    for key in ("python", "torch", "transformers", "date"):
        assert result[key]
    assert set(result["build_s"]) == {"text_encoder", "dit", "video_vae", "audio_vae"}
    # The decode and mux settings the times were made with.
    assert result["video_decode_tiles_per_call"] == DECODE_BATCH_TILES
    assert result["x264_thread_type"] == "FRAME"
    assert all(seconds > 0 for seconds in result["build_s"].values())
    phases = result["phases_s"]
    for name in (
        "text_encode",
        "denoise_timed",
        "video_decode",
        "audio_decode",
        "decode_and_mux",
        "mux_overlapped",
    ):
        assert phases[name] > 0, name
    assert phases["denoise_prep"] >= 0 and phases["mux_after_decode"] >= 0
    # The writer runs alongside the video decode: the phase is at least each part, and no more than both in a row.
    assert (
        phases["decode_and_mux"]
        >= phases["audio_decode"] + phases["video_decode"] + phases["mux_after_decode"]
    )
    assert phases["decode_and_mux"] >= phases["mux_overlapped"]

    assert result["schedule"] == {
        "recipe": "sglang",
        "steps": steps,
        "timed_steps": timed_steps,
        "flow_shifts": [6.0, 3.0] if turbo else [12.0, 3.0],
        "turbo_preset": turbo,
    }
    assert len(result["step_s"]) == timed_steps and all(seconds > 0 for seconds in result["step_s"])
    assert math.isclose(result["step_mean_s"], sum(result["step_s"]) / timed_steps)
    # The events bracket the DiT forward and the update of each step, inside the pipeline's own loop timer.
    assert sum(result["step_s"]) <= phases["denoise_timed"]
    expected_request = (
        phases["text_encode"] + phases["denoise_prep"] + result["denoise_s"] + phases["decode_and_mux"]
    )
    assert math.isclose(result["request_s"], expected_request)
    # A second request's first steps on the warm DiT, its AdaLN tables rebuilt.
    repeat = result["warm_repeat"]
    assert len(repeat["step_s"]) == min(2, steps) and all(seconds > 0 for seconds in repeat["step_s"])
    assert repeat["denoise_outside_steps_s"] >= 0

    shapes = result["shapes"]
    assert shapes["text_rows"] == result["tokenizer"]["text_rows"] == 24
    assert result["tokenizer"]["max_token_id"] < result["tokenizer"]["model_vocab_size"]
    assert shapes["sequence_rows"] == shapes["text_rows"] + shapes["video_rows"] + shapes["audio_rows"]
    rows_per_frame = (shapes["latent_h"] // 2) * (shapes["latent_w"] // 2)
    assert shapes["video_rows"] == shapes["latent_frames"] * rows_per_frame
    assert shapes["audio_rows"] == 2 * shapes["audio_latents_per_channel"]
    assert result["outputs"]["video"]["shape"] == [shapes["frames"], shapes["height"], shapes["width"], 3]
    assert set(result["outputs"]) == {"text_states", "video_latents", "audio_latents", "video", "audio"}
    assert all(summary["finite"] for summary in result["outputs"].values())
    assert result["outputs_finite"] is True
    # Random weights that leave nothing degenerate: every output varies.
    assert all(summary["std"] > 0 for summary in result["outputs"].values())
    assert result["peak_gpu_memory_gib"] is None


def test_timed_prefix_is_extrapolated_and_keeps_no_mp4(tmp_path):
    result = run_tiny(e2e, tmp_path, "--steps", "3", "--timed-steps", "2")
    check_common_fields(result, steps=3, timed_steps=2)
    assert result["extrapolated"] is True
    # Warm by default: the first step is the warm-up; a warm request's first step (AdaLN tables built alongside)
    # stands in for it, the second gives the rate of the other two.
    assert result["warmup"] is True
    assert result["denoise_outside_steps_s"] >= 0
    warm_first = result["warm_repeat"]["step_s"][0]
    assert math.isclose(
        result["denoise_s"], result["denoise_outside_steps_s"] + warm_first + result["step_s"][1] * 2
    )
    first_calls = result["first_call_s"]
    assert set(first_calls) == {"text_encode", "decode_one_window", "dit_first_step"}
    assert all(seconds > 0 for seconds in first_calls.values())
    assert first_calls["dit_first_step"] == result["step_s"][0]
    assert result["mp4"] is None
    assert not list(tmp_path.glob("*.mp4"))


def test_without_a_repeat_the_rate_covers_every_step(tmp_path):
    result = run_tiny(e2e, tmp_path, "--steps", "3", "--timed-steps", "2", "--repeat-steps", "0")
    assert result["warm_repeat"] is None
    assert math.isclose(result["denoise_s"], result["denoise_outside_steps_s"] + result["step_s"][1] * 3)


def test_the_turbo_preset_times_its_8_steps_on_its_shifts(tmp_path):
    result = run_tiny(e2e, tmp_path, "--turbo", "--timed-steps", "2")
    check_common_fields(result, steps=8, timed_steps=2, turbo=True)


def test_resident_full_run_keeps_the_mp4(tmp_path):
    result = run_tiny(e2e, tmp_path, "--steps", "1", "--resident", "--no-warmup")
    check_common_fields(result, steps=1, timed_steps=1)
    assert result["extrapolated"] is False
    assert result["warmup"] is False and result["first_call_s"] is None
    assert result["denoise_s"] == result["phases_s"]["denoise_timed"]
    assert result["order"].startswith("resident")
    probe = probe_mp4(result["mp4"])
    assert probe["frame_count"] == result["shapes"]["frames"]
    assert (probe["width"], probe["height"]) == (result["shapes"]["width"], result["shapes"]["height"])


@pytest.mark.parametrize(
    "steps_options",
    [
        ("--steps", "2", "--timed-steps", "3"),  # beyond the schedule
        ("--steps", "3", "--timed-steps", "1"),  # no step left after the warm-up
        ("--steps", "2", "--repeat-steps", "3"),  # a repeat beyond the schedule
    ],
)
def test_bad_step_counts_are_refused(tmp_path, steps_options):
    with pytest.raises(SystemExit):
        e2e.main(["--tiny", "--device", "cpu", *steps_options, "--output-dir", str(tmp_path)])
