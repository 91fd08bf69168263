"""Packed DiT requests laid out like the real pipeline (docs/MODEL.md §3), for the DiT benchmark and the DiT tests.

The builder is deliberately independent of h3engine's own packing code (it follows docs/MODEL.md §3), so the DiT
tests do not depend on it. Row order: [text (optionally with vision-block rows tagged video) | keyframe condition
video rows | target audio rows (left channel, then right) | target video rows].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Latent frame k spans (5/3) * [1, 4, 4, 4, 4][k mod 5] rotary units (1 unit = 1/40 s).
FRAME_SPAN_PATTERN = (1.0, 4.0, 4.0, 4.0, 4.0)
SPATIAL_SCALE = 32.0
CONDITION_TIMESTEP = 0.999
TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2


@dataclass
class PackedRequest:
    """The DiT's per-forward inputs (no batch axis) plus the geometry they came from."""

    video_rows: Tensor
    audio_rows: Tensor
    text_states: Tensor
    timesteps: Tensor
    timestep_index: Tensor
    tags: Tensor
    positions: Tensor
    video_index: Tensor
    audio_index: Tensor
    text_index: Tensor

    def as_h3_arguments(self) -> tuple[Tensor, ...]:
        return (
            self.video_rows,
            self.audio_rows,
            self.text_states,
            self.timesteps,
            self.timestep_index,
            self.tags,
            self.positions,
            self.video_index,
            self.audio_index,
            self.text_index,
        )

    def as_diffusers_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments of diffusers MiniMaxH3Transformer3DModel.forward (batch axis of 1)."""
        return {
            "hidden_states": self.video_rows[None],
            "audio_hidden_states": self.audio_rows[None],
            "encoder_hidden_states": self.text_states[None],
            "timestep": self.timesteps,
            "timestep_indices": self.timestep_index,
            "token_tags": self.tags,
            "position_ids": self.positions,
            "video_indices": self.video_index,
            "audio_indices": self.audio_index,
            "text_indices": self.text_index,
        }

    def to(self, device: torch.device | str) -> PackedRequest:
        return PackedRequest(**{name: tensor.to(device) for name, tensor in vars(self).items()})


def spatial_grid(latent_height: int, latent_width: int, patch: int = 2) -> tuple[Tensor, Tensor]:
    """Per-patch (h, w) RoPE coordinates, fp64: centred on sqrt(area), numpy linspace(endpoint=False) spacing."""
    side = math.sqrt(latent_height * latent_width)
    coordinates = []
    for length in (latent_height, latent_width):
        ratio = length / side
        left = (1.0 - ratio) / 2.0
        steps = length // patch
        coordinates.append(SPATIAL_SCALE * (left + ratio * torch.arange(steps, dtype=torch.float64) / steps))
    return coordinates[0], coordinates[1]


def frame_offsets(num_frames: int) -> list[float]:
    """Temporal RoPE offset of each target latent frame: sequential fp64 sum of the frame spans."""
    offsets, total = [], 0.0
    for frame in range(num_frames):
        offsets.append(total)
        total += (5.0 / 3.0) * FRAME_SPAN_PATTERN[frame % len(FRAME_SPAN_PATTERN)]
    return offsets


def build_packed_request(
    *,
    text_rows: int,
    vision_rows_in_text: int,
    condition_frames: int,
    latent_frames: int,
    latent_height: int,
    latent_width: int,
    audio_latents_per_channel: int,
    video_channels: int,
    audio_channels: int,
    text_dim: int,
    text_dtype: torch.dtype,
    video_timestep: float,
    audio_timestep: float,
    seed: int,
    patch: int = 2,
) -> PackedRequest:
    """A T2VA-style packed request; `condition_frames` first-keyframe frames (FL2VA) make t = 0.999 rows.

    Text rows use the video timestep; vision-block rows inside the text (the last `vision_rows_in_text` text rows)
    are tagged video. Inputs are standard normal, like latents and (normalized) encoder states.
    """
    grid_h, grid_w = spatial_grid(latent_height, latent_width, patch)
    rows_per_frame = grid_h.numel() * grid_w.numel()
    frame_h = grid_h[:, None].expand(-1, grid_w.numel()).reshape(-1)
    frame_w = grid_w[None, :].expand(grid_h.numel(), -1).reshape(-1)
    origin = float(text_rows)

    positions, tags, row_timesteps = [], [], []

    def add_rows(t: Tensor, h: Tensor, w: Tensor, tag_values: Tensor, timestep: float) -> None:
        positions.append(torch.stack((t, h, w), dim=-1))
        tags.append(tag_values)
        row_timesteps.append(torch.full((t.numel(),), timestep, dtype=torch.float32))

    text_tags = torch.full((text_rows,), TAG_TEXT, dtype=torch.long)
    text_tags[text_rows - vision_rows_in_text :] = TAG_VIDEO
    zeros = torch.zeros(text_rows, dtype=torch.float64)
    add_rows(torch.arange(text_rows, dtype=torch.float64), zeros, zeros, text_tags, video_timestep)

    condition_timestep = max(video_timestep, CONDITION_TIMESTEP)
    for _ in range(condition_frames):
        add_rows(
            torch.full((rows_per_frame,), origin, dtype=torch.float64),
            frame_h,
            frame_w,
            torch.full((rows_per_frame,), TAG_VIDEO, dtype=torch.long),
            condition_timestep,
        )

    audio_t = origin + torch.arange(audio_latents_per_channel, dtype=torch.float64)
    for channel_w in (grid_w[0], grid_w[-1]):
        add_rows(
            audio_t,
            torch.zeros_like(audio_t),
            torch.full_like(audio_t, float(channel_w)),
            torch.full((audio_latents_per_channel,), TAG_AUDIO, dtype=torch.long),
            audio_timestep,
        )

    for offset in frame_offsets(latent_frames):
        add_rows(
            torch.full((rows_per_frame,), origin + offset, dtype=torch.float64),
            frame_h,
            frame_w,
            torch.full((rows_per_frame,), TAG_VIDEO, dtype=torch.long),
            video_timestep,
        )

    positions_all = torch.cat(positions)
    tags_all = torch.cat(tags)
    timesteps, timestep_index = torch.unique(torch.cat(row_timesteps), sorted=True, return_inverse=True)

    num_condition_rows = condition_frames * rows_per_frame
    num_audio_rows = 2 * audio_latents_per_channel
    num_video_rows = num_condition_rows + latent_frames * rows_per_frame
    text_index = torch.arange(text_rows)
    condition_index = text_rows + torch.arange(num_condition_rows)
    audio_index = text_rows + num_condition_rows + torch.arange(num_audio_rows)
    target_video_index = (
        text_rows + num_condition_rows + num_audio_rows + torch.arange(num_video_rows - num_condition_rows)
    )

    generator = torch.Generator().manual_seed(seed)
    return PackedRequest(
        video_rows=torch.randn(num_video_rows, video_channels * patch * patch, generator=generator),
        audio_rows=torch.randn(num_audio_rows, audio_channels, generator=generator),
        text_states=torch.randn(text_rows, text_dim, generator=generator).to(text_dtype),
        timesteps=timesteps,
        timestep_index=timestep_index,
        tags=tags_all,
        positions=positions_all,
        video_index=torch.cat((condition_index, target_video_index)),
        audio_index=audio_index,
        text_index=text_index,
    )


def max_relative_error(actual: Tensor, reference: Tensor) -> float:
    """max |actual - reference| / max |reference| (fp64), the error measure of the DiT benchmark and tests."""
    actual, reference = actual.double(), reference.double()
    return ((actual - reference).abs().max() / reference.abs().max()).item()


def relative_l2(actual: Tensor, reference: Tensor) -> float:
    """||actual - reference|| / ||reference||, in float64."""
    return float((actual.double() - reference.double()).norm() / reference.double().norm())
