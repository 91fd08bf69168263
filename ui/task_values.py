"""A tab's inputs as a request: `parameter_names(task)` (an endpoint's parameters in `TaskTab.inputs` order),
`TaskValues`, `build_request`, the type checks a request cannot make (`check_input_types`), a RequestError as the
page shows it (`failing_parameter`, `error_text`, `shown_problem`, `page_problem`), and a request back as input
values (`request_values`, History's restore).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from h3engine.engine.lora.library import LoraLibrary, lora_choices
from h3engine.errors import RequestError, without_server_paths
from h3engine.request.checks import parse_rungs
from h3engine.request.files import Keyframe, Reference
from h3engine.request.limits import MAX_DURATION_SECONDS, MIN_DURATION_SECONDS
from h3engine.request.model import VERIFIED_SHORT_EDGE, GenerationRequest
from ui.components import NotAnUpload
from ui.inputs import reference_kind
from ui.loras import lora_values
from ui.tabs import DEFAULT_VALUES, MEDIA_PARAMETERS, SETTINGS_PARAMETERS

_SCALAR_FIELDS = {
    "prompt",
    "aspect_ratio",
    "short_edge",
    "seed",
    "steps",
    "flow_shift",
    "audio_flow_shift",
    "takes",
    "rungs",
    "loras",
    "cache",
}


_BOOLEAN_FIELDS = ("randomize_seed", "duration_from_reference")


_FILE_FIELDS = ("first_image", "last_image", "references")


# The endpoint parameters an API client may leave out although their components start empty.
_OPTIONAL_FILE_PARAMETERS = ("first_image", "last_image")


_KEYFRAME_WORDS = {"first_image": "first frame", "last_image": "last frame"}


def parameter_names(task: str) -> tuple[str, ...]:
    return ("prompt", *MEDIA_PARAMETERS[task], *SETTINGS_PARAMETERS)


@dataclasses.dataclass(frozen=True)
class TaskValues:
    """One endpoint's raw inputs, by parameter name."""

    task: str
    values: dict[str, Any]

    @classmethod
    def from_inputs(cls, task: str, inputs: Sequence[Any]) -> TaskValues:
        return cls(task, dict(zip(parameter_names(task), inputs, strict=True)))

    def files(self) -> dict[str, list[str]]:
        """The file inputs' paths, by parameter name (what is not a path, check_input_types refuses)."""
        files = {}
        for name in _FILE_FIELDS:
            if name in self.values:
                value = self.values[name]
                items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
                files[name] = [item for item in items if isinstance(item, str)]
        return files


def build_request(
    values: TaskValues,
    seed: int | None = None,
    keep: Callable[[str], str] = str,
    prompt: str | None = None,
    library: LoraLibrary | None = None,
) -> GenerationRequest:
    """A GenerationRequest from a tab's inputs; `keep` maps each input file to the path the request names, `library`
    each adapter name (the app's --lora-dir)."""
    named = values.values
    keyframes = tuple(
        Keyframe(path=keep(named[name]), position=position)
        for name, position in (("first_image", "first"), ("last_image", "last"))
        if named.get(name)
    )
    references = tuple(
        Reference(kind=reference_kind(path), path=keep(path)) for path in named.get("references") or ()
    )
    from_reference = values.task == "ref2va" and bool(named.get("duration_from_reference"))
    return GenerationRequest(
        task=values.task,
        prompt=named["prompt"] if prompt is None else prompt,
        duration_seconds=None if from_reference else named["duration_seconds"],
        aspect_ratio=named["aspect_ratio"],
        short_edge=named["short_edge"],
        seed=named["seed"] if seed is None else seed,
        steps=named["steps"],
        flow_shift=named["flow_shift"],
        audio_flow_shift=named["audio_flow_shift"],
        keyframes=keyframes,
        references=references,
        loras=lora_choices(named.get("loras"), values.task, library or LoraLibrary(None)),
        rungs=parse_rungs(named.get("rungs")),
        cache=named.get("cache", DEFAULT_VALUES["cache"]),
    )


def check_input_types(values: TaskValues) -> None:
    """The type checks GenerationRequest cannot make: its checkboxes are not request fields, and a file input must
    hold uploaded files (ui.components.as_uploaded), not a bare path or some other value."""
    for name in _BOOLEAN_FIELDS:
        if name in values.values and not isinstance(values.values[name], bool):
            raise RequestError(name, f"must be true or false, got {_short(values.values[name])}")
    for name in _FILE_FIELDS:
        value = values.values.get(name)
        items = value if name == "references" and isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, NotAnUpload):
                raise RequestError(
                    name,
                    f"must be an uploaded file (gradio_client: handle_file(path)), got {_short(item.value)}",
                )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def failing_parameter(error: RequestError, values: TaskValues) -> str:
    """The input a RequestError is about: the one holding its field (`keyframes[1].path` -> that keyframe's input,
    `width, height` -> the aspect ratio), else the one holding its file, else the prompt."""
    head, index = _field_head(error.field)
    names = values.values
    if head in _SCALAR_FIELDS or head in _BOOLEAN_FIELDS or head in _FILE_FIELDS:
        return head
    if head in ("width", "height"):
        return "aspect_ratio"
    if head == "duration_seconds":
        return "duration_from_reference" if names.get("duration_from_reference") else "duration_seconds"
    if head == "keyframes":
        given = [name for name in ("first_image", "last_image") if names.get(name)]
        index = index or 0
        return given[index] if index < len(given) else "first_image"
    if error.path is not None:
        # The request may name a stored copy of the upload (ui.inputs.InputStore), which keeps its file name.
        for name, paths in values.files().items():
            if error.path in paths or Path(error.path).name in {Path(path).name for path in paths}:
                return name
    return "prompt"


