"""Conditioning media -> what the DiT conditions on: fitted keyframes, normalized references, clean latents.

Media arrive decoded (PIL images, uint8 frame stacks with their frame rate, float waveforms with their sample rate);
nothing here opens a file. Each step reproduces the released recipe as diffusers 0.42.1 implements it:
`fit_keyframes` (FL2VA), `normalize_reference_image` / `_video` / `_audio` (Ref2VA), then `encode_keyframes` /
`encode_references` turn the normalized media into `EncodedConditions` (clean, normalized latents in packed
order). Noising the visual rows to t = 0.999 happens when the rows are packed (`pipeline`), because that noise
comes from the request seed.

Danger: every rounding here is the reference's. A LANCZOS resize instead of a stretch, `floor` instead of
`round`, a different centring, the request seed instead of 42, a skipped fp16 round trip or a different resampler
all move the conditioning latents, and the conditioning latents move everything the model generates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from h3engine.engine.sampling.packing import (
    AudioReference,
    ImageReference,
    KeyframeAnchor,
    PackedLayout,
    ReferenceBlock,
    VideoReference,
    audio_latents_to_rows,
    fl2va_layout,
    ref2va_layout,
    t2va_layout,
)
from h3engine.request.files import ReferenceKind
from h3engine.request.geometry import (
    FPS,
    Geometry,
    reference_image_size,
    reference_video_encode_frames,
    resolve_canvas,
)

# The conditioning posterior is sampled under its own seed, whatever the request seed, so that one input always
# encodes to one anchor (SGLang's MINIMAX_H3_REFERENCE_VIDEO_ENCODE_SEED, diffusers' keyframe_encode_seed).
CONDITION_ENCODE_SEED = 42

# torchaudio.transforms.Resample defaults (Hann-windowed sinc), the resampler the reference runs once per soundtrack.
_RESAMPLE_LOWPASS_ZERO_CROSSINGS = 6
_RESAMPLE_ROLLOFF = 0.99


# ---------------------------------------------------------------------------------------------------------------
# FL2VA keyframes


def fit_keyframes(keyframes: Sequence[Image.Image], height: int, width: int) -> list[Image.Image]:
    """Put keyframes (in packed order) onto a `height` x `width` canvas: the first stretched, the others cropped.

    The first listed keyframe anchors the geometry and is resized to the canvas whatever its aspect (LANCZOS). A
    follower is scaled to cover the canvas and centre-cropped with the released integer arithmetic. An image that
    already has the canvas size is used as it is.

    The follower's cover crop: scale to cover, `round()` the resized size, centre offsets `(src - dst) // 2`. Without
    an explicit canvas, the first listed keyframe's own aspect resolves it (`geometry.resolve_canvas`).
    """
    fitted = []
    for index, keyframe in enumerate(keyframes):
        if keyframe.size == (width, height):
            fitted.append(keyframe)
        elif index == 0:
            fitted.append(keyframe.resize((width, height), Image.Resampling.LANCZOS))
        else:
            fitted.append(_cover_crop(keyframe, height, width))
    return fitted


def _cover_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    source_width, source_height = image.size
    scale = max(width / source_width, height / source_height)
    # round() (half to even) and max() are the released sizing; floor-based crops differ by a pixel on many ratios.
    resized_width = max(width, round(source_width * scale))
    resized_height = max(height, round(source_height * scale))
    left = max(0, (resized_width - width) // 2)
    top = max(0, (resized_height - height) // 2)
    resized = image.resize((resized_width, resized_height), Image.Resampling.LANCZOS)
    return resized.crop((left, top, left + width, top + height))


# ---------------------------------------------------------------------------------------------------------------
# Ref2VA references


@dataclass(frozen=True, eq=False)
class NormalizedReference:
    """One Ref2VA reference on the model's own rates and resolution, in request order.

    `image`: the resized PIL image (kind "image"); `frames`: uint8 [F, H, W, 3] at 24 fps on the video's own canvas
    (kind "video"); `audio`: float32 stereo [2, N] at the audio VAE's rate (kind "audio", or a video's soundtrack).
    """

    kind: ReferenceKind
    image: Image.Image | None = None
    frames: np.ndarray | None = None
    audio: torch.Tensor | None = None

    @property
    def has_audio(self) -> bool:
        return self.audio is not None


def normalize_reference_image(image: Image.Image, short_edge: int, multiple: int) -> Image.Image:
    """Resize a reference image (LANCZOS) to its own high-detail canvas, see `reference_image_size`.

    Scaled so that its short edge is the checkpoint's reference short edge (2048 for the release, upscaling allowed,
    no area cap), each axis rounded to the nearest canvas multiple.
    """
    size = reference_image_size(*image.size, short_edge=short_edge, multiple=multiple)
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


def hold_frames_at_fps(frames: np.ndarray, fps: float, target_fps: float = FPS) -> np.ndarray:
    """Resample a frame stack to `target_fps` by holding each frame until the slot of the next one.

    Frame i lands on slot `floor(i * target/fps + 0.5)`; the last one is held until the slot the stream's end
    rounds to (the constant-frame-rate resample of the reference's ffmpeg decode).
    """
    if not fps > 0:
        raise ValueError(f"a video needs a positive frame rate, got {fps}")
    if fps == target_fps:
        return frames
    scale = target_fps / fps
    slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
    end_slot = math.floor(frames.shape[0] * scale + 0.5)
    return np.repeat(frames, np.diff(slots, append=end_slot), axis=0)


def normalize_reference_video(
    frames: np.ndarray,
    fps: float,
    num_frames: int,
    *,
    multiple: int,
    short_edge: int,
    max_pixels: int,
) -> np.ndarray:
    """uint8 [F, H, W, 3] at `fps` -> uint8 frames at 24 fps, at most `num_frames`, on the video's own canvas.

    The canvas is the one the video's aspect resolves to under the target's rule (`short_edge`, `max_pixels`,
    `multiple`); frames already at that size are kept bit for bit, others are resized with PIL LANCZOS.

    Held onto 24 fps and cut to the generated frame count before the resize; the VAE later sees it snapped down to
    17n+5 frames.
    """
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"reference frames must be uint8 [frames, height, width, 3], got {frames.shape}")
    frames = hold_frames_at_fps(frames, fps)[:num_frames]
    height, width = resolve_canvas(
        frames.shape[2], frames.shape[1], multiple=multiple, short_edge=short_edge, max_pixels=max_pixels
    )
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack(
        [
            np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.LANCZOS))
            for frame in frames
        ]
    )


def normalize_reference_audio(
    waveform: torch.Tensor, sample_rate: int, target_sample_rate: int, max_seconds: float
) -> torch.Tensor:
    """[C, N] mono or stereo at `sample_rate` -> float32 stereo [2, M] at `target_sample_rate`, cut to `max_seconds`.

    The cut happens at the source rate, before the single resampling pass, as in the reference.

    A clip or a video's soundtrack: cut to the generated duration at its own rate, mono duplicated to stereo, then
    resampled once to the audio VAE's rate (`resample_waveform`, the windowed-sinc resampler of
    `torchaudio.transforms.Resample` with its defaults).
    """
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2):
        raise ValueError(
            f"a reference waveform must be [channels, samples] mono or stereo, got {waveform.shape}"
        )
    waveform = waveform.to(torch.float32)[:, : int(max_seconds * sample_rate)]
    if waveform.shape[0] == 1:
        waveform = waveform.expand(2, -1).contiguous()
    return resample_waveform(waveform, sample_rate, target_sample_rate)


def resample_waveform(waveform: torch.Tensor, source_rate: int, target_rate: int) -> torch.Tensor:
    """Band-limited resampling of float32 [C, N], bit-compatible with `torchaudio.transforms.Resample(src, dst)`.

    A Hann-windowed sinc filter bank (6 zero crossings, roll-off 0.99) applied as one strided conv1d, as torchaudio
    computes it: the kernel in float64 (the per-phase offsets `j / up` are rounded to float32 first, as torchaudio's
    integer arange divides in the default dtype), then stored as float32; the output length is
    `ceil(up * N / down)` evaluated in float32.
    """
    if source_rate == target_rate:
        return waveform
    if source_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {source_rate} -> {target_rate}")
    divisor = math.gcd(int(source_rate), int(target_rate))
    down, up = int(source_rate) // divisor, int(target_rate) // divisor
    kernel, half_width = sinc_resample_kernel(down, up)
    channels, length = waveform.shape
    padded = torch.nn.functional.pad(waveform, (half_width, half_width + down))
    phases = torch.nn.functional.conv1d(padded[:, None], kernel.to(waveform.device), stride=down)
    interleaved = phases.transpose(1, 2).reshape(channels, -1)
    output_length = int(torch.ceil(torch.tensor(up * length / down, dtype=torch.float32)))
    return interleaved[:, :output_length]


def sinc_resample_kernel(down: int, up: int) -> tuple[torch.Tensor, int]:
    """The [up, 1, 2 * half_width + down] float32 filter bank of a `down` -> `up` (coprime) rate change and its
    half width in source samples."""
    zero_crossings = _RESAMPLE_LOWPASS_ZERO_CROSSINGS
    cutoff = min(down, up) * _RESAMPLE_ROLLOFF
    half_width = math.ceil(zero_crossings * down / cutoff)
    source_offsets = torch.arange(-half_width, half_width + down, dtype=torch.float64)[None, None] / down
    phase_offsets = torch.arange(0, -up, -1, dtype=torch.float32)[:, None, None] / up
    # Operation order below is torchaudio's, so that the float64 values (and so their float32 rounding) agree.
    times = phase_offsets + source_offsets
    times *= cutoff
    times = times.clamp_(-zero_crossings, zero_crossings)
    window = torch.cos(times * math.pi / zero_crossings / 2) ** 2
    times *= math.pi
    sinc = torch.where(times == 0, torch.tensor(1.0, dtype=times.dtype), times.sin() / times)
    sinc *= window * (cutoff / down)
    return sinc.to(torch.float32), half_width


# ---------------------------------------------------------------------------------------------------------------
# Encoding


@dataclass(frozen=True, eq=False)
class EncodedConditions:
    """The clean conditioning of one request, in packed order, and how it is laid out.

    `visual_latents`: normalized fp32 CPU latents [1, C, T, h, w], one per keyframe / image or video reference;
    `audio_rows`: normalized fp32 CPU rows [2A, C] (channel-major), one per audio-bearing reference. For FL2VA
    `keyframe_anchors` names each keyframe's end; for Ref2VA `reference_blocks` describes every reference block.
    """

    task: Literal["t2va", "fl2va", "ref2va"]
    visual_latents: tuple[torch.Tensor, ...] = ()
    audio_rows: tuple[torch.Tensor, ...] = ()
    keyframe_anchors: tuple[KeyframeAnchor, ...] = ()
    reference_blocks: tuple[ReferenceBlock, ...] = ()

    @property
    def visual_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """(latent frames, latent h, latent w) of each visual condition: the shapes its noise is drawn at."""
        return tuple(tuple(latents.shape[2:5]) for latents in self.visual_latents)

    def layout(self, text_tags: torch.Tensor, geometry: Geometry) -> PackedLayout:
        if self.task == "fl2va":
            return fl2va_layout(text_tags, geometry, self.keyframe_anchors)
        if self.task == "ref2va":
            return ref2va_layout(text_tags, geometry, self.reference_blocks)
        return t2va_layout(text_tags, geometry)


def encode_visual_condition(video_vae: torch.nn.Module, frames: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> normalized conditioning latents [1, C, T, h, w] (fp32, CPU).

    Sampled posterior (own CPU generator seeded 42), rounded through fp16, normalized: the released recipe.
    """
    weight = next(video_vae.parameters())
    # A writable C-contiguous copy only when needed: PIL-backed arrays are read-only, which torch warns about.
    pixels = (
        torch.from_numpy(np.require(frames, requirements=("C", "W")))
        .to(weight.device)
        .permute(3, 0, 1, 2)[None]
    )
    unit_range = pixels.to(torch.float32).div(255.0)
    mean, logvar = video_vae.encode(video_vae.from_unit_range(unit_range))
    generator = torch.Generator(device="cpu").manual_seed(CONDITION_ENCODE_SEED)
    latents = video_vae.sample_posterior(mean, logvar, generator)
    # The reference rounds the sampled latents through fp16 (11 significant bits) before normalizing them; the
    # conditioning the model saw carries that rounding, so it is kept even in fp32 runs.
    latents = latents.to(torch.float16).to(torch.float32).cpu()
    return video_vae.normalize_latents(latents)


