"""What every reader of a user's media file shares (h3engine.media.inputs, input_video, input_audio).

`opened` opens the file only once it is a non-empty regular file within `MAX_FILE_BYTES`; `decoding` turns
whatever a decoder raises into a `RequestError` about the file; `check_container` checks the detected container.
A stream read to its end must reach the length its container declares (`check_not_short`), and a window must be
a finite range within the first `MAX_MEDIA_SECONDS` of the file (`check_window`).
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Iterator
from fractions import Fraction
from typing import Any, BinaryIO

import av

from h3engine.errors import RequestError, file_name
from h3engine.media.formats import FORMATS
from h3engine.request.limits import MAX_MEDIA_SECONDS

MAX_FILE_BYTES = 2 * 1024**3
# A stream read to its end may fall this short of its declared duration before it counts as truncated
# (container durations are rounded to their time base; AAC and MP3 frames are ~20-70 ms).
TRUNCATION_TOLERANCE_SECONDS = 0.05
TRUNCATION_TOLERANCE_FRACTION = 0.02
# `start_seconds * rate` of a start time typed in decimal lands a hair above the integer it means (0.1 s at
# 30 fps is 3.0000000000000004 frames); such a frame must still be kept.
INDEX_EPSILON = 1e-6


@contextlib.contextmanager
def opened(path: Any, what: str) -> Iterator[BinaryIO]:
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
def decoding(path: Any, what: str) -> Iterator[None]:
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


def check_container(container: Any, allowed: frozenset[str], path: Any, what: str) -> None:
    if container.format.name not in allowed:
        raise RequestError.about_file(
            path, f"not {FORMATS[what].describe()} (detected {container.format.name!r})"
        )


def _accepted(what: str) -> str:
    """What a file of this kind may be, for the messages about a file that is not one."""
    return f"; accepted: {FORMATS[what].describe()}" if what in FORMATS else ""


def stream_seconds(stream: Any) -> float | None:
    """The duration a stream declares, or None. Only a stream's own duration can show that it was cut short: a
    container's is the longest of its streams."""
    if stream.duration is not None and stream.duration > 0 and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return None


def declared_seconds(stream: Any, container: Any) -> float | None:
    seconds = stream_seconds(stream)
    if seconds is None and container.duration is not None and container.duration > 0:
        seconds = float(Fraction(container.duration, av.time_base))
    return seconds


def check_not_short(path: Any, what: str, decoded_seconds: float, declared_seconds: float) -> None:
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


def check_window(path: Any, start_seconds: Any, max_seconds: Any, *, open_end_allowed: bool) -> None:
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


def first_index_at(seconds: float, rate: float) -> int:
    return max(0, math.ceil(seconds * rate - INDEX_EPSILON))
