"""A remix request's sources read, encoded and turned into held rows, and its output spliced from them.

Mechanisms, facts from peers (../shared/docs/REMIX_MECHANISMS.md): v2a follows Wan2GP's "audio from a control
video" (the video's latents held clean, the output keeps the original pixels); a2v Wan2GP's uploaded soundtrack
and vLLM-Omni's `lock_source` (audio latents held clean over the span they cover); masks ComfyUI's noise masks.
Ours: everything is one mechanism (h3engine.engine.sampling.hold) on T2VA's DiT; extend holds the source's last
`overlap_frames` frames and their audio as the *target's* first rows (not as history condition rows, as Wan2GP
does), and the output is the source followed by the continuation after the overlap.
Sources are encoded as conditions are (video: sampled posterior seed 42, fp16-rounded; audio: posterior mean).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from h3engine.engine.conditioning.encode import encode_reference_audio, encode_visual_condition
from h3engine.engine.sampling.hold import HeldRows, audio_range_mask, pool_spatial_mask, video_range_mask
from h3engine.engine.sampling.packing import audio_latents_to_rows, patchify_video, rows_to_audio_latents
from h3engine.errors import RequestError
from h3engine.media import inputs as media_inputs
from h3engine.request.geometry import AUDIO_LATENTS_PER_SECOND, AUDIO_SAMPLE_RATE, FPS, Geometry
from h3engine.request.limits import MAX_MEDIA_SECONDS
from h3engine.request.remix import Remix

SAMPLES_PER_AUDIO_LATENT = AUDIO_SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND


@dataclass(frozen=True, eq=False)
class RemixPlan:
    """Held rows plus what the output keeps of the sources (plain CPU data)."""

    held: HeldRows
    mode: str | None
    # v2a with stream copy: the source file and the frames copied from it.
    copy_video_from: str | None = None
    copy_video_frames: int = 0
    # a2v: the source waveform [2, n] at 32 kHz put over the output's first n samples.
    audio_over: torch.Tensor | None = None
    # extend: the source's frames [F, H, W, 3] uint8 and waveform [2, n] before the continuation.
    prefix_frames: np.ndarray | None = None
    prefix_audio: torch.Tensor | None = None
    overlap_frames: int = 0


def _field(error: RequestError, field: str) -> RequestError:
    return error.in_field(field)


def _load_video(path: str, seconds: float, geometry: Geometry) -> media_inputs.LoadedVideo:
    try:
        return media_inputs.load_video(path, 0.0, seconds, resize_to=(geometry.width, geometry.height))
    except RequestError as error:
        raise _field(error, "remix.source_video") from None


def _audio_rows(
    audio_vae: torch.nn.Module, waveform: torch.Tensor, geometry: Geometry
) -> tuple[torch.Tensor, int]:
    """Channel-major rows [2A, C] of the clip's audio latents, the first `covered` from `waveform`, the rest 0."""
    covered = min(waveform.shape[1] // SAMPLES_PER_AUDIO_LATENT, geometry.audio_latents)
    if not covered:
        return torch.zeros(0), 0
    encoded = rows_to_audio_latents(encode_reference_audio(audio_vae, waveform))
    latents = torch.zeros(2, encoded.shape[1], geometry.audio_latents)
    latents[:, :, :covered] = encoded[:, :, :covered]
    return audio_latents_to_rows(latents), covered


def _audio_mask(geometry: Geometry, covered: int, remix: Remix) -> torch.Tensor:
    per_latent = torch.ones(geometry.audio_latents)
    per_latent[:covered] = 0.0
    mask = per_latent.repeat(2)
    if remix.audio_mask:
        mask = torch.maximum(mask, audio_range_mask(geometry, remix.audio_mask))
    return mask


def _video_mask(geometry: Geometry, held_latent_frames: int, remix: Remix) -> torch.Tensor:
    frames = torch.ones(geometry.latent_frames)
    frames[:held_latent_frames] = 0.0
    mask = frames[:, None].expand(-1, geometry.rows_per_frame).reshape(-1)
    spatial = None
    if remix.video_mask_image is not None:
        try:
            image = media_inputs.load_image(remix.video_mask_image).convert("L")
        except RequestError as error:
            raise _field(error, "remix.video_mask_image") from None
        grid = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
        spatial = pool_spatial_mask(
            grid, geometry.latent_h // geometry.patch, geometry.latent_w // geometry.patch
        )
    if remix.video_mask or spatial is not None:
        ranges = remix.video_mask or ((0.0, geometry.frames / FPS),)
        mask = torch.maximum(mask, video_range_mask(geometry, ranges, spatial))
    return mask


def plan_remix(
    remix: Remix, geometry: Geometry, video_vae: torch.nn.Module, audio_vae: torch.nn.Module
) -> RemixPlan:
    """Read and encode a checked remix's sources for a clip of `geometry`."""
    held: dict[str, torch.Tensor] = {}
    plan: dict[str, object] = {}
    clip_seconds = geometry.frames / FPS
    soundtrack = None
    if remix.source_video is not None:
        if remix.mode == "extend":
            source = _load_video(remix.source_video, MAX_MEDIA_SECONDS, geometry)
            frames = source.frames[-remix.overlap_frames :]
            plan |= {"prefix_frames": source.frames, "overlap_frames": remix.overlap_frames}
            if source.soundtrack is not None:
                waveform = torch.from_numpy(source.soundtrack.samples)
                end = round(source.frames.shape[0] * AUDIO_SAMPLE_RATE / FPS)
                start = round((source.frames.shape[0] - remix.overlap_frames) * AUDIO_SAMPLE_RATE / FPS)
                plan["prefix_audio"] = waveform[:, :end]
                soundtrack = waveform[:, start:end]
            held_latent_frames = (remix.overlap_frames - 5) // 17 * 5 + 2
        else:
            source = _load_video(remix.source_video, clip_seconds + 0.5 / FPS, geometry)
            frames = source.frames[: geometry.frames]
            if frames.shape[0] != geometry.frames:
                raise RequestError(
                    "remix.source_video",
                    f"decodes to {frames.shape[0]} frames, the clip needs {geometry.frames}",
                )
            if source.soundtrack is not None:
                soundtrack = torch.from_numpy(source.soundtrack.samples)
            held_latent_frames = geometry.latent_frames
            if remix.mode == "v2a" and not (
                remix.decoded_video or remix.video_mask or remix.video_mask_image
            ):
                plan |= {"copy_video_from": remix.source_video, "copy_video_frames": geometry.frames}
        if remix.mode != "a2v":
            latents = encode_visual_condition(video_vae, frames)
            clean = torch.zeros(geometry.video_rows, latents.shape[1] * geometry.patch**2)
            clean[: held_latent_frames * geometry.rows_per_frame] = patchify_video(latents, geometry.patch)
            held |= {"video_mask": _video_mask(geometry, held_latent_frames, remix), "video_clean": clean}
    audio = None
    if remix.source_audio is not None:
        try:
            loaded = media_inputs.load_audio(remix.source_audio, 0.0, clip_seconds)
        except RequestError as error:
            raise _field(error, "remix.source_audio") from None
        audio = torch.from_numpy(loaded.samples)
        if remix.mode == "a2v" and not remix.audio_mask:
            plan["audio_over"] = audio
    elif remix.mode == "extend" or remix.audio_mask:
        audio = soundtrack
    if audio is not None and (remix.mode in ("a2v", "extend") or remix.audio_mask):
        rows, covered = _audio_rows(audio_vae, audio, geometry)
        if covered:
            held |= {"audio_mask": _audio_mask(geometry, covered, remix), "audio_clean": rows}
    return RemixPlan(HeldRows(**held), remix.mode, **plan)


def splice_output(
    plan: RemixPlan, video: torch.Tensor, audio: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output tensors a remix writes: a2v keeps the source waveform where it covers; extend is the source
    followed by the continuation after the overlap (video [F, H, W, 3] in [0, 1], audio [2, N]). A decoded source
    waveform is clamped to [-1, 1] as decoded audio is (AAC overshoots near full scale)."""
    if plan.audio_over is not None:
        covered = min(plan.audio_over.shape[1], audio.shape[1])
        audio = torch.cat(
            [plan.audio_over[:, :covered].to(audio.dtype).clamp(-1.0, 1.0), audio[:, covered:]], dim=1
        )
    if plan.prefix_frames is not None:
        prefix = torch.from_numpy(plan.prefix_frames).to(video.dtype) / 255.0
        video = torch.cat([prefix, video[plan.overlap_frames :]])
        skip = round(plan.overlap_frames * AUDIO_SAMPLE_RATE / FPS)
        if plan.prefix_audio is not None:
            source_audio = plan.prefix_audio.to(audio.dtype).clamp(-1.0, 1.0)
        else:
            source_audio = torch.zeros(2, round(prefix.shape[0] * AUDIO_SAMPLE_RATE / FPS))
        audio = torch.cat([source_audio, audio[:, skip:]], dim=1)
    return video, audio


def chain_windows(
    generate_to_file: Callable[..., Any],
    request: Any,
    files: Any,
    on_step: Callable[..., None] | None,
    should_cancel: Callable[[], bool] | None,
) -> Any:
    """extend with `windows` K > 1: window k extends window k-1's MP4, so each window re-encodes the exported
    waveform (not chained audio latents, which garble speech after about 8 segments in peers' reports). The
    intermediate MP4s live in a hidden folder beside the output and are removed; the last window writes `files`."""
    remix = request.remix
    folder = files.video.parent / f".{files.video.name}.windows-{os.getpid()}"
    folder.mkdir()
    try:
        source = remix.source_video
        for window in range(remix.windows):
            single = replace(request, remix=replace(remix, source_video=source, windows=1))
            if window == remix.windows - 1:
                return generate_to_file(single, files.video, files.tensors, on_step, should_cancel)
            source = str(
                generate_to_file(single, folder / f"window{window}.mp4", None, on_step, should_cancel).video
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")
