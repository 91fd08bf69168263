"""Read the media a request conditions on: keyframe and reference images, reference videos with their
soundtrack, and reference audio clips.

`load_image`, `load_video`, `load_audio` / `read_audio_source` decode as the reference loaders do (their
docstrings hold each rule: EXIF orientation, the 24 fps frame holding, the audio window and resampling);
`probe_media` reads headers only and is what `request.validate` takes as `media_durations`. `start_seconds` is
our extension: a window that begins there behaves like a clip that begins there.

Every failure due to the file or the window, whatever the library raised, is a `RequestError` about the file
(`RequestError.about_file`: the caller files it under its request field); nothing is written. Danger: decoders
stop where the data stops, mostly silently (a truncated WAV or MP3 decodes into a shorter clip), so a stream read
to its end must reach the length its container declares (h3engine.media.input_files.check_not_short) and an Ogg
file must end exactly on a page boundary (h3engine.media.input_audio.check_ogg_ends_on_page). The checks of the file,
of its video stream and of its audio stream live in those modules and h3engine.media.input_video.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, BinaryIO

import av
import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from h3engine.errors import RequestError
from h3engine.media.formats import FORMATS
from h3engine.media.input_audio import (
    AudioCollector,
    check_ogg_ends_on_page,
    first_audio_stream,
    resample_audio,
)
from h3engine.media.input_files import check_container, check_window, declared_seconds, decoding, opened
from h3engine.media.input_video import (
    MODEL_FPS,
    FrameHolder,
    check_resize_target,
    first_video_stream,
    frame_rate,
)
from h3engine.request.files import Keyframe, MediaInfo, Reference
from h3engine.request.model import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, MIN_IMAGE_SIDE

MODEL_CHANNELS = 2

# The formats themselves live in h3engine.media.formats (one table for the loaders, the app's pickers and the CLI).
IMAGE_FORMATS = FORMATS["image"].content
_IMAGE_FORMATS_AS_OPENED = FORMATS["image"].detected
VIDEO_CONTAINERS = FORMATS["video"].detected
AUDIO_CONTAINERS = FORMATS["audio"].detected


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
    with opened(path, "image") as file, decoding(path, "image"):
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
    check_window(path, start_seconds, max_seconds, open_end_allowed=False)
    if resize_to is not None:
        check_resize_target(resize_to)
    with opened(path, "video") as file, decoding(path, "video"), av.open(file) as container:
        check_container(container, VIDEO_CONTAINERS, path, "video")
        video_stream = first_video_stream(container, path)
        if video_stream is None:
            raise RequestError.about_file(path, "has no video stream")
        holder = FrameHolder(video_stream, path, start_seconds, max_seconds, resize_to)
        collectors: list[FrameHolder | AudioCollector] = [holder]
        audio_stream = first_audio_stream(container, path)
        soundtrack = None
        if audio_stream is not None:
            soundtrack = AudioCollector(audio_stream, path, start_seconds, max_seconds)
            collectors.append(soundtrack)
        _decode_streams(container, collectors, path)
        frames = holder.frames()
        source_fps = holder.fps
        source_audio = _source_audio(soundtrack, "soundtrack") if soundtrack is not None else None
    loaded_soundtrack = None if source_audio is None else _model_audio(source_audio, path, "soundtrack")
    return LoadedVideo(
        frames=frames,
        source_fps=source_fps,
        duration_seconds=frames.shape[0] / MODEL_FPS,
        soundtrack=loaded_soundtrack,
    )


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
    check_window(path, start_seconds, max_seconds, open_end_allowed=True)
    with opened(path, "audio") as file, decoding(path, "audio"), av.open(file) as container:
        check_container(container, AUDIO_CONTAINERS, path, "audio")
        stream = first_audio_stream(container, path)
        if stream is None:
            raise RequestError.about_file(path, "has no audio stream")
        collector = AudioCollector(stream, path, start_seconds, max_seconds)
        _decode_streams(container, [collector], path)
        if container.format.name == "ogg" and not collector.done:
            check_ogg_ends_on_page(file, path)
        return _source_audio(collector, "audio")


def load_audio(
    path: str | os.PathLike[str], start_seconds: float = 0.0, max_seconds: float | None = None
) -> LoadedAudio:
    """`read_audio_source`'s window as stereo float32 [2, samples] at 32 kHz.

    Mono is duplicated to stereo, then resampled to 32 kHz with PyAV's `AudioResampler` and fitted to exactly
    `ceil(n * 32000 / rate)` samples, the output length of the reference's resampler.
    """
    return _model_audio(read_audio_source(path, start_seconds, max_seconds), path, "audio")


def _source_audio(collector: AudioCollector, what: str) -> SourceAudio:
    """The window `collector` kept, at the stream's own rate (RequestError when it holds no usable samples)."""
    return SourceAudio(samples=collector.window_samples(what), sample_rate=collector.sample_rate)


def _model_audio(source: SourceAudio, path: str | os.PathLike[str], what: str) -> LoadedAudio:
    with decoding(path, what):
        samples = resample_audio(source.samples, source.sample_rate)
    if not np.isfinite(samples).all():
        raise RequestError.about_file(path, f"{what} overflows when resampled (samples too large)")
    if source.samples.shape[0] == 1:
        samples = np.repeat(samples, MODEL_CHANNELS, axis=0)
    return LoadedAudio(samples=samples, source=source)


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
    with opened(path, "image") as file, decoding(path, "image"):
        image = _open_image_header(file, path, check_size=False)
        width, height = image.size
        if min(width, height) >= MIN_IMAGE_SIDE and _image_fits(width, height):
            width, height = _upright_image_size(image)
    return MediaInfo(duration_seconds=None, has_audio=False, width=width, height=height)


def _probe_video(path: Any) -> MediaInfo:
    with opened(path, "video") as file, decoding(path, "video"), av.open(file) as container:
        check_container(container, VIDEO_CONTAINERS, path, "video")
        video_stream = first_video_stream(container, path)
        audio_stream = first_audio_stream(container, path)
        if video_stream is None:
            return MediaInfo(
                duration_seconds=declared_seconds(audio_stream, container) if audio_stream else None,
                has_audio=audio_stream is not None,
                width=None,
                height=None,
            )
        frame_rate(video_stream, path)
        first_frame = next(container.decode(video_stream), None)
        if first_frame is None:
            raise RequestError.about_file(path, "has no decodable video frame")
        quarter_turns = round(first_frame.rotation / 90.0) % 4
        width, height = first_frame.width, first_frame.height
        if quarter_turns % 2:
            width, height = height, width
        durations = [
            declared_seconds(stream, container)
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
    with opened(path, "audio") as file, decoding(path, "audio"), av.open(file) as container:
        check_container(container, AUDIO_CONTAINERS, path, "audio")
        stream = first_audio_stream(container, path)
        duration = declared_seconds(stream, container) if stream is not None else None
    return MediaInfo(duration_seconds=duration, has_audio=stream is not None, width=None, height=None)


# ---------------------------------------------------------------------------------------------------------------
# Shared by the readers


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
        if isinstance(collector, AudioCollector) and not collector.done:
            collector.flush()
        if not collector.done:
            collector.check_complete()
