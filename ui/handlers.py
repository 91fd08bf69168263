"""What the buttons do: build requests from a tab's inputs, check them, run them on the engine front, restore.

* `parameter_names(task)` is the parameter list of the task's API endpoint (/t2va, /fl2va, /ref2va), in the order of
  `TaskTab.inputs`; `Handlers.generator(task)` (the endpoint) and `Handlers.validator(task)` take them in that order.
* The validators run before Gradio queues an event: they check the two checkboxes' types, build the request (no file
  copied) and run every model-free check; a failure marks the input it names (a ValidationError for API clients).
* The generate handlers check the request and copy its inputs into the outputs folder (in a worker thread), submit
  it (its files go to the caller's results folder, ui.access) and turn the front's messages into result-column
  updates (`RESULT_FIELDS` order) and `gr.Progress` steps. Every ending leaves a status in plain words (ui.endings;
  tracebacks go to the server log); a failure also raises them as a gr.Error. When Gradio cancels a handler
  (Cancel, `job.cancel()`, the browser went away) its job is cancelled.
* Every file a handler returns goes out through `AccessPolicy.publish`; History reads only the caller's folder.

Danger: every value here comes from a browser or an API client. Paths reach the engine only as Gradio uploads or
copies in the outputs folder; a history stem is looked up by `ui.history.find_entry`, which takes only a plain stem.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from h3engine.engine.lora.library import LoraLibrary, lora_choices
from h3engine.engine.options import cannot_write
from h3engine.errors import RequestError
from h3engine.request.checks import parse_rungs
from h3engine.request.files import Keyframe, Reference
from h3engine.request.limits import MAX_DURATION_SECONDS, MIN_DURATION_SECONDS
from h3engine.request.model import VERIFIED_SHORT_EDGE, GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.runtime.front import EngineFront, JobHandle, stamped_output_name
from h3engine.runtime.messages import PreviewFrame, outputs_refuse_writes
from ui.access import AccessPolicy
from ui.components import NotAnUpload
from ui.endings import UNEXPECTED_ERROR, NotStarted, storage_problem
from ui.history import (
    HistoryEntry,
    entry_markdown,
    find_entry,
    history_rows,
    list_history,
    result_markdown,
    sidecar_step_cache,
)
from ui.inputs import InputStore, last_frame_png, reference_kind
from ui.loras import lora_values
from ui.result import RESULT_FIELDS
from ui.tabs import DEFAULT_VALUES, MEDIA_PARAMETERS, SETTINGS_PARAMETERS
from ui.takes import Take, TakeSet, checked_takes

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# The status from the press until the generate handler's first update (ui.blocks's `finish` reads it).
STARTING_STATUS = "Starting…"
RANDOM_SEED_LIMIT = 2**31
PLACEHOLDER_PROMPT = "(prompt)"
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
_QUOTED_PATH = re.compile(r"(['\"])/[^'\"]*/([^'\"/]+)\1")


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
    return _QUOTED_PATH.sub(r"\1\2\1", text)


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


def result_update(**fields: Any) -> tuple[Any, ...]:
    """An update of the result column: the named fields change, the others are left as they are."""
    unknown = set(fields) - set(RESULT_FIELDS)
    if unknown:
        raise ValueError(f"unknown result fields: {sorted(unknown)}")
    return tuple(fields.get(name, gr.skip()) for name in RESULT_FIELDS)


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
        "steps": request.steps,
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


def take_caption(number: int, seed: int) -> str:
    return f"Take {number} · seed {seed}"


def _session_of(caller: gr.Request | None) -> str:
    return str(getattr(caller, "session_hash", None) or "")


def _unexpected(error: Exception, doing: str) -> NotStarted:
    """An exception no ending foresaw: logged with its traceback, shown as one sentence."""
    logger.error("the generate handler could not %s", doing, exc_info=error)
    return NotStarted(UNEXPECTED_ERROR, "Generation failed")


def swap_keyframes(first_image: str | None, last_image: str | None) -> tuple[str | None, str | None]:
    return last_image, first_image


class Handlers:
    def __init__(
        self,
        front: EngineFront,
        access: AccessPolicy,
        library: LoraLibrary | None = None,
        recorder: Any = None,
    ) -> None:
        self.front = front
        self.access = access
        # The job store's recorder (h3engine.serving.jobs.VideoJobs: record_ui, ui_event, ui_settle), or None.
        self.recorder = recorder
        self._store_ids: dict[str, str] = {}  # a UI job's front id -> its store id
        self.library = library or LoraLibrary(None)
        self.store = InputStore(access.outputs_dir)
        # The jobs each browser session has running, for its Cancel button.
        self._running: dict[str, set[JobHandle]] = {}

    # --- checks -----------------------------------------------------------------------------------------

    def problem(self, values: TaskValues) -> RequestError | None:
        """What is wrong with a tab's inputs, found without running a model (None: nothing)."""
        try:
            check_input_types(values)
            checked_takes(values.values["takes"])
            # A random seed is drawn later; check the request with a valid placeholder.
            seed = 0 if values.values["randomize_seed"] else None
            self.front.check(build_request(values, seed=seed, library=self.library))
        except RequestError as error:
            return error
        return None

    def validator(self, task: str) -> Callable[..., list[dict[str, Any]]]:
        def validate_inputs(*inputs: Any) -> list[dict[str, Any]]:
            values = TaskValues.from_inputs(task, inputs)
            error = self.problem(values)
            failing, message = shown_problem(error, values) if error is not None else (None, "")
            return [
                gr.validate(name != failing, message if name == failing else "")
                for name in parameter_names(task)
            ]

        return validate_inputs

    def start(self, task: str, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], bool]:
        """Run the moment Generate is pressed, before the job is queued: (result-column updates, whether a job
        starts). The status shows the inputs' problem or that a job starts, and then the previous result is cleared
        so that it cannot pass for the new one; the takes gallery shows when there are several takes."""
        values = TaskValues.from_inputs(task, inputs)
        error = self.problem(values)
        if error is not None:
            return result_update(status=f"⚠ Not started: {page_problem(error, values)}"), False
        cleared = result_update(
            status=STARTING_STATUS,
            preview=None,
            video=None,
            seed_used=gr.Number(value=None, visible=False),
            details="",
            downloads=None,
            takes=gr.Gallery(value=[], visible=checked_takes(values.values["takes"]) > 1),
            take_paths=[],
        )
        return cleared, True

    def describe_canvas(self, task: str) -> Callable[..., str]:
        """The derived canvas and frame count shown under a tab's duration and aspect ratio."""

        def describe(*inputs: Any) -> str:
            values = TaskValues.from_inputs(task, inputs)
            # Under the duration: a duration out of range first, in plain words (the field keeps what was typed).
            words = duration_out_of_range(values)
            if words is not None:
                return f"Canvas and frames: waiting for valid settings ({words})"
            try:
                check_input_types(values)
                request = build_request(values, seed=0, prompt=PLACEHOLDER_PROMPT, library=self.library)
                self.front.check(request)
                geometry = self.front.expected_geometry(request)
            except RequestError as error:
                # A file's problem as its input shows it; a setting's with the field's name (no input shows it).
                failing = failing_parameter(error, values)
                shown = error_text(error, failing if failing in _FILE_FIELDS else "", values)
                return f"Canvas and frames: waiting for valid settings ({shown})"
            return (
                f"Canvas **{geometry.width} × {geometry.height}** · **{geometry.frames}** frames at 24 fps "
                f"({geometry.duration:.2f} s)"
            )

        return describe

    # --- generation -------------------------------------------------------------------------------------

    def generator(self, task: str) -> Callable[..., AsyncIterator[tuple[Any, ...]]]:
        """The task's generate endpoint, an async generator of result-column updates.

        Gradio names an endpoint's API parameters after its handler's signature and passes `gr.Request` and
        `gr.Progress` where the signature asks for them (by annotation and by default value), so the handler is
        given that signature: `parameter_names(task)`, then `request`, then `progress`.
        """

        async def generate(*arguments: Any) -> AsyncIterator[tuple[Any, ...]]:
            *inputs, caller, progress = arguments
            async for update in self._generate(task, inputs, caller, progress):
                yield update

        # A keyframe may be left out (None: Gradio then lists it as optional); every parameter after the first
        # optional one needs a default too, its component's initial value (which the API lists anyway).
        parameter = functools.partial(inspect.Parameter, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = parameter_names(task)
        optional = [index for index, name in enumerate(names) if name in _OPTIONAL_FILE_PARAMETERS]
        first_optional = optional[0] if optional else len(names)
        generate.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                *(
                    parameter(name)
                    if index < first_optional
                    else parameter(name, default=DEFAULT_VALUES[name])
                    for index, name in enumerate(names)
                ),
                parameter("request", annotation=gr.Request, default=None),
                parameter("progress", default=gr.Progress()),
            ]
        )
        generate.__annotations__ = {"request": gr.Request}
        return generate

    async def _generate(
        self, task: str, inputs: Sequence[Any], caller: gr.Request | None, progress: gr.Progress
    ) -> AsyncIterator[tuple[Any, ...]]:
        """Every ending leaves a status saying what happened; an ending other than done or cancelled then raises a
        gr.Error with the same words (API clients read it; the page's `failure` event re-enables Generate)."""
        values = TaskValues.from_inputs(task, inputs)
        try:
            # The checks probe the media and the inputs are copied: blocking work, so off the event loop.
            requests, results_dir = await asyncio.to_thread(self._prepare, values, caller)
            handles = self._submit(requests, results_dir)
        except Exception as error:
            refusal = error if isinstance(error, NotStarted) else _unexpected(error, "start a job")
            yield result_update(status=f"⚠ Not started: {refusal.reason}")
            raise gr.Error(refusal.reason, title=refusal.title, print_exception=False) from None
        session = _session_of(caller)
        self._running.setdefault(session, set()).update(handles)
        try:
            async for update in self._follow(TakeSet.of(handles, self._observe), progress):
                yield update
        except gr.Error:
            raise
        except Exception as error:
            reason = _unexpected(error, "follow a job").reason
            yield result_update(status=f"Failed: {reason}")
            raise gr.Error(reason, title="Generation failed", print_exception=False) from None
        finally:
            # Cancelled by Gradio, or the reader went away: stop the engine at its next step.
            for handle in handles:
                self.front.cancel(handle)
                self._settle(handle)
            running = self._running.get(session, set())
            running.difference_update(handles)
            if not running:
                self._running.pop(session, None)

    def _prepare(self, values: TaskValues, caller: gr.Request | None) -> tuple[list[GenerationRequest], Path]:
        """A press's requests, one per take (consecutive seeds), checked, their input files copied into the outputs
        folder; and the caller's results folder, made. Blocking. NotStarted says why no job can start."""
        try:
            check_input_types(values)
            takes = checked_takes(values.values["takes"])
            # Consecutive seeds from the first: a drawn first seed leaves room for the others.
            seed = secrets.randbelow(RANDOM_SEED_LIMIT) if values.values["randomize_seed"] else None
            request = build_request(values, seed=seed, keep=self.store.keep_file, library=self.library)
            requests = [dataclasses.replace(request, seed=request.seed + take) for take in range(takes)]
            self.front.check(request)
            if takes > 1:
                self.front.check(requests[-1])
            results_dir = self.access.results_dir(caller)
            results_dir.mkdir(parents=True, exist_ok=True)
        except RequestError as error:
            failing, message = shown_problem(error, values)
            raise NotStarted(f"{failing}: {message}", "Invalid request") from None
        except OSError as error:
            raise storage_problem(error, self.access.outputs_dir) from None
        return requests, results_dir

    def _submit(self, requests: list[GenerationRequest], results_dir: Path) -> list[JobHandle]:
        """One job per request, writing into `results_dir`; all or none (NotStarted when the front refuses the
        output files: the folder went away or refuses writes)."""
        handles: list[JobHandle] = []
        store_id = None
        try:
            for take in requests:
                out_path = results_dir / stamped_output_name(take.task, secrets.token_hex(4))
                store_id = self._record(take, out_path, results_dir)
                handles.append(self.front.submit(take, out_path=out_path))
                if store_id is not None:
                    self._store_ids[handles[-1].job_id] = store_id
                    store_id = None
        except (RequestError, OSError) as error:
            for handle in handles:
                self.front.cancel(handle)
                self._settle(handle)
            if store_id is not None and self.recorder is not None:
                self.recorder.ui_settle(store_id)
            if isinstance(error, OSError):
                raise storage_problem(error, self.access.outputs_dir) from None
            logger.error("the engine front refused a job's output files: %s", error)
            why = cannot_write(results_dir) or "its files cannot be made there"
            raise NotStarted(outputs_refuse_writes(why), "Cannot write the outputs") from None
        return handles

    def _record(self, request: GenerationRequest, out_path: Path, results_dir: Path) -> str | None:
        """The job's row in the job store (None without one): written before the job is queued."""
        if self.recorder is None:
            return None
        try:
            return self.recorder.record_ui(self.recorder.ui_owner(results_dir), request, out_path)
        except Exception:  # a store that fails (a full disk) must not stop the page's job
            logger.exception("the job store could not record a job of the page")
            return None

    def _observe(self, handle: JobHandle, event: Any) -> None:
        store_id = self._store_ids.get(handle.job_id)
        if store_id is not None and self.recorder is not None:
            try:
                self.recorder.ui_event(store_id, event)
            except Exception:  # the store must never break the page's job
                logger.exception("the job store could not record job %s", handle.job_id)

    def _settle(self, handle: JobHandle) -> None:
        store_id = self._store_ids.pop(handle.job_id, None)
        if store_id is not None and self.recorder is not None:
            try:
                self.recorder.ui_settle(store_id)
            except Exception:
                logger.exception("the job store could not settle job %s", handle.job_id)

    async def _follow(self, takes: TakeSet, progress: gr.Progress) -> AsyncIterator[tuple[Any, ...]]:
        """Result-column updates while the takes run; the status after every message is the takes' own, and the
        last update states how they ended (a failure then also raises, for API clients)."""
        started_at = time.monotonic()
        latest_preview: PreviewFrame | None = None
        shown: Take | None = None
        while True:
            changed, preview, newly_finished = takes.drain()
            if not changed:
                await asyncio.sleep(POLL_INTERVAL_S)
                continue
            latest_preview = preview or latest_preview
            fields: dict[str, Any] = {"status": takes.status_line()}
            if preview is not None:
                fields["preview"] = preview.rgb
            if newly_finished:
                shown = shown or newly_finished[0]
                # Publishing copies the result's files: off the event loop.
                fields.update(await asyncio.to_thread(self._take_fields, takes, shown))
            done_steps = takes.progress()
            if done_steps is not None:
                progress(done_steps, desc=takes.status_line(), unit="steps")
            if not takes.ended:
                yield result_update(**fields)
                continue
            fields["status"] = takes.final_status(time.monotonic() - started_at)
            if shown is not None and latest_preview is not None:
                fields["preview"] = latest_preview.rgb
            yield result_update(**fields)
            failures = [
                take.failed for take in takes.takes if take.failed and take.failed.kind != "cancelled"
            ]
            if failures and not takes.finished:
                title = "Invalid request" if failures[0].kind == "request" else "Generation failed"
                raise gr.Error(failures[0].message, title=title, print_exception=False)
            return

    def _take_fields(self, takes: TakeSet, shown: Take) -> dict[str, Any]:
        """The result column's fields for the take shown, and the gallery of every take finished so far."""
        event = shown.finished
        assert event is not None and shown.started is not None
        timings = {"queue_wait_s": shown.started.queue_wait_s, **event.timings_s}
        video = self.access.publish(event.video_path)
        finished = takes.finished
        return {
            "video": video,
            "seed_used": event.seed,
            "details": result_markdown(
                event.seed,
                event.width,
                event.height,
                event.frames,
                event.fps,
                timings,
                sidecar_step_cache(event.sidecar_path),
            ),
            "downloads": [video, self.access.publish(event.sidecar_path)],
            "last_result": event.video_path,
            "takes": [
                (self.access.publish(take.finished.video_path), take_caption(take.number, take.finished.seed))
                for take in finished
            ],
            "take_paths": [take.finished.video_path for take in finished],
        }

    def cancel_jobs(self, caller: gr.Request) -> None:
        """Cancel: every job of the caller's session stops; each generate handler then writes how its jobs ended."""
        for handle in list(self._running.get(_session_of(caller), ())):
            self.front.cancel(handle)

    # --- history, examples, keyframes --------------------------------------------------------------------

    def history_samples(self, caller: gr.Request | None) -> list[list[str]]:
        return history_rows(list_history(self.access.results_dir(caller)))

    def refresh_history(self, request: gr.Request) -> gr.Dataset:
        """The caller's own past results (loaded per session: the page config carries none)."""
        return gr.Dataset(samples=self.history_samples(request))

    def history_entry(self, row: list[Any] | None, caller: gr.Request | None) -> HistoryEntry:
        """The caller's result a clicked History row names."""
        entry = find_entry(self.access.results_dir(caller), row[0] if row else None)
        if entry is None:
            raise gr.Error(
                "That result is no longer in your history (its files were removed); press Refresh under "
                "History to update the list.",
                title="Result gone",
                print_exception=False,
            )
        return entry

    def settings_of(self, entry: HistoryEntry) -> tuple[GenerationRequest, dict[str, Any]]:
        """A past result's request and its settings as input values (files that are gone left out)."""
        try:
            request = from_dict(entry.sidecar["request"])
        except RequestError as error:
            raise gr.Error(f"Cannot restore {entry.stem}: {error}", print_exception=False) from None
        return request, request_values(
            request, self.access.publish, self.library, self.front.facts.canvas.short_edge
        )

    def result_of(self, entry: HistoryEntry, keep_takes: bool = False) -> tuple[Any, ...]:
        """The result column showing a past result; `keep_takes`: it is one of the takes shown, which stay."""
        video = self.access.publish(entry.video_path)
        takes = {} if keep_takes else {"takes": gr.Gallery(value=[], visible=False), "take_paths": []}
        return result_update(
            status=f"Showing {entry.stem}.",
            preview=None,
            video=video,
            seed_used=gr.Number(value=int(entry.sidecar.get("seed", 0)), visible=True),
            details=entry_markdown(entry),
            downloads=[video, self.access.publish(entry.sidecar_path)],
            last_result=str(entry.video_path),
            **takes,
        )

    def show_take(
        self, take_paths: list[str] | None, selected: gr.SelectData, caller: gr.Request
    ) -> tuple[Any, ...]:
        """A take clicked in the takes gallery becomes the result shown (its video, details, downloads, last frame)."""
        paths = take_paths or []
        index = selected.index if isinstance(selected.index, int) else -1
        entry = (
            find_entry(self.access.results_dir(caller), Path(paths[index]).stem)
            if 0 <= index < len(paths)
            else None
        )
        if entry is None:
            raise gr.Error(
                "That take is no longer in your history (its files were removed).",
                title="Take gone",
                print_exception=False,
            )
        return self.result_of(entry, keep_takes=True)

    def entry_of_result(self, last_result: str | None, caller: gr.Request | None) -> HistoryEntry:
        """The history entry of the result shown in the result column."""
        if not last_result:
            raise gr.Error(
                "There is no result to restore yet: generate (or pick) one first.",
                title="No result yet",
                print_exception=False,
            )
        entry = find_entry(self.access.results_dir(caller), Path(last_result).stem)
        if entry is None:
            raise gr.Error(
                "The result shown is no longer in your history (its files were removed), so its settings cannot "
                "be restored.",
                title="Result gone",
                print_exception=False,
            )
        return entry

    def example_values(self, request: GenerationRequest) -> dict[str, Any]:
        return request_values(request, self.access.publish, self.library, self.front.facts.canvas.short_edge)

    def use_last_frame(self, last_result: str | None) -> str:
        if not last_result:
            raise gr.Error(
                "There is no previous result yet: generate (or restore) one first.",
                title="No result yet",
                print_exception=False,
            )
        if not Path(last_result).is_file():
            raise gr.Error(
                "The result shown is no longer on the server (its video was removed), so its last frame cannot "
                "be used.",
                title="Result gone",
                print_exception=False,
            )
        try:
            return self.access.publish(last_frame_png(last_result, self.store))
        except RequestError as error:
            raise gr.Error(str(error), print_exception=False) from None
        except OSError as error:  # storing the frame: a full disk, a folder that refuses writes
            refusal = storage_problem(error, self.access.outputs_dir)
            raise gr.Error(refusal.reason, title=refusal.title, print_exception=False) from None
