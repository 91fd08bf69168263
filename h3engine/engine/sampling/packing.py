"""The packed DiT sequence: latents <-> rows, row order, modality tags, rotary positions, row timesteps.

One single-stream DiT runs over one packed sequence per request (docs/MODEL.md §3):
    [ text rows (incl. Qwen vision blocks) | condition blocks | target audio | target video ]
Condition blocks are FL2VA keyframes (one latent frame each, on the target canvas) or Ref2VA references in request
order (image -> video rows; audio clip -> audio rows; video clip -> its soundtrack's audio rows, then its video
rows). ``video_index`` / ``audio_index`` list every video / audio row, condition rows first, so the generated rows
are always the tail of each modality.

Positions are fp64 ``(t, h, w)`` rotary coordinates. One rotary unit is 1/40 s, shared by the audio latents
(40/s) and the video latent frames (frame k spans ``5/3 * (1, 4, 4, 4, 4)[k % 5]`` units). The spatial axes are
centred, normalised by the square root of the latent area and scaled by 32. Bit parity of positions depends on
three summation details, each noted where it happens (`_spatial_axis`, `_frame_times`, `_pairwise_clip_span`,
`ref2va_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from h3engine.request.geometry import AUDIO_CHANNELS, Geometry

VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2

# Conditioning rows sit at fixed noise levels ("t", 1 = clean) for the whole loop: visual conditions are
# noised to 0.999 (the released model never saw perfectly clean anchors), reference audio stays clean.
VISUAL_CONDITION_LEVEL = 0.999
AUDIO_CONDITION_LEVEL = 1.0

FRAME_SPAN_UNIT = 5.0 / 3.0
FRAME_SPAN_PATTERN = (1, 4, 4, 4, 4)
SPATIAL_POSITION_SCALE = 32

KeyframeAnchor = Literal["first", "last"]


# --- latents <-> rows -------------------------------------------------------------------------------


def patchify_video(latents: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """``[1, C, T, h, w]`` -> rows ``[T * (h/p) * (w/p), C * p * p]``.

    Rows run frame-major, then patch row, then patch column; features run ``(channel, dy, dx)``.
    """
    if latents.ndim != 5 or latents.shape[0] != 1:
        raise ValueError(f"expected video latents [1, C, T, h, w], got {tuple(latents.shape)}")
    _, channels, frames, height, width = latents.shape
    if height % patch or width % patch:
        raise ValueError(f"latent size {height}x{width} is not divisible by the patch {patch}")
    blocks = latents.reshape(channels, frames, height // patch, patch, width // patch, patch)
    rows = blocks.permute(1, 2, 4, 0, 3, 5)
    return rows.reshape(frames * (height // patch) * (width // patch), channels * patch * patch).contiguous()


def unpatchify_video(
    rows: torch.Tensor, latent_frames: int, latent_h: int, latent_w: int, patch: int = 2
) -> torch.Tensor:
    """Inverse of :func:`patchify_video`: rows -> ``[1, C, T, h, w]``."""
    patch_rows, patch_cols = latent_h // patch, latent_w // patch
    expected_rows = latent_frames * patch_rows * patch_cols
    if rows.ndim != 2 or rows.shape[0] != expected_rows or rows.shape[1] % (patch * patch):
        raise ValueError(
            f"expected [{expected_rows}, C*{patch * patch}] rows for {latent_frames}x{latent_h}x{latent_w} "
            f"latents, got {tuple(rows.shape)}"
        )
    channels = rows.shape[1] // (patch * patch)
    blocks = rows.reshape(latent_frames, patch_rows, patch_cols, channels, patch, patch)
    latents = blocks.permute(3, 0, 1, 4, 2, 5)
    return latents.reshape(1, channels, latent_frames, latent_h, latent_w).contiguous()


def audio_latents_to_rows(latents: torch.Tensor) -> torch.Tensor:
    """Stereo audio latents ``[2, C, A]`` -> channel-major rows ``[2A, C]`` (all left, then all right)."""
    if latents.ndim != 3 or latents.shape[0] != AUDIO_CHANNELS:
        raise ValueError(f"expected audio latents [{AUDIO_CHANNELS}, C, A], got {tuple(latents.shape)}")
    return latents.permute(0, 2, 1).reshape(-1, latents.shape[1]).contiguous()


def rows_to_audio_latents(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`audio_latents_to_rows`: ``[2A, C]`` -> ``[2, C, A]``."""
    if rows.ndim != 2 or rows.shape[0] % AUDIO_CHANNELS:
        raise ValueError(f"expected channel-major audio rows [{AUDIO_CHANNELS}A, C], got {tuple(rows.shape)}")
    return rows.reshape(AUDIO_CHANNELS, -1, rows.shape[1]).permute(0, 2, 1).contiguous()


