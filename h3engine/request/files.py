"""A request's input files: keyframes and Ref2VA references, and what a probe says of each (`MediaFacts`: each file
probed once and remembered). Re-exported by h3engine.request; h3engine.request.remix reads them here (no import of
the package that imports it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

KeyframePosition = Literal["first", "last"]
ReferenceKind = Literal["image", "video", "audio"]


@dataclass(frozen=True)
class Keyframe:
    """An image the generated video starts ("first") or ends ("last") on."""

    path: str
    position: KeyframePosition


@dataclass(frozen=True)
class Reference:
    """A Ref2VA reference; its place in `GenerationRequest.references` is its label number in the prompt."""

    kind: ReferenceKind
    path: str
    start_seconds: float | None = None


@dataclass(frozen=True)
class MediaInfo:
    """Facts about one media file, measured by the caller's probe (None where the file has no such stream)."""

    duration_seconds: float | None
    has_audio: bool
    width: int | None
    height: int | None


MediaProbe = Callable[[Reference], MediaInfo]


class MediaFacts:
    """The facts of a request's input files, each file probed once and remembered: a `MediaProbe` that asks
    `probe` (h3engine.media.inputs.probe_media, or a test's) only about a file it has not seen, by kind and path; a
    keyframe is asked about as an image reference. Probing opens and may decode a file, and several rules (and the
    engine, after them) ask about the same one."""

    def __init__(self, probe: MediaProbe) -> None:
        self._probe = probe
        self._facts: dict[tuple[str, str], MediaInfo] = {}

    def __call__(self, entry: Reference | Keyframe) -> MediaInfo:
        kind = "image" if isinstance(entry, Keyframe) else entry.kind
        key = (kind, entry.path)
        if key not in self._facts:
            self._facts[key] = self._probe(Reference(kind=kind, path=entry.path))
        return self._facts[key]

    def moved(self, place: Callable[[str], str]) -> MediaFacts:
        """These facts for the same files at the paths `place` gives (copies of the same bytes)."""
        moved = MediaFacts(self._probe)
        moved._facts = {(kind, place(path)): info for (kind, path), info in self._facts.items()}
        return moved

    @classmethod
    def of(cls, probe: MediaProbe) -> MediaFacts:
        """`probe` itself when it already remembers, else a `MediaFacts` asking it."""
        return probe if isinstance(probe, MediaFacts) else cls(probe)
