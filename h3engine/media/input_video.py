"""The video stream of a user's file as `load_video` (h3engine.media.inputs) reads it: the stream's checks
(codec, frame size, frame rate) and `FrameHolder`, which puts the decoded frames on the model's 24 fps clock.
"""

from __future__ import annotations

import math
import os
from typing import Any

import av
import numpy as np
from PIL import Image

from h3engine.errors import RequestError
from h3engine.media.input_files import INDEX_EPSILON, check_not_short, first_index_at, stream_seconds

MODEL_FPS = 24
# DCI 4K (4096 x 2160) and UHD fit; a 15 s window of such frames is still ~10 GB as uint8, which is why
# `load_video` can resize while it decodes.
MAX_VIDEO_FRAME_PIXELS = 4096 * 2304
MAX_VIDEO_FPS = 240.0
MAX_VIDEO_OUTPUT_BYTES = 12 * 1024**3
# FFmpeg codec names (the codec, not the decoder: "mp3" rather than "mp3float").
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mjpeg", "prores"})


class FrameHolder:
    """Collects decoded frames onto the 24 fps clock by frame holding, one frame at a time."""

    def __init__(
        self,
        stream: Any,
        path: str | os.PathLike[str],
        start_seconds: float,
        max_seconds: float,
        resize_to: tuple[int, int] | None,
    ) -> None:
        self.stream = stream
        self.path = path
        self.fps = frame_rate(stream, path)
        # Same float64 operations as the reference's `np.arange(F) * (24 / fps) + 0.5`, so the slots agree.
        self.scale = MODEL_FPS / self.fps
        self.first_index = first_index_at(start_seconds, self.fps)
        self.output_frames = math.floor(max_seconds * MODEL_FPS + INDEX_EPSILON)
        self.resize_to = resize_to
        self.decoded = 0
        self.done = False
        self.held: list[np.ndarray] = []
        self.source_shape: tuple[int, ...] | None = None

    def add(self, frame: av.VideoFrame) -> None:
        if frame.width * frame.height > MAX_VIDEO_FRAME_PIXELS:
            raise RequestError.about_file(self.path, _frame_size_problem(frame.width, frame.height))
        index = self.decoded - self.first_index
        self.decoded += 1
        if index < 0:
            return
        first_slot = self._slot(index)
        end_slot = min(self._slot(index + 1), self.output_frames)
        if end_slot >= self.output_frames:
            self.done = True
        if end_slot <= first_slot:
            return
        pixels = self._pixels(frame)
        if (end_slot * pixels.nbytes) > MAX_VIDEO_OUTPUT_BYTES:
            raise RequestError.about_file(
                self.path,
                f"{end_slot} frames of {pixels.shape[1]}x{pixels.shape[0]} pixels exceed "
                f"the {MAX_VIDEO_OUTPUT_BYTES:,}-byte limit; read a shorter window or resize while decoding",
            )
        self.held.extend([pixels] * (end_slot - first_slot))

    def _slot(self, index: int) -> int:
        return math.floor(index * self.scale + 0.5)

    def _pixels(self, frame: av.VideoFrame) -> np.ndarray:
        pixels = frame.to_ndarray(format="rgb24")
        # The display matrix rotates counterclockwise; turning back by whole quarter turns shows it upright.
        quarter_turns = round(frame.rotation / 90.0) % 4
        if quarter_turns:
            pixels = np.ascontiguousarray(np.rot90(pixels, k=-quarter_turns))
        if self.source_shape is None:
            self.source_shape = pixels.shape
        elif pixels.shape != self.source_shape:
            raise RequestError.about_file(
                self.path,
                f"frame size changes mid-stream "
                f"({self.source_shape[1]}x{self.source_shape[0]} to {pixels.shape[1]}x{pixels.shape[0]})",
            )
        if self.resize_to is not None and (pixels.shape[1], pixels.shape[0]) != self.resize_to:
            pixels = np.asarray(Image.fromarray(pixels).resize(self.resize_to, Image.Resampling.LANCZOS))
        return pixels

    def check_complete(self) -> None:
        declared = stream_seconds(self.stream)
        if declared is not None:
            check_not_short(self.path, "video", self.decoded / self.fps, declared)

    def frames(self) -> np.ndarray:
        if not self.held:
            raise RequestError.about_file(
                self.path,
                "no video frames to use"
                + (" after start_seconds" if self.first_index and self.decoded else ""),
            )
        return np.stack(self.held)


def frame_rate(stream: Any, path: str | os.PathLike[str]) -> float:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate is not None else math.nan
    if not (0.0 < fps <= MAX_VIDEO_FPS):
        raise RequestError.about_file(
            path, f"video frame rate must be within (0, {MAX_VIDEO_FPS:g}], got {fps:g}"
        )
    return fps


def first_video_stream(container: Any, path: str | os.PathLike[str]) -> Any | None:
    if not container.streams.video:
        return None
    stream = container.streams.video[0]
    codec = stream.codec_context.codec.canonical_name
    if codec not in VIDEO_CODECS:
        supported = ", ".join(sorted(VIDEO_CODECS))
        raise RequestError.about_file(
            path, f"video codec {codec!r} is not supported (supported: {supported})"
        )
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > MAX_VIDEO_FRAME_PIXELS:
        raise RequestError.about_file(path, _frame_size_problem(width, height))
    return stream


def _frame_size_problem(width: int, height: int) -> str:
    return f"video frames have {width}x{height} pixels, more than the limit of {MAX_VIDEO_FRAME_PIXELS:,}"


def check_resize_target(resize_to: Any) -> None:
    # A programming error of the caller, not a property of the user's file.
    if (
        not isinstance(resize_to, tuple)
        or len(resize_to) != 2
        or not all(isinstance(side, int) and side > 0 for side in resize_to)
        or resize_to[0] * resize_to[1] > MAX_VIDEO_FRAME_PIXELS
    ):
        raise ValueError(f"resize_to must be a (width, height) tuple of positive ints, got {resize_to!r}")
