"""A cheap live preview: the newest latent frame of a running generation shown as an RGB image.

`latent_preview_rgb(...)` unpatchifies only the last latent frame of the generated video rows, projects its latent
channels to three colours with a fixed linear map, normalizes to [0, 1] and enlarges it to at least
`PREVIEW_SHORT_EDGE` pixels. It is an approximation, not a decode: no VAE runs and the colours do not match the
final video's, but it shows where structure appears and how it moves, for one small device-to-host copy.

Danger: the rows are the loop's live state; this module only reads them (a slice copied to the CPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from h3engine.engine.sampling.packing import unpatchify_video

PREVIEW_SHORT_EDGE = 256
# Contrast: values this many standard deviations from the mean reach black / white.
PREVIEW_SPREAD_STD = 2.5


def channel_to_rgb_weights(channels: int) -> np.ndarray:
    """A fixed [3, C] map: channel c leans towards the hue at angle 2*pi*c/C, so every channel shows up somewhere.

    A hue wheel rather than a learned projection: the map must exist for any channel count (24 for the
    released VAE, 4 for tiny test checkpoints) without fitting anything to decoded videos.
    """
    angles = 2 * math.pi * np.arange(channels) / channels
    offsets = 2 * math.pi * np.arange(3) / 3
    weights = np.cos(angles[None, :] - offsets[:, None])
    return (weights / np.sqrt(channels)).astype(np.float32)


def latent_preview_rgb(
    video_rows: torch.Tensor, latent_frames: int, latent_h: int, latent_w: int, patch: int
) -> np.ndarray:
    """The newest latent frame of `video_rows` as an RGB preview image (an approximation, not a decode).

    Takes the video rows the denoising loop holds after a step (`[T * (h/p) * (w/p), C * p * p]`, any device and
    float dtype) and returns a uint8 `[H, W, 3]` numpy array enlarged by whole-pixel repetition. The per-image
    normalization stretches whatever contrast there is, so early steps (mostly noise) look as bright as late ones;
    the resolution is the latent one (1/16 of the canvas for the released VAE).
    """
    rows_per_frame = (latent_h // patch) * (latent_w // patch)
    if video_rows.ndim != 2 or video_rows.shape[0] != latent_frames * rows_per_frame:
        raise ValueError(
            f"expected {latent_frames * rows_per_frame} video rows for {latent_frames}x{latent_h}x{latent_w} "
            f"latents (patch {patch}), got {tuple(video_rows.shape)}"
        )
    # Rows run frame-major, so the newest latent frame is the last block of rows: copy only that block.
    last_frame_rows = video_rows[-rows_per_frame:].detach().to(device="cpu", dtype=torch.float32)
    latent = unpatchify_video(last_frame_rows, 1, latent_h, latent_w, patch)[0, :, 0].numpy()  # [C, h, w]
    rgb = np.einsum("kc,chw->hwk", channel_to_rgb_weights(latent.shape[0]), latent)
    rgb = rgb - rgb.mean(axis=(0, 1), keepdims=True)
    spread = float(rgb.std()) * PREVIEW_SPREAD_STD
    unit = 0.5 + 0.5 * rgb / spread if spread > 0 else np.full_like(rgb, 0.5)
    image = np.round(np.clip(unit, 0.0, 1.0) * 255).astype(np.uint8)
    scale = max(1, math.ceil(PREVIEW_SHORT_EDGE / min(latent_h, latent_w)))
    return np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)
