"""Tests for the input side: images, videos with soundtracks and audio clips read for conditioning.

The reference (diffusers 0.42.1's MiniMax-H3 reference decoders and its setup step's 24 fps frame holding) is
the oracle for decoded samples and held frames, compared bit for bit. The fuzz test feeds several hundred
malformed files and requests and demands a `RequestError` naming the file from every one of them.
"""

from __future__ import annotations

import faulthandler
import functools
import math
import os
import struct
import time
import zlib
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile
from _refusals import refused
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size
from diffusers.modular_pipelines.minimax_h3.references import _decode_audio_file, _decode_video_file
from diffusers.utils import load_image as reference_load_image
from PIL import Image

from h3engine.errors import RequestError
from h3engine.media import input_video
from h3engine.media.input_audio import resample_audio
from h3engine.media.inputs import (
    LoadedAudio,
    load_audio,
    load_image,
    load_video,
    probe_media,
    read_audio_source,
)
from h3engine.request.files import Keyframe, MediaInfo, Reference
from h3engine.request.model import GenerationRequest
from h3engine.request.validate import validate

VIDEO_WIDTH, VIDEO_HEIGHT = 64, 48
SOURCE_RATE = 44_100
FUZZ_CASE_SECONDS = 10.0
FUZZ_HANG_GUARD_SECONDS = 300.0


# ---------------------------------------------------------------------------------------------------------------
# Media writers (small real files)


def tone(rate: int, seconds: float, channels: int) -> np.ndarray:
    """float32 [channels, n]: 440 Hz at 0.3 on the first channel, 660 Hz at 0.2 on the second."""
    time_axis = np.arange(round(rate * seconds)) / rate
    waves = [0.3 * np.sin(2 * np.pi * 440 * time_axis), 0.2 * np.sin(2 * np.pi * 660 * time_axis)]
    return np.stack(waves[:channels]).astype(np.float32)


