"""Tests for h3engine.request: every validation rule, both payload shapes, round trips, and a fuzz run.

The rule table drives each invalid request through `from_dict` + `validate` and checks the RequestError's field
and that its problem holds the rule's own wording: the one place where these messages' wording is checked (other
tests check the class and the field). All messages of the table must differ, so no two rules collapse into one
vague error. The fuzz run mutates valid payloads at random and requires that each one
either validates (and then survives a JSON round trip) or raises `RequestError` naming a field.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from _refusals import refused

from h3engine.engine.resolved import resolve_request
from h3engine.errors import RequestError
from h3engine.request.file_rules import reference_labels, resolve_aspect, resolve_duration_seconds
from h3engine.request.files import Keyframe, MediaInfo, Reference
from h3engine.request.geometry import frames_for_duration, resolve_canvas
from h3engine.request.model import GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.request.validate import validate

# ---------------------------------------------------------------------------------------------------------------
# Media the fake probe knows about (what the PyAV/Pillow probe would report for such files)

PICTURE = "/media/picture_1920x1080.png"
LORA = __file__  # request validation only checks that a LoRA's path names a file
LORA_FOLDER = str(Path(__file__).parent)
PORTRAIT = "/media/portrait_1080x1920.png"
WIDE_PICTURE = "/media/wide_2000x400.png"
BROKEN_PICTURE = "/media/broken.png"
CLIP_WITH_SOUND = "/media/clip_6s_sound.mp4"
SILENT_CLIP = "/media/clip_6s_silent.mp4"
SILENT_CLIP_8S = "/media/clip_8s_silent.mp4"
CLIP_1S = "/media/clip_1s.mp4"
CLIP_16S = "/media/clip_16s.mp4"
SOUND_ONLY_MP4 = "/media/sound_only.mp4"
VOICE_5S = "/media/voice_5s.wav"
VOICE_3S = "/media/voice_3s.wav"
VOICE_8S = "/media/voice_8s.wav"
SILENT_WAV = "/media/silent.wav"
UNKNOWN_LENGTH_WAV = "/media/unknown_length.wav"

MEDIA = {
    PICTURE: MediaInfo(duration_seconds=None, has_audio=False, width=1920, height=1080),
    PORTRAIT: MediaInfo(duration_seconds=None, has_audio=False, width=1080, height=1920),
    WIDE_PICTURE: MediaInfo(duration_seconds=None, has_audio=False, width=2000, height=400),
    BROKEN_PICTURE: MediaInfo(duration_seconds=None, has_audio=False, width=None, height=None),
    CLIP_WITH_SOUND: MediaInfo(duration_seconds=6.0, has_audio=True, width=1280, height=720),
    SILENT_CLIP: MediaInfo(duration_seconds=6.0, has_audio=False, width=1280, height=720),
    SILENT_CLIP_8S: MediaInfo(duration_seconds=8.0, has_audio=False, width=1280, height=720),
    CLIP_1S: MediaInfo(duration_seconds=1.0, has_audio=False, width=640, height=360),
    CLIP_16S: MediaInfo(duration_seconds=16.0, has_audio=False, width=640, height=360),
    SOUND_ONLY_MP4: MediaInfo(duration_seconds=6.0, has_audio=True, width=None, height=None),
    VOICE_5S: MediaInfo(duration_seconds=5.0, has_audio=True, width=None, height=None),
    VOICE_3S: MediaInfo(duration_seconds=3.0, has_audio=True, width=None, height=None),
    VOICE_8S: MediaInfo(duration_seconds=8.0, has_audio=True, width=None, height=None),
    SILENT_WAV: MediaInfo(duration_seconds=5.0, has_audio=False, width=None, height=None),
    UNKNOWN_LENGTH_WAV: MediaInfo(duration_seconds=None, has_audio=True, width=None, height=None),
}


def probe_media(reference: Reference) -> MediaInfo:
    return MEDIA[reference.path]


# ---------------------------------------------------------------------------------------------------------------
# Payload builders

T2VA = {"task": "t2va", "prompt": "A lighthouse at dusk, waves below.", "duration_seconds": 10}
FL2VA = {
    "task": "fl2va",
    "prompt": "The family lifts their bowls.",
    "duration_seconds": 8,
    "keyframes": [{"path": PICTURE, "position": "first"}],
}
REF2VA = {
    "task": "ref2va",
    "prompt": "<Picture 1> walks through <Video 1>.",
    "duration_seconds": 5,
    "references": [{"kind": "image", "path": PICTURE}, {"kind": "video", "path": CLIP_WITH_SOUND}],
}
SGLANG_T2VA = {
    "task": "t2va",
    "prompt": "integrated_multimodal_description: [Shot 1] a starship bridge ...",
    "target": {"short_edge": 768, "aspect_ratio": "16:9", "duration_seconds": 10},
    "seed": 0,
    "conditions": [],
}
SGLANG_FL2VA = {
    "task": "fl2va",
    "prompt": "For the target video, at 0.00 seconds into the target video, <Picture 1> is fully referenced.",
    "target": {"short_edge": 768, "aspect_ratio": "auto", "duration_seconds": 8},
    "seed": 0,
    "conditions": [{"type": "image", "uri": f"file://{PICTURE}", "role": "keyframe", "frame_index": 0}],
}
SGLANG_REF2VA = {
    "task": "ref2va",
    "prompt": "subject_definitions: <Subject 1>, <Video 1>, <Audio 1>, <Audio 2> ...",
    "target": {"short_edge": 768, "aspect_ratio": "auto", "duration_seconds": 5},
    "seed": 0,
    "conditions": [
        {"type": "video", "uri": f"file://{CLIP_WITH_SOUND}", "role": "reference"},
        {"type": "audio", "uri": f"file://{VOICE_5S}", "role": "reference"},
    ],
}

DELETE = object()


def edit(base: dict, **changes: object) -> dict:
    """A deep copy of `base` with top-level fields replaced (or removed with DELETE)."""
    payload = copy.deepcopy(base)
    for name, value in changes.items():
        if value is DELETE:
            del payload[name]
        else:
            payload[name] = value
    return payload


def with_references(*references: tuple, **changes: object) -> dict:
    """A Ref2VA payload with the given (kind, path[, start_seconds]) references."""
    entries = []
    for kind, path, *start in references:
        entry = {"kind": kind, "path": path}
        if start:
            entry["start_seconds"] = start[0]
        entries.append(entry)
    return edit(REF2VA, references=entries, **changes)


def with_keyframes(*keyframes: tuple[str, str], **changes: object) -> dict:
    return edit(
        FL2VA, keyframes=[{"path": path, "position": position} for path, position in keyframes], **changes
    )


def with_condition(base: dict, index: int, **changes: object) -> dict:
    payload = copy.deepcopy(base)
    condition = payload["conditions"][index]
    for name, value in changes.items():
        if value is DELETE:
            del condition[name]
        else:
            condition[name] = value
    return payload


def run(payload: object, media: bool = False) -> list[str]:
    # JSON-like payloads go through from_dict; anything else is handed to validate as a request object.
    request = from_dict(payload) if isinstance(payload, dict | list) else payload
    return validate(request, probe_media if media else None)


# ---------------------------------------------------------------------------------------------------------------
# The rule table: (payload, probe media?, field the message starts with, the rule's own wording)

NINE_IMAGES = [("image", PICTURE)] * 9

INVALID = [
    # the payload itself
    pytest.param([T2VA], False, "request", "must be a JSON object", id="payload-not-object"),
    pytest.param("not a request", False, "request", "must be a GenerationRequest", id="validate-non-request"),
    # task and prompt
    pytest.param(edit(T2VA, task=DELETE), False, "task", "is required", id="task-missing"),
    pytest.param(edit(T2VA, task="i2v"), False, "task", "must be one of t2va, fl2va, ref2va", id="task-unknown"),
    pytest.param(edit(T2VA, task=["t2va"]), False, "task", "must be one of", id="task-list"),
    pytest.param(edit(T2VA, prompt=DELETE), False, "prompt", "is required", id="prompt-missing"),
    pytest.param(edit(T2VA, prompt=""), False, "prompt", "must be a non-empty string", id="prompt-empty"),
    pytest.param(edit(T2VA, prompt=" \n\t"), False, "prompt", "must be a non-empty string", id="prompt-blank"),
    pytest.param(edit(T2VA, prompt=42), False, "prompt", "must be a non-empty string", id="prompt-number"),
    pytest.param(
        edit(T2VA, prompt="a cat <|image_pad|>"), False, "prompt", "reserved token", id="prompt-vision-token"
    ),
    # duration
    # The README's example message (under the API's name for the field, seconds).
    pytest.param(edit(T2VA, duration_seconds=3), False, "duration_seconds", "must be within [4, 15] s, got 3", id="duration-short"),
    pytest.param(edit(T2VA, duration_seconds=15.5), False, "duration_seconds", "got 15.5", id="duration-long"),
    pytest.param(edit(T2VA, duration_seconds=float("nan")), False, "duration_seconds", "finite number, got nan", id="duration-nan"),
    pytest.param(edit(T2VA, duration_seconds=float("inf")), False, "duration_seconds", "finite number, got inf", id="duration-inf"),
    pytest.param(edit(T2VA, duration_seconds="10"), False, "duration_seconds", "finite number, got '10'", id="duration-string"),
    pytest.param(edit(T2VA, duration_seconds=True), False, "duration_seconds", "finite number, got True", id="duration-bool"),
    pytest.param(edit(T2VA, duration_seconds=10**400), False, "duration_seconds", "1329-bit integer", id="duration-huge-int"),
    pytest.param(edit(T2VA, duration_seconds=None), False, "duration_seconds", "is required for task 't2va'", id="duration-none-t2va"),
    pytest.param(edit(FL2VA, duration_seconds=None), False, "duration_seconds", "is required for task 'fl2va'", id="duration-none-fl2va"),
    pytest.param(
        with_references(("image", PICTURE), ("audio", VOICE_5S), ("audio", VOICE_3S), duration_seconds=None),
        False, "duration_seconds", "several references carry audio", id="duration-none-two-audio",
    ),
    pytest.param(
        with_references(("image", PICTURE), duration_seconds=None),
        False, "duration_seconds", "exactly one reference with audio to take", id="duration-none-images-only",
    ),
    pytest.param(
        with_references(("image", PICTURE), ("video", SILENT_CLIP), duration_seconds=None),
        True, "duration_seconds", "exactly one reference carries audio, got 0", id="duration-none-silent-video",
    ),
    pytest.param(
        with_references(("video", CLIP_WITH_SOUND), ("audio", VOICE_5S), duration_seconds=None),
        True, "duration_seconds", "exactly one reference carries audio, got 2", id="duration-none-soundtrack-and-audio",
    ),
    pytest.param(
        with_references(("image", PICTURE), ("audio", VOICE_3S), duration_seconds=None),
        True, "duration_seconds", "(taken from the reference with audio), got 3.0", id="duration-derived-too-short",
    ),
    pytest.param(
        with_references(("video", CLIP_WITH_SOUND, 2.5), duration_seconds=None),
        True, "duration_seconds", "(taken from the reference with audio), got 3.5", id="duration-derived-after-start",
    ),
    # canvas
    pytest.param(edit(T2VA, aspect_ratio="2:1"), False, "aspect_ratio", "must be 'auto' or one of 21:9, 16:9", id="aspect-unlisted"),
    pytest.param(edit(T2VA, aspect_ratio=1.78), False, "aspect_ratio", "must be 'auto' or one of", id="aspect-number"),
    pytest.param(
        with_keyframes((WIDE_PICTURE, "first"), aspect_ratio="auto"),
        True, "aspect_ratio", "resolved ratio ('auto' follows keyframes[0]) must be within 1:4 to 4:1, got 2000:400",
        id="aspect-auto-keyframe-too-wide",
    ),
    pytest.param(edit(T2VA, short_edge=0), False, "short_edge", "must be >= 1, got 0", id="short-edge-zero"),
    pytest.param(edit(T2VA, short_edge=768.5), False, "short_edge", "must be an integer, got 768.5", id="short-edge-fraction"),
    pytest.param(edit(T2VA, short_edge="768"), False, "short_edge", "must be an integer, got '768'", id="short-edge-string"),
    pytest.param(edit(T2VA, width=1344), False, "height", "width and height go together", id="width-without-height"),
    pytest.param(edit(T2VA, height=768), False, "width", "width and height go together", id="height-without-width"),
    pytest.param(edit(T2VA, width=1000, height=768), False, "width", "must be a multiple of 32, got 1000", id="width-not-multiple"),
    pytest.param(edit(T2VA, width=1344, height=770), False, "height", "must be a multiple of 32, got 770", id="height-not-multiple"),
    pytest.param(edit(T2VA, width=8192, height=4096), False, "width", "must be <= 4096, got 8192", id="width-too-large"),
    pytest.param(edit(T2VA, width=0, height=32), False, "width", "must be >= 32, got 0", id="width-zero"),
    pytest.param(
        edit(T2VA, width=1344, height=768, aspect_ratio="9:16"),
        False, "aspect_ratio", "must be 'auto' when width and height are given", id="canvas-and-aspect",
    ),
    pytest.param(
        edit(T2VA, width=4096, height=32), False, "width, height", "resolved ratio must be within 1:4 to 4:1",
        id="canvas-ratio",
    ),
    # seed, steps, shifts, recipe
    pytest.param(edit(T2VA, seed=-1), False, "seed", "must be >= 0, got -1", id="seed-negative"),
    pytest.param(edit(T2VA, seed=2**63), False, "seed", "must be <= 9223372036854775807", id="seed-too-large"),
    pytest.param(edit(T2VA, seed=1.5), False, "seed", "must be an integer, got 1.5", id="seed-fraction"),
    pytest.param(edit(T2VA, seed=True), False, "seed", "must be an integer, got True", id="seed-bool"),
    pytest.param(edit(T2VA, steps=0), False, "steps", "must be >= 1, got 0", id="steps-zero"),
    pytest.param(edit(T2VA, steps=1, recipe="diffusers"), False, "steps", "must be >= 2, got 1", id="steps-one-diffusers"),
    pytest.param(edit(T2VA, steps=10**6), False, "steps", "must be <= 1000", id="steps-huge"),
    pytest.param(edit(T2VA, steps="50"), False, "steps", "must be an integer, got '50'", id="steps-string"),
    pytest.param(edit(T2VA, flow_shift=0), False, "flow_shift", "must be positive, got 0", id="flow-shift-zero"),
    pytest.param(edit(T2VA, flow_shift=float("nan")), False, "flow_shift", "finite number", id="flow-shift-nan"),
    pytest.param(edit(T2VA, audio_flow_shift=-3.0), False, "audio_flow_shift", "must be positive, got -3.0", id="audio-shift-negative"),
    pytest.param(edit(T2VA, audio_flow_shift=float("inf")), False, "audio_flow_shift", "finite number", id="audio-shift-inf"),
    pytest.param(edit(T2VA, recipe="comfy"), False, "recipe", "must be one of sglang, diffusers", id="recipe-unknown"),
    # keyframes
    pytest.param(edit(T2VA, keyframes=FL2VA["keyframes"]), False, "keyframes", "task 't2va' takes no keyframes", id="t2va-keyframe"),
    pytest.param(edit(FL2VA, keyframes=[]), False, "keyframes", "needs a first and/or a last keyframe", id="fl2va-no-keyframe"),
    pytest.param(with_keyframes((PICTURE, "last"), (PORTRAIT, "first")), False, "keyframes", "first then last, got last, first", id="keyframes-reversed"),
    pytest.param(with_keyframes((PICTURE, "first"), (PORTRAIT, "first")), False, "keyframes", "got first, first", id="keyframes-twice-first"),
    pytest.param(
        with_keyframes((PICTURE, "first"), (PORTRAIT, "last"), (PICTURE, "last")),
        False, "keyframes", "got first, last, last", id="keyframes-three",
    ),
    pytest.param(with_keyframes((PICTURE, "middle")), False, "keyframes[0].position", "must be 'first' or 'last'", id="keyframe-position"),
    pytest.param(with_keyframes(("", "first")), False, "keyframes[0].path", "must be a non-empty path", id="keyframe-path-empty"),
    pytest.param(
        with_keyframes(("https://cdn.example.com/frame.png", "first")),
        False, "keyframes[0].path", "remote URIs are not supported", id="keyframe-path-https",
    ),
    pytest.param(edit(FL2VA, keyframes=[{"path": PICTURE}]), False, "keyframes[0].position", "is required", id="keyframe-position-missing"),
    pytest.param(
        edit(FL2VA, keyframes=[{"path": PICTURE, "position": "first", "frame_index": 0}]),
        False, "keyframes[0].frame_index", "unknown field (allowed: path, position)", id="keyframe-unknown-field",
    ),
    pytest.param(edit(FL2VA, keyframes=PICTURE), False, "keyframes", "must be a list", id="keyframes-not-list"),
    pytest.param(edit(FL2VA, keyframes=[PICTURE]), False, "keyframes[0]", "must be an object with path, position", id="keyframe-not-object"),
    pytest.param(
        with_keyframes((BROKEN_PICTURE, "first"), aspect_ratio="16:9"),
        True, "keyframes[0]", "keyframe image has no usable size", id="keyframe-unreadable",
    ),
    # references
    pytest.param(edit(T2VA, references=REF2VA["references"]), False, "references", "task 't2va' takes no references", id="t2va-reference"),
    pytest.param(edit(FL2VA, references=REF2VA["references"]), False, "references", "task 'fl2va' takes no references", id="fl2va-reference"),
    pytest.param(with_references(), False, "references", "needs at least one reference (use 't2va'", id="ref2va-none"),
    pytest.param(
        with_references(keyframes=FL2VA["keyframes"]),
        False, "keyframes", "task 'ref2va' takes no keyframes: keyframes beside references are not supported", id="ref2va-keyframe-only",
    ),
    pytest.param(with_references(*NINE_IMAGES, ("image", PORTRAIT)), False, "references", "at most 9 image references, got 10", id="ten-images"),
    pytest.param(with_references(*[("video", SILENT_CLIP)] * 4), False, "references", "at most 3 video references, got 4", id="four-videos"),
    pytest.param(
        with_references(("image", PICTURE), *[("audio", VOICE_3S)] * 4),
        False, "references", "at most 3 audio references, got 4", id="four-audio",
    ),
    pytest.param(
        with_references(*NINE_IMAGES, *[("video", SILENT_CLIP)] * 3, ("audio", VOICE_3S)),
        False, "references", "at most 12 references in total, got 13", id="thirteen-references",
    ),
    pytest.param(with_references(("audio", VOICE_5S)), False, "references", "needs at least one image or video reference", id="audio-only"),
    pytest.param(with_references(("gif", PICTURE)), False, "references[0].kind", "must be one of image, video, audio", id="reference-kind"),
    pytest.param(with_references(("image", PICTURE, 1.0)), False, "references[0].start_seconds", "only allowed for video references, not image", id="start-on-image"),
    pytest.param(with_references(("video", SILENT_CLIP, -1.0)), False, "references[0].start_seconds", "must be >= 0, got -1.0", id="start-negative"),
    pytest.param(with_references(("video", SILENT_CLIP, float("nan"))), False, "references[0].start_seconds", "finite number", id="start-nan"),
    pytest.param(with_references(("image", "a\x00b.png")), False, "references[0].path", "NUL character", id="reference-path-nul"),
    pytest.param(edit(REF2VA, references=[{"kind": "image"}]), False, "references[0].path", "is required", id="reference-path-missing"),
    pytest.param(
        edit(REF2VA, references=[{"kind": "image", "path": PICTURE, "weight": 1}]),
        False, "references[0].weight", "unknown field (allowed: kind, path, start_seconds)", id="reference-unknown-field",
    ),
    # rules that need the probed media
    pytest.param(with_references(("image", PICTURE), ("video", SOUND_ONLY_MP4)), True, "references[1]", "video file has no video stream", id="video-without-picture"),
    pytest.param(with_references(("image", PICTURE), ("audio", SILENT_WAV)), True, "references[1]", "audio file has no audio stream", id="audio-without-sound"),
    pytest.param(with_references(("video", CLIP_1S)), True, "references[0]", "video clip must last 2-15 s, got 1.0 s", id="clip-too-short"),
    pytest.param(with_references(("video", CLIP_16S)), True, "references[0]", "video clip must last 2-15 s, got 16.0 s", id="clip-too-long"),
    pytest.param(
        with_references(("image", PICTURE), ("audio", UNKNOWN_LENGTH_WAV)),
        True, "references[1]", "clip duration is unknown, got None", id="clip-length-unknown",
    ),
    pytest.param(
        with_references(("video", SILENT_CLIP_8S), ("video", SILENT_CLIP_8S)),
        True, "references", "video references may last 15 s in total, got 16 s", id="video-total",
    ),
    pytest.param(
        with_references(("image", PICTURE), ("audio", VOICE_8S), ("audio", VOICE_8S)),
        True, "references", "audio references may last 15 s in total, got 16 s", id="audio-total",
    ),
    pytest.param(
        with_references(("image", PICTURE), ("video", SILENT_CLIP, 6.0)),
        True, "references[1].start_seconds", "must be less than the clip duration 6 s, got 6.0", id="start-past-end",
    ),
    pytest.param(
        with_references(("image", WIDE_PICTURE)),
        True, "references[0]", "reference image ratio must be within 1:4 to 4:1, got 2000x400", id="reference-image-ratio",
    ),
    pytest.param(with_references(("image", BROKEN_PICTURE)), True, "references[0]", "reference image has no usable size", id="reference-image-unreadable"),
    # guidance and timing knobs, unknown fields
    pytest.param(edit(T2VA, guidance_scale=5.0), False, "guidance_scale", "guidance-distilled", id="guidance-scale"),
    pytest.param(edit(T2VA, negative_prompt="blurry"), False, "negative_prompt", "guidance-distilled", id="negative-prompt"),
    pytest.param(edit(T2VA, audio_guidance_scale=3.0), False, "audio_guidance_scale", "no negative prompt", id="audio-guidance"),
    pytest.param(edit(T2VA, cfg_scale=1.0), False, "cfg_scale", "one conditional forward per step", id="cfg-scale"),
    pytest.param(edit(T2VA, num_frames=121), False, "num_frames", "derives its timing from duration_seconds", id="num-frames"),
    pytest.param(edit(T2VA, fps=30), False, "fps", "derives its timing from duration_seconds", id="fps"),
    pytest.param(edit(T2VA, frame_rate=25), False, "frame_rate", "24 fps, frame count snapped up to 17n+5", id="frame-rate"),
    pytest.param(edit(T2VA, wobble=1), False, "wobble", "unknown field (allowed: task, prompt,", id="unknown-field"),
    pytest.param(edit(T2VA, wobble=1, zap=2), False, "wobble, zap", "unknown fields (allowed:", id="unknown-fields"),
    # the SGLang shape
    pytest.param(edit(SGLANG_T2VA, target=DELETE), False, "target", "is required and must be an object, got None", id="sglang-target-missing"),
    pytest.param(edit(SGLANG_T2VA, target="16:9"), False, "target", "is required and must be an object, got '16:9'", id="sglang-target-string"),
    pytest.param(
        edit(SGLANG_T2VA, target={"duration_seconds": 10, "resolution": "768p"}),
        False, "target.resolution", "unknown field (allowed: short_edge, aspect_ratio, duration_seconds)",
        id="sglang-target-unknown",
    ),
    pytest.param(edit(SGLANG_T2VA, target={"duration_seconds": 10, "fps": 24}), False, "target.fps", "derives its timing", id="sglang-target-fps"),
    pytest.param(edit(SGLANG_T2VA, target={"aspect_ratio": "16:9"}), False, "duration_seconds", "is required for task 't2va'", id="sglang-duration-missing"),
    pytest.param(edit(SGLANG_T2VA, duration_seconds=10), False, "duration_seconds", "unknown field (allowed: task, prompt, target", id="sglang-mixed-shapes"),
    pytest.param(edit(SGLANG_T2VA, guidance_scale=4.0), False, "guidance_scale", "guidance-distilled", id="sglang-guidance"),
    pytest.param(edit(SGLANG_T2VA, conditions={}), False, "conditions", "must be a list", id="sglang-conditions-object"),
    pytest.param(edit(SGLANG_FL2VA, conditions=["frame.png"]), False, "conditions[0]", "must be an object", id="sglang-condition-string"),
    pytest.param(with_condition(SGLANG_FL2VA, 0, uri=DELETE), False, "conditions[0].uri", "is required", id="sglang-uri-missing"),
    pytest.param(with_condition(SGLANG_FL2VA, 0, role="anchor"), False, "conditions[0].role", "must be 'keyframe' or 'reference'", id="sglang-role"),
    pytest.param(with_condition(SGLANG_FL2VA, 0, type="video"), False, "conditions[0].type", "a keyframe must be an 'image'", id="sglang-keyframe-video"),
    pytest.param(with_condition(SGLANG_FL2VA, 0, frame_index=5), False, "conditions[0].frame_index", "must be 0 (first frame) or -1", id="sglang-frame-index"),
    pytest.param(with_condition(SGLANG_FL2VA, 0, frame_index=DELETE), False, "conditions[0].frame_index", "is required for a keyframe", id="sglang-frame-index-missing"),
    pytest.param(
        with_condition(SGLANG_FL2VA, 0, start_time_seconds=1.0),
        False, "conditions[0].start_time_seconds", "is only allowed for video references", id="sglang-start-on-keyframe",
    ),
    pytest.param(
        with_condition(SGLANG_REF2VA, 0, frame_index=0),
        False, "conditions[0].frame_index", "is not allowed for role 'reference'", id="sglang-frame-index-on-reference",
    ),
    pytest.param(
        with_condition(SGLANG_REF2VA, 0, type="gif"),
        False, "conditions[0].type", "must be one of image, video, video_audio, audio", id="sglang-reference-type",
    ),
    pytest.param(
        with_condition(SGLANG_REF2VA, 1, start_time_seconds=1.0),
        False, "references[1].start_seconds", "only allowed for video references, not audio", id="sglang-start-on-audio",
    ),
    pytest.param(
        with_condition(SGLANG_REF2VA, 0, uri="https://cdn.hailuoai.com/h3/clip.mp4"),
        False, "conditions[0].uri", "remote URIs are not supported (h3engine never downloads)", id="sglang-https",
    ),
    pytest.param(
        with_condition(SGLANG_REF2VA, 0, uri="file://fileserver/clip.mp4"),
        False, "conditions[0].uri", "file:// URIs must name this machine", id="sglang-file-uri-other-host",
    ),
    pytest.param(with_condition(SGLANG_REF2VA, 0, weight=1.0), False, "conditions[0].weight", "unknown field (allowed: type, uri", id="sglang-condition-unknown"),
    # labels the prompt cites that no input defines (checked with the probe: a video's soundtrack defines one)
    pytest.param(
        with_references(("image", PICTURE), prompt="<Picture 1> meets <Picture 3>."),
        True, "prompt", "cites <Picture 3>, which no input defines: the references define <Picture 1>", id="label-picture-3",
    ),
    pytest.param(
        with_references(("image", PICTURE), ("video", SILENT_CLIP), prompt="<Video 1> sings <Audio 1>, <Video 2>"),
        True, "prompt", "cites <Audio 1>, <Video 2>, which no input defines: the references define <Picture 1>, <Video 1>", id="label-audio-of-silent-video",
    ),
    pytest.param(
        edit(FL2VA, prompt="From <Picture 1> to <Picture 2>."),
        True, "prompt", "cites <Picture 2>, which no input defines: the keyframes define <Picture 1>", id="label-fl2va-one-keyframe",
    ),
    pytest.param(
        edit(T2VA, prompt="<Audio 1> plays."),
        True, "prompt", "cites <Audio 1>, which no input defines: task 't2va' defines no labels", id="label-t2va",
    ),
    # LoRA choices (the file's contents are the engine's to check: tests/test_adapters.py)
    pytest.param(edit(T2VA, loras={"path": LORA}), False, "loras", "must be a list", id="loras-not-list"),
    pytest.param(edit(T2VA, loras=[LORA]), False, "loras[0]", "must be an object with path, strength, target", id="lora-string"),
    pytest.param(edit(T2VA, loras=[{"strength": 1}]), False, "loras[0].path", "is required", id="lora-path-missing"),
    pytest.param(edit(T2VA, loras=[{"path": LORA, "rank": 4}]), False, "loras[0].rank", "unknown field (allowed: path, strength, target)", id="lora-unknown-field"),
    pytest.param(edit(T2VA, loras=[{"path": "https://hf.co/x.safetensors"}]), False, "loras[0].path", "remote URIs are not supported", id="lora-https"),
    pytest.param(edit(T2VA, loras=[{"path": "/nowhere/style.safetensors"}]), False, "loras[0].path", "no such file: 'style.safetensors'", id="lora-missing-file"),
    pytest.param(edit(T2VA, loras=[{"path": LORA_FOLDER}]), False, "loras[0].path", "is a folder, not a .safetensors file", id="lora-folder"),
    pytest.param(edit(T2VA, loras=[{"path": LORA, "strength": "1"}]), False, "loras[0].strength", "must be a finite number, got '1'", id="lora-strength-string"),
    pytest.param(edit(T2VA, loras=[{"path": LORA, "strength": -4.01}]), False, "loras[0].strength", "must be within [-4, 4], got -4.01", id="lora-strength-range"),
    pytest.param(edit(T2VA, loras=[{"path": LORA, "target": "vae"}]), False, "loras[0].target", "must be transformer, transformer_ref or null", id="lora-target-unknown"),
    pytest.param(edit(T2VA, loras=[{"path": LORA, "target": "transformer_ref"}]), False, "loras[0].target", "a t2va request runs the 'transformer' DiT, this adapter targets 'transformer_ref'", id="lora-target-ref-on-t2va"),
    pytest.param(edit(REF2VA, loras=[{"path": LORA}, {"path": LORA, "target": "transformer"}]), False, "loras[1].target", "a ref2va request runs the 'transformer_ref' DiT", id="lora-target-fl2va-on-ref2va"),
    pytest.param(edit(T2VA, loras=[{"path": LORA}] * 9), False, "loras", "at most 8 adapters per request, got 9", id="lora-too-many"),
    pytest.param(GenerationRequest(task="t2va", prompt="p", loras=(LORA,)), False, "loras[0]", "must be a LoraChoice", id="direct-lora-string"),
    # requests built directly in Python
    pytest.param(GenerationRequest(task="fl2va", prompt="p", keyframes=(PICTURE,)), False, "keyframes[0]", "must be a Keyframe", id="direct-keyframe-string"),
    pytest.param(GenerationRequest(task="ref2va", prompt="p", references=PICTURE), False, "references", "must be a tuple of Reference", id="direct-references-string"),
    pytest.param(
        GenerationRequest(task="ref2va", prompt="p", references=(Reference("image", f"file://{PICTURE}"),)),
        False, "references[0].path", "must be a local path, not a URI", id="direct-file-uri",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("payload", "media", "field", "wording"), INVALID)
def test_each_invalid_request_names_its_field_and_rule(
    payload: object, media: bool, field: str, wording: str
) -> None:
    with refused(RequestError, field=field, says=wording):
        run(payload, media)


# These restate a rule of our shape in the SGLang shape, so they share its message on purpose.
SAME_RULE_IN_SGLANG_SHAPE = {"sglang-duration-missing", "sglang-guidance"}


def test_every_rule_has_its_own_message() -> None:
    messages = {}
    for case in INVALID:
        if case.id in SAME_RULE_IN_SGLANG_SHAPE:
            continue
        payload, media, _, _ = case.values
        with pytest.raises(RequestError) as caught:
            run(payload, media)
        messages.setdefault(str(caught.value), []).append(case.id)
    shared = {message: ids for message, ids in messages.items() if len(ids) > 1}
    assert not shared, shared
    assert len(INVALID) >= 100


def test_prompt_labels_follow_the_inputs_and_other_tags_are_free_text() -> None:
    # A video's soundtrack takes an <Audio j> before its <Video k>; the numbering is the UI's (reference_labels).
    sounding = with_references(
        ("image", PICTURE), ("video", CLIP_WITH_SOUND), ("audio", VOICE_3S),
        prompt="<Picture 1> in <Video 1> sings like <Audio 1> and <Audio 2>. <Subject 1> [Shot 1] <d>[English] Hi</d>",
    )  # fmt: skip
    assert run(sounding, media=True) == []
    assert reference_labels(["image", "video", "audio"], [False, True, True]) == [
        ("<Picture 1>",),
        ("<Audio 1>", "<Video 1>"),
        ("<Audio 2>",),
    ]
    with refused(RequestError, field="prompt") as caught:
        run(edit(sounding, prompt="<Audio 3>"), media=True)
    # The labels a soundtrack defines, in the UI's order: the table checks this rule's wording, this its list.
    assert caught.value.problem.endswith("the references define <Picture 1>, <Audio 1>, <Video 1>, <Audio 2>")
    assert (
        run(with_keyframes((PICTURE, "first"), (PORTRAIT, "last"), prompt="<Picture 1> to <Picture 2>"), True)
        == []
    )
    # Only the three label forms are checked; without a probe (no file facts) the rule waits for one.
    assert run(edit(T2VA, prompt="<picture 1> <Subject 2> <Picture>"), media=True) == []
    assert run(edit(T2VA, prompt="<Picture 1>")) == []


# ---------------------------------------------------------------------------------------------------------------
# Valid requests


VALID = [
    pytest.param(T2VA, id="t2va"),
    pytest.param(edit(T2VA, duration_seconds=4), id="t2va-4s"),
    pytest.param(edit(T2VA, duration_seconds=15.0, aspect_ratio="9:16"), id="t2va-15s-portrait"),
    pytest.param(edit(T2VA, seed=2**63 - 1, steps=1, flow_shift=0.5, audio_flow_shift=7), id="t2va-extremes"),
    pytest.param(edit(T2VA, steps=2, recipe="diffusers"), id="t2va-diffusers-two-steps"),
    pytest.param(edit(T2VA, width=1344, height=768), id="t2va-explicit-canvas"),
    pytest.param(edit(T2VA, seed=7.0, steps=30.0, short_edge=768.0), id="t2va-integral-floats"),
    pytest.param(FL2VA, id="fl2va-first"),
    pytest.param(with_keyframes((PORTRAIT, "last")), id="fl2va-last"),
    pytest.param(
        with_keyframes((PICTURE, "first"), (PORTRAIT, "last"), aspect_ratio="1:1"), id="fl2va-first-last"
    ),
    pytest.param(REF2VA, id="ref2va"),
    pytest.param(
        edit(T2VA, loras=[{"path": LORA}, {"path": LORA, "strength": -4, "target": "transformer"}] * 4),
        id="t2va-eight-loras",
    ),
    pytest.param(
        edit(REF2VA, loras=[{"path": f"file://{LORA}", "strength": 4.0, "target": "transformer_ref"}]),
        id="ref2va-lora",
    ),
    pytest.param(
        with_references(
            ("image", PICTURE), ("video", SILENT_CLIP, 1.5), ("audio", VOICE_5S), duration_seconds=None
        ),
        id="ref2va-duration-from-audio",
    ),
    pytest.param(
        with_references(*NINE_IMAGES, *[("video", SILENT_CLIP)] * 2, ("audio", VOICE_3S)),
        id="ref2va-twelve-references",
    ),
]


@pytest.mark.parametrize("payload", VALID)
def test_valid_requests_validate_and_round_trip(payload: dict) -> None:
    request = from_dict(payload)
    assert validate(request) == validate(request, probe_media)
    text = json.dumps(request.to_dict(), allow_nan=False)
    restored = from_dict(json.loads(text))
    assert restored == request
    assert restored.to_dict() == request.to_dict()


def test_defaults_and_kept_order() -> None:
    request = from_dict(
        with_references(
            ("audio", VOICE_3S),
            ("video", SILENT_CLIP, 0.5),
            ("image", PORTRAIT),
            ("image", PICTURE),
            ("audio", VOICE_5S),
        )
    )
    assert [(reference.kind, reference.path) for reference in request.references] == [
        ("audio", VOICE_3S),
        ("video", SILENT_CLIP),
        ("image", PORTRAIT),
        ("image", PICTURE),
        ("audio", VOICE_5S),
    ]
    assert request.references[1].start_seconds == 0.5
    defaults = from_dict({"task": "t2va", "prompt": "p"})
    assert defaults == GenerationRequest(task="t2va", prompt="p")
    assert (defaults.duration_seconds, defaults.aspect_ratio, defaults.short_edge, defaults.seed) == (
        5.0,
        "auto",
        None,  # the checkpoint's own canvas rule
        0,
    )
    # Steps left out are filled in when the request is resolved: DEFAULT_STEPS, or a step-distilled count.
    assert defaults.steps is None and resolve_request(defaults, None).request.steps == 50
    assert (defaults.flow_shift, defaults.audio_flow_shift, defaults.recipe) == (
        12.0,
        3.0,
        "sglang",
    )


def test_warnings() -> None:
    assert validate(from_dict(T2VA)) == []
    (short_edge_warning,) = validate(from_dict(edit(T2VA, short_edge=512)))
    assert short_edge_warning.startswith("short_edge: 512 is outside the verified configuration")
    (canvas_warning,) = validate(from_dict(edit(T2VA, width=32, height=64)))
    assert canvas_warning.startswith("width, height: the explicit 32x64 canvas")
    # Tiny checkpoints have a smaller latent grid: 40 is a multiple of 8 but not of 32.
    assert len(validate(from_dict(edit(T2VA, width=40, height=32)), canvas_multiple=8)) == 1
    with refused(RequestError, field="width"):
        validate(from_dict(edit(T2VA, width=40, height=32)))


def test_resolve_aspect_and_duration() -> None:
    assert resolve_aspect(from_dict(T2VA), None) == (16, 9)
    assert resolve_aspect(from_dict(edit(T2VA, aspect_ratio="21:9")), None) == (21.0, 9.0)
    assert resolve_aspect(from_dict(REF2VA), (1080, 1920)) == (16, 9)  # references never bind the geometry
    assert resolve_aspect(from_dict(edit(T2VA, width=768, height=1024)), None) == (768, 1024)
    fl2va_last_only = from_dict(with_keyframes((PORTRAIT, "last")))
    assert resolve_aspect(fl2va_last_only, (1080, 1920)) == (1080, 1920)
    assert resolve_aspect(from_dict(edit(FL2VA, aspect_ratio="4:3")), (1080, 1920)) == (4.0, 3.0)
    with refused(RequestError, field="keyframes[0]", says="its image size is needed"):
        resolve_aspect(from_dict(FL2VA), None)

    derived = from_dict(
        with_references(("image", PICTURE), ("video", CLIP_WITH_SOUND, 1.5), duration_seconds=None)
    )
    validate(derived, probe_media)
    assert resolve_duration_seconds(derived, probe_media) == 4.5  # the soundtrack counts from the start time
    from_audio = from_dict(
        with_references(("video", SILENT_CLIP), ("audio", VOICE_5S), duration_seconds=None)
    )
    assert resolve_duration_seconds(from_audio, probe_media) == 5.0
    assert resolve_duration_seconds(from_dict(T2VA), None) == 10
    with refused(
        RequestError, field="duration_seconds", says="is required when the reference media cannot be probed"
    ):
        resolve_duration_seconds(from_audio, None)


def test_probe_is_called_once_per_file() -> None:
    calls = []

    def counting_probe(reference: Reference) -> MediaInfo:
        calls.append(reference.path)
        return probe_media(reference)

    request = from_dict(
        with_references(("image", PICTURE), ("video", CLIP_WITH_SOUND), duration_seconds=None)
    )
    validate(request, counting_probe)
    assert sorted(calls) == sorted([PICTURE, CLIP_WITH_SOUND])


# ---------------------------------------------------------------------------------------------------------------
# The official SGLang requests (docs/CHECKPOINT.md §6.2), with their https media replaced by local files


def test_sglang_t2va_request() -> None:
    request = from_dict(SGLANG_T2VA)
    assert request == GenerationRequest(
        task="t2va",
        prompt=SGLANG_T2VA["prompt"],
        duration_seconds=10,
        aspect_ratio="16:9",
        short_edge=768,
        seed=0,
        steps=None,  # SGLang's default (50) is DEFAULT_STEPS, filled in when resolved
        recipe="sglang",
    )
    assert validate(request) == []
    assert resolve_canvas(*resolve_aspect(request, None)) == (768, 1344)
    assert frames_for_duration(request.duration_seconds) == 243


def test_sglang_fl2va_request() -> None:
    request = from_dict(SGLANG_FL2VA)
    assert request == GenerationRequest(
        task="fl2va",
        prompt=SGLANG_FL2VA["prompt"],
        duration_seconds=8,
        aspect_ratio="auto",
        short_edge=768,
        seed=0,
        keyframes=(Keyframe(path=PICTURE, position="first"),),
    )
    assert validate(request, probe_media) == []
    assert resolve_aspect(request, (1920, 1080)) == (1920, 1080)
    assert frames_for_duration(request.duration_seconds) == 192

    first_and_last = copy.deepcopy(SGLANG_FL2VA)
    first_and_last["conditions"].append(
        {"type": "image", "uri": f"file://localhost{PORTRAIT}", "role": "keyframe", "frame_index": -1}
    )
    assert from_dict(first_and_last).keyframes == (Keyframe(PICTURE, "first"), Keyframe(PORTRAIT, "last"))


def test_sglang_ref2va_request() -> None:
    request = from_dict(SGLANG_REF2VA)
    assert request == GenerationRequest(
        task="ref2va",
        prompt=SGLANG_REF2VA["prompt"],
        duration_seconds=5,
        aspect_ratio="auto",
        short_edge=768,
        seed=0,
        references=(Reference(kind="video", path=CLIP_WITH_SOUND), Reference(kind="audio", path=VOICE_5S)),
    )
    assert validate(request, probe_media) == []
    assert resolve_canvas(*resolve_aspect(request, None)) == (768, 1344)
    assert frames_for_duration(request.duration_seconds) == 124


def test_sglang_shape_details() -> None:
    # SGLang fills in seed 42 when none is sent; keeping that reproduces its outputs.
    assert from_dict(edit(SGLANG_T2VA, seed=DELETE)).seed == 42
    assert from_dict(edit(SGLANG_T2VA, num_inference_steps=30)).steps == 30
    video_audio = with_condition(SGLANG_REF2VA, 0, type="video_audio", start_time_seconds=1.5)
    assert from_dict(video_audio).references[0] == Reference("video", CLIP_WITH_SOUND, 1.5)
    escaped = with_condition(SGLANG_REF2VA, 0, uri="file:///data/my%20clip.mp4")
    assert from_dict(escaped).references[0].path == "/data/my clip.mp4"
    plain_path = with_condition(SGLANG_REF2VA, 0, uri="relative/clip.mp4")
    assert from_dict(plain_path).references[0].path == "relative/clip.mp4"
    no_duration = edit(
        SGLANG_REF2VA, target={"aspect_ratio": "auto"}, prompt="<Picture 1> speaks in the voice of <Audio 1>."
    )
    no_duration["conditions"] = no_duration["conditions"][1:] + [
        {"type": "image", "uri": PICTURE, "role": "reference"}
    ]
    request = from_dict(no_duration)
    # Left out, the short edge is the checkpoint's own rule (None), as in our shape.
    assert request.duration_seconds is None and request.short_edge is None
    validate(request, probe_media)
    assert resolve_duration_seconds(request, probe_media) == 5.0


def test_request_module_imports_neither_torch_nor_numpy() -> None:
    code = "import sys, h3engine.request, h3engine.request.shapes; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------
# Fuzz: random malformed payloads either validate or raise RequestError naming a field


JUNK = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**63,
    -(2**63) - 1,
    2**4000,
    1.5,
    -0.0,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    " ",
    "x" * 5000,
    "auto",
    "16:9",
    "first",
    "last",
    "video",
    "audio",
    "image",
    "reference",
    "keyframe",
    "ref2va",
    "https://example.com/a.png",
    "file://elsewhere/a.png",
    "file:///tmp/a.png",
    "file://[::1",
    "a\x00b",
    [],
    {},
    [[[[[]]]]],
    {"a": {"b": [1, {"c": None}]}},
    [1, "2", None, 2**4000],
    ("tuple", 1),
    b"bytes",
    frozenset({1, 2}),
    {"path": PICTURE, "position": "first"},
    {"kind": "video", "path": CLIP_WITH_SOUND, "start_seconds": 1.0},
    {"type": "image", "uri": PICTURE, "role": "reference"},
]
EXTRA_KEYS = [
    "guidance_scale",
    "fps",
    "num_frames",
    "negative_prompt",
    "extra",
    "",
    7,
    "target",
    "keyframes",
    "path",
]
FUZZ_PROBE_DURATIONS = [
    None,
    float("nan"),
    float("inf"),
    -1.0,
    0,
    1.0,
    3.0,
    5.0,
    6.0,
    14.0,
    20.0,
    2**4000,
    True,
]
FUZZ_PROBE_SIZES = [None, 0, -5, 1, 32, 1080, 1920, 2**4000, 1.5, True]


def slots(node: object) -> list[tuple[object, object]]:
    """Every (container, key) pair inside a payload, depth first."""
    found = []
    if isinstance(node, dict):
        for key in list(node):
            found.append((node, key))
            found += slots(node[key])
    elif isinstance(node, list):
        for index in range(len(node)):
            found.append((node, index))
            found += slots(node[index])
    return found


def mutate(payload: dict, rng: random.Random) -> tuple[object, list[str]]:
    """Apply 1-3 random mutations; return the payload and a printable log (values may be unprintable)."""
    log = []
    for _ in range(rng.randint(1, 3)):
        places = slots(payload) if isinstance(payload, dict) else []
        operation = rng.choices(["replace", "delete", "add", "repeat", "whole"], weights=[12, 3, 3, 2, 1])[0]
        if operation == "whole" or not places:
            junk_index = rng.randrange(len(JUNK))
            payload = copy.deepcopy(JUNK[junk_index])
            log.append(f"whole payload -> JUNK[{junk_index}]")
            continue
        container, key = rng.choice(places)
        if operation == "replace":
            junk_index = rng.randrange(len(JUNK))
            container[key] = copy.deepcopy(JUNK[junk_index])
            log.append(f"{key!r} -> JUNK[{junk_index}]")
        elif operation == "delete":
            del container[key]
            log.append(f"delete {key!r}")
        elif operation == "add":
            target = container if isinstance(container, dict) else payload
            extra = rng.choice(EXTRA_KEYS)
            junk_index = rng.randrange(len(JUNK))
            target[extra] = copy.deepcopy(JUNK[junk_index])
            log.append(f"add {extra!r} = JUNK[{junk_index}]")
        else:
            lists = [value for _, value in places if isinstance(value, list) and value]
            if lists:
                chosen = rng.choice(lists)
                chosen.extend(copy.deepcopy(chosen) * rng.randint(1, 12))
                log.append("repeat a list")
    return payload, log


def fuzz_probe(rng: random.Random):
    facts: dict[str, MediaInfo] = {}

    def probe(reference: Reference) -> MediaInfo:
        if reference.path not in facts:
            facts[reference.path] = MediaInfo(
                duration_seconds=rng.choice(FUZZ_PROBE_DURATIONS),
                has_audio=rng.random() < 0.5,
                width=rng.choice(FUZZ_PROBE_SIZES),
                height=rng.choice(FUZZ_PROBE_SIZES),
            )
        return facts[reference.path]

    return probe


def test_fuzz_malformed_payloads_raise_only_request_error() -> None:
    rng = random.Random(20240611)
    bases = [
        T2VA,
        FL2VA,
        REF2VA,
        with_keyframes((PICTURE, "first"), (PORTRAIT, "last")),
        with_references(
            ("image", PICTURE), ("video", SILENT_CLIP, 1.0), ("audio", VOICE_5S), duration_seconds=None
        ),
        SGLANG_T2VA,
        SGLANG_FL2VA,
        SGLANG_REF2VA,
    ]
    accepted = rejected = 0
    for case in range(400):
        payload, log = mutate(copy.deepcopy(rng.choice(bases)), rng)
        probe = fuzz_probe(rng) if rng.random() < 0.5 else (probe_media if rng.random() < 0.5 else None)
        try:
            request = from_dict(payload)
            warnings = validate(request, probe)
        except RequestError as error:
            assert error.field and error.problem, (case, log, str(error))
            rejected += 1
            continue
        except Exception as error:  # noqa: BLE001 - any other exception type is the failure under test
            pytest.fail(f"case {case} ({'; '.join(log)}): {type(error).__name__}: {error}")
        accepted += 1
        assert all(isinstance(warning, str) for warning in warnings)
        restored = from_dict(json.loads(json.dumps(request.to_dict(), allow_nan=False)))
        assert restored == request, (case, log)
    # Both outcomes must be common, or the fuzz run is not exercising the validator.
    assert rejected >= 200 and accepted >= 10, (accepted, rejected)
