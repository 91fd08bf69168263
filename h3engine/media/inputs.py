"""Read the media a request conditions on: keyframe and reference images, reference videos with their
soundtrack, and reference audio clips.

`load_image`, `load_video`, `load_audio` / `read_audio_source` decode as the reference loaders do (their
docstrings hold each rule: EXIF orientation, the 24 fps frame holding, the audio window and resampling);
`probe_media` reads headers only and is what `request.validate` takes as `media_durations`. `start_seconds` is
our extension: a window that begins there behaves like a clip that begins there.

Every failure due to the file or the window, whatever the library raised, is a `RequestError` about the file
(`RequestError.about_file`: the caller files it under its request field); nothing is written. Danger: decoders
stop where the data stops, mostly silently (a truncated WAV or MP3 decodes into a shorter clip), so a stream read
to its end must reach the length its container declares (`_check_not_short`) and an Ogg file must end exactly on a
page boundary (`_check_ogg_ends_on_page`).
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, BinaryIO

import av
import numpy as np
from av.audio.resampler import AudioResampler
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from h3engine.errors import RequestError, file_name
from h3engine.media.formats import FORMATS
from h3engine.request.files import Keyframe, MediaInfo, Reference
from h3engine.request.limits import MAX_MEDIA_SECONDS
from h3engine.request.model import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, MIN_IMAGE_SIDE

MODEL_FPS = 24
MODEL_SAMPLE_RATE = 32_000
MODEL_CHANNELS = 2

MAX_FILE_BYTES = 2 * 1024**3
# DCI 4K (4096 x 2160) and UHD fit; a 15 s window of such frames is still ~10 GB as uint8, which is why
# `load_video` can resize while it decodes.
MAX_VIDEO_FRAME_PIXELS = 4096 * 2304
MAX_VIDEO_FPS = 240.0
MAX_VIDEO_OUTPUT_BYTES = 12 * 1024**3
MIN_SAMPLE_RATE = 4_000
MAX_SAMPLE_RATE = 384_000
MAX_SOURCE_CHANNELS = 2

# The formats themselves live in h3engine.media.formats (one table for the loaders, the app's pickers and the CLI).
IMAGE_FORMATS = FORMATS["image"].content
_IMAGE_FORMATS_AS_OPENED = FORMATS["image"].detected
VIDEO_CONTAINERS = FORMATS["video"].detected
AUDIO_CONTAINERS = FORMATS["audio"].detected
# FFmpeg codec names (the codec, not the decoder: "mp3" rather than "mp3float").
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mjpeg", "prores"})
AUDIO_CODECS = frozenset({"flac", "vorbis", "opus", "mp3", "aac", "alac"})
AUDIO_CODEC_PREFIXES = ("pcm_",)

# A stream read to its end may fall this short of its declared duration before it counts as truncated
# (container durations are rounded to their time base; AAC and MP3 frames are ~20-70 ms).
TRUNCATION_TOLERANCE_SECONDS = 0.05
TRUNCATION_TOLERANCE_FRACTION = 0.02
# `start_seconds * rate` of a start time typed in decimal lands a hair above the integer it means (0.1 s at
# 30 fps is 3.0000000000000004 frames); such a frame must still be kept.
_INDEX_EPSILON = 1e-6
_OGG_PAGE_HEADER_BYTES = 27
_OGG_MAX_PAGE_BYTES = _OGG_PAGE_HEADER_BYTES + 255 + 255 * 255


@dataclass(frozen=True, eq=False)
class SourceAudio:
    """Audio as decoded: float32 [channels, samples] at the file's own sample rate."""

    samples: np.ndarray
    sample_rate: int


@dataclass(frozen=True, eq=False)
class LoadedAudio:
    """Audio ready for the audio VAE, float32 [2, samples] at 32 kHz, and the source-rate window it came from
    (for a caller that resamples with another resampler)."""

    samples: np.ndarray
    source: SourceAudio

    @property
    def source_rate(self) -> int:
        return self.source.sample_rate

    @property
    def source_channels(self) -> int:
        return self.source.samples.shape[0]

    @property
    def duration_seconds(self) -> float:
        """Length of the source window that was read."""
        return self.source.samples.shape[1] / self.source.sample_rate


