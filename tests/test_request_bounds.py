"""Upper bounds of request fields (issue 17, "Hardening"): every number and every text a request carries is
refused past a bound derived from the model's limits, by `validate`, before any model work, with a message that
names the field (`RequestError.field`) and says what would be accepted: these bounds' messages are made in
h3engine/request (validate.py, file_rules.py), and this is where their wording is checked.

Bounds restated here on purpose (not imported), so that a changed constant shows up as a failing test.
"""

from __future__ import annotations

import dataclasses

import pytest
from _refusals import refused

from h3engine.errors import RequestError
from h3engine.request.files import Keyframe, MediaInfo, Reference
from h3engine.request.model import GenerationRequest
from h3engine.request.validate import validate

PICTURE = "/media/picture.png"


def t2va(**changes: object) -> GenerationRequest:
    values = {"task": "t2va", "prompt": "A lighthouse at dusk, waves below.", "duration_seconds": 5.0}
    values.update(changes)
    return GenerationRequest(**values)


def refusal(request: GenerationRequest, probe=None, **options: object) -> RequestError:
    with pytest.raises(RequestError) as caught:
        validate(request, probe, **options)
    return caught.value


def field_and_problem(error: RequestError) -> tuple[str, str]:
    return error.field, error.problem


def probe_sizes(sizes: dict[str, tuple[int, int]], seconds: float | None = None):
    """A probe reporting `sizes[path]` as (width, height) (and a duration for clips)."""

    def probe(reference: Reference) -> MediaInfo:
        width, height = sizes[reference.path]
        return MediaInfo(duration_seconds=seconds, has_audio=False, width=width, height=height)

    return probe


# ---------------------------------------------------------------------------------------------------------------
# Prompt: characters, tokens, UTF-8


def test_prompt_character_bound() -> None:
    official_length = "For the target video, <Picture 1> is fully referenced. " * 80  # ~4,400 characters
    assert validate(t2va(prompt=official_length)) == []
    assert validate(t2va(prompt="x" * 32_768)) == []
    error = refusal(t2va(prompt="x" * 200_000))
    assert field_and_problem(error) == ("prompt", "must be at most 32,768 characters, got 200,000")


def test_prompt_token_bound_counts_with_the_given_tokenizer() -> None:
    from h3engine.request.validate import check_prompt_tokens

    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return 8_193

    error = refusal(t2va(prompt="a fox"), count_prompt_tokens=count)
    assert error.field == "prompt"
    assert error.problem.startswith("must be at most 8,192 tokens of the checkpoint's tokenizer, got 8,193")
    assert counted == ["a fox"]
    assert validate(t2va(prompt="a fox"), count_prompt_tokens=lambda text: 8_192) == []
    check_prompt_tokens("a fox", lambda text: 8_192)
    with refused(RequestError, field="prompt"):
        # The character bound comes first: the tokenizer never sees an oversized prompt.
        check_prompt_tokens("x" * 40_000, count)
    assert counted == ["a fox"]


def test_the_token_count_runs_before_the_media_probe() -> None:
    probed: list[str] = []

    def probe(reference: Reference) -> MediaInfo:
        probed.append(reference.path)
        return MediaInfo(duration_seconds=None, has_audio=False, width=64, height=64)

    request = GenerationRequest(
        task="fl2va", prompt="p", duration_seconds=5.0, keyframes=(Keyframe(PICTURE, "first"),)
    )
    assert refusal(request, probe, count_prompt_tokens=lambda text: 10**6).field == "prompt"
    assert probed == []


@pytest.mark.parametrize(
    "prompt",
    ["a fox \udcff in snow", "half a pair \ud83d", "\udc80"],
    ids=["undecodable-byte", "lone-high-surrogate", "only-surrogate"],
)
def test_prompt_must_be_valid_utf8(prompt: str) -> None:
    error = refusal(t2va(prompt=prompt))
    assert error.field == "prompt" and error.problem.startswith("must be valid UTF-8 text"), error
    assert "lone surrogate" in error.problem


def test_paths_must_be_valid_utf8() -> None:
    request = GenerationRequest(
        task="fl2va",
        prompt="p",
        duration_seconds=5.0,
        keyframes=(Keyframe("/media/\udcffframe.png", "first"),),
    )
    assert refusal(request).field == "keyframes[0].path"
    request = GenerationRequest(
        task="ref2va", prompt="p", duration_seconds=5.0, references=(Reference("image", "/media/\udcff.png"),)
    )
    assert refusal(request).field == "references[0].path"


# ---------------------------------------------------------------------------------------------------------------
# Numbers: canvas, shifts, start times


def test_short_edge_bound() -> None:
    assert validate(t2va(short_edge=2048)) == ["short_edge: 2048 is outside the verified configuration (768)"]
    assert field_and_problem(refusal(t2va(short_edge=100_000))) == (
        "short_edge",
        "must be <= 2048, got 100000",
    )
    huge = refusal(t2va(short_edge=2**70))
    assert field_and_problem(huge) == ("short_edge", "must be <= 2048, got <71-bit integer>")


