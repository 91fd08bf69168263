"""Initial noise of a request, and the noise of its visual condition rows, from one integer seed.

Two recipes draw different streams from the same seed (docs/MODEL.md §8.5); both draw fp32 on the CPU (so results
do not depend on the accelerator) and return rows (video patchified, audio channel-major). `draw_initial_noise`
spells out each recipe's draws.

Danger: draw order and draw shapes *are* the recipe; drawing a bigger tensor and slicing it, reordering draws or
drawing rows instead of the latent tensor gives different noise for the same seed. Reference-audio rows are never
noised by default (level 1.0), so no audio condition noise is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h3engine.engine.sampling.packing import VISUAL_CONDITION_LEVEL, patchify_video
from h3engine.request.geometry import AUDIO_CHANNELS, Geometry

NOISE_RECIPES = ("sglang", "diffusers")

RELEASED_VIDEO_LATENT_CHANNELS = 24
RELEASED_AUDIO_LATENT_CHANNELS = 32
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, eq=False)
class InitialNoise:
    """fp32 CPU noise rows of one request.

    ``video_rows`` [geometry.video_rows, C*p*p] and ``audio_rows`` [2A, Ca] are the starting state of the
    generated rows; ``condition_video_rows`` holds one noise tensor (patchified) per visual condition, in
    packed order, to be mixed into that condition's clean rows with :func:`noise_condition_rows`.
    """

    video_rows: torch.Tensor
    audio_rows: torch.Tensor
    condition_video_rows: tuple[torch.Tensor, ...]


def _seeded_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")


def draw_initial_noise(
    seed: int,
    geometry: Geometry,
    *,
    recipe: str,
    condition_shapes: Sequence[tuple[int, int, int]] = (),
    video_channels: int = RELEASED_VIDEO_LATENT_CHANNELS,
    audio_channels: int = RELEASED_AUDIO_LATENT_CHANNELS,
) -> InitialNoise:
    """Draw the request's noise under ``recipe``.

    ``condition_shapes`` are the ``(latent_frames, latent_h, latent_w)`` of the visual conditions
    (FL2VA keyframes, Ref2VA image/video references) in packed order; empty for T2VA.

    * ``"sglang"`` (the serving path behind the README's reference outputs): the video noise
      ``randn([1, C, T, h, w])`` from a CPU generator seeded ``seed``; the audio noise ``randn([2A, Ca])``
      (already in row layout) from a *second* generator also seeded ``seed``; each visual condition from a
      *fresh* generator seeded ``seed``, drawn as ``[1, C, T_target + n_conditions, h_c, w_c]`` and cut to
      its first ``T_c`` frames.
    * ``"diffusers"`` (diffusers 0.42.1 with ``generator=torch.Generator().manual_seed(seed)``): one
      generator consumed in order: one ``randn`` per visual condition at its latent shape, then the video
      noise ``[1, C, T, h, w]``, then the audio noise ``[2A, Ca]``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    target_shape = (1, video_channels, geometry.latent_frames, geometry.latent_h, geometry.latent_w)
    audio_shape = (AUDIO_CHANNELS * geometry.audio_latents, audio_channels)

    if recipe == "sglang":
        video_noise = _randn(target_shape, _seeded_generator(seed))
        audio_rows = _randn(audio_shape, _seeded_generator(seed))
        condition_noise = [
            sglang_condition_noise(
                seed,
                shape,
                count=len(condition_shapes),
                target_frames=geometry.latent_frames,
                channels=video_channels,
            )
            for shape in condition_shapes
        ]
    elif recipe == "diffusers":
        generator = _seeded_generator(seed)
        condition_noise = [
            _randn((1, video_channels, frames, height, width), generator)
            for frames, height, width in condition_shapes
        ]
        video_noise = _randn(target_shape, generator)
        audio_rows = _randn(audio_shape, generator)
    else:
        raise ValueError(f"unknown noise recipe {recipe!r}; expected one of {NOISE_RECIPES}")

    return InitialNoise(
        video_rows=patchify_video(video_noise, geometry.patch),
        audio_rows=audio_rows,
        condition_video_rows=tuple(patchify_video(noise, geometry.patch) for noise in condition_noise),
    )


def sglang_condition_noise(
    seed: int, shape: Sequence[int], *, count: int, target_frames: int, channels: int
) -> torch.Tensor:
    """One visual condition's noise latent ``[1, channels, T_c, h_c, w_c]`` under the sglang recipe.

    ``shape`` is the condition's ``(T_c, h_c, w_c)``, ``count`` the request's number of visual conditions: the
    condition restarts the stream (a fresh generator seeded ``seed``) and draws a clip longer than itself, the
    target's ``target_frames`` plus one frame per condition, keeping only its own leading ``T_c`` frames. Shared by
    `draw_initial_noise` and the reference runner, which hands this noise to diffusers.
    """
    frames, height, width = shape
    draw = (1, channels, target_frames + count, height, width)
    return _randn(draw, _seeded_generator(seed))[:, :, :frames]


def noise_condition_rows(
    clean_rows: torch.Tensor, noise_rows: torch.Tensor, level: float = VISUAL_CONDITION_LEVEL
) -> torch.Tensor:
    """Rectified-flow noising of condition rows to ``t = level``: ``level * clean + (1 - level) * noise``.

    ``level`` is rounded to fp32 first and both products are separate fp32 ops, as in the reference
    (folding the scalar in float64 moves results by an ulp). Patchify is a permutation, so mixing rows
    equals mixing latents.
    """
    level_fp32 = torch.tensor(level, dtype=torch.float32, device=clean_rows.device)
    return level_fp32 * clean_rows.to(torch.float32) + (1.0 - level_fp32) * noise_rows.to(torch.float32)