def encode_reference_audio(audio_vae: torch.nn.Module, waveform: torch.Tensor) -> torch.Tensor:
    """Stereo [2, N] at the VAE rate -> normalized channel-major rows [2A, C] (posterior mean, fp32, CPU)."""
    device = next(audio_vae.parameters()).device
    latents = audio_vae.encode_stereo(waveform.to(device)).to(torch.float32).cpu()
    return audio_latents_to_rows(audio_vae.normalize_latents(latents))


def encode_keyframes(
    video_vae: torch.nn.Module, fitted_keyframes: Sequence[Image.Image], anchors: Sequence[KeyframeAnchor]
) -> EncodedConditions:
    """Encode fitted keyframes (packed order: first, then last) as one latent frame each.

    Visual latents are the VAE posterior *sampled* with its own CPU generator seeded 42 and rounded through fp16, as
    the reference does (the same rule in `encode_references`; audio latents are the posterior mean).
    """
    if len(fitted_keyframes) != len(anchors):
        raise ValueError(f"{len(fitted_keyframes)} keyframes but {len(anchors)} anchors")
    latents = tuple(
        encode_visual_condition(video_vae, np.asarray(image.convert("RGB"))[None])
        for image in fitted_keyframes
    )
    return EncodedConditions(task="fl2va", visual_latents=latents, keyframe_anchors=tuple(anchors))