def frame_pattern(index: int, width: int = VIDEO_WIDTH, height: int = VIDEO_HEIGHT) -> np.ndarray:
    """A frame that differs from its neighbours: a colour that steps per frame and a bar that moves."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[..., 0] = (index * 37) % 256
    pixels[..., 2] = 255 - (index * 11) % 256
    bar = index % (width - 8)
    pixels[:, bar : bar + 8, 1] = 230
    return pixels


def write_video(
    path: Path,
    fps: Fraction,
    frame_count: int,
    *,
    with_audio: bool = True,
    faststart: bool = False,
    rotation: int | None = None,
) -> Path:
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        video = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast"})
        video.width, video.height, video.pix_fmt = VIDEO_WIDTH, VIDEO_HEIGHT, "yuv420p"
        if rotation is not None:
            video.set_display_rotation(rotation)
        audio = container.add_stream("aac", rate=SOURCE_RATE, layout="stereo") if with_audio else None
        for index in range(frame_count):
            frame = av.VideoFrame.from_ndarray(frame_pattern(index), format="rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode())
        if audio is not None:
            encode_audio(container, audio, tone(SOURCE_RATE, frame_count / fps, 2))
    return path


def encode_audio(
    container: av.container.OutputContainer, stream: av.AudioStream, samples: np.ndarray
) -> None:
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    for start in range(0, samples.shape[1], 1152):
        chunk = np.ascontiguousarray(samples[:, start : start + 1152])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate = stream.rate
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def write_audio_with_pyav(path: Path, codec: str, container_format: str, seconds: float = 2.2) -> Path:
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=SOURCE_RATE, layout="stereo")
        encode_audio(container, stream, tone(SOURCE_RATE, seconds, 2))
    return path


def noisy_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    generator = np.random.default_rng(seed)
    channels = len(mode)
    pixels = generator.integers(0, 256, (height, width, channels), dtype=np.uint8)
    # Smooth the noise a little so JPEG / WEBP keep some structure to compare.
    pixels[:, : width // 2] //= 4
    return Image.fromarray(pixels, mode)


def with_orientation(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("media_inputs")
    files: dict[str, Path] = {}
    image = noisy_image(40, 24, seed=1)
    files["png_rotated"] = folder / "rotated.png"
    image.save(files["png_rotated"], exif=with_orientation(6))
    files["jpeg_rotated"] = folder / "rotated.jpg"
    image.save(files["jpeg_rotated"], quality=90, exif=with_orientation(8))
    files["webp"] = folder / "plain.webp"
    image.save(files["webp"], quality=80)
    files["png_rgba"] = folder / "alpha.png"
    noisy_image(24, 24, seed=2, mode="RGBA").save(files["png_rgba"])
    files["png_named_jpg"] = folder / "really_a_png.jpg"
    image.save(files["png_named_jpg"], format="PNG")
    files["png"] = folder / "plain.png"
    image.save(files["png"])
    files["jpeg"] = folder / "plain.jpg"
    image.save(files["jpeg"], quality=90)

    files["video_30"] = write_video(folder / "clip30.mp4", Fraction(30), 75)
    files["video_25"] = write_video(folder / "clip25.mp4", Fraction(25), 60, faststart=True)
    files["video_2997"] = write_video(folder / "clip2997.mp4", Fraction(30000, 1001), 75, with_audio=False)
    files["video_rotated"] = write_video(
        folder / "rotated.mp4", Fraction(30), 12, with_audio=False, rotation=90
    )

    files["wav_mono"] = folder / "mono.wav"
    soundfile.write(files["wav_mono"], tone(SOURCE_RATE, 2.2, 1)[0], SOURCE_RATE, subtype="PCM_16")
    files["wav_32k"] = folder / "stereo32k.wav"
    soundfile.write(files["wav_32k"], tone(32_000, 2.0, 2).T, 32_000, subtype="FLOAT")
    files["flac"] = folder / "stereo.flac"
    soundfile.write(files["flac"], tone(SOURCE_RATE, 2.2, 2).T, SOURCE_RATE)
    files["ogg"] = folder / "stereo.ogg"
    soundfile.write(files["ogg"], tone(SOURCE_RATE, 2.2, 2).T, SOURCE_RATE)
    files["mp3"] = write_audio_with_pyav(folder / "stereo.mp3", "libmp3lame", "mp3")
    files["m4a"] = write_audio_with_pyav(folder / "stereo.m4a", "aac", "mp4")
    return files


# ---------------------------------------------------------------------------------------------------------------
# Images


@pytest.mark.parametrize("name", ["png_rotated", "jpeg_rotated", "webp", "png_rgba", "png_named_jpg"])
def test_image_equals_reference_loader(media: dict[str, Path], name: str) -> None:
    ours = load_image(media[name])
    reference = reference_load_image(str(media[name]))
    assert ours.mode == "RGB"
    assert ours.size == reference.size
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


def test_image_exif_rotation_is_applied_and_probed(media: dict[str, Path]) -> None:
    for name in ("png_rotated", "jpeg_rotated"):
        assert load_image(media[name]).size == (24, 40)
        info = probe_media(Keyframe(path=str(media[name]), position="first"))
        assert info == MediaInfo(duration_seconds=None, has_audio=False, width=24, height=40)
    assert load_image(media["webp"]).size == (40, 24)
    assert probe_media(Reference(kind="image", path=str(media["webp"]))).width == 40


def test_image_format_is_read_from_content(tmp_path: Path) -> None:
    gif_named_png = tmp_path / "animation.png"
    noisy_image(8, 8, seed=3).save(gif_named_png, format="GIF")
    bmp = tmp_path / "picture.bmp"
    noisy_image(8, 8, seed=3).save(bmp)
    for path in (gif_named_png, bmp):
        # The wording: test_a_file_that_is_not_its_kind_is_refused_naming_what_is_accepted.
        with refused(RequestError, field="", path=path):
            load_image(path)
        with refused(RequestError, field="", path=path):
            probe_media(Reference(kind="image", path=str(path)))


def test_a_file_that_is_not_its_kind_is_refused_naming_what_is_accepted(tmp_path: Path) -> None:
    # h3engine.media.formats is the one list: the messages spell it out, suffixes included.
    tiff = tmp_path / "scan.tiff"
    noisy_image(32, 32, seed=4).save(tiff)
    empty_image, empty_audio, text_audio = (
        tmp_path / "empty.png",
        tmp_path / "empty.wav",
        tmp_path / "notes.mp3",
    )
    missing = tmp_path / "gone.png"
    empty_image.write_bytes(b"")
    empty_audio.write_bytes(b"")
    text_audio.write_bytes(b"not a sound\n" * 10)
    image = "accepted: a JPEG, PNG or WEBP image (.jpg, .jpeg, .png, .webp)"
    audio = "accepted: a WAV, MP3, FLAC, Ogg (Vorbis, Opus), M4A or AAC audio file (.wav, .mp3, .flac, .ogg, .oga, .opus"
    cases = [
        (lambda: load_image(tiff), tiff, "not a JPEG, PNG or WEBP image (.jpg, .jpeg, .png, .webp)"),
        (lambda: probe_media(Reference(kind="image", path=str(empty_image))), empty_image, f"the image file is empty; {image}"),
        (lambda: probe_media(Reference(kind="audio", path=str(empty_audio))), empty_audio, f"the audio file is empty; {audio}"),
        (lambda: probe_media(Reference(kind="audio", path=str(text_audio))), text_audio, "corrupt or truncated (InvalidDataError"),
        (lambda: probe_media(Reference(kind="audio", path=str(text_audio))), text_audio, audio),
        (lambda: probe_media(Reference(kind="video", path=str(tiff))), tiff, "not an MP4, QuickTime, WebM, Matroska or AVI video (.mp4, .mov"),
        (lambda: probe_media(Reference(kind="image", path=str(missing))), missing, "cannot open the image file (No such file"),
    ]  # fmt: skip
    for read, path, wording in cases:
        # The readers know the file, not the request field (the caller files it: `in_field`).
        with refused(RequestError, field="", path=path, says=wording):
            read()


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares width x height over a few bytes of data: only a header-only reader stays cheap."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


def test_image_sizes_outside_the_model_range_are_refused_from_the_header(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.png"
    noisy_image(1, 1, seed=4).save(tiny)
    huge = png_header_only(tmp_path / "huge.png", 8190, 8190)
    for path, field, size in ((tiny, "keyframes[0]", "1x1"), (huge, "keyframes[0]", "8190x8190")):
        request = GenerationRequest(task="fl2va", prompt="p", keyframes=(Keyframe(str(path), "first"),))
        # The header's size reaches the rule (its wording: tests/test_request_bounds.py).
        with refused(RequestError, field=field) as caught:
            validate(request, media_durations=probe_media)
        assert f"{str(path)!r} is {size} pixels" in caught.value.problem, caught.value
    reference = GenerationRequest(task="ref2va", prompt="p", references=(Reference("image", str(huge)),))
    with refused(RequestError, field="references[0]"):
        validate(reference, media_durations=probe_media)
    # The loader refuses them too, from the header (the huge one's pixel data is not even there to decode).
    with refused(RequestError, field="", path=huge) as caught:
        load_image(huge)
    assert (
        caught.value.problem
        == "image has 8190x8190 pixels; at most 8192 pixels a side and 16,777,216 in all are read"
    )
    with refused(
        RequestError, field="", path=tiny, says="image has 1x1 pixels; each side must be at least 16"
    ):
        load_image(tiny)


# ---------------------------------------------------------------------------------------------------------------
# Video


def decode_raw_frames(path: Path) -> tuple[np.ndarray, float]:
    """Every frame of the first video stream at the source rate, without the display rotation."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def reference_held_frames(
    frames: np.ndarray, fps: float, num_frames: int, canvas: tuple[int, int] | None = None
) -> np.ndarray:
    """The reference's 24 fps holding and cut; `canvas=(width, height)` also runs its LANCZOS resize."""
    height, width = frames.shape[1:3]
    if canvas is None:
        # The canvas rule then resolves to the frames' own size, which the reference leaves untouched.
        multiple, short_edge = 16, min(width, height)
    else:
        multiple, short_edge = 16, min(canvas)
    expected_canvas = resolve_canvas_size(width, height, multiple, short_edge, 10**9)
    if canvas is not None:
        assert expected_canvas == (canvas[1], canvas[0])
    return MiniMaxH3Ref2VASetupStep._normalize_video_condition(
        frames, fps, num_frames, multiple, short_edge, 10**9, 24.0
    )