def test_explicit_canvas_area_bound() -> None:
    # 2048 x 3584 (7,340,032 pixels) is the released area cap scaled to the largest short edge.
    validate(t2va(width=3584, height=2048))
    validate(t2va(width=2048, height=3584))
    error = refusal(t2va(width=4096, height=2048))
    assert error.field == "width, height", error
    assert error.problem.startswith("the canvas may have at most 7,340,032 pixels"), error
    assert "got 4096x2048 = 8,388,608" in error.problem


@pytest.mark.parametrize("field", ["flow_shift", "audio_flow_shift"])
def test_flow_shift_bounds(field: str) -> None:
    for accepted in (0.001, 0.5, 12.0, 1000):
        validate(t2va(**{field: accepted}))
    for value in (1e308, 1000.5, 0.0009):
        error = refusal(t2va(**{field: value}))
        assert error.field == field and error.problem.startswith("must be within [0.001, 1000]"), error
    assert field_and_problem(refusal(t2va(**{field: 0}))) == (field, "must be positive, got 0")


def test_start_seconds_bound_without_a_probe() -> None:
    def ref2va(start: float) -> GenerationRequest:
        return GenerationRequest(
            task="ref2va",
            prompt="p",
            duration_seconds=5.0,
            references=(Reference("video", "/m/c.mp4", start),),
        )

    validate(ref2va(14.5))
    for start in (15.0, 1e300):
        error = refusal(ref2va(start))
        assert error.field == "references[0].start_seconds", error
        assert error.problem.startswith("must be less than 15 s"), error


# ---------------------------------------------------------------------------------------------------------------
# Image sizes (from the probe, i.e. the file header)


@pytest.mark.parametrize(
    ("size", "wording"),
    [
        ((1, 1), "is 1x1 pixels; each side must be at least 16"),
        ((15, 40), "is 15x40 pixels; each side must be at least 16"),
        ((8190, 8190), "is 8190x8190 pixels; at most 8192 pixels a side and 16,777,216 pixels in all"),
        ((8200, 2050), "is 8200x2050 pixels; at most 8192 pixels a side"),
        ((4100, 4100), "is 4100x4100 pixels; at most 8192 pixels a side and 16,777,216 pixels in all"),
    ],
    ids=["1x1", "narrow", "8190-square", "side", "area"],
)
def test_image_size_bounds_name_the_field_and_the_file(size: tuple[int, int], wording: str) -> None:
    probe = probe_sizes({PICTURE: size, "/media/ok.png": (64, 36)})
    keyframe = GenerationRequest(
        task="fl2va", prompt="p", duration_seconds=5.0, keyframes=(Keyframe(PICTURE, "first"),)
    )
    error = refusal(keyframe, probe)
    assert error.field == "keyframes[0]" and error.problem.startswith(f"keyframe image '{PICTURE}' "), error
    assert wording in error.problem, error
    last = GenerationRequest(
        task="fl2va",
        prompt="p",
        duration_seconds=5.0,
        aspect_ratio="16:9",
        keyframes=(Keyframe("/media/ok.png", "first"), Keyframe(PICTURE, "last")),
    )
    assert refusal(last, probe).field == "keyframes[1]"
    reference = GenerationRequest(
        task="ref2va", prompt="p", duration_seconds=5.0, references=(Reference("image", PICTURE),)
    )
    error = refusal(reference, probe)
    assert error.field == "references[0]" and error.problem.startswith(f"reference image '{PICTURE}' "), error
    assert wording in error.problem, error


def test_image_size_bounds_accept_the_extremes() -> None:
    sizes = {"/a.png": (16, 16), "/b.png": (8192, 2048), "/c.png": (4096, 4096), "/d.png": (2048, 8192)}
    probe = probe_sizes(sizes)
    request = GenerationRequest(
        task="ref2va",
        prompt="p",
        duration_seconds=5.0,
        references=tuple(Reference("image", path) for path in sizes),
    )
    assert validate(request, probe) == []


def test_video_reference_frames_need_the_minimum_side() -> None:
    probe = probe_sizes({"/m/tiny.mp4": (8, 8), "/m/ok.mp4": (64, 36)}, seconds=5.0)
    request = GenerationRequest(
        task="ref2va", prompt="p", duration_seconds=5.0, references=(Reference("video", "/m/tiny.mp4"),)
    )
    assert field_and_problem(refusal(request, probe)) == (
        "references[0]",
        "video '/m/tiny.mp4' frames are 8x8 pixels; each side must be at least 16",
    )
    assert validate(dataclasses.replace(request, references=(Reference("video", "/m/ok.mp4"),)), probe) == []
