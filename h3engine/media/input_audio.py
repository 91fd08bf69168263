"""The audio stream of a user's file as h3engine.media.inputs reads it: the stream's checks (codec, rate,
channels), `AudioCollector`, which keeps a window of it at its own rate, the Ogg last-page check, and
`resample_audio` to the model's 32 kHz.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

import av
import numpy as np
from av.audio.resampler import AudioResampler

from h3engine.errors import RequestError
from h3engine.media.input_files import check_not_short, first_index_at, stream_seconds
from h3engine.request.limits import MAX_MEDIA_SECONDS

MODEL_SAMPLE_RATE = 32_000
MIN_SAMPLE_RATE = 4_000
MAX_SAMPLE_RATE = 384_000
MAX_SOURCE_CHANNELS = 2
# FFmpeg codec names (the codec, not the decoder: "mp3" rather than "mp3float").
AUDIO_CODECS = frozenset({"flac", "vorbis", "opus", "mp3", "aac", "alac"})
AUDIO_CODEC_PREFIXES = ("pcm_",)
_OGG_PAGE_HEADER_BYTES = 27
_OGG_MAX_PAGE_BYTES = _OGG_PAGE_HEADER_BYTES + 255 + 255 * 255


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


class AudioCollector:
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
        self.first_sample = first_index_at(start_seconds, self.sample_rate)
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
        declared = stream_seconds(self.stream)
        if declared is not None:
            check_not_short(self.path, "audio", self.position / self.sample_rate, declared)

    def window_samples(self, what: str) -> np.ndarray:
        """The kept window, float32 [channels, samples]; RequestError when it is empty or not finite."""
        if not self.chunks:
            raise RequestError.about_file(
                self.path,
                f"{what} has no samples"
                + (" after start_seconds" if self.first_sample and self.position else ""),
            )
        samples = np.concatenate(self.chunks, axis=1)
        if not np.isfinite(samples).all():
            raise RequestError.about_file(self.path, f"{what} contains NaN or infinite samples")
        return samples


def first_audio_stream(container: Any, path: str | os.PathLike[str]) -> Any | None:
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


def check_ogg_ends_on_page(file: BinaryIO, path: str | os.PathLike[str]) -> None:
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