# --- layout -----------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """The structure of one packed sequence of ``S`` rows (everything but the row contents).

    ``tags`` [S] int64 (0 video, 1 text, 2 audio); ``positions`` [S, 3] float64; ``video_index`` /
    ``audio_index`` / ``text_index`` int64 sequence positions of each modality's rows. The first
    ``num_condition_video_rows`` of ``video_index`` (and ``num_condition_audio_rows`` of ``audio_index``)
    are conditioning rows that the sampler never writes; the rest are generated (target) rows.
    """

    tags: torch.Tensor
    positions: torch.Tensor
    video_index: torch.Tensor
    audio_index: torch.Tensor
    text_index: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int

    @property
    def sequence_length(self) -> int:
        return self.tags.numel()

    @property
    def num_text_rows(self) -> int:
        return self.text_index.numel()

    @property
    def num_target_video_rows(self) -> int:
        return self.video_index.numel() - self.num_condition_video_rows

    @property
    def num_target_audio_rows(self) -> int:
        return self.audio_index.numel() - self.num_condition_audio_rows


@dataclass(frozen=True)
class ImageReference:
    """A Ref2VA image reference, encoded as one latent frame on its own canvas."""

    latent_h: int
    latent_w: int


@dataclass(frozen=True)
class AudioReference:
    """A Ref2VA audio clip with ``audio_latents`` latents per stereo channel."""

    audio_latents: int


@dataclass(frozen=True)
class VideoReference:
    """A Ref2VA video clip on its own canvas; ``audio_latents`` = 0 when it has no soundtrack."""

    latent_frames: int
    latent_h: int
    latent_w: int
    audio_latents: int = 0


ReferenceBlock = ImageReference | AudioReference | VideoReference


def _spatial_axis(extent: int, sqrt_area: float, patch: int) -> torch.Tensor:
    """Patch-centre coordinates along one spatial axis of a latent canvas, float64."""
    span = extent / sqrt_area
    left = (1.0 - span) / 2.0
    # numpy's linspace (start + i * step) is not torch.linspace's formula; the coordinates must match
    # the reference to the last bit, so numpy computes them.
    axis = np.linspace(left, left + span, extent // patch, endpoint=False) * SPATIAL_POSITION_SCALE
    return torch.from_numpy(axis)


@dataclass(frozen=True, eq=False)
class _CanvasGrid:
    """The (h, w) coordinates of every row of one latent frame, and the w axis they came from."""

    frame_hw: torch.Tensor
    width_axis: torch.Tensor

    @classmethod
    def build(cls, latent_h: int, latent_w: int, patch: int) -> _CanvasGrid:
        sqrt_area = float(np.sqrt(latent_h * latent_w))
        height_axis = _spatial_axis(latent_h, sqrt_area, patch)
        width_axis = _spatial_axis(latent_w, sqrt_area, patch)
        return cls(torch.cartesian_prod(height_axis, width_axis), width_axis)


def _frame_span(frame: int) -> float:
    return FRAME_SPAN_UNIT * FRAME_SPAN_PATTERN[frame % len(FRAME_SPAN_PATTERN)]


def _frame_times(latent_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame: ``origin + sum of the earlier spans``, a sequential running sum added to
    the origin in that order (as the reference does; another order changes the last bit)."""
    offsets = [0.0]
    for frame in range(latent_frames - 1):
        offsets.append(offsets[-1] + _frame_span(frame))
    return origin + torch.tensor(offsets, dtype=torch.float64)


def _pairwise_clip_span(latent_frames: int) -> float:
    """Rotary length of a whole clip, summed by numpy (pairwise), as the FL2VA "last" anchor is (the Ref2VA clock
    uses Python's `sum()` instead; the two differ in the last ulp for long clips)."""
    return float(np.array([_frame_span(frame) for frame in range(latent_frames)], dtype=np.float64).sum())


def _video_positions(frame_times: torch.Tensor, grid: _CanvasGrid) -> torch.Tensor:
    rows_per_frame = grid.frame_hw.shape[0]
    positions = torch.empty(frame_times.numel() * rows_per_frame, 3, dtype=torch.float64)
    positions[:, 0] = frame_times.repeat_interleave(rows_per_frame)
    positions[:, 1:] = grid.frame_hw.repeat(frame_times.numel(), 1)
    return positions