@pytest.mark.parametrize("name", ["video_30", "video_25", "video_2997", "video_rotated"])
def test_video_frames_equal_reference_holding(media: dict[str, Path], name: str) -> None:
    reference_frames, reference_fps, _, _ = _decode_video_file(media[name])
    loaded = load_video(media[name])
    expected = reference_held_frames(reference_frames, reference_fps, num_frames=360)
    assert loaded.source_fps == reference_fps
    assert loaded.frames.dtype == np.uint8 and loaded.frames.shape[3] == 3
    np.testing.assert_array_equal(loaded.frames, expected)
    assert loaded.duration_seconds == loaded.frames.shape[0] / 24


@pytest.mark.parametrize("name", ["video_30", "video_25", "video_2997"])
def test_video_holding_follows_spec_formula(media: dict[str, Path], name: str) -> None:
    raw_frames, fps = decode_raw_frames(media[name])
    loaded = load_video(media[name])
    scale = 24 / fps
    slots = [math.floor(index * scale + 0.5) for index in range(raw_frames.shape[0] + 1)]
    assert loaded.frames.shape[0] == slots[-1]
    for output_index, frame in enumerate(loaded.frames):
        source_index = max(index for index in range(raw_frames.shape[0]) if slots[index] <= output_index)
        np.testing.assert_array_equal(frame, raw_frames[source_index])
    if fps == 30:
        # 30 -> 24 fps drops one frame in five: source frames 2, 7, 12, ... never show.
        shown = {index for index in range(raw_frames.shape[0]) if slots[index + 1] > slots[index]}
        assert sorted(set(range(raw_frames.shape[0])) - shown) == list(range(2, raw_frames.shape[0], 5))