@dataclass(frozen=True, eq=False)
class LoadedVideo:
    """Frames uint8 [F, H, W, 3] RGB at 24 fps (`duration_seconds` = F / 24) and the soundtrack, if any."""

    frames: np.ndarray
    source_fps: float
    duration_seconds: float
    soundtrack: LoadedAudio | None


# ---------------------------------------------------------------------------------------------------------------
# Images


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """An upright RGB image from a JPEG, PNG or WEBP file; `RequestError` naming the file otherwise.

    Recognised by content, never by extension. Turned upright by its EXIF orientation with `ImageOps.exif_transpose`,
    then `convert("RGB")`: the order and calls of the reference loader (an alpha channel is dropped, not composited).
    Animated files give their first frame. The size is checked from the header, before anything is decoded, against
    the model's image bounds (`h3engine.request`: `MIN_IMAGE_SIDE`, `MAX_IMAGE_SIDE`, `MAX_IMAGE_PIXELS`).
    """
    with _opened(path, "image") as file, _decoding(path, "image"):
        image = _open_image_header(file, path)
        upright = ImageOps.exif_transpose(image)
        return upright.convert("RGB")


def _open_image_header(
    file: BinaryIO, path: str | os.PathLike[str], *, check_size: bool = True
) -> Image.Image:
    try:
        image = Image.open(file, formats=list(IMAGE_FORMATS))
    except UnidentifiedImageError as error:
        raise RequestError.about_file(path, f"not {FORMATS['image'].describe()}") from error
    except Image.DecompressionBombError as error:
        raise RequestError.about_file(path, f"image is too large ({error})") from error
    if image.format not in _IMAGE_FORMATS_AS_OPENED:
        raise RequestError.about_file(path, f"not {FORMATS['image'].describe()} (found {image.format})")
    width, height = image.size
    if check_size and min(width, height) < MIN_IMAGE_SIDE:
        raise RequestError.about_file(
            path, f"image has {width}x{height} pixels; each side must be at least {MIN_IMAGE_SIDE}"
        )
    if check_size and not _image_fits(width, height):
        raise RequestError.about_file(
            path,
            f"image has {width}x{height} pixels; at most {MAX_IMAGE_SIDE} pixels a side and "
            f"{MAX_IMAGE_PIXELS:,} in all are read",
        )
    return image


def _image_fits(width: int, height: int) -> bool:
    return max(width, height) <= MAX_IMAGE_SIDE and width * height <= MAX_IMAGE_PIXELS


def _upright_image_size(image: Image.Image) -> tuple[int, int]:
    # The orientations that `exif_transpose` turns by a quarter turn (transpose, 270, transverse, 90).
    orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    width, height = image.size
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


# ---------------------------------------------------------------------------------------------------------------
# Video


