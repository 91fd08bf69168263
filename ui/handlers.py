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
import functools
import inspect
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from h3engine.engine.lora.library import LoraLibrary
from h3engine.engine.options import cannot_write
from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.request.model import GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.runtime.front import EngineFront, JobHandle, stamped_output_name
from h3engine.runtime.messages import PreviewFrame, outputs_refuse_writes
from h3engine.serving.jobs import JobView, Refused, VideoJobs, page_jobs
from h3engine.serving.videos import DEFAULT_MODEL
from ui.access import AccessPolicy
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
from ui.inputs import InputStore, last_frame_png
from ui.press import PressResolutions
from ui.result import RESULT_FIELDS
from ui.tabs import DEFAULT_VALUES
from ui.takes import Take, TakeSet, checked_takes
from ui.task_values import (
    _FILE_FIELDS,
    _OPTIONAL_FILE_PARAMETERS,
    TaskValues,
    build_request,
    check_input_types,
    duration_out_of_range,
    error_text,
    failing_parameter,
    page_problem,
    parameter_names,
    request_values,
    shown_problem,
)

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# The status from the press until the generate handler's first update (ui.blocks's `finish` reads it).
STARTING_STATUS = "Starting…"
RANDOM_SEED_LIMIT = 2**31
PLACEHOLDER_PROMPT = "(prompt)"


def result_update(**fields: Any) -> tuple[Any, ...]:
    """An update of the result column: the named fields change, the others are left as they are."""
    unknown = set(fields) - set(RESULT_FIELDS)
    if unknown:
        raise ValueError(f"unknown result fields: {sorted(unknown)}")
    return tuple(fields.get(name, gr.skip()) for name in RESULT_FIELDS)


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
        jobs: VideoJobs | None = None,
    ) -> None:
        self.front = front
        self.access = access
        # The one job service (the API's too): it records, queues and follows the page's jobs; a page of its own
        # (tests, a page without the API) gets one keeping its store in the outputs folder.
        self.jobs = jobs or page_jobs(front, access.outputs_dir)
        self.library = library or LoraLibrary(None)
        self.store = InputStore(access.outputs_dir)
        # The page's steps of a Generate press each ask for the press's resolution; only the first resolves.
        self.resolutions = PressResolutions(front.resolve)
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
            self.resolutions(build_request(values, seed=seed, library=self.library))
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
                geometry = self.resolutions(request).geometry
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
            views = self._submit(requests, results_dir)
        except Exception as error:
            refusal = error if isinstance(error, NotStarted) else _unexpected(error, "start a job")
            yield result_update(status=f"⚠ Not started: {refusal.reason}")
            raise gr.Error(refusal.reason, title=refusal.title, print_exception=False) from None
        session = _session_of(caller)
        self._running.setdefault(session, set()).update(views)
        try:
            async for update in self._follow(TakeSet.of(views), progress):
                yield update
        except gr.Error:
            raise
        except Exception as error:
            reason = _unexpected(error, "follow a job").reason
            yield result_update(status=f"Failed: {reason}")
            raise gr.Error(reason, title="Generation failed", print_exception=False) from None
        finally:
            # Cancelled by Gradio, or the reader went away: stop the engine at its next step.
            for view in views:
                self.jobs.cancel(view.job_id)
            running = self._running.get(session, set())
            running.difference_update(views)
            if not running:
                self._running.pop(session, None)

    def _prepare(self, values: TaskValues, caller: gr.Request | None) -> tuple[list[ResolvedRequest], Path]:
        """A press's resolved requests, one per take (consecutive seeds), their input files copied into the outputs
        folder; and the caller's results folder, made. Blocking. NotStarted says why no job can start."""
        try:
            check_input_types(values)
            takes = checked_takes(values.values["takes"])
            # Consecutive seeds from the first: a drawn first seed leaves room for the others.
            seed = secrets.randbelow(RANDOM_SEED_LIMIT) if values.values["randomize_seed"] else None
            resolved = self.resolutions(build_request(values, seed=seed, library=self.library))
            kept = resolved.with_files_at(self.store.keep_file)
            requests = [kept.with_seed(kept.request.seed + take) for take in range(takes)]
            results_dir = self.access.results_dir(caller)
            results_dir.mkdir(parents=True, exist_ok=True)
        except RequestError as error:
            failing, message = shown_problem(error, values)
            raise NotStarted(f"{failing}: {message}", "Invalid request") from None
        except OSError as error:
            raise storage_problem(error, self.access.outputs_dir) from None
        return requests, results_dir

    def _submit(self, requests: list[ResolvedRequest], results_dir: Path) -> list[JobView]:
        """One job of the job service per request, writing into `results_dir`; all or none (NotStarted when the
        service refuses one: the folder went away or refuses writes, the store cannot record it)."""
        views: list[JobView] = []
        owner = self.jobs.ui_owner(results_dir)
        try:
            for take in requests:
                out_path = results_dir / stamped_output_name(take.request.task, secrets.token_hex(4))
                meta = {"model": DEFAULT_MODEL, "seconds": f"{take.duration_seconds:g}"}
                view = JobView(take.request)
                record, _ = self.jobs.create(owner, take, meta, "ui", out_path=out_path, view=view)
                if record.status == "failed":  # the front refused it (its output files)
                    raise Refused(503, record.error_code or "not_queued", record.error_message or "")
                views.append(view)
        except (Refused, OSError) as error:
            for view in views:
                self.jobs.cancel(view.job_id)
            if isinstance(error, OSError):
                raise storage_problem(error, self.access.outputs_dir) from None
            logger.error("the job service refused a job of the page: %s", error)
            if error.code == "outputs_unwritable":
                why = cannot_write(results_dir) or "its files cannot be made there"
                raise NotStarted(outputs_refuse_writes(why), "Cannot write the outputs") from None
            raise NotStarted(error.message, "Not started") from None
        return views

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
        for view in list(self._running.get(_session_of(caller), ())):
            self.jobs.cancel(view.job_id)

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