@pytest.mark.parametrize("name", ["video_30", "video_25"])
def test_video_window_resize_and_soundtrack(media: dict[str, Path], name: str) -> None:
    reference_frames, fps, reference_audio, sample_rate = _decode_video_file(media[name])
    start_seconds, max_seconds = 0.5, 1.0
    first_frame = math.ceil(start_seconds * fps)
    loaded = load_video(media[name], start_seconds, max_seconds, resize_to=(48, 32))

    expected = reference_held_frames(reference_frames[first_frame:], fps, num_frames=24, canvas=(48, 32))
    assert loaded.frames.shape == (24, 32, 48, 3)
    np.testing.assert_array_equal(loaded.frames, expected)

    # Soundtrack: cut at the source rate from the start time, then resampled once.
    first_sample = math.ceil(start_seconds * sample_rate)
    window = reference_audio.numpy()[:, first_sample : first_sample + int(max_seconds * sample_rate)]
    soundtrack = loaded.soundtrack
    assert isinstance(soundtrack, LoadedAudio)
    assert soundtrack.source_rate == sample_rate and soundtrack.source_channels == 2
    assert soundtrack.samples.shape == (2, 32_000)
    np.testing.assert_array_equal(soundtrack.samples, resample_audio(window, sample_rate))

    # The soundtrack read as an audio file decodes to the reference's samples.
    source = read_audio_source(media[name])
    np.testing.assert_array_equal(source.samples, reference_audio.numpy())
    np.testing.assert_array_equal(soundtrack.source.samples, window)


def test_video_probe(media: dict[str, Path]) -> None:
    info = probe_media(Reference(kind="video", path=str(media["video_30"])))
    assert info.has_audio and (info.width, info.height) == (64, 48)
    assert info.duration_seconds == pytest.approx(2.5, abs=0.01)
    rotated = probe_media(Reference(kind="video", path=str(media["video_rotated"])))
    assert (rotated.width, rotated.height, rotated.has_audio) == (48, 64, False)
    assert load_video(media["video_rotated"]).frames.shape[1:3] == (64, 48)