def load_video(
    path: str | os.PathLike[str],
    start_seconds: float = 0.0,
    max_seconds: float = 15.0,
    *,
    resize_to: tuple[int, int] | None = None,
) -> LoadedVideo:
    """The video's frames on the 24 fps clock from `start_seconds`, at most `max_seconds` of them, and its
    soundtrack over the same window. `resize_to=(width, height)` resizes each frame with PIL LANCZOS.

    Frames: the first video stream as uint8 [F, H, W, 3] RGB, upright by the stream's display rotation; the
    soundtrack is the first audio stream as a `LoadedAudio`, or None. The 24 fps clock is the reference's frame
    holding: with `scale = 24 / fps`, source frame j (counted from the first kept frame) fills output slots
    `floor(j * scale + 0.5)` up to `floor((j + 1) * scale + 0.5)`; a frame whose slots coincide is dropped, one whose
    slots span several is repeated. `fps` is the container's average frame rate (or FFmpeg's guess), as in the
    reference; timestamps are not consulted. The output is cut to `floor(max_seconds * 24)` frames. Resizing each kept
    frame (LANCZOS) is what the reference does after holding and cutting, so doing it per frame gives the same pixels
    while holding only canvas-sized frames. The first kept frame is the first whose nominal time `index / fps` is not
    before `start_seconds`, the first kept sample the first whose `index / rate` is not.
    """
    _check_window(path, start_seconds, max_seconds, open_end_allowed=False)
    if resize_to is not None:
        _check_resize_target(resize_to)
    with _opened(path, "video") as file, _decoding(path, "video"), av.open(file) as container:
        _check_container(container, VIDEO_CONTAINERS, path, "video")
        video_stream = _video_stream(container, path)
        if video_stream is None:
            raise RequestError.about_file(path, "has no video stream")
        holder = _FrameHolder(video_stream, path, start_seconds, max_seconds, resize_to)
        collectors: list[_FrameHolder | _AudioCollector] = [holder]
        audio_stream = _audio_stream(container, path)
        soundtrack = None
        if audio_stream is not None:
            soundtrack = _AudioCollector(audio_stream, path, start_seconds, max_seconds)
            collectors.append(soundtrack)
        _decode_streams(container, collectors, path)
        frames = holder.frames()
        source_fps = holder.fps
        source_audio = soundtrack.source_audio("soundtrack") if soundtrack is not None else None
    loaded_soundtrack = None if source_audio is None else _model_audio(source_audio, path, "soundtrack")
    return LoadedVideo(
        frames=frames,
        source_fps=source_fps,
        duration_seconds=frames.shape[0] / MODEL_FPS,
        soundtrack=loaded_soundtrack,
    )


class _FrameHolder:
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
        self.fps = _frame_rate(stream, path)
        # Same float64 operations as the reference's `np.arange(F) * (24 / fps) + 0.5`, so the slots agree.
        self.scale = MODEL_FPS / self.fps
        self.first_index = _first_index_at(start_seconds, self.fps)
        self.output_frames = math.floor(max_seconds * MODEL_FPS + _INDEX_EPSILON)
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
        declared = _stream_seconds(self.stream)
        if declared is not None:
            _check_not_short(self.path, "video", self.decoded / self.fps, declared)

    def frames(self) -> np.ndarray:
        if not self.held:
            raise RequestError.about_file(
                self.path,
                "no video frames to use"
                + (" after start_seconds" if self.first_index and self.decoded else ""),
            )
        return np.stack(self.held)


def _frame_rate(stream: Any, path: str | os.PathLike[str]) -> float:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate is not None else math.nan
    if not (0.0 < fps <= MAX_VIDEO_FPS):
        raise RequestError.about_file(
            path, f"video frame rate must be within (0, {MAX_VIDEO_FPS:g}], got {fps:g}"
        )
    return fps


def _video_stream(container: Any, path: str | os.PathLike[str]) -> Any | None:
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


def _check_resize_target(resize_to: Any) -> None:
    # A programming error of the caller, not a property of the user's file.
    if (
        not isinstance(resize_to, tuple)
        or len(resize_to) != 2
        or not all(isinstance(side, int) and side > 0 for side in resize_to)
        or resize_to[0] * resize_to[1] > MAX_VIDEO_FRAME_PIXELS
    ):
        raise ValueError(f"resize_to must be a (width, height) tuple of positive ints, got {resize_to!r}")


# ---------------------------------------------------------------------------------------------------------------
# Audio


def read_audio_source(
    path: str | os.PathLike[str], start_seconds: float = 0.0, max_seconds: float | None = None
) -> SourceAudio:
    """The first audio stream's window `[start_seconds, start_seconds + max_seconds)` (to the end when
    `max_seconds` is None) as float32 [channels, samples] at the file's own rate, mono or stereo.

    Every audio file is decoded by PyAV, as the reference does. WAV, FLAC, Ogg (Vorbis, Opus), MP3, AAC (ADTS) and
    M4A/MP4 are accepted; a video file (MP4/MOV, Matroska/WebM, AVI) lends its first audio stream. The window is cut
    at the source rate, keeping `int(max_seconds * rate)` samples (the reference truncates there, before it resamples
    once). More than two channels are refused, as the reference refuses them (there is no downmix).
    """
    _check_window(path, start_seconds, max_seconds, open_end_allowed=True)
    with _opened(path, "audio") as file, _decoding(path, "audio"), av.open(file) as container:
        _check_container(container, AUDIO_CONTAINERS, path, "audio")
        stream = _audio_stream(container, path)
        if stream is None:
            raise RequestError.about_file(path, "has no audio stream")
        collector = _AudioCollector(stream, path, start_seconds, max_seconds)
        _decode_streams(container, [collector], path)
        if container.format.name == "ogg" and not collector.done:
            _check_ogg_ends_on_page(file, path)
        return collector.source_audio("audio")


