"""Tests for the output side: MP4 muxing/probing, JSON sidecars, tensor dumps and atomic writes."""

from __future__ import annotations

import json
import math
import threading
import time

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from h3engine.media import mux
from h3engine.media.mux import (
    audio_samples_for_frames,
    mp4_top_level_boxes,
    probe_mp4,
    quantize_to_uint8,
    write_mp4,
)
from h3engine.media.outputs import atomic_output, output_paths, save_tensors, write_sidecar
from h3engine.media.progressive import FramesUnavailable, ProgressiveFrames

FRAMES, HEIGHT, WIDTH = 22, 48, 64
RATE = 32_000
AAC_FRAME_SECONDS = 1024 / RATE


def moving_pattern(frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """Smooth gradients plus a bright square that moves 2 px right and 1 px down per frame."""
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    video = np.stack([x * 3 + 20, y * 4 + 20, np.full_like(x, 90) + t * 3], axis=-1)
    for index in range(frames):
        top, left = 4 + index, 4 + 2 * index
        video[index, top : top + 12, left : left + 12] = (235, 235, 40)
    return video.clip(0, 255).astype(np.uint8)


def stereo_sine(samples: int, left_hz: float = 440.0, right_hz: float = 660.0) -> np.ndarray:
    seconds = np.arange(samples) / RATE
    return np.stack(
        [0.5 * np.sin(2 * np.pi * left_hz * seconds), 0.5 * np.sin(2 * np.pi * right_hz * seconds)]
    ).astype(np.float32)


def decode_video(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def decode_audio(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=1)


def test_audio_sample_count_rule() -> None:
    assert audio_samples_for_frames(22, 24) == 29_333  # 29,333.33
    assert audio_samples_for_frames(124, 24) == 165_333  # 165,333.33
    assert audio_samples_for_frames(24, 24) == 32_000
    assert audio_samples_for_frames(1, 24) == 1_333  # 1,333.33
    assert audio_samples_for_frames(5, 24) == 6_667  # 6,666.67 rounds up
    assert audio_samples_for_frames(3, 64, 32_000) == 1_500  # exactly 1,500
    assert audio_samples_for_frames(1, 64_000, 32_000) == 1  # 0.5 -> half up


def test_written_clip_is_browser_playable_h264_aac_faststart(tmp_path) -> None:
    video = moving_pattern()
    path = write_mp4(tmp_path / "clip.mp4", video, stereo_sine(40_000))
    info = probe_mp4(path)

    assert info["video_codec"] == "h264"
    assert info["pix_fmt"] == "yuv420p"
    assert info["fps"] == 24.0
    assert info["frame_count"] == FRAMES
    assert (info["width"], info["height"]) == (WIDTH, HEIGHT)
    assert info["color_space"] == "itu709"
    assert (info["color_primaries"], info["color_transfer"], info["color_range"]) == (
        "bt709",
        "bt709",
        "mpeg",
    )
    assert info["audio_codec"] == "aac"
    assert info["audio_sample_rate"] == RATE
    assert info["audio_channels"] == 2
    assert abs(info["audio_duration_s"] - FRAMES / 24) <= AAC_FRAME_SECONDS
    assert info["moov_before_mdat"] is True
    assert info["box_order"].index("moov") < info["box_order"].index("mdat")
    assert mp4_top_level_boxes(path)[0] == "ftyp"
    json.dumps(info)  # the app stores it as is

    decoded = decode_video(path)
    assert decoded.shape == video.shape
    # Order and content survive: every decoded frame is closest to its own source frame.
    error = np.abs(decoded[:, None].astype(np.int16) - video[None].astype(np.int16)).mean(axis=(2, 3, 4))
    assert (error.argmin(axis=1) == np.arange(FRAMES)).all()
    # Quality: x264's mode decisions follow the CPU's SIMD paths, so the same encode lands differently per machine
    # (mean error of the worst frame 2.95 and 3.02 on two AMD EPYC machines with PyAV 18.1.0). A real fault (a
    # wrong colour matrix or range, a lost frame, a collapsed bitrate) costs tens of code values or breaks the
    # order check above; 4 (1.6 % of full scale) leaves a third of margin over what encoders were seen to do.
    assert np.diag(error).max() < 4.0


def test_frame_timestamps_are_constant_rate(tmp_path) -> None:
    path = write_mp4(tmp_path / "clip.mp4", moving_pattern(), stereo_sine(1000))
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        times = sorted(float(frame.pts * frame.time_base) for frame in container.decode(stream))
    assert np.allclose(np.diff(times), 1 / 24, atol=1e-4)
    assert times[0] == 0.0


def test_flat_colours_round_trip_through_bt709(tmp_path) -> None:
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [128, 128, 128], [20, 200, 90]], np.uint8)
    video = np.broadcast_to(colours[:, None, None, :], (5, 16, 16, 3)).copy()
    decoded = decode_video(write_mp4(tmp_path / "flat.mp4", video, np.zeros((2, 0), np.float32)))
    # A BT.601/709 mix-up would move saturated red/green/blue by tens of code values.
    assert np.abs(decoded[:, 8, 8].astype(int) - colours.astype(int)).max() <= 3