def test_video_frame_size_limit(media: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_video, "MAX_VIDEO_FRAME_PIXELS", VIDEO_WIDTH * VIDEO_HEIGHT - 1)
    for call in (
        lambda: load_video(media["video_30"]),
        lambda: probe_media(Reference(kind="video", path=str(media["video_30"]))),
    ):
        with refused(
            RequestError, field="", path=media["video_30"], says="64x48 pixels, more than the limit"
        ):
            call()


# ---------------------------------------------------------------------------------------------------------------
# Audio


@pytest.mark.parametrize("name", ["wav_mono", "wav_32k", "flac", "ogg", "mp3", "m4a"])
def test_audio_source_equals_reference_and_resamples(media: dict[str, Path], name: str) -> None:
    reference_samples, reference_rate = _decode_audio_file(media[name])
    source = read_audio_source(media[name])
    assert source.sample_rate == reference_rate
    np.testing.assert_array_equal(source.samples, reference_samples.numpy())

    loaded = load_audio(media[name])
    np.testing.assert_array_equal(loaded.source.samples, source.samples)
    source_length = source.samples.shape[1]
    assert loaded.samples.dtype == np.float32
    assert loaded.samples.shape == (2, math.ceil(source_length * 32_000 / reference_rate))
    assert loaded.source_channels == source.samples.shape[0]
    assert loaded.duration_seconds == source_length / reference_rate
    if source.samples.shape[0] == 1:
        np.testing.assert_array_equal(loaded.samples[0], loaded.samples[1])
    if reference_rate == 32_000:
        np.testing.assert_array_equal(loaded.samples, source.samples)
    if name in ("wav_mono", "flac"):
        # Lossless sources: the resampled tone matches the analytic one away from the edges.
        expected = tone(32_000, loaded.samples.shape[1] / 32_000, 2)
        if name == "wav_mono":
            expected = np.repeat(expected[:1], 2, axis=0)
        interior = slice(400, -400)
        np.testing.assert_allclose(loaded.samples[:, interior], expected[:, interior], atol=2e-4)

    info = probe_media(Reference(kind="audio", path=str(media[name])))
    assert info.has_audio and info.width is None
    assert info.duration_seconds == pytest.approx(source_length / reference_rate, abs=0.05)


def test_audio_window_is_cut_at_source_rate(media: dict[str, Path]) -> None:
    reference_samples, rate = _decode_audio_file(media["wav_mono"])
    source = read_audio_source(media["wav_mono"], start_seconds=0.5, max_seconds=1.0)
    np.testing.assert_array_equal(source.samples, reference_samples.numpy()[:, 22_050 : 22_050 + 44_100])
    loaded = load_audio(media["wav_mono"], max_seconds=1.0)
    expected = resample_audio(reference_samples.numpy()[:, : int(1.0 * rate)], rate)
    np.testing.assert_array_equal(loaded.samples, np.repeat(expected, 2, axis=0))
    assert loaded.samples.shape == (2, 32_000)


def test_resample_audio_length_and_accuracy() -> None:
    # Lengths whose exact 32 kHz length has a fractional part below one half (rate + 1 at 22.05 and 96 kHz):
    # there the reference's ceiling and swresample's rounding differ by one sample.
    for rate in (8_000, 22_050, 44_100, 48_000, 96_000):
        for length in (rate + 1, int(rate * 1.3) - 3):
            samples = tone(rate, 1.3, 2)[:, :length]
            resampled = resample_audio(samples, rate)
            assert resampled.shape == (2, math.ceil(Fraction(length * 32_000, rate)))
            expected = tone(32_000, resampled.shape[1] / 32_000 + 1, 2)[:, : resampled.shape[1]]
            np.testing.assert_allclose(resampled[:, 300:-300], expected[:, 300:-300], atol=3e-4)
    with pytest.raises(ValueError):
        resample_audio(np.zeros((3, 10), np.float32), 44_100)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("rate", [SOURCE_RATE, 32_000])
