"""API fields -> `GenerationRequest`, and jobs -> OpenAI Video objects.

`request_from_fields(fields, inputs_dir, facts, ...)` reads a POST /v1/videos body (JSON values, or multipart
strings: numbers, lists and objects are read from their text) into a request that the one checker then judges; its
`RequestError`s name API fields (`api_error_of`): `seconds` for the duration, `size` for the canvas,
`input_reference` / `last_frame` / `references` for files. `size_fields`: `size` is `auto`, a "WxH" canvas the
checkpoint's rule makes for a preset (`supported_sizes`), or an explicit canvas that the one checker judges. Several `input_reference` files (or one
that is not an image) are Ref2VA's ordered references. `video_object(record, live)` is the Video object.

Danger: every value here comes from a client; uploads reach the engine only as copies in the job's own inputs
folder (h3engine.serving.inputs), under a sanitised base name.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.engine.lora.library import LoraLibrary, lora_choices
from h3engine.errors import RequestError, without_server_paths
from h3engine.media.formats import kind_of_suffix
from h3engine.request.checks import parse_rungs
from h3engine.request.files import Keyframe, Reference
from h3engine.request.geometry import PRESET_ASPECT_RATIOS, canvas_rule, resolve_canvas
from h3engine.request.model import LORA_TARGET_OF_TASK, GenerationRequest, LoraChoice
from h3engine.request.remix import REMIX_MODES, Remix, parse_ranges
from h3engine.serving.inputs import write_input
from h3engine.serving.store import JobRecord

DEFAULT_MODEL = "minimax-h3"
DEFAULT_SECONDS = 4.0
RANDOM_SEED_LIMIT = 2**31
# The fields POST /v1/videos reads: OpenAI's, then H3's own (what the SDK sends through `extra_body`).
OPENAI_FIELDS = ("prompt", "model", "seconds", "size", "input_reference")
H3_FIELDS = (
    "task",
    "last_frame",
    "references",
    "seed",
    "steps",
    "flow_shift",
    "audio_flow_shift",
    "rungs",
    "loras",
    "aspect_ratio",
    "short_edge",
    "callback_url",
    # Remix (task v2a / a2v / extend, or masks on t2va: h3engine.request.remix).
    "source_video",
    "source_audio",
    "video_mask",
    "audio_mask",
)
FILE_FIELDS = ("input_reference", "last_frame", "references", "source_video", "source_audio")
FILE_VALUE_RULE = (
    "must be an uploaded file (multipart), a data: URL, or the id of a file uploaded to /v1/files"
)
_INTEGER_FIELDS = ("seed", "steps", "short_edge")
_NUMBER_FIELDS = ("flow_shift", "audio_flow_shift")
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")
_INTEGER_TEXT = re.compile(r"^[+-]?\d{1,30}$")
_NUMBER_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


@dataclass(frozen=True)
class Upload:
    """A file a client sent: its own name and bytes."""

    name: str
    data: bytes


@dataclass
class Built:
    """A request read from API fields, with what the Video object reports and where each file came from."""

    request: GenerationRequest
    meta: dict[str, Any]
    file_fields: dict[str, str] = field(default_factory=dict)  # stored path -> the API field it came in
    keyframe_fields: list[str] = field(default_factory=list)  # keyframes[i] -> its API field
    reference_fields: list[str] = field(default_factory=list)  # references[i] -> its API field


class ApiFieldError(Exception):
    """A request field the API itself refuses (before the checker): 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def supported_sizes(facts: CheckpointFacts, short_edge: int | None = None) -> list[str]:
    """The canvases the checkpoint's rule gives for the preset aspect ratios, as "WxH"."""
    edge, max_pixels = canvas_rule(short_edge, facts.canvas.short_edge, facts.canvas.max_pixels)
    sizes = []
    for preset in PRESET_ASPECT_RATIOS:
        width, height = (float(part) for part in preset.split(":"))
        canvas_h, canvas_w = resolve_canvas(
            width, height, multiple=facts.canvas_multiple, short_edge=edge, max_pixels=max_pixels
        )
        sizes.append(f"{canvas_w}x{canvas_h}")
    return sizes


