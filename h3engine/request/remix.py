"""Remix requests: new sound for a video (v2a), new video for a sound (a2v), extend a clip, masked regeneration.

A `Remix` rides on a T2VA request (the DiT it runs is T2VA's, with some target rows held at the source's latents:
h3engine.engine.sampling.hold). `check_remix` is the checker's part for it (RequestError naming `remix.<field>`; each file
probed once through the request's `MediaFacts`); `remix_seconds` is the clip length a remix generates.
Modes: "v2a" holds the source video (trimmed down to the 17k+5 frame grid, the trim said in a warning); "a2v" holds
the source audio over the span it covers (a longer one trimmed, said); "extend" holds the source's last
`overlap_frames` (17k+5) frames and their audio at the head of a clip `duration_seconds` longer. Masks (seconds,
[start, end) pairs) mark what is regenerated (1); the rest of a held modality is kept (0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from h3engine.request.checks import check_integer_range, check_local_path, describe, fail, is_number
from h3engine.request.files import Reference
from h3engine.request.geometry import FPS, frames_for_duration, snap_frames_down
from h3engine.request.limits import MAX_DURATION_SECONDS, MAX_MEDIA_SECONDS, MIN_DURATION_SECONDS

REMIX_MODES = ("v2a", "a2v", "extend")
DEFAULT_OVERLAP_FRAMES = 22  # 17k + 5 with k = 1: two latent frames held (peers default to 18-22)
MAX_WINDOWS = 8  # chained audio degrades after about 8 segments in peers' reports, even with re-encoding
MAX_MASK_RANGES = 32
MIN_GRID_FRAMES = 22

RemixMode = Literal["v2a", "a2v", "extend"]
TimeRange = tuple[float, float]


@dataclass(frozen=True)
class Remix:
    """What a remix keeps of its sources; `mode` None: masks only (on a plain T2VA request)."""

    mode: RemixMode | None = None
    source_video: str | None = None
    source_audio: str | None = None
    video_mask: tuple[TimeRange, ...] = ()
    audio_mask: tuple[TimeRange, ...] = ()
    video_mask_image: str | None = None
    # v2a: write the VAE-decoded frames instead of copying the source's video stream.
    decoded_video: bool = False
    overlap_frames: int = DEFAULT_OVERLAP_FRAMES
    windows: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "source_video": self.source_video,
            "source_audio": self.source_audio,
            "video_mask": [list(pair) for pair in self.video_mask],
            "audio_mask": [list(pair) for pair in self.audio_mask],
            "video_mask_image": self.video_mask_image,
            "decoded_video": self.decoded_video,
            "overlap_frames": self.overlap_frames,
            "windows": self.windows,
        }

    @classmethod
    def from_dict(cls, payload: Any) -> Remix:
        if not isinstance(payload, dict):
            fail("remix", f"must be an object, got {describe(payload)}")
        unknown = sorted(set(payload) - set(cls().to_dict()))
        if unknown:
            fail(f"remix.{unknown[0]}", "is not a remix field")
        values = dict(payload)
        for name in ("video_mask", "audio_mask"):
            if name in values:
                values[name] = _ranges_from(values[name], f"remix.{name}")
        return cls(**values)


def _ranges_from(value: Any, field: str) -> tuple[TimeRange, ...]:
    if isinstance(value, str):
        return parse_ranges(value, field)
    if not isinstance(value, (list, tuple)):
        fail(field, f"must be a list of [start, end] pairs, got {describe(value)}")
    pairs = []
    for index, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            fail(f"{field}[{index}]", f"must be a [start, end] pair, got {describe(pair)}")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def parse_ranges(text: str, field: str) -> tuple[TimeRange, ...]:
    """'START-END[,START-END...]' in seconds -> pairs (judged later by `check_remix`)."""
    pairs = []
    for part in text.split(","):
        start, dash, end = part.strip().partition("-")
        try:
            pairs.append((float(start), float(end)))
        except ValueError:
            fail(field, f"must be START-END[,START-END...] in seconds, got {text!r}")
        if not dash:
            fail(field, f"must be START-END[,START-END...] in seconds, got {text!r}")
    return tuple(pairs)


def _video_frames(seconds: float) -> int:
    return snap_frames_down(math.floor(seconds * FPS + 1e-6))


def remix_seconds(remix: Remix, duration_seconds: float, video_seconds: float | None) -> float:
    """The clip length a remix generates: v2a the source video's grid-trimmed length (at most the longest clip);
    extend the overlap plus `duration_seconds`; else `duration_seconds`."""
    if remix.mode == "v2a":
        return _video_frames(min(video_seconds, MAX_DURATION_SECONDS)) / FPS
    if remix.mode == "extend":
        return remix.overlap_frames / FPS + duration_seconds
    return duration_seconds


def check_remix(remix: Any, task: str, duration_seconds: Any, probe: Any) -> tuple[float, list[str]]:
    """Judge a request's remix (probe: the request's `MediaFacts`; None skips the file rules and returns the
    request's duration); returns (the seconds it generates, warnings)."""
    if not isinstance(remix, Remix):
        fail("remix", f"must be a Remix, got {describe(remix)}")
    if task != "t2va":
        fail("task", f"a remix runs on task 't2va' (its DiT), got {describe(task)}")
    if remix.mode is not None and remix.mode not in REMIX_MODES:
        fail("remix.mode", f"must be one of {', '.join(REMIX_MODES)}, got {describe(remix.mode)}")
    for name in ("source_video", "source_audio", "video_mask_image"):
        if getattr(remix, name) is not None:
            check_local_path(getattr(remix, name), f"remix.{name}")
    if not isinstance(remix.decoded_video, bool):
        fail("remix.decoded_video", f"must be true or false, got {describe(remix.decoded_video)}")
    _check_sources(remix)
    check_integer_range(remix.windows, "remix.windows", 1, MAX_WINDOWS)
    check_integer_range(
        remix.overlap_frames, "remix.overlap_frames", MIN_GRID_FRAMES, 4 * MIN_GRID_FRAMES + 17
    )
    if remix.overlap_frames % 17 != 5:
        fail("remix.overlap_frames", f"must be 17k + 5 frames (22, 39, 56, ...), got {remix.overlap_frames}")
    if remix.windows > 1 and remix.mode != "extend":
        fail("remix.windows", "only 'extend' chains windows")
    if probe is None:
        return float(duration_seconds), []
    return _check_files(remix, float(duration_seconds), probe)