def _audio_positions(origin: float, audio_latents: int, width_axis: torch.Tensor) -> torch.Tensor:
    """Channel-major audio rows: time ``origin + j``, no height, w pinned to the block's w-axis ends
    (left channel at the first coordinate, right channel at the last)."""
    positions = torch.zeros(AUDIO_CHANNELS * audio_latents, 3, dtype=torch.float64)
    positions[:, 0] = (origin + torch.arange(audio_latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    positions[:audio_latents, 2] = width_axis[0]
    positions[audio_latents:, 2] = width_axis[-1]
    return positions


class _SequenceAssembler:
    """Collects row blocks in sequence order and turns them into a :class:`PackedLayout`."""

    def __init__(self, text_tags: torch.Tensor) -> None:
        if text_tags.ndim != 1 or text_tags.dtype.is_floating_point or text_tags.dtype == torch.bool:
            raise ValueError("text_tags must be a 1-D integer tensor")
        if not bool(((text_tags == TEXT_TAG) | (text_tags == VIDEO_TAG)).all()):
            raise ValueError("text rows are tagged 1 (text) or 0 (Qwen vision block rows) only")
        num_text_rows = text_tags.numel()
        text_positions = torch.zeros(num_text_rows, 3, dtype=torch.float64)
        text_positions[:, 0] = torch.arange(num_text_rows, dtype=torch.float64)
        self._text_tags = text_tags.to(torch.long)
        self._position_blocks = [text_positions]
        self._length = num_text_rows
        self._video_ranges: list[torch.Tensor] = []
        self._audio_ranges: list[torch.Tensor] = []
        self._condition_video_rows = 0
        self._condition_audio_rows = 0

    @property
    def num_text_rows(self) -> int:
        return self._text_tags.numel()

    def _append(self, positions: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(self._length, self._length + positions.shape[0])
        self._position_blocks.append(positions)
        self._length += positions.shape[0]
        return rows

    def add_video(self, positions: torch.Tensor, *, condition: bool) -> None:
        self._video_ranges.append(self._append(positions))
        if condition:
            self._condition_video_rows += positions.shape[0]

    def add_audio(self, positions: torch.Tensor, *, condition: bool) -> None:
        self._audio_ranges.append(self._append(positions))
        if condition:
            self._condition_audio_rows += positions.shape[0]

    def add_targets(self, geometry: Geometry, grid: _CanvasGrid, origin: float) -> None:
        """The generated rows: target audio then target video, both starting at ``origin``."""
        self.add_audio(_audio_positions(origin, geometry.audio_latents, grid.width_axis), condition=False)
        self.add_video(_video_positions(_frame_times(geometry.latent_frames, origin), grid), condition=False)

    def finish(self) -> PackedLayout:
        empty = torch.empty(0, dtype=torch.long)
        video_index = torch.cat(self._video_ranges) if self._video_ranges else empty
        audio_index = torch.cat(self._audio_ranges) if self._audio_ranges else empty
        text_index = torch.arange(self.num_text_rows)
        tags = torch.empty(self._length, dtype=torch.long)
        tags[text_index] = self._text_tags
        tags[video_index] = VIDEO_TAG
        tags[audio_index] = AUDIO_TAG
        return PackedLayout(
            tags=tags,
            positions=torch.cat(self._position_blocks),
            video_index=video_index,
            audio_index=audio_index,
            text_index=text_index,
            num_condition_video_rows=self._condition_video_rows,
            num_condition_audio_rows=self._condition_audio_rows,
        )


def _target_grid(geometry: Geometry) -> _CanvasGrid:
    return _CanvasGrid.build(geometry.latent_h, geometry.latent_w, geometry.patch)


def t2va_layout(text_tags: torch.Tensor, geometry: Geometry) -> PackedLayout:
    """Layout of a text-only request: ``[text | target audio | target video]``, media clock at L."""
    return fl2va_layout(text_tags, geometry, ())


def fl2va_layout(
    text_tags: torch.Tensor, geometry: Geometry, keyframe_anchors: Sequence[KeyframeAnchor]
) -> PackedLayout:
    """Layout with keyframe condition rows: ``[text | keyframes | target audio | target video]``.

    Each keyframe is one latent frame on the target canvas grid, in the order given. A "first" keyframe
    sits at rotary time L (the first target frame); a "last" one at the time of the final *pixel* frame,
    ``L + (whole clip span, pairwise sum) - 5/3``.
    """
    assembler = _SequenceAssembler(text_tags)
    grid = _target_grid(geometry)
    origin = float(assembler.num_text_rows)
    for anchor in keyframe_anchors:
        if anchor == "first":
            anchor_time = origin
        elif anchor == "last":
            anchor_time = origin + _pairwise_clip_span(geometry.latent_frames) - FRAME_SPAN_UNIT
        else:
            raise ValueError(f"a keyframe anchor is 'first' or 'last', got {anchor!r}")
        assembler.add_video(
            _video_positions(torch.tensor([anchor_time], dtype=torch.float64), grid), condition=True
        )
    assembler.add_targets(geometry, grid, origin)
    return assembler.finish()


def ref2va_layout(
    text_tags: torch.Tensor, geometry: Geometry, references: Sequence[ReferenceBlock]
) -> PackedLayout:
    """Layout of a reference request: ``[text | reference blocks in request order | target audio | video]``.

    A running rotary clock starts at L; each reference occupies the clock from its current value and
    pushes it forward (image: 1 unit; audio: its latent count; video: the longer of its soundtrack and its
    frame span). The targets start where the last reference left the clock. Reference canvases use their
    own spatial grids; a standalone audio clip is pinned to the *target* grid's w extremes, a soundtrack
    to its video's.
    """
    assembler = _SequenceAssembler(text_tags)
    target_grid = _target_grid(geometry)
    clock = float(assembler.num_text_rows)
    for reference in references:
        if isinstance(reference, ImageReference):
            grid = _CanvasGrid.build(reference.latent_h, reference.latent_w, geometry.patch)
            assembler.add_video(
                _video_positions(torch.tensor([clock], dtype=torch.float64), grid), condition=True
            )
            # A still image takes one integer rotary slot, not a latent frame's span.
            clock += 1.0
        elif isinstance(reference, AudioReference):
            positions = _audio_positions(clock, reference.audio_latents, target_grid.width_axis)
            assembler.add_audio(positions, condition=True)
            clock += float(reference.audio_latents)
        elif isinstance(reference, VideoReference):
            grid = _CanvasGrid.build(reference.latent_h, reference.latent_w, geometry.patch)
            if reference.audio_latents:
                positions = _audio_positions(clock, reference.audio_latents, grid.width_axis)
                assembler.add_audio(positions, condition=True)
            assembler.add_video(
                _video_positions(_frame_times(reference.latent_frames, clock), grid), condition=True
            )
            # Python's built-in sum() on purpose, as the reference: a plain left-to-right sum up to Python 3.11, a
            # compensated (Neumaier) one from 3.12 on, so this clock depends on the interpreter like the reference's.
            clip_span = sum(_frame_span(frame) for frame in range(reference.latent_frames))
            clock += max(float(reference.audio_latents), clip_span)
        else:
            raise TypeError(f"unknown reference block {reference!r}")
    assembler.add_targets(geometry, target_grid, clock)
    return assembler.finish()


# --- per-row timesteps ------------------------------------------------------------------------------


def row_timesteps(
    layout: PackedLayout,
    t_video: float | torch.Tensor,
    t_audio: float | torch.Tensor,
    *,
    visual_condition_level: float = VISUAL_CONDITION_LEVEL,
    audio_condition_level: float = AUDIO_CONDITION_LEVEL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT's ``(timesteps [M] fp32 ascending, timestep_index [S] int64)`` for one step.

    Target video rows and *text* rows take ``t_video``; target audio rows ``t_audio``; visual condition
    rows ``max(t_video, visual_condition_level)``; reference audio rows ``max(t_audio, audio_condition_level)``.
    The max is taken in float64 and then stored in fp32, as the reference does.
    """
    video_t, audio_t = float(t_video), float(t_audio)
    per_row = torch.full((layout.sequence_length,), video_t, dtype=torch.float32)
    condition_video = layout.video_index[: layout.num_condition_video_rows]
    per_row[condition_video] = max(video_t, visual_condition_level)
    per_row[layout.audio_index[layout.num_condition_audio_rows :]] = audio_t
    per_row[layout.audio_index[: layout.num_condition_audio_rows]] = max(audio_t, audio_condition_level)
    timesteps, timestep_index = torch.unique(per_row, sorted=True, return_inverse=True)
    return timesteps, timestep_index
