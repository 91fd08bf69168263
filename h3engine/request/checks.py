"""Small checks the request rules share: each raises a RequestError naming its field.

`fail(field, problem)` raises; `parse_rungs(text, field)` reads "999,750,500,250" (every door's rungs); `describe(value)` prints any value short (huge integers by their size, long texts
cut) with its type unless it is a plain JSON scalar; `check_local_path` refuses empty paths, NUL characters,
lone surrogates (text that is not UTF-8) and URIs.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, NoReturn

from h3engine.errors import RequestError


def fail(field: str, problem: str) -> NoReturn:
    raise RequestError(field, problem)


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_integer_range(value: Any, field: str, minimum: int, maximum: int | None) -> None:
    if not is_integer(value):
        fail(field, f"must be an integer, got {describe(value)}")
    if value < minimum:
        fail(field, f"must be >= {minimum}, got {describe(value)}")
    if maximum is not None and value > maximum:
        fail(field, f"must be <= {maximum}, got {describe(value)}")


def check_finite_number(value: Any, field: str) -> None:
    # Only floats can be NaN or infinite; ints are compared as they are (a huge one must not go through float).
    if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        fail(field, f"must be a finite number, got {describe(value)}")


def check_local_path(value: Any, field: str) -> None:
    if not isinstance(value, str) or not value.strip():
        fail(field, f"must be a non-empty path, got {describe(value)}")
    if "\x00" in value:
        fail(field, "must not contain a NUL character")
    # Such a name opens, but the UTF-8 sidecar that records it could not be written after the generation.
    check_utf8(value, field)
    if uri_scheme(value) is not None:
        fail(
            field,
            f"must be a local path, not a URI (from_dict turns file:// URIs into paths), got {describe(value)}",
        )


def uri_scheme(value: str) -> str | None:
    """The scheme of `scheme://...`, or None for a path (a one-letter "scheme" is a Windows drive: `C://x`)."""
    head, separator, _ = value.partition("://")
    if not separator or len(head) < 2 or not head[0].isalpha():
        return None
    if not all(character.isalnum() or character in "+-." for character in head):
        return None
    return head.lower()


def check_utf8(value: str, field: str) -> None:
    """Refuse lone surrogates: what Python makes of bytes that are not UTF-8 (command-line arguments, file names) or
    of half a UTF-16 pair in JSON. The tokenizer, the sidecar and the MP4 muxer would all fail on them later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        fail(
            field,
            f"must be valid UTF-8 text; character {error.start} is {value[error.start]!r}, a lone surrogate "
            "(a byte that is not UTF-8, or half a UTF-16 pair)",
        )


class _ShortRepr(reprlib.Repr):
    """reprlib, except that huge ints are not printed: past 4300 digits Python refuses to turn them into text."""

    def repr_int(self, value: int, level: int) -> str:
        if value.bit_length() > 64:
            return f"<{value.bit_length()}-bit integer>"
        return super().repr_int(value, level)


_SHORT_REPR = _ShortRepr()
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxstring = 48
_SHORT_REPR.maxother = 48


def describe(value: Any) -> str:
    """A short printable form of any value for messages, with its type unless it is a plain JSON scalar."""
    text = _SHORT_REPR.repr(value)
    if value is None or isinstance(value, str | int | float):
        return text
    return f"{text} ({type(value).__name__})"


def parse_rungs(text: Any, field: str = "rungs") -> tuple[int, ...]:
    """Rungs written as text, "999,750,500,250" (empty or None: none), as integers; RequestError naming `field`
    otherwise. The request rules judge the numbers (h3engine.request)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return ()
    try:
        if not isinstance(text, str):
            raise ValueError
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        fail(field, f"expected comma-separated integers such as 999,750,500,250, got {describe(text)}")