def _field_head(field: str) -> tuple[str, int | None]:
    """A field path's first name and its first index: `keyframes[1].path` -> ("keyframes", 1), `width, height` ->
    ("width", None)."""
    match = re.match(r"([A-Za-z_]+)(?:\[(\d+)\])?", field)
    if match is None:
        return "", None
    return match.group(1), None if match.group(2) is None else int(match.group(2))


def error_text(error: RequestError, parameter: str, values: TaskValues) -> str:
    """A RequestError as shown at the input `parameter` (Gradio's validation message, which gradio_client prints
    after the parameter's name and the page shows in place of an image's label): files by the names they were
    uploaded under, never a server path, the field not named a second time, and a file input's file named with the
    input it came in (`'cat.png' (first frame): ...`, `'a.wav' (reference 2): ...`)."""
    field, problem = error.field, _without_server_paths(error.problem, values)
    file = None if error.path is None else f"'{Path(error.path).name}'"
    if field == parameter or (parameter in _KEYFRAME_WORDS and _field_head(field)[0] == "keyframes"):
        return _with_input(problem, file, _KEYFRAME_WORDS.get(parameter))
    head, index = _field_head(field)
    if head == "references" and index is not None:
        inner = field[len(f"references[{index}]") :]
        return _with_input(problem, file, f"reference {index + 1}{inner}")
    if file is not None:
        problem = f"{file}: {problem}"
    if not field:
        return problem
    if problem.startswith(("is ", "must ")):  # another field's rule: "duration_seconds is required, or ..."
        return f"{field} {problem}"
    return f"{field}: {problem}"


def _without_server_paths(text: str, values: TaskValues) -> str:
    """`text` with every uploaded file, and any other quoted server path, by its base name."""
    for paths in values.files().values():
        for path in paths:
            if isinstance(path, str) and path:
                text = text.replace(path, Path(path).name)
    return without_server_paths(text)


def shown_problem(error: RequestError, values: TaskValues) -> tuple[str, str]:
    """(the input a RequestError is about, its message as shown there: `error_text`)."""
    failing = failing_parameter(error, values)
    return failing, error_text(error, failing, values)


def duration_out_of_range(values: TaskValues) -> str | None:
    """When the tab's own duration is used and is a number outside what the model makes, that in plain words (the
    page shows it in the canvas line and the status; the field keeps what was typed): else None."""
    named = values.values
    seconds = named.get("duration_seconds")
    if values.task == "ref2va" and named.get("duration_from_reference") is True:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds != seconds:
        return None
    if MIN_DURATION_SECONDS <= seconds <= MAX_DURATION_SECONDS:
        return None
    return (
        f"the duration must be from {MIN_DURATION_SECONDS:g} to {MAX_DURATION_SECONDS:g} seconds, and {seconds:g} s "
        "was typed; change it to a duration in that range"
    )


def page_problem(error: RequestError, values: TaskValues) -> str:
    """A RequestError as the page's status says it: `<input>: <message>` (`shown_problem`), or a duration outside
    the model's range in plain words."""
    if error.field == "duration_seconds":
        words = duration_out_of_range(values)
        if words is not None:
            return words
    failing, message = shown_problem(error, values)
    return f"{failing}: {message}"


def _with_input(problem: str, file: str | None, words: str | None) -> str:
    """A problem at the input it came in: `'name' (words): problem` for a file's, else `words: problem` for a
    reference's (a keyframe's input says which frame it is)."""
    if file is not None:
        return f"{file} ({words}): {problem}" if words else f"{file}: {problem}"
    if words is not None and words.startswith("reference"):
        return f"{words}: {problem}"
    return problem


def request_values(
    request: GenerationRequest,
    keep: Callable[[str], str],
    library: LoraLibrary | None = None,
    own_short_edge: int = VERIFIED_SHORT_EDGE,
) -> dict[str, Any]:
    """A request's settings as input values by parameter name (files that no longer exist, and adapters no longer
    in the LoRA folder, are left out); a short edge left to the checkpoint's rule shows as `own_short_edge`, the
    rule's own (a browser cannot send an empty number)."""
    values: dict[str, Any] = {
        "prompt": request.prompt,
        "duration_seconds": request.duration_seconds or DEFAULT_VALUES["duration_seconds"],
        "aspect_ratio": request.aspect_ratio,
        "seed": request.seed,
        "randomize_seed": False,
        "steps": DEFAULT_VALUES["steps"] if request.steps is None else request.steps,
        "flow_shift": request.flow_shift,
        "audio_flow_shift": request.audio_flow_shift,
        "short_edge": own_short_edge if request.short_edge is None else request.short_edge,
        "takes": 1,
        "rungs": ",".join(map(str, request.rungs)),
        "loras": lora_values(request, library or LoraLibrary(None)),
        "cache": request.cache,
    }
    if request.task == "fl2va":
        by_position = {keyframe.position: keyframe.path for keyframe in request.keyframes}
        for name, position in (("first_image", "first"), ("last_image", "last")):
            path = by_position.get(position)
            values[name] = keep(path) if path and Path(path).is_file() else None
    if request.task == "ref2va":
        values["references"] = [
            keep(reference.path) for reference in request.references if Path(reference.path).is_file()
        ]
        values["duration_from_reference"] = request.duration_seconds is None
    return values
