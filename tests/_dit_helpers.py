"""The tiny FL2VA-like packed DiT request of the DiT tests (the builder is benchmarks/_packed_request.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from benchmarks._packed_request import PackedRequest, build_packed_request

if TYPE_CHECKING:
    from h3engine.models.dit_config import DiTConfig


def tiny_fl2va_request(
    config: DiTConfig, text_dtype: torch.dtype, seed: int, text_rows: int = 10
) -> PackedRequest:
    """FL2VA-like on the tiny DiT: `text_rows` text rows (2 vision rows tagged video), 1 keyframe at t=0.999, 4
    target frames, audio."""
    return build_packed_request(
        text_rows=text_rows,
        vision_rows_in_text=2,
        condition_frames=1,
        latent_frames=4,
        latent_height=8,
        latent_width=12,
        audio_latents_per_channel=9,
        video_channels=config.video_in_channels,
        audio_channels=config.audio_in_channels,
        text_dim=config.text_dim,
        text_dtype=text_dtype,
        video_timestep=0.42,
        audio_timestep=0.67,
        seed=seed,
    )
