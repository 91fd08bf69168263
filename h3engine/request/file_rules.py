"""The request's rules on its input files, from their probed facts (`MediaFacts`: one probe a file): reference
media sizes, durations and soundtracks, the prompt's labels (`reference_labels`), the duration a Ref2VA request
takes from its reference (`resolve_duration_seconds`) and the canvas aspect (`resolve_aspect`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from fractions import Fraction

from h3engine.errors import RequestError, file_name
from h3engine.request.checks import (
    describe,
    fail,
    is_integer,
    is_number,
)
from h3engine.request.files import MediaInfo, MediaProbe, Reference
from h3engine.request.geometry import (
    MAX_ASPECT_RATIO,
    MIN_ASPECT_RATIO,
    parse_aspect_ratio,
)
from h3engine.request.limits import (
    MAX_CLIP_SECONDS,
    MAX_DURATION_SECONDS,
    MAX_TOTAL_AUDIO_SECONDS,
    MAX_TOTAL_VIDEO_SECONDS,
    MIN_CLIP_SECONDS,
    MIN_DURATION_SECONDS,
)
from h3engine.request.model import (
    DEFAULT_ASPECT,
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    MIN_IMAGE_SIDE,
    GenerationRequest,
)

_LABEL_PATTERN = re.compile(r"<(?:Picture|Video|Audio) \d+>")


def check_duration_range(seconds: float, field: str, origin: str) -> None:
    if not MIN_DURATION_SECONDS <= seconds <= MAX_DURATION_SECONDS:
        fail(
            field,
            f"must be within [{MIN_DURATION_SECONDS:g}, {MAX_DURATION_SECONDS:g}] s{origin}, got {describe(seconds)}",
        )


def _probed(probe: MediaProbe, reference: Reference, field: str) -> MediaInfo:
    """The probe's facts; its RequestError (about the file) is filed under `field`."""
    try:
        return probe(reference)
    except RequestError as error:
        raise error.in_field(field) from None


def _check_reference_media(request: GenerationRequest, probe: MediaProbe) -> None:
    """The rules that need file facts: streams, clip lengths and totals, image ratios, derived duration."""
    total_seconds = {"video": 0.0, "audio": 0.0}
    for index, reference in enumerate(request.references):
        field = f"references[{index}]"
        info = _probed(probe, reference, field)
        if reference.kind == "image":
            size = _image_size(info, field, "reference image", reference.path)
            _check_image_ratio(size, field, "reference image")
            continue
        if reference.kind == "video" and not _has_size(info):
            fail(field, f"video file has no video stream: {describe(reference.path)}")
        if reference.kind == "video" and min(info.width, info.height) < MIN_IMAGE_SIDE:
            fail(
                field,
                f"video {file_name(reference.path)} frames are {info.width}x{info.height} pixels; each side must "
                f"be at least {MIN_IMAGE_SIDE}",
            )
        if reference.kind == "audio" and not info.has_audio:
            fail(field, f"audio file has no audio stream: {describe(reference.path)}")
        seconds = _clip_seconds(info, field)
        if not MIN_CLIP_SECONDS <= seconds <= MAX_CLIP_SECONDS:
            fail(
                field,
                f"{reference.kind} clip must last {MIN_CLIP_SECONDS:g}-{MAX_CLIP_SECONDS:g} s, "
                f"got {describe(seconds)} s",
            )
        if reference.start_seconds is not None and reference.start_seconds >= seconds:
            fail(
                f"{field}.start_seconds",
                f"must be less than the clip duration {seconds:g} s, got {describe(reference.start_seconds)}",
            )
        total_seconds[reference.kind] += seconds
    limits = {"video": MAX_TOTAL_VIDEO_SECONDS, "audio": MAX_TOTAL_AUDIO_SECONDS}
    for kind, total in total_seconds.items():
        if total > limits[kind]:
            fail("references", f"{kind} references may last {limits[kind]:g} s in total, got {total:g} s")
    if request.duration_seconds is None:
        seconds = resolve_duration_seconds(request, probe)
        check_duration_range(seconds, "duration_seconds", " (taken from the reference with audio)")


def reference_labels(kinds: Sequence[str], has_audio: Sequence[bool]) -> list[tuple[str, ...]]:
    """The prompt labels of each Ref2VA reference, in reference order, numbered per modality as the model was
    trained (h3engine.engine.conditioning.presentation.reference_presentation): `<Picture i>` for an image, `<Video k>` for a video,
    `<Audio j>` for an audio clip, and a video carrying audio (`has_audio`) takes an `<Audio j>` before its
    `<Video k>`."""
    counters = {"Picture": 0, "Video": 0, "Audio": 0}

    def next_label(modality: str) -> str:
        counters[modality] += 1
        return f"<{modality} {counters[modality]}>"

    labels = []
    for kind, carries_audio in zip(kinds, has_audio, strict=True):
        if kind == "image":
            labels.append((next_label("Picture"),))
        elif kind == "video":
            audio = (next_label("Audio"),) if carries_audio else ()
            labels.append(audio + (next_label("Video"),))
        else:
            labels.append((next_label("Audio"),))
    return labels


def _defined_labels(request: GenerationRequest, probe: MediaProbe) -> tuple[str, tuple[str, ...]]:
    """What defines the labels of `request`'s task, and those labels in order."""
    if request.task == "fl2va":
        return "the keyframes", tuple(
            f"<Picture {number}>" for number in range(1, len(request.keyframes) + 1)
        )
    if request.task != "ref2va":
        return f"task {request.task!r}", ()
    kinds = [reference.kind for reference in request.references]
    has_audio = [
        kind == "audio" or (kind == "video" and probe(ref).has_audio)
        for kind, ref in zip(kinds, request.references, strict=True)
    ]
    labels = reference_labels(kinds, has_audio)
    return "the references", tuple(label for entry in labels for label in entry)


