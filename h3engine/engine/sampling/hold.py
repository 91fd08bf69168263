"""Held target rows: some generated rows kept at (or blended toward) clean source latents while the rest denoise.

A `HeldRows` gives each target row a mask value m (0 keeps the source, 1 regenerates, between: a blend) and the
source's clean rows. The rule (facts from ComfyUI #15375/#15988, read in ../shared/docs/REMIX_MECHANISMS.md; the
code is ours): per-row timestep t = min(1 - m * sigma, max(t, cap)) with cap 0.999 for video and 1.0 for audio;
kept rows are fed 0.999 * clean + 0.001 * noise (video) or clean (audio); the velocity is multiplied by m; after
each Euler step the kept rows are restored (m = 0: exactly the clean rows; 0 < m < 1: lerp(clean, state, m)).
Rows with m = 1 take the plain arithmetic, so an all-1 mask equals plain generation bit for bit.
Masks come from time ranges in seconds (`video_range_mask`, `audio_range_mask`), pooled with max to latent frames
(a latent frame is regenerated when any of its pixel frames is), optionally times a spatial grid on the patch grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h3engine.engine.sampling.noise import noise_condition_rows
from h3engine.engine.sampling.packing import (
    AUDIO_CONDITION_LEVEL,
    FRAME_SPAN_PATTERN,
    VISUAL_CONDITION_LEVEL,
    PackedLayout,
)
from h3engine.request.geometry import AUDIO_CHANNELS, AUDIO_LATENTS_PER_SECOND, FPS, Geometry

TimeRange = tuple[float, float]


@dataclass(frozen=True, eq=False)
class HeldRows:
    """Masks and clean rows of a request's target rows (fp32, CPU); None for a modality generated as usual.

    `video_mask` [geometry.video_rows] with `video_clean` [video_rows, C*p*p]; `audio_mask` [geometry.audio_rows]
    with `audio_clean` [audio_rows, Ca] (channel-major, as packed)."""

    video_mask: torch.Tensor | None = None
    video_clean: torch.Tensor | None = None
    audio_mask: torch.Tensor | None = None
    audio_clean: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, mask, clean in (
            ("video", self.video_mask, self.video_clean),
            ("audio", self.audio_mask, self.audio_clean),
        ):
            if (mask is None) != (clean is None):
                raise ValueError(f"held {name} rows need both a mask and clean rows")
            if mask is not None and (mask.ndim != 1 or clean.ndim != 2 or mask.shape[0] != clean.shape[0]):
                raise ValueError(
                    f"held {name} mask {tuple(mask.shape)} does not fit clean rows {tuple(clean.shape)}"
                )


def _frame_intervals(latent_frames: int) -> list[tuple[int, int]]:
    """Pixel frames [first, last] each latent frame covers: the VAE's spans (1, 4, 4, 4, 4) repeating."""
    intervals, first = [], 0
    for latent_frame in range(latent_frames):
        span = FRAME_SPAN_PATTERN[latent_frame % len(FRAME_SPAN_PATTERN)]
        intervals.append((first, first + span - 1))
        first += span
    return intervals


def _overlaps(start: float, end: float, ranges: Sequence[TimeRange]) -> bool:
    return any(start < range_end and range_start < end for range_start, range_end in ranges)


