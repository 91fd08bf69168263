"""Mux generated frames and stereo audio into a browser-playable MP4, and probe MP4 files.

`write_mp4` encodes H.264 (libx264, yuv420p, constant 24 fps, BT.709 limited range, tagged) and AAC-LC stereo
32 kHz into an MP4 with `+faststart`, quantizing float frames exactly as the diffusers reference does; its docstring
holds the full contract. `probe_mp4` reads back what a test or the app needs to know about a file (codecs,
geometry, rates, counts, durations, box order) with PyAV, without decoding video.

Danger: frames are converted one at a time, so a bad value in the last frame is only found after the earlier
frames were encoded; the atomic write (a hidden temporary file renamed onto `path` only after the muxer closed it)
is what keeps that from leaving a truncated file behind.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from enum import IntEnum
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc, Interpolation

from h3engine.media.outputs import atomic_output
from h3engine.media.progressive import ProgressiveFrames

H264_ENCODER = "libx264"
AAC_ENCODER = "aac"
OUTPUT_FPS = 24
AUDIO_SAMPLE_RATE = 32_000
AUDIO_CHANNELS = 2
DEFAULT_CRF = 18
DEFAULT_PRESET = "fast"
DEFAULT_AUDIO_BITRATE = 192_000
# x264's CRF scale for 8-bit output.
CRF_RANGE = (0.0, 51.0)

for _required_encoder in (H264_ENCODER, AAC_ENCODER):
    # Fail at import, not after a 10-minute generation, if PyAV's FFmpeg build lacks an encoder.
    if _required_encoder not in av.codecs_available:
        raise ImportError(f"PyAV's FFmpeg build has no {_required_encoder!r} encoder; write_mp4 cannot work")

# Threads converting frames ahead of the encoder (x264 runs its own threads besides).
FRAME_CONVERSION_THREADS = min(8, os.cpu_count() or 1)
# x264 threading: frame threads (several frames in flight), as the ffmpeg command line runs it. PyAV's default,
# slice threads, splits every frame into slices instead: less parallel work per frame and a different bitstream.
ENCODER_THREAD_TYPE = "FRAME"

# swscale's RGB -> YUV step: BT.709 matrix, limited range; ACCURATE_RND avoids swscale's fast
# approximate rounding so the conversion is as exact as 8 bits allow.
_YUV_CONVERSION = {
    "format": "yuv420p",
    "dst_colorspace": Colorspace.ITU709,
    "dst_color_range": ColorRange.MPEG,
    "interpolation": Interpolation.BILINEAR | Interpolation.ACCURATE_RND,
}


def write_mp4(
    path: str | os.PathLike[str],
    video: torch.Tensor | np.ndarray | ProgressiveFrames,
    audio: torch.Tensor | np.ndarray,
    *,
    fps: int = OUTPUT_FPS,
    crf: float = DEFAULT_CRF,
    preset: str = DEFAULT_PRESET,
    audio_bitrate: int = DEFAULT_AUDIO_BITRATE,
) -> Path:
    """Write `video` [F, H, W, 3] and `audio` [2, N] (32 kHz) to an H.264/AAC MP4 at `path`, atomically.

    Returns the final path.

    * Video: H.264 from libx264 (present in PyAV's bundled FFmpeg; checked at import time), pixel format yuv420p,
      constant frame rate `fps` (frame i has pts i in a 1/fps time base), CRF rate control with the x264 preset
      "fast" (as SGLang's serving path). RGB is converted to YUV with the BT.709 matrix in limited ("TV") range and
      the stream is tagged BT.709 (matrix, primaries, transfer): an untagged stream is read as BT.601 by some
      players and BT.709 by others.
    * Frames: [F, H, W, 3] RGB, numpy array or torch tensor (any device), uint8 (used as is) or floating point in
      [0, 1]; or a `ProgressiveFrames` still being decoded (each frame is encoded as soon as it exists). Floats are
      quantized as `round(x * 255)` with ties to even, in their own precision (numpy's and torch's `round`, which
      the diffusers reference uses for its 8-bit frames). Floats outside [0, 1] or non-finite raise ValueError (a
      wrong pixel convention, not noise); odd H or W raise ValueError (yuv420p halves both chroma axes).
    * Audio: [2, N] float in [-1, 1] at 32 kHz, encoded as AAC-LC stereo 32 kHz, trimmed or zero-padded at the end
      to exactly round_half_up(F * 32000 / fps) samples, the video's duration. The track then lasts that long
      (FFmpeg's MP4 muxer writes an edit list hiding the AAC encoder priming), i.e. within one AAC frame (1024
      samples = 32 ms) of the video.
    * Container: `movflags=+faststart` (the moov index before the media data, so a browser can start playing
      before the whole file arrived); packets fed in presentation order, so the media data is interleaved in time.
    * Atomicity: the file is written under a hidden temporary name in the destination folder and renamed onto
      `path` with os.replace only after the muxer closed it (see `h3engine.media.outputs`). Any error, invalid frame
      data found mid-stream included, deletes the temporary file and leaves an existing file at `path` untouched.
    """
    _check_video_layout(video)
    waveform = _waveform_as_float32(audio)
    if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
        raise ValueError(f"fps must be a positive integer, got {fps!r}")
    if not CRF_RANGE[0] <= crf <= CRF_RANGE[1]:
        raise ValueError(f"crf must be within {CRF_RANGE}, got {crf!r}")
    if audio_bitrate <= 0:
        raise ValueError(f"audio_bitrate must be positive, got {audio_bitrate!r}")

    frame_count = int(video.shape[0])
    waveform = _fit_waveform_length(waveform, audio_samples_for_frames(frame_count, fps))
    final_path = Path(path)
    with atomic_output(final_path) as partial_path:
        _encode_mp4(
            partial_path, video, waveform, fps=fps, crf=crf, preset=preset, audio_bitrate=audio_bitrate
        )
    return final_path


def audio_samples_for_frames(frame_count: int, fps: int, sample_rate: int = AUDIO_SAMPLE_RATE) -> int:
    """Samples covering `frame_count` frames at `fps`: round_half_up(frame_count * sample_rate / fps), exact."""
    return (2 * frame_count * sample_rate + fps) // (2 * fps)


def _check_video_layout(video: torch.Tensor | np.ndarray | ProgressiveFrames) -> None:
    if not isinstance(video, torch.Tensor | np.ndarray | ProgressiveFrames):
        raise ValueError(f"video must be a torch.Tensor or numpy.ndarray, got {type(video).__name__}")
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video must have shape [frames, height, width, 3], got {tuple(video.shape)}")
    frame_count, height, width, _ = (int(size) for size in video.shape)
    if frame_count < 1 or height < 1 or width < 1:
        raise ValueError(
            f"video must have at least one frame of at least 1x1 pixels, got {tuple(video.shape)}"
        )
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs an even width and height, got width {width} and height {height}")
    if isinstance(video, torch.Tensor | ProgressiveFrames):
        supported = video.dtype == torch.uint8 or video.dtype.is_floating_point
    else:
        supported = video.dtype == np.uint8 or np.issubdtype(video.dtype, np.floating)
    if not supported:
        raise ValueError(f"video must be uint8 or floating point in [0, 1], got dtype {video.dtype}")


def _frame_as_uint8(video: torch.Tensor | np.ndarray | ProgressiveFrames, index: int) -> np.ndarray:
    """Frame `index` as a C-contiguous uint8 [H, W, 3] array (validated and quantized if floating)."""
    frame = video[index]
    if isinstance(frame, torch.Tensor):
        frame = frame.detach().cpu()
        if frame.is_floating_point() and frame.dtype != torch.float64:
            # numpy has no bfloat16, and float16 * 255 would round before quantization.
            frame = frame.to(torch.float32)
        frame = frame.numpy()
    if frame.dtype == np.uint8:
        return np.ascontiguousarray(frame)
    if frame.dtype != np.float64:
        frame = frame.astype(np.float32)
    if not np.isfinite(frame).all():
        raise ValueError(f"video frame {index} contains NaN or infinite values")
    lowest, highest = float(frame.min()), float(frame.max())
    if lowest < 0.0 or highest > 1.0:
        raise ValueError(
            f"video frame {index} has values in [{lowest}, {highest}], expected floats in [0, 1]"
        )
    return quantize_to_uint8(frame)


def quantize_to_uint8(values: np.ndarray) -> np.ndarray:
    """Map float values in [0, 1] to uint8 as `round(values * 255)` with ties to even.

    Ties to even is what numpy's and torch's `round` do, and so what the diffusers reference pipeline does when it
    turns its float frames into 8-bit ones; keeping the same rule keeps our 8-bit frames equal to the reference's.
    The caller guarantees finite values in [0, 1].
    """
    scaled = values * values.dtype.type(255)
    return np.ascontiguousarray(np.round(scaled).astype(np.uint8))


def _waveform_as_float32(audio: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu()
        if not audio.is_floating_point():
            raise ValueError(f"audio must be floating point in [-1, 1], got dtype {audio.dtype}")
        audio = audio.to(torch.float32).numpy()
    elif isinstance(audio, np.ndarray):
        if not np.issubdtype(audio.dtype, np.floating):
            raise ValueError(f"audio must be floating point in [-1, 1], got dtype {audio.dtype}")
        audio = audio.astype(np.float32)
    else:
        raise ValueError(f"audio must be a torch.Tensor or numpy.ndarray, got {type(audio).__name__}")
    if audio.ndim != 2 or audio.shape[0] != AUDIO_CHANNELS:
        raise ValueError(f"audio must have shape [{AUDIO_CHANNELS}, samples], got {tuple(audio.shape)}")
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite values")
    if audio.size and (audio.min() < -1.0 or audio.max() > 1.0):
        raise ValueError(f"audio has values in [{audio.min()}, {audio.max()}], expected [-1, 1]")
    return audio


def _fit_waveform_length(waveform: np.ndarray, sample_count: int) -> np.ndarray:
    """Trim the end, or append silence, so that the waveform has exactly `sample_count` samples."""
    fitted = np.zeros((waveform.shape[0], sample_count), dtype=np.float32)
    kept = min(sample_count, waveform.shape[1])
    fitted[:, :kept] = waveform[:, :kept]
    return fitted


def _encode_mp4(
    target: Path,
    video: torch.Tensor | np.ndarray | ProgressiveFrames,
    waveform: np.ndarray,
    *,
    fps: int,
    crf: float,
    preset: str,
    audio_bitrate: int,
) -> None:
    frame_count, height, width, _ = (int(size) for size in video.shape)
    # The temp name has no .mp4 suffix, so the format is named explicitly.
    with av.open(
        str(target), mode="w", format="mp4", container_options={"movflags": "+faststart"}
    ) as container:
        video_stream = container.add_stream(H264_ENCODER, rate=fps)
        video_stream.width = width
        video_stream.height = height
        video_stream.pix_fmt = "yuv420p"
        video_stream.codec_context.time_base = Fraction(1, fps)
        video_stream.codec_context.colorspace = Colorspace.ITU709
        video_stream.codec_context.color_range = ColorRange.MPEG
        video_stream.codec_context.color_trc = ColorTrc.BT709
        video_stream.codec_context.color_primaries = ColorPrimaries.BT709
        video_stream.options = {"crf": f"{crf:g}", "preset": preset}
        video_stream.codec_context.thread_type = ENCODER_THREAD_TYPE

        audio_stream = container.add_stream(
            AAC_ENCODER, rate=AUDIO_SAMPLE_RATE, layout="stereo", format="fltp"
        )
        audio_stream.bit_rate = audio_bitrate
        audio_stream.codec_context.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
        samples_per_audio_frame = audio_stream.codec_context.frame_size or 1024

        def yuv_frame(index: int) -> av.VideoFrame:
            rgb = av.VideoFrame.from_ndarray(_frame_as_uint8(video, index), format="rgb24")
            yuv = rgb.reformat(**_YUV_CONVERSION)
            yuv.pts = index
            yuv.time_base = Fraction(1, fps)
            return yuv

        next_audio_sample = 0
        # Quantization and colour conversion (numpy and swscale release the GIL) run on worker threads ahead of
        # the encoder, in frame order; a bad frame's error surfaces here and the partial file is discarded.
        with ThreadPoolExecutor(max_workers=FRAME_CONVERSION_THREADS) as pool:
            for index, yuv in enumerate(pool.map(yuv_frame, range(frame_count))):
                container.mux(video_stream.encode(yuv))
                # Keep audio up to the end of this video frame so the muxer can interleave by time.
                audio_until = audio_samples_for_frames(index + 1, fps)
                while next_audio_sample < audio_until:
                    next_audio_sample = _encode_audio_frame(
                        container, audio_stream, waveform, next_audio_sample, samples_per_audio_frame
                    )
        while next_audio_sample < waveform.shape[1]:
            next_audio_sample = _encode_audio_frame(
                container, audio_stream, waveform, next_audio_sample, samples_per_audio_frame
            )
        container.mux(video_stream.encode(None))
        container.mux(audio_stream.encode(None))


def _encode_audio_frame(
    container: av.container.OutputContainer,
    audio_stream: av.audio.stream.AudioStream,
    waveform: np.ndarray,
    start: int,
    samples_per_audio_frame: int,
) -> int:
    """Encode the samples [start, start + frame size) (fewer at the end) and return the next start."""
    stop = min(start + samples_per_audio_frame, waveform.shape[1])
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(waveform[:, start:stop]), format="fltp", layout="stereo"
    )
    frame.sample_rate = AUDIO_SAMPLE_RATE
    frame.pts = start
    frame.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
    container.mux(audio_stream.encode(frame))
    return stop


def mp4_top_level_boxes(path: str | os.PathLike[str]) -> list[str]:
    """Types of the top-level ISO-BMFF boxes of `path`, in file order (e.g. ['ftyp', 'moov', 'free', 'mdat'])."""
    box_types: list[str] = []
    with open(path, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        offset = 0
        while offset + 8 <= file_size:
            handle.seek(offset)
            size, box_type = struct.unpack(">I4s", handle.read(8))
            header_size = 8
            if size == 1:
                (size,) = struct.unpack(">Q", handle.read(8))
                header_size = 16
            elif size == 0:
                size = file_size - offset
            if size < header_size:
                raise ValueError(f"{str(path)!r}: malformed box header at byte {offset} (size {size})")
            box_types.append(box_type.decode("latin-1"))
            offset += size
    return box_types


def probe_mp4(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe an MP4: codecs, pix_fmt, fps, frame count, size, audio rate/channels, durations, box order.

    Keys (values are None where the file has no such stream): video_codec, pix_fmt, width, height, fps
    (float, from the stream's average frame rate), frame_count (video packets, one per frame for H.264 in
    MP4), video_duration_s (frame_count / fps), color_space, color_primaries, color_transfer, color_range
    (FFmpeg's names, lower case; "mpeg" range is limited range), audio_codec, audio_sample_rate, audio_channels,
    audio_duration_s (the track duration after the edit list, i.e. without encoder priming), box_order,
    moov_before_mdat. Everything is JSON-serializable.
    """
    with av.open(str(path)) as container:
        video_stream = container.streams.video[0] if container.streams.video else None
        audio_stream = container.streams.audio[0] if container.streams.audio else None
        report: dict[str, Any] = {
            "video_codec": None,
            "pix_fmt": None,
            "width": None,
            "height": None,
            "fps": None,
            "frame_count": None,
            "video_duration_s": None,
            "color_space": None,
            "color_primaries": None,
            "color_transfer": None,
            "color_range": None,
            "audio_codec": None,
            "audio_sample_rate": None,
            "audio_channels": None,
            "audio_duration_s": None,
        }
        if video_stream is not None:
            frame_rate = video_stream.average_rate
            report["video_codec"] = video_stream.codec_context.name
            report["pix_fmt"] = video_stream.codec_context.pix_fmt
            report["width"] = video_stream.codec_context.width
            report["height"] = video_stream.codec_context.height
            report["fps"] = float(frame_rate) if frame_rate else None
            report["color_space"] = _enum_name(Colorspace, video_stream.codec_context.colorspace)
            report["color_primaries"] = _enum_name(ColorPrimaries, video_stream.codec_context.color_primaries)
            report["color_transfer"] = _enum_name(ColorTrc, video_stream.codec_context.color_trc)
            report["color_range"] = _enum_name(ColorRange, video_stream.codec_context.color_range)
        if audio_stream is not None:
            report["audio_codec"] = audio_stream.codec_context.name
            report["audio_sample_rate"] = audio_stream.codec_context.sample_rate
            report["audio_channels"] = audio_stream.codec_context.channels
            if audio_stream.duration is not None:
                report["audio_duration_s"] = float(audio_stream.duration * audio_stream.time_base)
        if video_stream is not None:
            frame_count = sum(1 for packet in container.demux(video_stream) if packet.size)
            report["frame_count"] = frame_count
            if report["fps"]:
                report["video_duration_s"] = frame_count / report["fps"]
    box_order = mp4_top_level_boxes(path)
    report["box_order"] = box_order
    report["moov_before_mdat"] = (
        "moov" in box_order and "mdat" in box_order and box_order.index("moov") < box_order.index("mdat")
    )
    return report


def _enum_name(enum_type: type[IntEnum], code: int) -> str:
    try:
        return enum_type(code).name.lower()
    except ValueError:
        return f"unknown({code})"