def _check_prompt_labels(request: GenerationRequest, probe: MediaProbe) -> None:
    """Refuse a prompt citing a `<Picture N>`, `<Video N>` or `<Audio N>` that no input defines (other tags, such
    as `<Subject 1>` or `[Shot 1]`, are free text to the model)."""
    source, defined = _defined_labels(request, probe)
    cited = dict.fromkeys(match.group(0) for match in _LABEL_PATTERN.finditer(request.prompt))
    undefined = [label for label in cited if label not in defined]
    if not undefined:
        return
    defines = f"{source} define {', '.join(defined)}" if defined else f"{source} defines no labels"
    if not defined and request.task == "t2va":
        defines += " (labels cite fl2va keyframes or ref2va references)"
    fail("prompt", f"cites {', '.join(undefined)}, which no input defines: {defines}")


def resolve_duration_seconds(request: GenerationRequest, media_durations: MediaProbe | None) -> float:
    """The duration to generate: the requested one, or (Ref2VA) that of its one reference carrying audio.

    A video's soundtrack counts from the video's `start_seconds`. Expects a request that passed `validate`.
    """
    if request.duration_seconds is not None:
        return request.duration_seconds
    if media_durations is None:
        fail("duration_seconds", "is required when the reference media cannot be probed")
    with_audio = []
    for index, reference in enumerate(request.references):
        if reference.kind != "image" and media_durations(reference).has_audio:
            with_audio.append((index, reference))
    if len(with_audio) != 1:
        fail(
            "duration_seconds",
            f"is required unless exactly one reference carries audio, got {len(with_audio)}",
        )
    index, reference = with_audio[0]
    return _clip_seconds(media_durations(reference), f"references[{index}]") - (
        reference.start_seconds or 0.0
    )


def _checked_keyframe_sizes(request: GenerationRequest, probe: MediaProbe) -> tuple[int, int] | None:
    """Every keyframe must be a readable image; the first listed one's size is returned (it anchors 'auto')."""
    sizes = [
        _image_size(
            _probed(probe, Reference(kind="image", path=keyframe.path), f"keyframes[{index}]"),
            f"keyframes[{index}]",
            "keyframe image",
            keyframe.path,
        )
        for index, keyframe in enumerate(request.keyframes)
    ]
    return sizes[0] if sizes else None


def _has_size(info: MediaInfo) -> bool:
    return is_integer(info.width) and is_integer(info.height) and info.width > 0 and info.height > 0


def _image_size(info: MediaInfo, field: str, what: str, path: str) -> tuple[int, int]:
    if not _has_size(info):
        fail(field, f"{what} has no usable size, got {describe(info.width)}x{describe(info.height)}")
    width, height = info.width, info.height
    size = f"{what} {file_name(path)} is {describe(width)}x{describe(height)} pixels"
    if min(width, height) < MIN_IMAGE_SIDE:
        fail(field, f"{size}; each side must be at least {MIN_IMAGE_SIDE}")
    if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        fail(
            field,
            f"{size}; at most {MAX_IMAGE_SIDE} pixels a side and {MAX_IMAGE_PIXELS:,} pixels in all are read "
            f"(the model's largest picture is 8192x2048): downscale it",
        )
    return width, height


def _check_image_ratio(size: tuple[int, int], field: str, what: str) -> None:
    if not _ratio_is_supported(*size):
        fail(field, f"{what} ratio must be within 1:4 to 4:1, got {size[0]}x{size[1]}")


def _ratio_is_supported(width: float, height: float) -> bool:
    # Exact rational comparison: a probe may report absurd sizes, and int / int overflows a float past 1e308.
    ratio = Fraction(width) / Fraction(height)
    return Fraction(MIN_ASPECT_RATIO) <= ratio <= Fraction(MAX_ASPECT_RATIO)


def _clip_seconds(info: MediaInfo, field: str) -> float:
    seconds = info.duration_seconds
    if not is_number(seconds) or (isinstance(seconds, float) and not math.isfinite(seconds)) or seconds <= 0:
        fail(field, f"clip duration is unknown, got {describe(seconds)}")
    return seconds


def _aspect_follows_keyframe(request: GenerationRequest) -> bool:
    return request.task == "fl2va" and request.aspect_ratio == "auto" and request.width is None


def resolve_aspect(
    request: GenerationRequest, first_keyframe_size: tuple[int, int] | None
) -> tuple[float, float]:
    """The (width, height) aspect of the canvas, checked to lie within 1:4..4:1; pass it to the canvas resolver.

    An explicit width/height wins; "auto" is 16:9 for T2VA and Ref2VA (references never bind the geometry) and
    the first listed keyframe's own (width, height) for FL2VA. Expects a request that passed `validate`.
    """
    follows = ""
    if request.width is not None and request.height is not None:
        aspect, field = (request.width, request.height), "width, height"
    elif request.aspect_ratio != "auto":
        aspect, field = parse_aspect_ratio(request.aspect_ratio), "aspect_ratio"
    elif request.task == "fl2va":
        if first_keyframe_size is None:
            fail("keyframes[0]", "its image size is needed to resolve aspect_ratio 'auto'")
        aspect, field, follows = first_keyframe_size, "aspect_ratio", " ('auto' follows keyframes[0])"
    else:
        aspect, field = DEFAULT_ASPECT, "aspect_ratio"
    width, height = aspect
    if not _ratio_is_supported(width, height):
        fail(
            field,
            f"resolved ratio{follows} must be within 1:4 to 4:1, got {describe(width)}:{describe(height)}",
        )
    return width, height