@pytest.mark.parametrize("audio_samples", [0, 1000, 29_000, 29_333, 29_334, 50_000, 96_000])
def test_audio_is_trimmed_or_padded_to_the_video_length(tmp_path, audio_samples) -> None:
    path = write_mp4(tmp_path / "clip.mp4", moving_pattern(), stereo_sine(audio_samples))
    info = probe_mp4(path)
    assert abs(info["audio_duration_s"] - info["video_duration_s"]) <= AAC_FRAME_SECONDS
    # The MP4 muxer rounds the edit list to its 1 ms movie timescale: the track is exact to that.
    assert abs(info["audio_duration_s"] - FRAMES / 24) <= 1e-3


def test_short_audio_is_followed_by_silence_and_long_audio_keeps_its_start(tmp_path) -> None:
    short = stereo_sine(8_000)  # 0.25 s of tone, then padding
    decoded = decode_audio(write_mp4(tmp_path / "short.mp4", moving_pattern(), short))
    assert decoded.shape[0] == 2
    tone_rms = np.sqrt((decoded[:, 1_000:7_000] ** 2).mean())
    tail_rms = np.sqrt((decoded[:, 10_000:29_000] ** 2).mean())
    assert tone_rms > 0.3
    assert tail_rms < 1e-3

    long = stereo_sine(200_000, left_hz=1000.0, right_hz=250.0)
    decoded = decode_audio(write_mp4(tmp_path / "long.mp4", moving_pattern(), long))
    # Priming is hidden: decoded sample i lines up with input sample i (channels stay in order).
    correlation = [np.corrcoef(decoded[c, 2_000:28_000], long[c, 2_000:28_000])[0, 1] for c in range(2)]
    assert min(correlation) > 0.99


def test_float_frames_are_quantized_to_the_same_uint8_frames(tmp_path) -> None:
    uint8_video = moving_pattern()
    float_video = torch.from_numpy(uint8_video).float() / 255.0
    # Encoded bytes are not compared: libx264's mb-tree lookahead gives run-to-run different bitstreams at
    # some tiny sizes such as 64x48 (not at the canvas sizes we ship), so equality is checked before encoding.
    candidates = [
        float_video,
        float_video.half(),
        float_video.double().numpy(),
        torch.from_numpy(uint8_video),
    ]
    for candidate in candidates:
        for index in range(FRAMES):
            np.testing.assert_array_equal(mux._frame_as_uint8(candidate, index), uint8_video[index])

    decoded = decode_video(write_mp4(tmp_path / "float.mp4", float_video, stereo_sine(100)))
    assert decoded.shape == uint8_video.shape
    assert np.abs(decoded.astype(np.int16) - uint8_video.astype(np.int16)).mean() < 3.0


def test_quantization_rule_against_exact_reference() -> None:
    generator = np.random.default_rng(0)
    ties32 = ((np.arange(255, dtype=np.float64) + 0.5) / 255).astype(np.float32)
    near_ties = np.concatenate(
        [ties32, np.nextafter(ties32, np.float32(0)), np.nextafter(ties32, np.float32(1))]
    )
    edges = np.array([0.0, 1.0, np.nextafter(np.float32(0.5 / 255), np.float32(0))], dtype=np.float32)
    values = np.concatenate([near_ties, edges, generator.random(100_000, dtype=np.float32)])

    scaled = values * np.float32(255)
    # float32 * 255 is exact in float64, so this is an exact round-half-to-even reference (the reference's rule).
    scaled64 = scaled.astype(np.float64)
    lower = np.floor(scaled64)
    fraction = scaled64 - lower
    tie_up = (fraction == 0.5) & (lower % 2 == 1)
    reference = (lower + ((fraction > 0.5) | tie_up)).astype(np.uint8)
    exact_ties = fraction == 0.5
    assert exact_ties.sum() > 10  # the case that separates half-to-even from half-up
    np.testing.assert_array_equal(quantize_to_uint8(values), reference)
    frames = torch.from_numpy(values)
    np.testing.assert_array_equal(quantize_to_uint8(values), (frames * 255).round().to(torch.uint8).numpy())