def size_fields(size: Any, facts: CheckpointFacts) -> dict[str, Any]:
    """The request's canvas fields for a `size`: "auto" (the task's own canvas); a "WxH" the checkpoint's rule makes
    for a preset aspect ratio at its own short edge, or at min(W, H) (aspect_ratio, short_edge); any other "WxH" is
    that explicit canvas (width, height), judged by the one checker as `--width/--height` are. ApiFieldError listing
    the supported sizes for anything that is not "WxH"."""
    if isinstance(size, str) and size.strip().lower() == "auto":
        return {}
    supported = supported_sizes(facts)
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is not None and int(match.group(1)) > 0 and int(match.group(2)) > 0:
        width, height = int(match.group(1)), int(match.group(2))
        if f"{width}x{height}" in supported:
            return {"aspect_ratio": PRESET_ASPECT_RATIOS[supported.index(f"{width}x{height}")]}
        at_edge = supported_sizes(facts, min(width, height))
        if f"{width}x{height}" in at_edge:
            return {
                "aspect_ratio": PRESET_ASPECT_RATIOS[at_edge.index(f"{width}x{height}")],
                "short_edge": min(width, height),
            }
        return {"width": width, "height": height}
    raise ApiFieldError(
        "size",
        f"size: {str(size)[:40]!r} is not WxH; supported: auto, {', '.join(supported)}, or any W x H in multiples of "
        f"{facts.canvas_multiple}",
    )


def _number_from_text(value: Any, integer: bool) -> Any:
    """A multipart field's text as a number when it reads as one; anything else is left for the checker's message."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if integer and _INTEGER_TEXT.match(text):
        return int(text)
    if _NUMBER_TEXT.match(text):
        number = float(text)
        return int(number) if integer and number.is_integer() else number
    return value


def _structured(value: Any, name: str) -> Any:
    """A list or object field: JSON text (multipart) is parsed; other values pass as they are."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError:
            raise ApiFieldError(name, f"{name}: not valid JSON: {value[:60]!r}") from None
    return value


def _rungs(value: Any) -> Any:
    value = _structured(value, "rungs")
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return parse_rungs(value)
    if isinstance(value, list):
        return tuple(_number_from_text(item, integer=True) for item in value)
    return value


def _loras(value: Any, task: str, library: LoraLibrary) -> tuple[LoraChoice, ...]:
    """`loras` (JSON text in multipart; a strength as text there too) as the request's entries (lora_choices)."""
    value = _structured(value, "loras")
    if isinstance(value, list):
        value = [
            {**item, "strength": _number_from_text(item["strength"], integer=False)}
            if isinstance(item, dict) and "strength" in item
            else item
            for item in value
        ]
    return lora_choices(value, task, library)


def _as_uploads(value: Any) -> list[Upload]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [item for item in items if isinstance(item, Upload)]


def _remix_of(fields: Mapping[str, Any], task: Any, kept: Any) -> Remix | None:
    """The request's remix from the remix fields (None without any): `task` v2a / a2v / extend is its mode."""
    mode = task if task in REMIX_MODES else None
    videos, audios = _as_uploads(fields.get("source_video")), _as_uploads(fields.get("source_audio"))
    masks = {
        name: parse_ranges(str(fields[name]), f"remix.{name}")
        for name in ("video_mask", "audio_mask")
        if fields.get(name) not in (None, "")
    }
    if mode is None and not (videos or audios or masks):
        return None
    return Remix(
        mode=mode,
        source_video=kept(videos[0], "source_video") if videos else None,
        source_audio=kept(audios[0], "source_audio") if audios else None,
        **masks,
    )


def request_from_fields(
    fields: Mapping[str, Any],
    inputs_dir: Path,
    facts: CheckpointFacts,
    library: LoraLibrary | None = None,
) -> Built:
    """The request of a POST /v1/videos body (files already read into `Upload`s, written into `inputs_dir`, the
    job's own folder). Raises ApiFieldError or RequestError (whose field `api_error_of` maps to the API's name)."""
    _check_known_fields(fields)
    first = _as_uploads(fields.get("input_reference"))
    # Several input_reference files, or one that is not an image, are Ref2VA's ordered references.
    several = len(first) > 1 or any(kind_of_suffix(upload.name) not in (None, "image") for upload in first)
    task = fields.get("task") or (
        "ref2va"
        if fields.get("references") or several
        else "fl2va"
        if first or fields.get("last_frame")
        else "t2va"
    )
    built = Built(GenerationRequest(task="t2va", prompt=""), {})

    def kept(upload: Upload, api_field: str) -> str:
        path = str(write_input(inputs_dir, upload.name, upload.data))
        built.file_fields[path] = api_field
        return path

    remix = _remix_of(fields, task, kept)
    task = "t2va" if task in REMIX_MODES else task
    keyframes, references = _placed_files(fields, task, built, kept)
    seconds = fields.get("seconds")
    duration = DEFAULT_SECONDS if seconds in (None, "") else _number_from_text(seconds, integer=False)
    seed = fields.get("seed")
    seed = (
        secrets.randbelow(RANDOM_SEED_LIMIT) if seed in (None, "") else _number_from_text(seed, integer=True)
    )
    values: dict[str, Any] = {
        name: _number_from_text(fields[name], integer=name in _INTEGER_FIELDS)
        for name in ("steps", "flow_shift", "audio_flow_shift")
        if fields.get(name) not in (None, "")
    }
    built.request = GenerationRequest(
        task=task,
        prompt=fields["prompt"],
        duration_seconds=duration,
        **_canvas_fields(fields, facts),
        seed=seed,
        keyframes=keyframes,
        references=references,
        loras=_loras(fields.get("loras"), task, library or LoraLibrary(None))
        if task in LORA_TARGET_OF_TASK
        else (),
        rungs=_rungs(fields.get("rungs")),
        remix=remix,
        **values,
    )
    built.meta = {
        "model": DEFAULT_MODEL,
        "seconds": f"{duration:g}" if isinstance(duration, int | float) else str(duration),
    }
    callback = fields.get("callback_url")
    if callback not in (None, ""):
        if (
            not isinstance(callback, str)
            or not re.match(r"^https?://[^\s]+$", callback)
            or len(callback) > 2000
        ):
            raise ApiFieldError("callback_url", "callback_url: must be an http:// or https:// URL")
        built.meta["callback_url"] = callback
    return built


