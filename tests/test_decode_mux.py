"""`pipeline.decode` with an MP4 path: the file is written while the video decodes, the tensors are those of a plain
decode, and a failure on either side leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3engine.checkpoint import audio_vae_keys, video_vae_keys
from h3engine.engine import pipeline
from h3engine.engine.pipeline import Models, Mp4WriteError, decode
from h3engine.media.mux import probe_mp4
from h3engine.models.audio_vae import AudioVAE, AudioVAEConfig
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

LATENT_FRAMES = 12  # two decode windows with the tiny VAE


@pytest.fixture(scope="module")
def models() -> Models:
    video_config, audio_config = VideoVAEConfig.tiny(), AudioVAEConfig.tiny()
    video_vae = VideoVAE(video_config).eval()
    video_vae.load_state_dict(video_vae_keys.random_native_state(video_config, seed=3), strict=True)
    audio_vae = AudioVAE(audio_config).eval()
    audio_vae.load_state_dict(audio_vae_keys.random_native_state(audio_config, seed=3), strict=True)
    return Models(dit=None, video_vae=video_vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None)


@pytest.fixture(scope="module")
def latents(models: Models) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    video = torch.randn(
        1, models.video_vae.config.latent_channels, LATENT_FRAMES, 10, 14, generator=generator
    )
    audio = torch.randn(2, models.audio_vae.config.latent_channels, 40, generator=generator)
    return video, audio


def test_the_mp4_is_written_while_decoding_and_the_tensors_are_unchanged(
    models, latents, tmp_path: Path
) -> None:
    with torch.inference_mode():
        plain_video, plain_audio, plain_timings = decode(models, *latents)
        video, audio, timings = decode(models, *latents, mp4_path=tmp_path / "clip.mp4")
    assert torch.equal(video, plain_video) and torch.equal(audio, plain_audio)
    assert models.video_vae.plan_decode(latents[0].shape).window_count == 2
    assert "mux_s" not in plain_timings
    assert {"audio_decode_s", "video_decode_s", "mux_s", "mux_after_decode_s"} <= set(timings)
    probe = probe_mp4(tmp_path / "clip.mp4")
    assert (probe["frame_count"], probe["height"], probe["width"]) == tuple(video.shape[:3])
    assert [path.name for path in tmp_path.iterdir()] == ["clip.mp4"]


def test_a_writer_failure_raises_and_leaves_no_file(models, latents, tmp_path: Path, monkeypatch) -> None:
    def broken_write(path, video, audio):
        video[0]  # waits for the first window, like the real writer
        raise OSError("No space left on device")

    monkeypatch.setattr(pipeline, "write_mp4", broken_write)
    with pytest.raises(Mp4WriteError, match="clip.mp4.*No space left") as raised, torch.inference_mode():
        decode(models, *latents, mp4_path=tmp_path / "clip.mp4")
    assert isinstance(raised.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []


def test_a_decode_failure_stops_the_writer_and_leaves_no_file(
    models, latents, tmp_path: Path, monkeypatch
) -> None:
    calls = []
    decode_batch = models.video_vae.decode_batch

    def failing_in_the_second_window(latents, tiles):
        calls.extend(tiles)
        if len(calls) > models.video_vae.plan_decode(latents.shape).tiles_per_window:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return decode_batch(latents, tiles)

    monkeypatch.setattr(models.video_vae, "decode_batch", failing_in_the_second_window)
    with pytest.raises(RuntimeError, match="illegal memory access"), torch.inference_mode():
        decode(models, *latents, mp4_path=tmp_path / "clip.mp4")
    assert len(calls) > 1  # the first window was decoded (and handed to the writer) before the failure
    assert list(tmp_path.iterdir()) == []