@pytest.mark.parametrize(
    ("video", "audio", "message"),
    [
        (np.zeros((2, 48, 63, 3), np.uint8), np.zeros((2, 10), np.float32), "even"),
        (np.zeros((2, 47, 64, 3), np.uint8), np.zeros((2, 10), np.float32), "even"),
        (np.zeros((2, 48, 64, 4), np.uint8), np.zeros((2, 10), np.float32), "shape"),
        (np.zeros((0, 48, 64, 3), np.uint8), np.zeros((2, 10), np.float32), "at least one frame"),
        (np.zeros((2, 48, 64, 3), np.int64), np.zeros((2, 10), np.float32), "dtype"),
        (np.zeros((2, 48, 64, 3), np.uint8), np.zeros((1, 10), np.float32), "shape"),
        (np.zeros((2, 48, 64, 3), np.uint8), np.full((2, 10), 2.0, np.float32), r"\[-1, 1\]"),
        (np.zeros((2, 48, 64, 3), np.uint8), np.zeros((2, 10), np.int16), "floating"),
    ],
)
def test_invalid_inputs_are_refused_before_writing(tmp_path, video, audio, message) -> None:
    with pytest.raises(ValueError, match=message):
        write_mp4(tmp_path / "clip.mp4", video, audio)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad_value", [float("nan"), 1.5, -0.25])
def test_bad_frame_found_mid_write_leaves_no_file(tmp_path, bad_value) -> None:
    video = moving_pattern().astype(np.float32) / 255.0
    video[FRAMES - 1, 3, 3, 1] = bad_value  # found only after 21 frames were encoded
    with pytest.raises(ValueError, match="frame 21"):
        write_mp4(tmp_path / "clip.mp4", video, stereo_sine(30_000))
    assert list(tmp_path.iterdir()) == []


def test_interrupted_write_keeps_the_previous_file_and_no_temp(tmp_path, monkeypatch) -> None:
    final = tmp_path / "clip.mp4"
    write_mp4(final, moving_pattern(), stereo_sine(30_000))
    previous_bytes = final.read_bytes()
    real_frame_conversion = mux._frame_as_uint8
    seen_partial_names = []

    def interrupt_on_frame_five(video, index):
        if index == 5:
            seen_partial_names.extend(path.name for path in tmp_path.iterdir() if path != final)
            raise KeyboardInterrupt
        return real_frame_conversion(video, index)

    monkeypatch.setattr(mux, "_frame_as_uint8", interrupt_on_frame_five)
    with pytest.raises(KeyboardInterrupt):
        write_mp4(final, moving_pattern()[::-1].copy(), stereo_sine(30_000))

    assert len(seen_partial_names) == 1
    partial_name = seen_partial_names[0]
    assert partial_name.startswith(".clip.mp4.") and partial_name.endswith(".partial")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["clip.mp4"]
    assert final.read_bytes() == previous_bytes


def test_successful_write_replaces_previous_file(tmp_path) -> None:
    final = tmp_path / "clip.mp4"
    final.write_bytes(b"old")
    write_mp4(final, moving_pattern(), stereo_sine(30_000))
    assert probe_mp4(final)["frame_count"] == FRAMES
    assert [path.name for path in tmp_path.iterdir()] == ["clip.mp4"]


def test_atomic_output_hides_the_final_name_until_done(tmp_path) -> None:
    final = tmp_path / "data.bin"
    with atomic_output(final) as partial:
        assert partial.parent == tmp_path and partial.exists()
        partial.write_bytes(b"abc")
        assert not final.exists()
    assert final.read_bytes() == b"abc"
    assert not partial.exists()

    with pytest.raises(RuntimeError), atomic_output(final) as partial:
        partial.write_bytes(b"half")
        raise RuntimeError("boom")
    assert final.read_bytes() == b"abc"
    assert [path.name for path in tmp_path.iterdir()] == ["data.bin"]


def test_output_paths_rule(tmp_path) -> None:
    mp4_path, sidecar_path = output_paths(tmp_path / "20250101-120000_seed7.mp4")
    assert mp4_path == tmp_path / "20250101-120000_seed7.mp4"
    assert sidecar_path == tmp_path / "20250101-120000_seed7.json"
    assert output_paths("a.b.MP4")[1].name == "a.b.json"
    with pytest.raises(ValueError, match=".mp4"):
        output_paths(tmp_path / "clip.webm")