def test_non_finite_audio_is_refused(tmp_path: Path, bad_value: float, rate: int) -> None:
    samples = tone(rate, 0.5, 2).T.copy()
    samples[1234, 1] = bad_value
    path = tmp_path / "bad.wav"
    soundfile.write(path, samples, rate, subtype="FLOAT")
    for read in (read_audio_source, load_audio):
        with refused(RequestError, field="", path=path, says="contains NaN or infinite samples"):
            read(path)


def test_valid_requests_validate_with_probe(media: dict[str, Path]) -> None:
    fl2va = GenerationRequest(
        task="fl2va",
        prompt="a scene",
        keyframes=(Keyframe(path=str(media["jpeg_rotated"]), position="first"),),
    )
    assert validate(fl2va, media_durations=probe_media) == []
    ref2va = GenerationRequest(
        task="ref2va",
        prompt="a scene",
        duration_seconds=5.0,
        references=(
            Reference(kind="image", path=str(media["webp"])),
            Reference(kind="video", path=str(media["video_2997"])),
            Reference(kind="audio", path=str(media["flac"])),
        ),
    )
    assert validate(ref2va, media_durations=probe_media) == []


# ---------------------------------------------------------------------------------------------------------------
# Fuzz: malformed files and requests


def png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00" + b"\x10" * 3 * 8)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def jpeg_claiming(valid_jpeg: bytes, width: int, height: int) -> bytes:
    frame_header = valid_jpeg.index(b"\xff\xc0")
    size = struct.pack(">HH", height, width)
    return valid_jpeg[: frame_header + 5] + size + valid_jpeg[frame_header + 9 :]


def webp_claiming(valid_webp: bytes, width: int, height: int) -> bytes:
    # Simple lossy WEBP: 'VP8 ' chunk at 12, key frame start code 9d 01 2a at 23, then 14-bit sizes.
    assert valid_webp[12:16] == b"VP8 " and valid_webp[23:26] == b"\x9d\x01\x2a"
    return valid_webp[:26] + struct.pack("<HH", width, height) + valid_webp[30:]


