"""Request geometry: canvas size, frame counts and latent extents of one MiniMax H3 generation.

Contract: pure integer/float arithmetic, no torch. Every function here reproduces the released recipe
bit for bit (diffusers 0.42.1 / SGLang agree on all of it), because the canvas and the frame counts fix
the packed sequence, and the packed sequence fixes every rotary coordinate the DiT sees.

Danger:
* Rounding is Python's ``round`` (half to even) on purpose: the reference resolver uses it, and a
  different tie rule moves a canvas by a whole 32-pixel step for some odd aspect ratios.
* The area cap uses ``x ** 0.5``, not ``math.sqrt``, to stay on the reference's exact operation.
* Frame counts are ``17n + 5`` and latent counts ``5n + 2`` (the video VAE's chunking), *not* the
  ``4k + 1`` of most video VAEs. The audio latent count is derived from the *snapped* frame count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FPS = 24
AUDIO_SAMPLE_RATE = 32000
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2

# The video VAE encodes 17 pixel frames into 5 latent frames per chunk; a valid clip is 17n + 5
# pixel frames (n >= 0) and becomes 5n + 2 latent frames.
VAE_FRAMES_PER_CHUNK = 17
VAE_LATENTS_PER_CHUNK = 5

RELEASED_SHORT_EDGE = 768
RELEASED_MAX_PIXELS = 768 * 1344
RELEASED_VAE_SPATIAL_RATIO = 16
RELEASED_PATCH = 2

MIN_ASPECT_RATIO = 1 / 4
MAX_ASPECT_RATIO = 4.0

# The aspect ratios the T2VA request schema offers; any ratio within [1/4, 4] resolves.
PRESET_ASPECT_RATIOS = ("21:9", "16:9", "4:3", "1:1", "3:4", "9:16")


def resolve_canvas(
    aspect_w: float,
    aspect_h: float,
    *,
    multiple: int = RELEASED_VAE_SPATIAL_RATIO * RELEASED_PATCH,
    short_edge: int = RELEASED_SHORT_EDGE,
    max_pixels: int = RELEASED_MAX_PIXELS,
) -> tuple[int, int]:
    """Resolve an aspect ratio W:H to the generation canvas ``(height, width)`` in pixels.

    The short edge starts at ``short_edge``; if the area then exceeds ``max_pixels`` both sides shrink
    by the same factor; finally each side is rounded to the nearest ``multiple`` (at least one multiple).
    Only the ratio ``aspect_w / aspect_h`` matters, so source pixel sizes work as well as "16", "9".
    """
    if not (aspect_w > 0 and aspect_h > 0) or math.isinf(aspect_w) or math.isinf(aspect_h):
        raise ValueError(f"aspect ratio sides must be positive finite numbers, got {aspect_w}:{aspect_h}")
    if multiple <= 0 or short_edge <= 0 or max_pixels <= 0:
        raise ValueError(
            f"multiple, short_edge and max_pixels must be positive, got {multiple}, {short_edge}, {max_pixels}"
        )
    ratio = aspect_w / aspect_h
    if not MIN_ASPECT_RATIO <= ratio <= MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {aspect_w:g}:{aspect_h:g} (= {ratio:.4g}) is outside the supported range "
            "1:4 to 4:1 that MiniMax H3 was trained on"
        )

    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        shrink = (max_pixels / area) ** 0.5
        width, height = width * shrink, height * shrink

    def to_multiple(length: float) -> int:
        return max(multiple, round(length / multiple) * multiple)

    return to_multiple(height), to_multiple(width)


def canvas_rule(short_edge: int | None, rule_short_edge: int, rule_max_pixels: int) -> tuple[int, int]:
    """(short edge, area cap) of a requested short edge on a checkpoint whose canvas rule is
    (`rule_short_edge`, `rule_max_pixels`); reference videos follow the same rule.

    None stands for the checkpoint's own rule (768 for the release, the tiny checkpoints' 32); a short edge is
    taken as given, every one alike (768 too), and scales the area cap with it.
    """
    if short_edge is None:
        return rule_short_edge, rule_max_pixels
    return short_edge, rule_max_pixels * short_edge**2 // rule_short_edge**2


def parse_aspect_ratio(text: str) -> tuple[float, float]:
    """Parse ``"W:H"`` (e.g. ``"16:9"``, ``"2.39:1"``) into ``(w, h)``.

    ``"auto"`` is not accepted here: what it means depends on the task (16:9 for T2VA, the keyframe's
    own ratio for FL2VA), so the request layer resolves it before calling this.
    """
    parts = text.strip().split(":")
    if len(parts) != 2:
        raise ValueError(f"aspect ratio must look like 'W:H' (for example '16:9'), got {text!r}")
    try:
        width, height = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"aspect ratio must look like 'W:H' with numbers, got {text!r}") from None
    if not (width > 0 and height > 0) or math.isinf(width) or math.isinf(height):
        raise ValueError(f"aspect ratio sides must be positive finite numbers, got {text!r}")
    return width, height


def snap_frames_up(frames: int) -> int:
    """The smallest valid clip length ``17n + 5`` that is ``>= frames``."""
    if frames < 1:
        raise ValueError(f"frame count must be positive, got {frames}")
    return frames + (VAE_LATENTS_PER_CHUNK - frames) % VAE_FRAMES_PER_CHUNK


def snap_frames_down(frames: int) -> int:
    """The largest valid clip length ``17n + 5`` that is ``<= frames`` (used for video references)."""
    if frames < VAE_LATENTS_PER_CHUNK:
        raise ValueError(f"a clip needs at least {VAE_LATENTS_PER_CHUNK} frames, got {frames}")
    return frames - (frames - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK


def frames_for_duration(seconds: float, fps: int = FPS) -> int:
    """Pixel frames generated for a requested duration: ``round(seconds * fps)`` snapped up to 17n+5.

    The result is usually a little longer than asked (5 s -> 124 frames = 5.167 s).
    """
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"duration must be a positive number of seconds, got {seconds}")
    return snap_frames_up(max(1, round(seconds * fps)))


def video_latent_frames(frames: int) -> int:
    """Latent frames the video VAE produces for a ``17n + 5`` clip: ``5n + 2``."""
    if frames < VAE_LATENTS_PER_CHUNK or frames % VAE_FRAMES_PER_CHUNK != VAE_LATENTS_PER_CHUNK:
        raise ValueError(f"frame count must be of the form 17n + 5, got {frames}")
    return (frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK * VAE_LATENTS_PER_CHUNK + 2


def audio_latent_count(frames: int) -> int:
    """Audio latents per stereo channel covering ``frames`` video frames at 24 fps (40 latents/s).

    The operation order (divide by fps, then multiply) is the reference's; ties cannot occur for
    integer frame counts (frames * 5/3 has fractional part 0, 1/3 or 2/3).
    """
    if frames < 1:
        raise ValueError(f"frame count must be positive, got {frames}")
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


@dataclass(frozen=True)
class Geometry:
    """Every size of one request, in pixels and in latent units.

    ``latent_h`` / ``latent_w`` are in VAE latent cells (not patches); the DiT sees
    ``(latent_h / patch) * (latent_w / patch)`` rows per latent frame (temporal patch is always 1).
    """

    height: int
    width: int
    frames: int
    latent_frames: int
    latent_h: int
    latent_w: int
    audio_latents: int
    patch: int = RELEASED_PATCH

    @property
    def rows_per_frame(self) -> int:
        return (self.latent_h // self.patch) * (self.latent_w // self.patch)

    @property
    def video_rows(self) -> int:
        return self.latent_frames * self.rows_per_frame

    @property
    def audio_rows(self) -> int:
        return AUDIO_CHANNELS * self.audio_latents

    @property
    def duration(self) -> float:
        """Length of the generated video in seconds (of the snapped frame count)."""
        return self.frames / FPS

    @classmethod
    def from_canvas(
        cls,
        height: int,
        width: int,
        frames: int,
        *,
        vae_spatial_ratio: int = RELEASED_VAE_SPATIAL_RATIO,
        patch: int = RELEASED_PATCH,
    ) -> Geometry:
        """Geometry of an already resolved canvas and a ``17n + 5`` frame count."""
        multiple = vae_spatial_ratio * patch
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(
                f"canvas {width}x{height} (WxH) must have positive sides that are multiples of {multiple} "
                f"(VAE spatial ratio {vae_spatial_ratio} x patch {patch})"
            )
        return cls(
            height=height,
            width=width,
            frames=frames,
            latent_frames=video_latent_frames(frames),
            latent_h=height // vae_spatial_ratio,
            latent_w=width // vae_spatial_ratio,
            audio_latents=audio_latent_count(frames),
            patch=patch,
        )

    @classmethod
    def for_request(
        cls,
        aspect: str | tuple[float, float],
        duration_seconds: float,
        *,
        short_edge: int = RELEASED_SHORT_EDGE,
        max_pixels: int = RELEASED_MAX_PIXELS,
        vae_spatial_ratio: int = RELEASED_VAE_SPATIAL_RATIO,
        patch: int = RELEASED_PATCH,
    ) -> Geometry:
        """Geometry of a request given as an aspect ratio ("16:9" or ``(16, 9)``) and a duration."""
        aspect_w, aspect_h = parse_aspect_ratio(aspect) if isinstance(aspect, str) else aspect
        height, width = resolve_canvas(
            aspect_w,
            aspect_h,
            multiple=vae_spatial_ratio * patch,
            short_edge=short_edge,
            max_pixels=max_pixels,
        )
        return cls.from_canvas(
            height,
            width,
            frames_for_duration(duration_seconds),
            vae_spatial_ratio=vae_spatial_ratio,
            patch=patch,
        )


# Rules of the reference conditioning that the memory planner needs too (one definition: h3engine.engine.conditioning
# and h3engine.memory.shapes both read them here).

QWEN_VIDEO_SAMPLE_FPS = 2.0  # the rate the text encoder samples a reference video at


def reference_image_size(width: int, height: int, short_edge: int, multiple: int) -> tuple[int, int]:
    """`(width, height)` of a reference image scaled to `short_edge` (no area cap), each axis rounded to `multiple`."""
    if not MIN_ASPECT_RATIO <= width / height <= MAX_ASPECT_RATIO:
        raise ValueError(f"a reference image must be within 1:4 and 4:1, got {width}x{height}")
    scale = short_edge / min(width, height)
    return (
        max(multiple, round(width * scale / multiple) * multiple),
        max(multiple, round(height * scale / multiple) * multiple),
    )


def reference_video_encode_frames(num_frames: int) -> int:
    """Frames of a reference video the VAE encodes: snapped down to 17n + 5, with n >= 1 (the reference's rule)."""
    chunks = max(1, (num_frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK)
    return chunks * VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


def qwen_video_sampling(
    num_frames: int,
    fps: float = FPS,
    sample_fps: float = QWEN_VIDEO_SAMPLE_FPS,
    temporal_patch: int = 2,
) -> tuple[list[int], list[float]]:
    """Which frames of a `fps` clip the text encoder sees, and the timestamp of each of its temporal blocks.

    Frames `round(m * fps / sample_fps)` (Python rounding, duplicates dropped); the sampled list is padded with its
    last timestamp to a multiple of `temporal_patch` (Qwen repeats the last frame itself), and a block is stamped
    with the mean of its first and last timestamps.
    """
    stride = fps / sample_fps
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < num_frames:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise ValueError(
            f"a reference video needs at least {minimum} frames at {fps:g} fps for the text encoder, got {num_frames}"
        )
    timestamps = [sample / sample_fps for sample in range(len(indices))]
    timestamps += [timestamps[-1]] * (-len(timestamps) % temporal_patch)
    block_timestamps = [
        (timestamps[start] + timestamps[start + temporal_patch - 1]) / 2
        for start in range(0, len(timestamps), temporal_patch)
    ]
    return indices, block_timestamps