def _check_known_fields(fields: Mapping[str, Any]) -> None:
    """ApiFieldError for an unknown field, a missing or non-text prompt, another model, or a file field that does
    not hold uploaded files."""
    unknown = sorted(set(fields) - set(OPENAI_FIELDS) - set(H3_FIELDS))
    if unknown:
        raise ApiFieldError(
            unknown[0], f"{unknown[0]}: unknown field; accepted: {', '.join(OPENAI_FIELDS + H3_FIELDS)}"
        )
    if not isinstance(fields.get("prompt"), str):
        raise ApiFieldError(
            "prompt", "prompt: is required" if "prompt" not in fields else "prompt: must be a string"
        )
    model = fields.get("model")
    if model not in (None, "") and (not isinstance(model, str) or model.strip() != DEFAULT_MODEL):
        raise ApiFieldError("model", f"model: this server serves {DEFAULT_MODEL!r}, got {model!r:.60}")
    for name in FILE_FIELDS:
        value = fields.get(name)
        items = value if isinstance(value, list) else [] if value is None else [value]
        for item in items:
            if not isinstance(item, Upload):
                raise ApiFieldError(name, f"{name}: {FILE_VALUE_RULE}, got {str(item)[:60]!r}")


def _placed_files(
    fields: Mapping[str, Any], task: str, built: Built, kept: Callable[[Upload, str], str]
) -> tuple[tuple[Keyframe, ...], tuple[Reference, ...]]:
    """The task's keyframes (FL2VA's first and last frames) or references (Ref2VA's, in order), each written by
    `kept`; `built` records the API field of each."""
    first = _as_uploads(fields.get("input_reference"))
    last = _as_uploads(fields.get("last_frame"))
    references = _as_uploads(fields.get("references"))
    keyframes: list[Keyframe] = []
    reference_list: list[Reference] = []
    if task == "ref2va":
        for api_field, uploads in (("input_reference", first), ("references", references)):
            for upload in uploads:
                path = kept(upload, api_field)
                kind = kind_of_suffix(path) or "image"
                reference_list.append(Reference(kind=kind, path=path))  # type: ignore[arg-type]
                built.reference_fields.append(api_field)
        if last:
            raise ApiFieldError("last_frame", "last_frame: only FL2VA takes a last frame; give task fl2va")
    else:
        for api_field, position, uploads in (
            ("input_reference", "first", first),
            ("last_frame", "last", last),
        ):
            for upload in uploads:
                keyframes.append(Keyframe(path=kept(upload, api_field), position=position))  # type: ignore[arg-type]
                built.keyframe_fields.append(api_field)
        if references:
            raise ApiFieldError("references", "references: only Ref2VA takes references; give task ref2va")
    return tuple(keyframes), tuple(reference_list)


def _canvas_fields(fields: Mapping[str, Any], facts: CheckpointFacts) -> dict[str, Any]:
    """The request's canvas from `size`, or from `aspect_ratio` / `short_edge` (not both ways at once)."""
    canvas: dict[str, Any] = {"short_edge": _number_from_text(fields.get("short_edge"), integer=True)}
    if fields.get("size") not in (None, ""):
        if "aspect_ratio" in fields or "short_edge" in fields:
            raise ApiFieldError("size", "size: give either size or aspect_ratio / short_edge, not both")
        return size_fields(fields["size"], facts)
    if fields.get("aspect_ratio") not in (None, ""):
        canvas["aspect_ratio"] = fields["aspect_ratio"]
    return canvas