def test_sidecar_round_trip(tmp_path) -> None:
    payload = {
        "prompt": "Ein Hund bellt — 狗",
        "seed": 7,
        "steps": 50,
        "size": [1344, 768],
        "meta": {"b": 1, "a": None},
    }
    path = write_sidecar(tmp_path / "clip.json", payload)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == payload
    assert text == json.dumps(payload, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert text.index('"meta"') < text.index('"prompt"') < text.index('"seed"')

    with pytest.raises(ValueError):
        write_sidecar(tmp_path / "nan.json", {"guidance": math.nan})
    with pytest.raises(TypeError):
        write_sidecar(tmp_path / "obj.json", {"bad": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.json"]


def test_tensors_round_trip_as_float32(tmp_path) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64)
    tensors = {
        "latents_bf16": base.to(torch.bfloat16),
        "latents_fp16": base.to(torch.float16),
        "latents_fp64": base,
        "transposed": base.float().transpose(0, 2),  # not contiguous
        "view_a": base.float()[0],  # two views of one storage
        "view_b": base.float()[1],
    }
    path = save_tensors(tmp_path / "clip.safetensors", tensors)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, original in tensors.items():
        assert loaded[name].dtype == torch.float32
        assert loaded[name].shape == original.shape
        assert torch.equal(loaded[name], original.to(torch.float32))

    with pytest.raises(ValueError, match="floating"):
        save_tensors(tmp_path / "ints.safetensors", {"index": torch.arange(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.safetensors"]


# ---------------------------------------------------------------------------------------------------- progressive


def fill_progressively(
    frames: ProgressiveFrames, video: torch.Tensor, piece: int, fail_after: int | None = None
):
    """A producer thread appending `video` `piece` frames at a time (slowly), or failing after `fail_after` frames."""

    def produce() -> None:
        for start in range(0, video.shape[0], piece):
            if fail_after is not None and start >= fail_after:
                frames.fail(RuntimeError("decoder exploded"))
                return
            time.sleep(0.01)
            frames.append(video[start : start + piece])

    thread = threading.Thread(target=produce)
    thread.start()
    return thread


def test_progressive_frames_mux_the_same_frames_as_the_whole_video(tmp_path, monkeypatch) -> None:
    # x264's threads make the bytes vary from run to run (whole tensors too), so the check is on what the encoder is
    # given: the same 8-bit frames, all of them, and a complete file.
    encoded: dict[str, dict[int, np.ndarray]] = {"whole": {}, "progressive": {}}
    target = "whole"
    frame_as_uint8 = mux._frame_as_uint8

    def recording(video, index):
        encoded[target][index] = frame_as_uint8(video, index)
        return encoded[target][index]

    monkeypatch.setattr(mux, "_frame_as_uint8", recording)
    video = torch.from_numpy(moving_pattern()).float() / 255
    audio = stereo_sine(audio_samples_for_frames(FRAMES, 24))
    write_mp4(tmp_path / "whole.mp4", video, audio)
    target = "progressive"
    frames = ProgressiveFrames(FRAMES, HEIGHT, WIDTH)
    assert frames.shape == video.shape and frames.written == 0
    producer = fill_progressively(frames, video, piece=5)
    write_mp4(tmp_path / "progressive.mp4", frames, audio)
    producer.join()
    assert frames.written == FRAMES and torch.equal(frames.frames, video)
    assert sorted(encoded["progressive"]) == list(range(FRAMES))
    assert all(np.array_equal(encoded["progressive"][i], encoded["whole"][i]) for i in range(FRAMES))
    assert probe_mp4(tmp_path / "progressive.mp4")["frame_count"] == FRAMES


def test_a_failed_producer_leaves_no_file(tmp_path) -> None:
    video = torch.from_numpy(moving_pattern()).float() / 255
    frames = ProgressiveFrames(FRAMES, HEIGHT, WIDTH)
    producer = fill_progressively(frames, video, piece=5, fail_after=10)
    with pytest.raises(FramesUnavailable, match="decoder exploded"):
        write_mp4(tmp_path / "clip.mp4", frames, stereo_sine(1000))
    producer.join()
    assert list(tmp_path.iterdir()) == []


def test_progressive_frames_refuse_what_does_not_fit() -> None:
    frames = ProgressiveFrames(4, 2, 2)
    with pytest.raises(ValueError, match="cannot append"):
        frames.append(torch.zeros(5, 2, 2, 3))
    with pytest.raises(ValueError, match="cannot append"):
        frames.append(torch.zeros(1, 2, 4, 3))
    frames.append(torch.ones(4, 2, 2, 3, dtype=torch.float16))
    assert frames[3].dtype == torch.float32 and frames[3].sum() == 12
    with pytest.raises(IndexError):
        frames[4]
