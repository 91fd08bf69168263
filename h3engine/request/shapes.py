"""Reading a request: a JSON object in one of two shapes -> `GenerationRequest` (h3engine.request).

`from_dict` reads ours (the field names of `GenerationRequest`, also written by `to_dict` for the JSON sidecar) and
the official SGLang `/v1/videos` shape (`target{...}`, `conditions[...]`, docs/CHECKPOINT.md §6-§7). It maps
names and nesting and turns `file://` URIs into paths; it does not judge values (`h3engine.request.validate` does).
It raises `RequestError` naming the field for unknown, refused or missing fields and for remote URIs: guidance and
timing knobs are refused with their reason rather than ignored.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from h3engine.request.checks import describe, fail, is_integer, uri_scheme
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest, LoraChoice
from h3engine.request.remix import Remix

# SGLang fills in this seed when a request in its shape carries none; keeping it reproduces its outputs.
SGLANG_DEFAULT_SEED = 42

_GUIDANCE_REASON = (
    "not supported: MiniMax H3 is guidance-distilled (one conditional forward per step), "
    "so there is no guidance scale and no negative prompt"
)
_TIMING_REASON = (
    "not supported: MiniMax H3 derives its timing from duration_seconds "
    "(24 fps, frame count snapped up to 17n+5)"
)
_TIMING_FIELDS = frozenset({"seconds", "length", "video_length", "frames", "frame_count", "framerate"})

_ENGINE_INTEGER_FIELDS = ("short_edge", "width", "height", "seed", "steps")
_KEYFRAME_FIELDS = ("path", "position")
_REFERENCE_FIELDS = ("kind", "path", "start_seconds")
_LORA_FIELDS = ("path", "strength", "target")
_SGLANG_FIELDS = (
    "task",
    "prompt",
    "target",
    "conditions",
    "seed",
    "flow_shift",
    "audio_flow_shift",
    "num_inference_steps",
    "quality",
)
_SGLANG_TARGET_FIELDS = ("short_edge", "aspect_ratio", "duration_seconds")
_SGLANG_CONDITION_FIELDS = ("type", "uri", "role", "frame_index", "start_time_seconds")
# SGLang's "video_audio" is a video whose soundtrack is also a reference; our video references always bring
# their soundtrack along when the file has one, so both types map to one kind.
_SGLANG_REFERENCE_KINDS = {"image": "image", "video": "video", "video_audio": "video", "audio": "audio"}
_SGLANG_KEYFRAME_POSITIONS = {0: "first", -1: "last"}
# SGLang's request-scoped `quality` ("lossless": no Cache-DiT, "high": its H3 Cache-DiT preset) -> our `cache`.
_SGLANG_QUALITY = {"lossless": "off", "high": "high"}

_ENGINE_FIELDS = tuple(field.name for field in fields(GenerationRequest))


def from_dict(payload: Mapping[str, Any]) -> GenerationRequest:
    """Read our JSON shape or the official SGLang shape (recognised by `target` or `conditions`).

    Raises `RequestError` for unknown, refused or missing fields and for remote URIs; values themselves are
    judged by `validate`.
    """
    if not isinstance(payload, Mapping):
        fail("request", f"must be a JSON object, got {describe(payload)}")
    if "target" in payload or "conditions" in payload:
        return _from_sglang_shape(payload)
    return _from_engine_shape(payload)


def _from_engine_shape(payload: Mapping[str, Any]) -> GenerationRequest:
    _check_field_names(payload, _ENGINE_FIELDS, "")
    for required in ("task", "prompt"):
        if required not in payload:
            fail(required, "is required")
    values = {name: payload[name] for name in _ENGINE_FIELDS if name in payload}
    for name in _ENGINE_INTEGER_FIELDS:
        if name in values:
            values[name] = _integral_float_as_int(values[name])
    values["keyframes"] = tuple(
        _keyframe_from_dict(entry, f"keyframes[{index}]")
        for index, entry in enumerate(_as_list(payload.get("keyframes", []), "keyframes"))
    )
    values["references"] = tuple(
        _reference_from_dict(entry, f"references[{index}]")
        for index, entry in enumerate(_as_list(payload.get("references", []), "references"))
    )
    values["loras"] = tuple(
        _lora_from_dict(entry, f"loras[{index}]")
        for index, entry in enumerate(_as_list(payload.get("loras", []), "loras"))
    )
    if values.get("remix") is not None:
        values["remix"] = Remix.from_dict(values["remix"])
    if "rungs" in values:
        rungs = values["rungs"]
        values["rungs"] = tuple(rungs) if isinstance(rungs, list) else rungs
    return GenerationRequest(**values)


def _lora_from_dict(entry: Any, field: str) -> LoraChoice:
    if not isinstance(entry, Mapping):
        fail(field, f"must be an object with {', '.join(_LORA_FIELDS)}, got {describe(entry)}")
    _check_field_names(entry, _LORA_FIELDS, f"{field}.")
    if "path" not in entry:
        fail(f"{field}.path", "is required")
    return LoraChoice(
        path=_local_path(entry["path"], f"{field}.path"),
        strength=entry.get("strength", 1.0),
        target=entry.get("target"),
    )


def _keyframe_from_dict(entry: Any, field: str) -> Keyframe:
    if not isinstance(entry, Mapping):
        fail(field, f"must be an object with {', '.join(_KEYFRAME_FIELDS)}, got {describe(entry)}")
    _check_field_names(entry, _KEYFRAME_FIELDS, f"{field}.")
    for required in _KEYFRAME_FIELDS:
        if required not in entry:
            fail(f"{field}.{required}", "is required")
    return Keyframe(path=_local_path(entry["path"], f"{field}.path"), position=entry["position"])


def _reference_from_dict(entry: Any, field: str) -> Reference:
    if not isinstance(entry, Mapping):
        fail(field, f"must be an object with {', '.join(_REFERENCE_FIELDS)}, got {describe(entry)}")
    _check_field_names(entry, _REFERENCE_FIELDS, f"{field}.")
    for required in ("kind", "path"):
        if required not in entry:
            fail(f"{field}.{required}", "is required")
    return Reference(
        kind=entry["kind"],
        path=_local_path(entry["path"], f"{field}.path"),
        start_seconds=entry.get("start_seconds"),
    )


def _from_sglang_shape(payload: Mapping[str, Any]) -> GenerationRequest:
    _check_field_names(payload, _SGLANG_FIELDS, "")
    for required in ("task", "prompt"):
        if required not in payload:
            fail(required, "is required")
    target = payload.get("target")
    if not isinstance(target, Mapping):
        fail("target", f"is required and must be an object, got {describe(target)}")
    _check_field_names(target, _SGLANG_TARGET_FIELDS, "target.")

    keyframes: list[Keyframe] = []
    references: list[Reference] = []
    for index, condition in enumerate(_as_list(payload.get("conditions", []), "conditions")):
        field = f"conditions[{index}]"
        if not isinstance(condition, Mapping):
            fail(field, f"must be an object, got {describe(condition)}")
        _check_field_names(condition, _SGLANG_CONDITION_FIELDS, f"{field}.")
        for required in ("type", "uri", "role"):
            if required not in condition:
                fail(f"{field}.{required}", "is required")
        path = _local_path(condition["uri"], f"{field}.uri")
        role, condition_type = condition["role"], condition["type"]
        if role == "keyframe":
            keyframes.append(_sglang_keyframe(condition, condition_type, path, field))
        elif role == "reference":
            references.append(_sglang_reference(condition, condition_type, path, field))
        else:
            fail(f"{field}.role", f"must be 'keyframe' or 'reference', got {describe(role)}")

    return GenerationRequest(
        task=payload["task"],
        prompt=payload["prompt"],
        duration_seconds=target.get("duration_seconds"),
        aspect_ratio=target.get("aspect_ratio", "auto"),
        short_edge=_integral_float_as_int(target.get("short_edge")),
        seed=_integral_float_as_int(payload.get("seed", SGLANG_DEFAULT_SEED)),
        steps=_integral_float_as_int(payload.get("num_inference_steps")),
        flow_shift=payload.get("flow_shift", 12.0),
        audio_flow_shift=payload.get("audio_flow_shift", 3.0),
        recipe="sglang",
        cache=_sglang_quality(payload.get("quality", "lossless")),
        keyframes=tuple(keyframes),
        references=tuple(references),
    )


def _sglang_quality(quality: Any) -> str:
    if not isinstance(quality, str) or quality not in _SGLANG_QUALITY:
        fail("quality", f"must be one of {', '.join(_SGLANG_QUALITY)}, got {describe(quality)}")
    return _SGLANG_QUALITY[quality]


def _sglang_keyframe(condition: Mapping[str, Any], condition_type: Any, path: str, field: str) -> Keyframe:
    if condition_type != "image":
        fail(f"{field}.type", f"a keyframe must be an 'image', got {describe(condition_type)}")
    if "start_time_seconds" in condition:
        fail(f"{field}.start_time_seconds", "is only allowed for video references")
    if "frame_index" not in condition:
        fail(f"{field}.frame_index", "is required for a keyframe (0 = first frame, -1 = last frame)")
    frame_index = _integral_float_as_int(condition["frame_index"])
    if not is_integer(frame_index) or frame_index not in _SGLANG_KEYFRAME_POSITIONS:
        fail(
            f"{field}.frame_index",
            f"must be 0 (first frame) or -1 (last frame), got {describe(frame_index)}",
        )
    return Keyframe(path=path, position=_SGLANG_KEYFRAME_POSITIONS[frame_index])


def _sglang_reference(condition: Mapping[str, Any], condition_type: Any, path: str, field: str) -> Reference:
    if not isinstance(condition_type, str) or condition_type not in _SGLANG_REFERENCE_KINDS:
        fail(
            f"{field}.type",
            f"must be one of {', '.join(_SGLANG_REFERENCE_KINDS)}, got {describe(condition_type)}",
        )
    if "frame_index" in condition:
        fail(f"{field}.frame_index", "is not allowed for role 'reference'")
    return Reference(
        kind=_SGLANG_REFERENCE_KINDS[condition_type],
        path=path,
        start_seconds=condition.get("start_time_seconds"),
    )


def _check_field_names(entry: Mapping[Any, Any], allowed: tuple[str, ...], prefix: str) -> None:
    """Refuse guidance and timing knobs with their reason, then anything else we do not know, by name."""
    unknown = [name for name in sorted(entry, key=describe) if name not in allowed]
    for name in unknown:
        reason = _refusal_reason(name)
        if reason is not None:
            fail(prefix + _field_name(name), reason)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        fail(
            ", ".join(prefix + _field_name(name) for name in unknown),
            f"unknown field{plural} (allowed: {', '.join(allowed)})",
        )


def _field_name(name: Any) -> str:
    return name if isinstance(name, str) and 0 < len(name) <= 64 else describe(name)


def _refusal_reason(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    lowered = name.lower()
    if "guidance" in lowered or "negative" in lowered or "cfg" in lowered:
        return _GUIDANCE_REASON
    if (
        lowered in _TIMING_FIELDS
        or "fps" in lowered
        or "frame_rate" in lowered
        or lowered.endswith("_frames")
    ):
        return _TIMING_REASON
    return None


def _as_list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        fail(field, f"must be a list, got {describe(value)}")
    return list(value)


def _local_path(value: Any, field: str) -> str:
    """A plain path, or a `file://` URI turned into one; remote URIs are refused because we never download."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        fail(field, f"must be a local path or file:// URI, got {describe(value)}")
    scheme = uri_scheme(value)
    if scheme is None:
        return value
    if scheme != "file":
        fail(field, _remote_uri_problem(value))
    try:
        parsed = urllib.parse.urlsplit(value)
    except ValueError:
        fail(field, f"is not a valid file:// URI, got {describe(value)}")
    if parsed.netloc not in ("", "localhost"):
        fail(field, f"file:// URIs must name this machine (file:///path), got {describe(value)}")
    return urllib.parse.unquote(parsed.path)


def _remote_uri_problem(value: str) -> str:
    return (
        f"remote URIs are not supported (h3engine never downloads); download the file and pass its local "
        f"path, got {describe(value)}"
    )


def _integral_float_as_int(value: Any) -> Any:
    """JSON writers emit 50.0 for 50; accept that for integer fields and leave everything else to `validate`."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