RANDOM_EXTENSIONS = (
    ".png",
    ".jpg",
    ".jpeg",
    ".webp",
    ".mp4",
    ".mov",
    ".webm",
    ".mkv",
    ".wav",
    ".flac",
    ".mp3",
    ".m4a",
    ".ogg",
    ".aac",
)
KIND_OF_EXTENSION = {
    ".png": "image",
    ".jpg": "image",
    ".jpeg": "image",
    ".webp": "image",
    ".mp4": "video",
    ".mov": "video",
    ".webm": "video",
    ".mkv": "video",
}
MAGIC_PREFIXES = {
    "png": (b"\x89PNG\r\n\x1a\n", ".png", "image"),
    "jpeg": (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", ".jpg", "image"),
    "webp": (b"RIFF\x00\x10\x00\x00WEBPVP8 ", ".webp", "image"),
    "wav": (b"RIFF\x00\x10\x00\x00WAVEfmt ", ".wav", "audio"),
    "flac": (b"fLaC\x00\x00\x00\x22", ".flac", "audio"),
    "ogg": (b"OggS\x00\x02", ".ogg", "audio"),
    "id3": (b"ID3\x03\x00\x00\x00\x00\x00\x00", ".mp3", "audio"),
    "mp4": (b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom", ".mp4", "video"),
    "mkv": (b"\x1a\x45\xdf\xa3", ".mkv", "video"),
}


def build_fuzz_cases(media: dict[str, Path], folder: Path) -> list[tuple[str, str, Path, dict]]:
    """(label, kind, path, loader keyword arguments) for every malformed input; each must be refused."""
    generator = np.random.default_rng(20260214)
    cases: list[tuple[str, str, Path, dict]] = []

    def add(label: str, kind: str, data: bytes, suffix: str, **options: float) -> None:
        path = folder / f"case{len(cases):03d}{suffix}"
        path.write_bytes(data)
        cases.append((label, kind, path, options))

    for extension in RANDOM_EXTENSIONS:
        kind = KIND_OF_EXTENSION.get(extension, "audio")
        for size in (1, 3, 16, 100, 1_000, 4_096, 20_000, 70_000):
            add(f"random {size} bytes {extension}", kind, generator.bytes(size), extension)
    for name, (prefix, extension, kind) in MAGIC_PREFIXES.items():
        for size in (0, 50, 3_000):
            add(f"{name} magic + {size} random bytes", kind, prefix + generator.bytes(size), extension)
    for extension in RANDOM_EXTENSIONS:
        add(f"empty {extension}", KIND_OF_EXTENSION.get(extension, "audio"), b"", extension)

    truncation_sources = {
        "png": "image",
        "jpeg": "image",
        "webp": "image",
        "video_30": "video",
        "video_25": "video",
        "wav_mono": "audio",
        "flac": "audio",
        "ogg": "audio",
        "mp3": "audio",
        "m4a": "audio",
        "wav_32k": "audio",
    }
    for name, kind in truncation_sources.items():
        data = media[name].read_bytes()
        # Cut anywhere up to 90 % of the file: that always removes coded media, not just a trailer.
        for cut in generator.integers(1, int(len(data) * 0.9), size=12):
            add(f"{name} cut at {cut} of {len(data)}", kind, data[:cut], media[name].suffix)

    for width, height in ((100_000, 100_000), (20_000, 20_000), (9_000, 9_000), (1, 100_000_000)):
        add(f"png claiming {width}x{height}", "image", png_claiming(width, height), ".png")
    jpeg = media["jpeg"].read_bytes()
    for width, height in ((65_000, 65_000), (9_000, 9_000)):
        add(f"jpeg claiming {width}x{height}", "image", jpeg_claiming(jpeg, width, height), ".jpg")
    add(
        "webp claiming 16383x16383",
        "image",
        webp_claiming(media["webp"].read_bytes(), 0x3FFF, 0x3FFF),
        ".webp",
    )

    audio_folder = folder / "written"
    audio_folder.mkdir()
    for label, samples, subtype in (
        ("NaN float WAV", np.array([[0.1, np.nan]] * 4_000, np.float32), "FLOAT"),
        ("all-NaN float WAV", np.full((4_000, 1), np.nan, np.float32), "FLOAT"),
        ("inf float WAV", np.array([[0.1], [np.inf]] * 2_000, np.float32), "FLOAT"),
        ("-inf double WAV", np.array([[-np.inf, 0.0]] * 2_000, np.float64), "DOUBLE"),
        ("NaN double WAV", np.full((4_000, 2), np.nan, np.float64), "DOUBLE"),
        ("zero-length WAV", np.zeros((0, 2), np.float32), "FLOAT"),
        ("six-channel WAV", np.zeros((4_000, 6), np.float32), "FLOAT"),
    ):
        path = audio_folder / f"{len(cases):03d}.wav"
        soundfile.write(path, samples, SOURCE_RATE, subtype=subtype)
        add(label, "audio", path.read_bytes(), ".wav")
    path = audio_folder / "low_rate.wav"
    soundfile.write(path, np.zeros(4_000, np.float32), 1_000, subtype="PCM_16")
    add("1 kHz WAV", "audio", path.read_bytes(), ".wav")
    path = audio_folder / "header_only.wav"
    soundfile.write(path, np.zeros((0, 1), np.int16), SOURCE_RATE, subtype="PCM_16")
    add("zero-length PCM WAV", "audio", path.read_bytes(), ".wav")

    wrong_kinds = {
        "png": ("video", "audio"),
        "jpeg": ("video", "audio"),
        "webp": ("video", "audio"),
        "wav_mono": ("image", "video"),
        "flac": ("image", "video"),
        "ogg": ("image", "video"),
        "mp3": ("image", "video"),
        "m4a": ("image", "video"),
        "video_30": ("image",),
        "video_25": ("image",),
        "video_2997": ("image", "audio"),
    }
    for name, kinds in wrong_kinds.items():
        for kind in kinds:
            cases.append((f"{name} read as {kind}", kind, media[name], {}))

    video = media["video_30"]
    for options in (
        {"start_seconds": float("nan")},
        {"start_seconds": -1.0},
        {"start_seconds": 2.6},
        {"start_seconds": 200.0},
        {"max_seconds": 0.0},
        {"max_seconds": float("inf")},
        {"max_seconds": -2.0},
    ):
        cases.append((f"video_30 with {options}", "video", video, options))
    cases.append(("audio window after the end", "audio", media["flac"], {"start_seconds": 3.0}))
    cases.append(("audio max_seconds NaN", "audio", media["flac"], {"max_seconds": float("nan")}))

    cases.append(("missing file", "image", folder / "does_not_exist.png", {}))
    cases.append(("folder", "video", audio_folder, {}))
    fifo = folder / "pipe.wav"
    os.mkfifo(fifo)
    cases.append(("named pipe", "audio", fifo, {}))
    return cases


LOADERS = {"image": load_image, "video": load_video, "audio": load_audio}


def request_for(kind: str, path: Path, options: dict, anchor_image: Path) -> GenerationRequest:
    if kind == "image":
        return GenerationRequest(
            task="fl2va", prompt="p", keyframes=(Keyframe(path=str(path), position="first"),)
        )
    references = (Reference(kind=kind, path=str(path), start_seconds=options.get("start_seconds")),)
    if kind == "audio":
        references = (Reference(kind="image", path=str(anchor_image)), *references)
    return GenerationRequest(task="ref2va", prompt="p", references=references)


def run_request(request: GenerationRequest) -> None:
    """What a worker does with a request: validate it against the probed files, then read every file."""
    validate(request, media_durations=probe_media)
    for keyframe in request.keyframes:
        load_image(keyframe.path)
    for reference in request.references:
        if reference.kind == "video":
            load_video(reference.path, reference.start_seconds or 0.0, request.duration_seconds)
        else:
            LOADERS[reference.kind](reference.path)


def outcome(call) -> str:
    """'refused: <message>' for a RequestError, 'accepted' for a return, 'CRASH ...' for anything else."""
    try:
        call()
    except RequestError as error:
        return f"refused: {error}"
    except Exception as error:
        return f"CRASH {type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_fuzz_malformed_files_and_requests(media: dict[str, Path], tmp_path: Path) -> None:
    cases = build_fuzz_cases(media, tmp_path)
    assert len(cases) >= 300
    listing_before = sorted(tmp_path.rglob("*"))
    media_listing_before = sorted(media["png"].parent.iterdir())
    problems: list[str] = []
    faulthandler.dump_traceback_later(FUZZ_HANG_GUARD_SECONDS, exit=True)
    try:
        for label, kind, path, options in cases:
            started = time.monotonic()
            loaded = outcome(functools.partial(LOADERS[kind], path, **options))
            probed = outcome(functools.partial(probe_media, Reference(kind=kind, path=str(path))))
            # A request cannot carry a read window; those cases are loader arguments only.
            requested = "refused: not applicable"
            if "max_seconds" not in options:
                request = request_for(kind, path, options, media["png"])
                requested = outcome(functools.partial(run_request, request))
            elapsed = time.monotonic() - started
            if not loaded.startswith("refused") or repr(str(path)) not in loaded:
                problems.append(f"{label}: load {loaded}")
            if probed.startswith("refused") and repr(str(path)) not in probed:
                problems.append(f"{label}: probe error does not name the file: {probed}")
            if probed.startswith("CRASH"):
                problems.append(f"{label}: probe {probed}")
            if not requested.startswith("refused"):
                problems.append(f"{label}: request {requested}")
            if elapsed > FUZZ_CASE_SECONDS:
                problems.append(f"{label}: took {elapsed:.1f} s")
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not problems, "\n".join(problems)
    assert sorted(tmp_path.rglob("*")) == listing_before
    assert sorted(media["png"].parent.iterdir()) == media_listing_before