def load_audio(
    path: str | os.PathLike[str], start_seconds: float = 0.0, max_seconds: float | None = None
) -> LoadedAudio:
    """`read_audio_source`'s window as stereo float32 [2, samples] at 32 kHz.

    Mono is duplicated to stereo, then resampled to 32 kHz with PyAV's `AudioResampler` and fitted to exactly
    `ceil(n * 32000 / rate)` samples, the output length of the reference's resampler.
    """
    return _model_audio(read_audio_source(path, start_seconds, max_seconds), path, "audio")


def resample_audio(samples: np.ndarray, source_rate: int, target_rate: int = MODEL_SAMPLE_RATE) -> np.ndarray:
    """Float32 [channels, n] (1 or 2 channels) at `source_rate` to [channels, ceil(n * target / source)] at
    `target_rate`, with PyAV's resampler (FFmpeg's swresample); unchanged when the rates are equal.

    swresample delivers `round(n * target / source)` samples once flushed; the reference's resampler delivers the
    ceiling, so a missing last sample is zero-padded.
    """
    if samples.ndim != 2 or samples.shape[0] not in (1, 2) or samples.dtype != np.float32:
        raise ValueError(f"samples must be float32 [1 or 2, n], got {samples.dtype} {tuple(samples.shape)}")
    if source_rate == target_rate:
        return samples
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    resampler = AudioResampler(format="fltp", layout=layout, rate=target_rate)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate = source_rate
    chunks = [out.to_ndarray() for out in resampler.resample(frame)]
    chunks += [out.to_ndarray() for out in resampler.resample(None)]
    resampled = np.concatenate(chunks, axis=1) if chunks else np.zeros((samples.shape[0], 0), np.float32)
    length = -(-samples.shape[1] * target_rate // source_rate)
    if resampled.shape[1] >= length:
        return np.ascontiguousarray(resampled[:, :length])
    return np.pad(resampled, ((0, 0), (0, length - resampled.shape[1])))


def _model_audio(source: SourceAudio, path: str | os.PathLike[str], what: str) -> LoadedAudio:
    with _decoding(path, what):
        samples = resample_audio(source.samples, source.sample_rate)
    if not np.isfinite(samples).all():
        raise RequestError.about_file(path, f"{what} overflows when resampled (samples too large)")
    if source.samples.shape[0] == 1:
        samples = np.repeat(samples, MODEL_CHANNELS, axis=0)
    return LoadedAudio(samples=samples, source=source)


class _AudioCollector:
    """Keeps the window of one audio stream as planar float32 at the stream's own rate, frame by frame."""

    def __init__(
        self, stream: Any, path: str | os.PathLike[str], start_seconds: float, max_seconds: float | None
    ) -> None:
        self.stream = stream
        self.path = path
        self.sample_rate = int(stream.codec_context.sample_rate)
        # Format conversion only (same rate and layout), exactly the reference's: decoders differ in the sample
        # format they emit (s16, s32, fltp), and the model reads floats.
        self.converter = AudioResampler(format="fltp", layout=stream.layout, rate=self.sample_rate)
        self.first_sample = _first_index_at(start_seconds, self.sample_rate)
        window = MAX_MEDIA_SECONDS - start_seconds if max_seconds is None else max_seconds
        self.end_sample = self.first_sample + int(window * self.sample_rate)
        self.window_is_whole_file = max_seconds is None
        self.position = 0
        self.done = False
        self.chunks: list[np.ndarray] = []

    def add(self, frame: av.AudioFrame) -> None:
        for converted in self.converter.resample(frame):
            self._keep(converted.to_ndarray())

    def flush(self) -> None:
        for converted in self.converter.resample(None):
            self._keep(converted.to_ndarray())

    def _keep(self, chunk: np.ndarray) -> None:
        begin = self.position
        self.position += chunk.shape[1]
        if self.position > self.end_sample and self.window_is_whole_file:
            raise RequestError.about_file(
                self.path, f"audio lasts longer than {MAX_MEDIA_SECONDS:g} s; only a window of it can be read"
            )
        low = max(self.first_sample - begin, 0)
        high = min(self.end_sample - begin, chunk.shape[1])
        if high > low:
            self.chunks.append(chunk[:, low:high])
        if self.position >= self.end_sample and not self.window_is_whole_file:
            self.done = True

    def check_complete(self) -> None:
        declared = _stream_seconds(self.stream)
        if declared is not None:
            _check_not_short(self.path, "audio", self.position / self.sample_rate, declared)

    def source_audio(self, what: str) -> SourceAudio:
        if not self.chunks:
            raise RequestError.about_file(
                self.path,
                f"{what} has no samples"
                + (" after start_seconds" if self.first_sample and self.position else ""),
            )
        samples = np.concatenate(self.chunks, axis=1)
        if not np.isfinite(samples).all():
            raise RequestError.about_file(self.path, f"{what} contains NaN or infinite samples")
        return SourceAudio(samples=samples, sample_rate=self.sample_rate)


def _audio_stream(container: Any, path: str | os.PathLike[str]) -> Any | None:
    if not container.streams.audio:
        return None
    stream = container.streams.audio[0]
    context = stream.codec_context
    codec = context.codec.canonical_name
    if codec not in AUDIO_CODECS and not codec.startswith(AUDIO_CODEC_PREFIXES):
        raise RequestError.about_file(
            path,
            f"audio codec {codec!r} is not supported (supported: {', '.join(sorted(AUDIO_CODECS))}, PCM)",
        )
    if not MIN_SAMPLE_RATE <= context.sample_rate <= MAX_SAMPLE_RATE:
        raise RequestError.about_file(
            path,
            f"audio sample rate must be within {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz, "
            f"got {context.sample_rate}",
        )
    if not 1 <= context.channels <= MAX_SOURCE_CHANNELS:
        raise RequestError.about_file(
            path, f"audio has {context.channels} channels; only mono and stereo are supported"
        )
    return stream


def _check_ogg_ends_on_page(file: BinaryIO, path: str | os.PathLike[str]) -> None:
    """Refuse an Ogg file whose last page is cut off (RFC 3533 page header: 27 bytes, lacing table, body).

    Neither FFmpeg nor libsndfile reports an Ogg file cut inside its last page.
    """
    size = file.seek(0, os.SEEK_END)
    tail_start = max(0, size - _OGG_MAX_PAGE_BYTES)
    file.seek(tail_start)
    tail = file.read()
    page = tail.rfind(b"OggS")
    if page >= 0 and page + _OGG_PAGE_HEADER_BYTES <= len(tail):
        segment_count = tail[page + _OGG_PAGE_HEADER_BYTES - 1]
        lacing = tail[page + _OGG_PAGE_HEADER_BYTES : page + _OGG_PAGE_HEADER_BYTES + segment_count]
        page_end = page + _OGG_PAGE_HEADER_BYTES + segment_count + sum(lacing)
        if len(lacing) == segment_count and page_end == len(tail):
            return
    raise RequestError.about_file(path, "the Ogg file is truncated (its last page is incomplete)")


# ---------------------------------------------------------------------------------------------------------------
# Probing (request validation)


def probe_media(reference: Reference | Keyframe) -> MediaInfo:
    """Size, duration and audio presence of a reference or keyframe file (keyframes are images), from headers.

    A video is probed as its first video stream (upright size, via its first decoded frame) and its soundtrack;
    an audio file as its first audio stream. A file of the right family without the stream its kind needs
    (an audio-only MP4 as a video) is reported as such (no size / `has_audio=False`) for `validate` to refuse
    under the field's name.

    An image outside the size bounds is reported at its stored size, without reading its EXIF orientation (Pillow
    decodes a whole PNG to find it); the bounds do not depend on the orientation. A video's duration is the shorter of
    its video and soundtrack durations, so that `validate`'s start-time and duration rules hold for both streams.
    """
    kind = "image" if isinstance(reference, Keyframe) else getattr(reference, "kind", None)
    path = getattr(reference, "path", None)
    if kind == "image":
        return _probe_image(path)
    if kind == "video":
        return _probe_video(path)
    if kind == "audio":
        return _probe_audio(path)
    raise RequestError.about_file(path, f"cannot probe media of kind {kind!r}")


def _probe_image(path: Any) -> MediaInfo:
    with _opened(path, "image") as file, _decoding(path, "image"):
        image = _open_image_header(file, path, check_size=False)
        width, height = image.size
        if min(width, height) >= MIN_IMAGE_SIDE and _image_fits(width, height):
            width, height = _upright_image_size(image)
    return MediaInfo(duration_seconds=None, has_audio=False, width=width, height=height)


def _probe_video(path: Any) -> MediaInfo:
    with _opened(path, "video") as file, _decoding(path, "video"), av.open(file) as container:
        _check_container(container, VIDEO_CONTAINERS, path, "video")
        video_stream = _video_stream(container, path)
        audio_stream = _audio_stream(container, path)
        if video_stream is None:
            return MediaInfo(
                duration_seconds=_declared_seconds(audio_stream, container) if audio_stream else None,
                has_audio=audio_stream is not None,
                width=None,
                height=None,
            )
        _frame_rate(video_stream, path)
        first_frame = next(container.decode(video_stream), None)
        if first_frame is None:
            raise RequestError.about_file(path, "has no decodable video frame")
        quarter_turns = round(first_frame.rotation / 90.0) % 4
        width, height = first_frame.width, first_frame.height
        if quarter_turns % 2:
            width, height = height, width
        durations = [
            _declared_seconds(stream, container)
            for stream in (video_stream, audio_stream)
            if stream is not None
        ]
        known = [seconds for seconds in durations if seconds is not None]
    return MediaInfo(
        duration_seconds=min(known) if known else None,
        has_audio=audio_stream is not None,
        width=width,
        height=height,
    )


def _probe_audio(path: Any) -> MediaInfo:
    with _opened(path, "audio") as file, _decoding(path, "audio"), av.open(file) as container:
        _check_container(container, AUDIO_CONTAINERS, path, "audio")
        stream = _audio_stream(container, path)
        duration = _declared_seconds(stream, container) if stream is not None else None
    return MediaInfo(duration_seconds=duration, has_audio=stream is not None, width=None, height=None)


# ---------------------------------------------------------------------------------------------------------------
# Shared by the readers


@contextlib.contextmanager
def _opened(path: Any, what: str) -> Iterator[BinaryIO]:
    """The file opened for reading, after checking that it is a non-empty regular file within the size limit.

    O_NONBLOCK keeps a named pipe from blocking the open; the type check then refuses it.
    """
    if not isinstance(path, str | os.PathLike):
        raise RequestError("", f"{what} path must be a string, got {file_name(path)}")
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise RequestError.about_file(path, f"cannot open the {what} file ({reason})") from error
    try:
        _check_file_status(path, what, os.fstat(descriptor))
        file = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    with file:
        yield file


def _check_file_status(path: Any, what: str, status: os.stat_result) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise RequestError.about_file(path, f"the {what} path is not a regular file")
    if status.st_size == 0:
        raise RequestError.about_file(path, f"the {what} file is empty{_accepted(what)}")
    if status.st_size > MAX_FILE_BYTES:
        raise RequestError.about_file(
            path, f"the {what} file has {status.st_size:,} bytes, more than the limit of {MAX_FILE_BYTES:,}"
        )


@contextlib.contextmanager
def _decoding(path: Any, what: str) -> Iterator[None]:
    """Turn whatever a decoder raises on malformed data into a `RequestError` naming the file.

    Pillow and FFmpeg raise many exception types on malformed input (OSError, SyntaxError, struct.error,
    ValueError, EOFError, av.error.*, even MemoryError), so the net is deliberately wide.
    """
    try:
        yield
    except RequestError:
        raise
    except Exception as error:
        # FFmpeg errors carry a file name that is only PyAV's handle for our file object; keep the reason only.
        detail = error.strerror if isinstance(error, av.FFmpegError) and error.strerror else str(error)
        reason = f"{type(error).__name__}: {detail}"
        if len(reason) > 200:
            reason = reason[:197] + "..."
        raise RequestError.about_file(
            path, f"the {what} file is corrupt or truncated ({reason}){_accepted(what)}"
        ) from error


def _check_container(container: Any, allowed: frozenset[str], path: Any, what: str) -> None:
    if container.format.name not in allowed:
        raise RequestError.about_file(
            path, f"not {FORMATS[what].describe()} (detected {container.format.name!r})"
        )


def _accepted(what: str) -> str:
    """What a file of this kind may be, for the messages about a file that is not one."""
    return f"; accepted: {FORMATS[what].describe()}" if what in FORMATS else ""


def _decode_streams(container: Any, collectors: list[Any], path: Any) -> None:
    """Demux once, feeding each stream's frames to its collector until every collector has its window."""
    by_stream = {collector.stream.index: collector for collector in collectors}
    for packet in container.demux(*(collector.stream for collector in collectors)):
        # FFmpeg flags a packet whose bytes ran out before its declared size: the file ends mid-packet.
        if packet.is_corrupt:
            raise RequestError.about_file(path, "the file is truncated or corrupt (incomplete packet)")
        collector = by_stream[packet.stream.index]
        if collector.done:
            if all(other.done for other in collectors):
                return
            continue
        for frame in packet.decode():
            collector.add(frame)
            if collector.done:
                break
    for collector in collectors:
        if isinstance(collector, _AudioCollector) and not collector.done:
            collector.flush()
        if not collector.done:
            collector.check_complete()


def _stream_seconds(stream: Any) -> float | None:
    """The duration a stream declares, or None. Only a stream's own duration can show that it was cut short: a
    container's is the longest of its streams."""
    if stream.duration is not None and stream.duration > 0 and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return None


def _declared_seconds(stream: Any, container: Any) -> float | None:
    seconds = _stream_seconds(stream)
    if seconds is None and container.duration is not None and container.duration > 0:
        seconds = float(Fraction(container.duration, av.time_base))
    return seconds


def _check_not_short(path: Any, what: str, decoded_seconds: float, declared_seconds: float) -> None:
    """Refuse a stream that ended before the length its container declares (minus the tolerance).

    An MP3 without a Xing/VBRI header only has a bitrate estimate of its length, so a variable-bitrate one whose
    estimate overshoots by more than the tolerance is refused as truncated. Packets FFmpeg marks corrupt (short reads)
    are refused while decoding.
    """
    tolerance = TRUNCATION_TOLERANCE_SECONDS + TRUNCATION_TOLERANCE_FRACTION * declared_seconds
    if decoded_seconds + tolerance < declared_seconds:
        raise RequestError.about_file(
            path,
            f"the file is truncated ({what} ends after {decoded_seconds:.3f} s of the "
            f"{declared_seconds:.3f} s its header declares)",
        )


def _check_window(path: Any, start_seconds: Any, max_seconds: Any, *, open_end_allowed: bool) -> None:
    for field, value in (("start_seconds", start_seconds), ("max_seconds", max_seconds)):
        if value is None and field == "max_seconds" and open_end_allowed:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RequestError.about_file(path, f"{field} must be a finite number, got {value!r}")
    if start_seconds < 0:
        raise RequestError.about_file(path, f"start_seconds must be >= 0, got {start_seconds!r}")
    if max_seconds is not None and max_seconds <= 0:
        raise RequestError.about_file(path, f"max_seconds must be positive, got {max_seconds!r}")
    end = start_seconds + (0.0 if max_seconds is None else max_seconds)
    if end > MAX_MEDIA_SECONDS:
        raise RequestError.about_file(
            path, f"only the first {MAX_MEDIA_SECONDS:g} s of a file can be read, asked up to {end:g} s"
        )


def _first_index_at(seconds: float, rate: float) -> int:
    return max(0, math.ceil(seconds * rate - _INDEX_EPSILON))