def encode_references(
    video_vae: torch.nn.Module, audio_vae: torch.nn.Module, references: Sequence[NormalizedReference]
) -> EncodedConditions:
    """Encode normalized references in request order: images and videos by the video VAE, audio by the audio VAE.

    A video's soundtrack rows belong to that video's block (packed right before its video rows).
    """
    visual_latents: list[torch.Tensor] = []
    audio_rows: list[torch.Tensor] = []
    blocks: list[ReferenceBlock] = []
    for reference in references:
        reference_audio_latents = 0
        if reference.audio is not None:
            rows = encode_reference_audio(audio_vae, reference.audio)
            audio_rows.append(rows)
            reference_audio_latents = rows.shape[0] // 2
        if reference.kind == "image":
            latents = encode_visual_condition(video_vae, np.asarray(reference.image.convert("RGB"))[None])
            visual_latents.append(latents)
            blocks.append(ImageReference(latent_h=latents.shape[3], latent_w=latents.shape[4]))
        elif reference.kind == "video":
            # Snapped *down* so that the VAE encodes whole chunks without padding frames of its own.
            frames = reference.frames[: reference_video_encode_frames(reference.frames.shape[0])]
            latents = encode_visual_condition(video_vae, frames)
            visual_latents.append(latents)
            blocks.append(
                VideoReference(
                    latent_frames=latents.shape[2],
                    latent_h=latents.shape[3],
                    latent_w=latents.shape[4],
                    audio_latents=reference_audio_latents,
                )
            )
        elif reference.kind == "audio":
            if reference.audio is None:
                raise ValueError("an audio reference needs its waveform")
            blocks.append(AudioReference(audio_latents=reference_audio_latents))
        else:
            raise ValueError(f"unknown reference kind {reference.kind!r}")
    return EncodedConditions(
        task="ref2va",
        visual_latents=tuple(visual_latents),
        audio_rows=tuple(audio_rows),
        reference_blocks=tuple(blocks),
    )
