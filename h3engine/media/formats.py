"""The media formats H3 reads, in one table: per kind (image, video, audio) the file name suffixes offered and the
content formats accepted.

`FORMATS[kind]` is a `MediaFormat`; the app's pickers (`file_types`), the Ref2VA kind-from-suffix rule, the loaders
in h3engine.media.inputs (which recognise files by content, never by name) and their messages, and the CLI's help
all read it, so what is offered and what is accepted cannot drift apart. Images are JPEG, PNG and WEBP only: the
reference loaders take nothing else (Pillow would read BMP or TIFF, the model's reference pipeline does not).
`safe_file_name` is the name a stored copy of a user's file keeps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MediaFormat:
    """One kind's accepted files: `suffixes` (lower case, with the dot), `content` (what a person calls the formats),
    and, as detected from the bytes, Pillow format names (images) or FFmpeg demuxer names (video, audio)."""

    kind: str
    noun: str
    suffixes: tuple[str, ...]
    content: tuple[str, ...]
    detected: frozenset[str]

    def describe(self) -> str:
        """`"a JPEG, PNG or WEBP image (.jpg, .jpeg, .png, .webp)"`: for messages and help texts."""
        names = ", ".join(self.content[:-1]) + " or " + self.content[-1]
        article = "an" if names[0] in "AEFHILMNORSX" else "a"
        return f"{article} {names} {self.noun} ({', '.join(self.suffixes)})"


# FFmpeg demuxer names as detected from the content.
_VIDEO_DEMUXERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi"})

FORMATS = {
    "image": MediaFormat(
        kind="image",
        noun="image",
        suffixes=(".jpg", ".jpeg", ".png", ".webp"),
        content=("JPEG", "PNG", "WEBP"),
        # Pillow reports a JPEG that carries several pictures (cameras' stereo / preview images) as MPO.
        detected=frozenset({"JPEG", "PNG", "WEBP", "MPO"}),
    ),
    "video": MediaFormat(
        kind="video",
        noun="video",
        suffixes=(".mp4", ".mov", ".m4v", ".webm", ".mkv", ".avi"),
        content=("MP4", "QuickTime", "WebM", "Matroska", "AVI"),
        detected=_VIDEO_DEMUXERS,
    ),
    "audio": MediaFormat(
        kind="audio",
        noun="audio file",
        suffixes=(".wav", ".mp3", ".flac", ".ogg", ".oga", ".opus", ".m4a", ".aac"),
        content=("WAV", "MP3", "FLAC", "Ogg (Vorbis, Opus)", "M4A", "AAC"),
        # Every video container too, so that a video's soundtrack can be read as an audio file.
        detected=frozenset({"wav", "flac", "ogg", "mp3", "aac"}) | _VIDEO_DEMUXERS,
    ),
}
IMAGE_FORMAT = FORMATS["image"]
# Every suffix a reference may have, in table order (the Ref2VA picker's `file_types`).
REFERENCE_SUFFIXES = tuple(suffix for media in FORMATS.values() for suffix in media.suffixes)


def kind_of_suffix(path: str | Path) -> str | None:
    """The kind ("image", "video", "audio") the file name's suffix says, in any case; None for another suffix."""
    suffix = Path(path).suffix.lower()
    for kind, media in FORMATS.items():
        if suffix in media.suffixes:
            return kind
    return None


def accepted_text() -> str:
    """Every kind's formats in one sentence, e.g. for the CLI's help and messages about an unknown suffix."""
    return "; ".join(f"{kind}: {media.describe()}" for kind, media in FORMATS.items())


# A stored copy keeps the user's own file name (messages name it), less what a file system or a URL could misread:
# letters and digits of any script stay, as do a few punctuation marks; the rest becomes "_".
_UNSAFE_NAME_CHARACTERS = re.compile(r"[^\w.,()\[\]+@ -]+")
MAX_NAME_BYTES = 120


def safe_file_name(name: str) -> str:
    """The base name a stored copy of a user's file keeps (the page's inputs, the API's): no folders, no leading dot,
    only letters, digits and a few marks, at most MAX_NAME_BYTES of UTF-8 with the suffix kept; "file" if nothing is
    left."""
    cleaned = _UNSAFE_NAME_CHARACTERS.sub("_", Path(name).name).strip(" .")
    if len(cleaned.encode("utf-8")) > MAX_NAME_BYTES:
        # Shorten the stem, keep the suffix (it tells the kind): at most MAX_NAME_BYTES bytes of UTF-8.
        suffix = Path(cleaned).suffix[:16]
        stem = cleaned[: len(cleaned) - len(suffix)]
        while len((stem + suffix).encode("utf-8")) > MAX_NAME_BYTES:
            stem = stem[:-1]
        cleaned = stem.rstrip(" .") + suffix
    return cleaned or "file"