def copy_inputs(request: GenerationRequest, folder: Path) -> GenerationRequest:
    """The request naming copies of its input files in `folder` (a new job's own: remixing a video must not
    depend on the source job's files staying). FileNotFoundError when one is gone."""
    copies: dict[str, str] = {}

    def copied(path: str | None) -> str | None:
        if path is None:
            return None
        if path not in copies:
            copies[path] = str(write_input(folder, Path(path).name, Path(path)))
        return copies[path]

    remix = request.remix
    if remix is not None:
        remix = replace(
            remix,
            source_video=copied(remix.source_video),
            source_audio=copied(remix.source_audio),
            video_mask_image=copied(remix.video_mask_image),
        )
    return replace(
        request,
        keyframes=tuple(replace(keyframe, path=copied(keyframe.path)) for keyframe in request.keyframes),
        references=tuple(replace(reference, path=copied(reference.path)) for reference in request.references),
        remix=remix,
    )


def api_param(error: RequestError, built: Built | None, size_given: bool) -> str:
    """The API field a RequestError is about."""
    match = re.match(r"([A-Za-z_]+)(?:\[(\d+)\])?", error.field or "")
    head, index = (match.group(1), match.group(2)) if match else ("", None)
    if built is not None and error.path is not None and error.path in built.file_fields:
        return built.file_fields[error.path]
    if head == "duration_seconds":
        return "seconds"
    if head == "remix":
        inner = (error.field or "").removeprefix("remix.").split("[")[0]
        return inner if inner in H3_FIELDS else "task"
    if head in ("width", "height", "aspect_ratio", "short_edge") and size_given:
        return "size"
    if head == "keyframes" and built is not None and built.keyframe_fields:
        position = int(index or 0)
        return built.keyframe_fields[min(position, len(built.keyframe_fields) - 1)]
    if head == "references" and built is not None and built.reference_fields and index is not None:
        return built.reference_fields[min(int(index), len(built.reference_fields) - 1)]
    if head == "keyframes":
        return "input_reference"
    return head or "prompt"


def api_message(error: RequestError, param: str) -> str:
    """The checker's sentence under the API's field name, files by their base names (never a server path)."""
    problem = without_server_paths(error.problem)
    parts = [param]
    if error.field and error.field != param and not error.field.startswith(param):
        inner = error.field
        if inner.startswith(f"remix.{param}"):
            inner = inner.removeprefix(f"remix.{param}")
            inner = f"{param}{inner}" if inner else ""
            parts = [] if inner else parts
        if inner.startswith(("keyframes", "references", "duration_seconds")) and param in (
            *FILE_FIELDS,
            "seconds",
        ):
            inner = ""
        if inner:
            parts.append(inner)
    if error.path is not None:
        parts.append(repr(Path(error.path).name))
    return ": ".join([*parts, problem])


def video_object(record: JobRecord, live: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI Video object of a job; H3's own fields under "h3"."""
    live = live or {}
    request, result, meta = record.request, record.result, record.meta
    error = None
    if record.status == "failed":
        error = {"code": record.error_code or "generation_failed", "message": record.error_message or ""}
    width = result.get("width") or meta.get("width")
    height = result.get("height") or meta.get("height")
    h3 = {
        "task": request.get("task"),
        "seed": result.get("seed", request.get("seed")),
        "steps": request.get("steps"),
        "flow_shift": request.get("flow_shift"),
        "audio_flow_shift": request.get("audio_flow_shift"),
        "aspect_ratio": request.get("aspect_ratio"),
        "short_edge": request.get("short_edge"),
        "rungs": request.get("rungs"),
        "frames": result.get("frames") or meta.get("frames"),
        "fps": result.get("fps", 24),
        "timings_s": result.get("timings_s", {}),
        "attempts": record.attempts,
        "source": record.source,
        "expired": record.expired,
        "queue_position": live.get("queue_position"),
        "step": live.get("step"),
        "total_steps": live.get("total_steps"),
        "eta_s": live.get("eta_s"),
    }
    return {
        "id": record.id,
        "object": "video",
        "model": meta.get("model", DEFAULT_MODEL),
        "status": record.status,
        "progress": int(live.get("progress", record.progress)),
        "created_at": int(record.created_at),
        "completed_at": None if record.completed_at is None else int(record.completed_at),
        "expires_at": None,
        "seconds": meta.get("seconds") or f"{request.get('duration_seconds') or DEFAULT_SECONDS:g}",
        "size": f"{width}x{height}" if width and height else meta.get("size"),
        "prompt": request.get("prompt"),
        "remixed_from_video_id": meta.get("remixed_from_video_id"),
        "error": error,
        "h3": h3,
    }