def _check_sources(remix: Remix) -> None:
    needs = {"v2a": "source_video", "extend": "source_video", "a2v": "source_audio"}.get(remix.mode)
    if needs is not None and getattr(remix, needs) is None:
        fail(f"remix.{needs}", f"is required for '{remix.mode}'")
    if remix.mode in ("v2a", "extend") and remix.source_audio is not None:
        fail("remix.source_audio", f"'{remix.mode}' takes its audio from remix.source_video")
    if remix.video_mask_image is not None and remix.source_video is None:
        fail("remix.video_mask_image", "needs remix.source_video (the video it keeps)")
    if remix.video_mask and remix.source_video is None:
        fail("remix.video_mask", "needs remix.source_video (the video it keeps outside the mask)")
    if remix.audio_mask and remix.source_video is None and remix.source_audio is None:
        fail("remix.audio_mask", "needs remix.source_audio or remix.source_video (the audio it keeps)")
    if remix.mode is None and not (remix.video_mask or remix.audio_mask or remix.video_mask_image):
        fail("remix", "has no mode and no mask: nothing to remix")


def _check_files(remix: Remix, duration_seconds: float, probe: Any) -> tuple[float, list[str]]:

    warnings = []
    video_seconds = None
    if remix.source_video is not None:
        info = _probed(probe, Reference(kind="video", path=remix.source_video), "remix.source_video")
        if info.width is None or info.duration_seconds is None:
            fail("remix.source_video", f"{remix.source_video} has no video stream")
        video_seconds = info.duration_seconds
        frames = math.floor(video_seconds * FPS + 1e-6)
        if frames < MIN_GRID_FRAMES:
            fail("remix.source_video", f"must hold at least {MIN_GRID_FRAMES} frames, has {frames}")
        if remix.mode == "extend" and video_seconds > MAX_MEDIA_SECONDS:
            fail(
                "remix.source_video",
                f"an extend source must be at most {MAX_MEDIA_SECONDS:g} s, is {video_seconds:.1f}",
            )
        if remix.mode == "extend" and frames < remix.overlap_frames:
            fail(
                "remix.overlap_frames",
                f"must be at most the source's {frames} frames, got {remix.overlap_frames}",
            )
        if remix.audio_mask and remix.source_audio is None and not info.has_audio:
            fail("remix.audio_mask", f"remix.source_video {remix.source_video} has no soundtrack to keep")
    seconds = remix_seconds(remix, duration_seconds, video_seconds)
    if remix.mode == "v2a":
        if seconds < MIN_DURATION_SECONDS:
            fail(
                "remix.source_video",
                f"must be at least {MIN_DURATION_SECONDS:g} s after trimming, is {seconds:.3f}",
            )
        warnings.append(
            f"remix.source_video: {video_seconds:.3f} s trimmed to {seconds:.3f} s ({round(seconds * FPS)} frames, "
            "the 17k+5 grid)"
        )
    if remix.mode == "extend" and seconds > MAX_DURATION_SECONDS:
        fail(
            "duration_seconds",
            f"overlap plus continuation must be at most {MAX_DURATION_SECONDS:g} s, is {seconds:.3f}",
        )
    clip_seconds = frames_for_duration(seconds) / FPS
    if remix.source_audio is not None:
        info = _probed(probe, Reference(kind="audio", path=remix.source_audio), "remix.source_audio")
        if not info.has_audio or info.duration_seconds is None:
            fail("remix.source_audio", f"{remix.source_audio} has no audio stream")
        if remix.mode == "a2v" and info.duration_seconds > clip_seconds:
            warnings.append(
                f"remix.source_audio: {info.duration_seconds:.3f} s trimmed to the clip's {clip_seconds:.3f} s"
            )
    if remix.video_mask_image is not None:
        _probed(probe, Reference(kind="image", path=remix.video_mask_image), "remix.video_mask_image")
    for name in ("video_mask", "audio_mask"):
        check_ranges(getattr(remix, name), f"remix.{name}", clip_seconds)
    return seconds, warnings


def _probed(probe: Any, reference: Any, field: str) -> Any:
    from h3engine.errors import RequestError

    try:
        return probe(reference)
    except RequestError as error:
        raise error.in_field(field) from None


def check_ranges(ranges: Sequence[Any], field: str, clip_seconds: float) -> None:
    """Each range a [start, end) pair of finite seconds with 0 <= start < end <= the clip's length."""
    if not isinstance(ranges, tuple) or len(ranges) > MAX_MASK_RANGES:
        fail(field, f"must be at most {MAX_MASK_RANGES} [start, end] pairs, got {describe(ranges)}")
    for index, pair in enumerate(ranges):
        start, end = pair
        if not all(is_number(value) and math.isfinite(value) for value in (start, end)):
            fail(f"{field}[{index}]", f"must be finite seconds, got {describe(start)}-{describe(end)}")
        if not 0 <= start < end:
            fail(f"{field}[{index}]", f"must have 0 <= start < end, got {start:g}-{end:g}")
        if end > clip_seconds + 1e-9:
            fail(f"{field}[{index}]", f"ends at {end:g} s, outside the {clip_seconds:.3f} s clip")
