"""The Remix section's mask timeline: a strip with one lane per modality over the clip the remix makes, spans that
are regenerated shaded, the rest kept (held at the source), updated as the mask fields or the source change.

The clip length is the one the engine makes (`remix_seconds`, then the frame grid): v2a the source video's trimmed
length, a2v the seconds asked for, extend the held overlap plus the seconds added. A span outside the clip or text
that does not parse is said in the strip, naming the field, as the request check would.
"""

from __future__ import annotations

import functools
import html
import math
import os

from h3engine.errors import RequestError
from h3engine.request.geometry import FPS, frames_for_duration
from h3engine.request.remix import DEFAULT_OVERLAP_FRAMES, Remix, check_ranges, parse_ranges, remix_seconds

LANE_COLOURS = {"video": "#6d5dfc", "audio": "#e0884a"}
KEPT_COLOUR = "#d9dde3"
EMPTY = "<div id='remix-mask-timeline' class='h3-timeline'><em>{}</em></div>"


def video_seconds_of(path: str | None) -> float | None:
    """The source video's length in seconds (None: no file or not a video). The strip is redrawn at every change
    of a mask field, so a file is probed once for as long as it stays the same (its size and modification time)."""
    if not path:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _probed_seconds(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _probed_seconds(path: str, size: int, modified_ns: int) -> float | None:
    from h3engine.media.inputs import probe_media
    from h3engine.request.files import Reference

    try:
        return probe_media(Reference(kind="video", path=path)).duration_seconds
    except (RequestError, OSError):
        return None


def clip_seconds(mode: str, seconds: float | None, video_seconds: float | None) -> float | None:
    """The length of the clip the remix makes (on the frame grid), or None while the source it needs is missing."""
    if mode in ("v2a", "extend") and video_seconds is None:
        return None
    remix = Remix(mode=mode, overlap_frames=DEFAULT_OVERLAP_FRAMES)
    length = remix_seconds(remix, float(seconds or 0), video_seconds)
    return frames_for_duration(length) / FPS if length > 0 else None


def timeline_html(
    mode: str, seconds: float | None, video_seconds: float | None, video_mask: str, audio_mask: str
) -> str:
    """The strip's HTML: two lanes with the regenerated spans shaded, a scale in seconds, or a line saying why not."""
    length = clip_seconds(mode, seconds, video_seconds)
    if length is None:
        return EMPTY.format("Choose the source video to see its timeline.")
    lanes = []
    for lane, text in (("video", video_mask), ("audio", audio_mask)):
        field = f"{lane}_mask"
        try:
            spans = parse_ranges(text, f"remix.{field}") if text and text.strip() else ()
            check_ranges(spans, f"remix.{field}", length)
        except RequestError as error:
            return EMPTY.format(html.escape(f"{error.field}: {error.problem}"))
        lanes.append(_lane(lane, spans, length, LANE_COLOURS[lane]))
    ticks = "".join(
        f"<span style='position:absolute;left:{100 * second / length:.3f}%'>{second}</span>"
        for second in range(0, math.floor(length) + 1)
    )
    return (
        f"<div id='remix-mask-timeline' class='h3-timeline' data-seconds='{length:.3f}'>"
        + "".join(lanes)
        + f"<div style='position:relative;height:1.2em;font-size:0.75em;margin-left:3.5em'>{ticks}</div>"
        + f"<div style='font-size:0.8em'>{length:.2f} s clip: shaded spans are regenerated, the rest is kept</div>"
        + "</div>"
    )


def _lane(name: str, spans: tuple[tuple[float, float], ...], length: float, colour: str) -> str:
    blocks = "".join(
        f"<div class='h3-span' data-lane='{name}' data-start='{start:g}' data-end='{end:g}' "
        f"title='{name}: regenerate {start:g}-{end:g} s' style='position:absolute;top:0;bottom:0;"
        f"left:{100 * start / length:.3f}%;width:{100 * (end - start) / length:.3f}%;background:{colour}'></div>"
        for start, end in spans
    )
    return (
        "<div style='display:flex;align-items:center;gap:0.5em;margin:2px 0'>"
        f"<span style='width:3em;font-size:0.8em'>{name}</span>"
        f"<div data-lane-strip='{name}' style='position:relative;flex:1;height:1.1em;background:{KEPT_COLOUR};"
        f"border-radius:3px;overflow:hidden'>{blocks}</div></div>"
    )