def video_range_mask(
    geometry: Geometry, ranges: Sequence[TimeRange], spatial: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row video mask: 1 on latent frames any of whose pixel frames overlaps a range (seconds), else 0.
    `spatial` [latent_h/p, latent_w/p] in [0, 1] (a region on the patch grid) multiplies the masked frames."""
    rows_per_frame = geometry.rows_per_frame
    frames = torch.zeros(geometry.latent_frames, dtype=torch.float32)
    for latent_frame, (first, last) in enumerate(_frame_intervals(geometry.latent_frames)):
        frames[latent_frame] = float(_overlaps(first / FPS, (last + 1) / FPS, ranges))
    mask = frames[:, None].expand(-1, rows_per_frame)
    if spatial is not None:
        if spatial.numel() != rows_per_frame:
            raise ValueError(
                f"the spatial mask has {spatial.numel()} cells, a latent frame {rows_per_frame} rows"
            )
        mask = mask * spatial.reshape(1, -1).to(torch.float32)
    return mask.reshape(-1).contiguous()


def audio_range_mask(geometry: Geometry, ranges: Sequence[TimeRange]) -> torch.Tensor:
    """Per-row audio mask (both stereo channels): 1 on audio latents overlapping a range (seconds), else 0."""
    step = 1.0 / AUDIO_LATENTS_PER_SECOND
    latents = torch.tensor(
        [
            float(_overlaps(index * step, (index + 1) * step, ranges))
            for index in range(geometry.audio_latents)
        ],
        dtype=torch.float32,
    )
    return latents.repeat(AUDIO_CHANNELS)


def pool_spatial_mask(image_mask: torch.Tensor, cells_h: int, cells_w: int) -> torch.Tensor:
    """A [H, W] mask in [0, 1] (white regenerates) -> [cells_h, cells_w] by max pooling, quantised to 1/256."""
    pooled = torch.nn.functional.adaptive_max_pool2d(
        image_mask[None, None].to(torch.float32), (cells_h, cells_w)
    )
    return torch.round(pooled[0, 0] * 256) / 256


@dataclass(frozen=True, eq=False)
class _ModalityHold:
    mask: torch.Tensor  # [R, 1] on the device
    clean: torch.Tensor  # [R, C]
    feed: torch.Tensor  # [R, C]: what a kept row is fed
    per_row_mask: torch.Tensor  # [R] on the CPU (fp64), for the timesteps
    regenerate_all: bool

    def start(self, noise: torch.Tensor) -> torch.Tensor:
        """The initial state: clean where m = 0, the noise elsewhere."""
        return torch.where(self.mask == 0, self.clean, noise)

    def fed(self, state: torch.Tensor) -> torch.Tensor:
        if self.regenerate_all:
            return state
        blended = torch.lerp(self.feed, state, self.mask)
        return torch.where(self.mask == 1, state, torch.where(self.mask == 0, self.feed, blended))

    def velocity(self, velocity: torch.Tensor) -> torch.Tensor:
        return velocity if self.regenerate_all else velocity * self.mask

    def restored(self, state: torch.Tensor) -> torch.Tensor:
        if self.regenerate_all:
            return state
        blended = torch.lerp(self.clean, state, self.mask)
        return torch.where(self.mask == 1, state, torch.where(self.mask == 0, self.clean, blended))

    def timesteps(self, t: float, sigma: float, cap: float) -> torch.Tensor:
        """Per-row t = min(1 - m * sigma, max(t, cap)) in float64, then fp32; exactly t where m = 1."""
        held = torch.minimum(1.0 - self.per_row_mask * sigma, torch.full_like(self.per_row_mask, max(t, cap)))
        return torch.where(self.per_row_mask == 1, torch.full_like(held, t), held).to(torch.float32)


class ActiveHold:
    """A `HeldRows` placed on the compute device for one request's denoise (the noise gives the video feed)."""

    def __init__(
        self, held: HeldRows, video_noise: torch.Tensor, audio_noise: torch.Tensor, device: torch.device
    ) -> None:
        self.video = None
        self.audio = None
        if held.video_mask is not None:
            clean = held.video_clean.to(torch.float32)
            feed = noise_condition_rows(clean, video_noise[: clean.shape[0]])
            self.video = self._modality(held.video_mask, clean, feed, device)
        if held.audio_mask is not None:
            clean = held.audio_clean.to(torch.float32)
            self.audio = self._modality(held.audio_mask, clean, clean, device)

    @staticmethod
    def _modality(
        mask: torch.Tensor, clean: torch.Tensor, feed: torch.Tensor, device: torch.device
    ) -> _ModalityHold:
        mask = mask.to(torch.float32)
        return _ModalityHold(
            mask[:, None].to(device),
            clean.to(device),
            feed.to(device),
            mask.to(torch.float64),
            bool((mask == 1).all()),
        )

    def row_timesteps(
        self,
        layout: PackedLayout,
        plain: tuple[torch.Tensor, torch.Tensor],
        video: tuple[float, float],
        audio: tuple[float, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain step's (timesteps, index) with the target rows' held timesteps put in; `video` and `audio`
        are each (t, sigma) of this step."""
        timesteps, index = plain
        per_row = timesteps[index].clone()
        if self.video is not None:
            rows = layout.video_index[layout.num_condition_video_rows :].cpu()
            per_row[rows] = self.video.timesteps(*video, VISUAL_CONDITION_LEVEL)
        if self.audio is not None:
            rows = layout.audio_index[layout.num_condition_audio_rows :].cpu()
            per_row[rows] = self.audio.timesteps(*audio, AUDIO_CONDITION_LEVEL)
        return torch.unique(per_row, sorted=True, return_inverse=True)

    def start(self, video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            video if self.video is None else self.video.start(video),
            audio if self.audio is None else self.audio.start(audio),
        )

    def inputs(
        self, video: torch.Tensor, audio: torch.Tensor, first_video: int, first_audio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed rows the DiT reads this step: kept target rows replaced by their feed (copies only then)."""
        if self.video is not None and not self.video.regenerate_all:
            video = torch.cat([video[:first_video], self.video.fed(video[first_video:])])
        if self.audio is not None and not self.audio.regenerate_all:
            audio = torch.cat([audio[:first_audio], self.audio.fed(audio[first_audio:])])
        return video, audio

    def velocities(self, video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target rows' velocities times the mask."""
        return (
            video if self.video is None else self.video.velocity(video),
            audio if self.audio is None else self.audio.velocity(audio),
        )

    def restore(self, video: torch.Tensor, audio: torch.Tensor, first_video: int, first_audio: int) -> None:
        """Put the kept target rows back after an Euler step (in place)."""
        if self.video is not None:
            video[first_video:] = self.video.restored(video[first_video:])
        if self.audio is not None:
            audio[first_audio:] = self.audio.restored(audio[first_audio:])
