"""The whole page: header and banner, the three task tabs, the shared result column, the history; and its events.

Contract: `build_ui(front, options)` returns a `gr.Blocks` (not yet queued or launched; app.py does both). Events:
* `/t2va`, `/fl2va`, `/ref2va`: the three generate endpoints (public API); `/remix` the Remix section's (ui.remix). Each has a validator that runs before
  Gradio queues it, and all three share the concurrency group "h3-engine" limited to the front's replica count.
  The page's Generate runs a private copy of its endpoint that ends a failure in the status line instead of raising
  it (ui.notices); the public endpoint, which raises for API clients, hangs on a trigger the page never shows.
* Everything else (derived canvas, swap, last frame, reference gallery, examples, history, cancel) is private: not
  part of the API. No page event whose outputs are inputs or players raises (Gradio would put each of them in its
  error state): a problem is one toast (ui.notices), and the buttons that act on the shown result are disabled
  while there is none.
* The page config (`/config`, the same for everyone) holds no result and no server path: History is filled per
  session by a `demo.load` event; app.py passes a checkpoint label and banner without server paths (unless
  `--shared-history`, the single-user mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from h3engine.engine.lora.library import LoraLibrary
from h3engine.runtime.front import EngineFront
from ui.access import AccessPolicy
from ui.endings import NOT_TAKEN_STATUS
from ui.examples import Example, load_examples
from ui.handlers import STARTING_STATUS, Handlers, swap_keyframes
from ui.history import HistoryEntry
from ui.loras import wire_lora_panel
from ui.notices import result_buttons_state, told_in_a_toast, told_in_the_status
from ui.prompt_builder import wire_prompt_builder
from ui.references import wire_reference_gallery
from ui.remix import RemixTab, build_remix_tab, wire_remix_tab
from ui.result import HistoryPanel, ResultColumn, build_history, build_result_column
from ui.tabs import DEFAULT_VALUES, TaskTab, build_fl2va_tab, build_ref2va_tab, build_t2va_tab
from ui.task_values import parameter_names

ENGINE_CONCURRENCY_ID = "h3-engine"
# Brings the status into view when Generate is pressed (on a phone the result column is below the tab).
SHOW_STATUS_JS = """() => {
    const show = () => {
        const status = document.querySelector("#h3-status");
        if (!status) return;
        const box = status.getBoundingClientRect();
        if (box.top < 0 || box.bottom > window.innerHeight) status.scrollIntoView({ block: "start" });
    };
    show();
    // Again once the cleared result column has settled (a slow page may still be laying it out).
    setTimeout(show, 400);
}"""
# Rerun, once the shown result's settings are back in its tab: press that tab's Generate (`task`: "" when the
# settings could not be restored, and nothing is pressed).
RERUN_JS = """(task) => {
    if (!task) return;
    setTimeout(() => document.getElementById(`${task}-generate`)?.click(), 300);
}"""
# Short enough that all three fit a phone-wide tab bar (Gradio folds the others into a menu).
TAB_TITLES = {"t2va": "Text", "fl2va": "First / last frame", "ref2va": "References"}
# The generate endpoints' descriptions on the API page.
API_DESCRIPTIONS = {
    "t2va": "Text to video with sound.",
    "fl2va": "First and/or last frame to video with sound.",
    "ref2va": "Ordered image / video / audio references to video with sound.",
}


@dataclass(frozen=True)
class UiOptions:
    outputs_dir: Path
    examples_path: Path
    repository_root: Path
    checkpoint_label: str
    memory_profile: str = "auto"
    banner_markdown: str | None = None
    max_jobs: int = 32  # generate events running at once (the engine front queues their jobs)
    lora_dir: Path | None = None  # the adapters the LoRA panels and the endpoints' `loras` may name


def build_ui(
    front: EngineFront,
    options: UiOptions,
    access: AccessPolicy | None = None,
    delete_cache: tuple[int, int] | None = None,
    jobs: Any = None,
) -> gr.Blocks:
    """`access`: who sees which results (default: per user or session); `delete_cache`: Gradio's (every N s,
    its files older than M s), for the uploads; `jobs`: the job service (h3engine.serving.jobs.VideoJobs), shared with the API."""
    library = LoraLibrary(options.lora_dir)
    handlers = Handlers(front, access or AccessPolicy(options.outputs_dir), library, jobs)
    examples = load_examples(options.examples_path, options.repository_root)
    with gr.Blocks(title="MiniMax H3", delete_cache=delete_cache) as demo:
        page = _build_page(front, options, handlers, library, examples)
        _wire_tabs(page, handlers, examples, options.max_jobs)
        _wire_restore(page, handlers)
        # Not queued: the queue's size (--queue-size) is for jobs, and a full one refused a page's History.
        page.history.refresh.click(
            handlers.refresh_history, outputs=page.history.table, queue=False, api_visibility="private"
        )
        demo.load(handlers.refresh_history, outputs=page.history.table, queue=False, api_visibility="private")
    return demo


@dataclass(frozen=True)
class _Page:
    """The page's parts that events are wired to."""

    tabs: dict[str, TaskTab]
    task_tabs: gr.Tabs
    remix_tab: RemixTab
    result: ResultColumn
    history: HistoryPanel


def _build_page(
    front: EngineFront,
    options: UiOptions,
    handlers: Handlers,
    library: LoraLibrary,
    examples: dict[str, list[Example]],
) -> _Page:
    """Header and banner, the task tabs with the Remix section beside them, the result column, the history."""
    builders = {"t2va": build_t2va_tab, "fl2va": build_fl2va_tab, "ref2va": build_ref2va_tab}
    gr.Markdown(
        "# MiniMax H3: video with sound\n"
        f"Checkpoint: `{options.checkpoint_label}` · engine replicas: {front.replicas} · "
        f"memory profile: {options.memory_profile} · "
        "24 fps video with 32 kHz stereo audio"
    )
    if options.banner_markdown:
        gr.Markdown(options.banner_markdown, elem_id="h3-banner")
    with gr.Row():
        with gr.Column(scale=3):
            with gr.Tabs(selected="t2va") as task_tabs:
                tabs: dict[str, TaskTab] = {}
                for task, build in builders.items():
                    with gr.Tab(TAB_TITLES[task], id=task, elem_id=f"tab-{task}"):
                        initial = _initial_values(front, task)
                        tabs[task] = build(
                            _initial_canvas_text(handlers, task, initial),
                            [example.title for example in examples[task]],
                            library,
                            initial["steps"],
                            initial["short_edge"],
                        )
            # Beside the task tabs, not among them: a fourth tab would push References into the tab bar's
            # overflow menu on a phone.
            with gr.Accordion("Remix a clip", open=False, elem_id="h3-remix"):
                remix_tab = build_remix_tab(_initial_values(front, "t2va")["steps"])
        with gr.Column(scale=2, elem_id="h3-result-column"):
            result = build_result_column()
    return _Page(tabs, task_tabs, remix_tab, result, build_history())


def _wire_tabs(page: _Page, handlers: Handlers, examples: dict[str, list[Example]], max_jobs: int) -> None:
    """Generate, cancel and the result buttons; each tab's canvas text, examples, prompt builder and LoRA panel;
    the keyframes and the reference gallery."""
    tabs, result = page.tabs, page.result
    generate_buttons = [tab.generate for tab in tabs.values()]
    for tab in tabs.values():
        _wire_generate(tab, handlers, result, generate_buttons, page.history.table, max_jobs)
    wire_remix_tab(page.remix_tab, handlers, result, max_jobs, ENGINE_CONCURRENCY_ID)
    # The buttons that act on the shown result follow it: enabled once there is one (a job's, a take's, a
    # History row's), disabled again when a page starts without one.
    needs_result = [
        result.restore,
        result.rerun,
        result.continue_in_fl2va,
        tabs["fl2va"].use_last_frame,
        page.remix_tab.use_result,
    ]
    result.last_result.change(
        lambda last_result: result_buttons_state(last_result, len(needs_result)),
        inputs=result.last_result,
        outputs=needs_result,
        queue=False,
        show_progress="hidden",
        api_visibility="private",
    )
    result.cancel.click(handlers.cancel_jobs, queue=False, api_visibility="private")
    for tab in tabs.values():
        _wire_canvas_text(tab, handlers)
        _wire_examples(tab, examples[tab.task], handlers)
        wire_prompt_builder(tab.prompt_builder, tab.prompt)
        settings = tab.settings
        wire_lora_panel(
            settings.lora_panel,
            settings.steps,
            settings.flow_shift,
            settings.audio_flow_shift,
            settings.rungs,
        )
    _wire_keyframes(tabs["fl2va"], handlers, result, page.task_tabs)
    wire_reference_gallery(tabs["ref2va"].reference_gallery, tabs["ref2va"].prompt)


def _wire_restore(page: _Page, handlers: Handlers) -> None:
    """A History row, Restore and Rerun put a result's settings back in its tab; a take shows that take."""
    tabs, task_tabs, result, history = page.tabs, page.task_tabs, page.result, page.history
    restore_outputs = [task_tabs, *result.outputs]
    for tab in tabs.values():
        restore_outputs += [*tab.inputs, *tab.prompt_builder.inputs]

    def restore(entry: HistoryEntry, keep_takes: bool) -> tuple[str, dict[Any, Any]]:
        """(the entry's task, the updates that show it and put its settings back in that task's tab)."""
        request, values = handlers.settings_of(entry)
        updates: dict[Any, Any] = {task_tabs: gr.Tabs(selected=request.task)}
        updates.update(zip(result.outputs, handlers.result_of(entry, keep_takes), strict=True))
        tab = tabs[request.task]
        updates.update(_tab_updates(tab, values))
        updates.update(tab.prompt_builder.builder_values(values["prompt"]))
        return request.task, updates

    def restore_from_history(row: list[Any], caller: gr.Request) -> dict[Any, Any]:
        return restore(handlers.history_entry(row, caller), keep_takes=False)[1]

    def restore_shown_result(last_result: str | None, caller: gr.Request) -> dict[Any, Any]:
        return restore(handlers.entry_of_result(last_result, caller), keep_takes=True)[1]

    def restore_for_rerun(last_result: str | None, caller: gr.Request) -> dict[Any, Any]:
        task, updates = restore(handlers.entry_of_result(last_result, caller), keep_takes=True)
        return {**updates, result.rerun_task: task}

    # A problem (the result's files went away) is one toast; nothing on the page changes then.
    history.table.click(
        told_in_a_toast(restore_from_history, len(restore_outputs)),
        inputs=history.table,
        outputs=restore_outputs,
        api_visibility="private",
    )
    result.restore.click(
        told_in_a_toast(restore_shown_result, len(restore_outputs)),
        inputs=result.last_result,
        outputs=restore_outputs,
        api_visibility="private",
    )
    # Rerun: the shown result's settings (seed included) back in its tab, then that tab's Generate; nothing is
    # pressed when they could not be restored.
    rerun_outputs = [*restore_outputs, result.rerun_task]
    result.rerun.click(lambda: "", outputs=result.rerun_task, queue=False, api_visibility="private").then(
        told_in_a_toast(restore_for_rerun, len(rerun_outputs)),
        inputs=result.last_result,
        outputs=rerun_outputs,
        api_visibility="private",
    ).then(None, js=RERUN_JS, inputs=result.rerun_task, queue=False, api_visibility="private")
    result.takes.select(
        told_in_a_toast(handlers.show_take, len(result.outputs)),
        inputs=result.take_paths,
        outputs=result.outputs,
        api_visibility="private",
    )


def _initial_values(front: EngineFront, task: str) -> dict[str, Any]:
    """The values a tab starts with: the defaults, with a step-distilled checkpoint's own step count and the
    checkpoint's own short edge."""
    distilled = front.facts.distilled_steps(task) if task in front.facts.tasks else None
    own = {"short_edge": front.facts.canvas.short_edge}
    return DEFAULT_VALUES | own | ({"steps": distilled} if distilled is not None else {})


def _initial_canvas_text(handlers: Handlers, task: str, initial: dict[str, Any]) -> str:
    return handlers.describe_canvas(task)(*(initial[name] for name in parameter_names(task)))


def _tab_updates(tab: TaskTab, values: dict[str, Any]) -> dict[Any, Any]:
    by_name = dict(zip(parameter_names(tab.task), tab.inputs, strict=True))
    return {by_name[name]: value for name, value in values.items()}


def _wire_generate(
    tab: TaskTab,
    handlers: Handlers,
    result: ResultColumn,
    generate_buttons: list[gr.Button],
    history_table: gr.Dataset,
    max_jobs: int,
) -> None:
    """Generate: at once (no queue) the status says what happens, the old result goes and all Generate buttons rest
    until the job ends; the page brings the status into view; then the queued endpoint runs the job. The endpoint's
    events may all run at once: the engine front queues the jobs and reports each one's place. However the job
    ends, `finish` gives the buttons back, refreshes History and, when the handler never ran (a full queue), says
    so: the page runs a `.then` step only after a normal completion, so it is wired as `.failure` too (Gradio fails
    the event for a full queue; the page's handler itself ends a failed or refused job in the status line)."""

    def start(*inputs: Any) -> tuple[Any, ...]:
        updates, starts = handlers.start(tab.task, inputs)
        return (*updates, *(gr.Button(interactive=not starts) for _ in generate_buttons))

    started = tab.generate.click(
        start,
        inputs=tab.inputs,
        outputs=[*result.outputs, *generate_buttons],
        queue=False,
        api_visibility="private",
    )
    # Once the status says what happens (its height may change), bring it into view.
    started.then(None, js=SHOW_STATUS_JS, queue=False, api_visibility="private")
    # The page's copy of the endpoint: a failure ends in the status line, never as Gradio's error state (a red
    # "Error" box over the player).
    generated = started.then(
        told_in_the_status(handlers.generator(tab.task)),
        inputs=tab.inputs,
        outputs=result.outputs,
        api_visibility="private",
        validator=handlers.validator(tab.task),
        concurrency_limit=max_jobs,
        concurrency_id=ENGINE_CONCURRENCY_ID,
        show_progress_on=[result.video],
    )
    # The public endpoint: the same handler and checks, raising a failure's words for API clients; its trigger is
    # never shown.
    gr.Button(visible=False, elem_id=f"{tab.task}-api").click(
        handlers.generator(tab.task),
        inputs=tab.inputs,
        outputs=result.outputs,
        api_name=tab.task,
        api_description=f"{API_DESCRIPTIONS[tab.task]} Returns status, preview, video, seed used, details, "
        "downloads, takes.",
        validator=handlers.validator(tab.task),
        concurrency_limit=max_jobs,
        concurrency_id=ENGINE_CONCURRENCY_ID,
    )

    def finish(status: str, seed_used: Any, caller: gr.Request) -> tuple[Any, ...]:
        return (
            *(gr.Button(interactive=True) for _ in generate_buttons),
            # Still the press's own status: the handler never ran (Gradio said why in a message of its own).
            NOT_TAKEN_STATUS if status == STARTING_STATUS else gr.skip(),
            gr.Number(visible=seed_used is not None),
            handlers.refresh_history(caller),
        )

    for after in (generated.then, generated.failure):
        after(
            finish,
            inputs=[result.status, result.seed_used],
            outputs=[*generate_buttons, result.status, result.seed_used, history_table],
            queue=False,
            # No timer over the status the job left (show_progress="hidden" still shows one on the page): the
            # progress goes to a state, which has nothing to show.
            show_progress_on=result.take_paths,
            api_visibility="private",
        )


def _wire_canvas_text(tab: TaskTab, handlers: Handlers) -> None:
    triggers = [*tab.settings.canvas_inputs, *tab.media]
    gr.on(
        [component.change for component in triggers],
        handlers.describe_canvas(tab.task),
        inputs=tab.inputs,
        outputs=tab.settings.derived,
        queue=False,
        trigger_mode="always_last",
        api_visibility="private",
    )


def _wire_examples(tab: TaskTab, examples: list[Example], handlers: Handlers) -> None:
    if tab.examples is None:
        return

    def fill(index: int) -> dict[Any, Any]:
        values = handlers.example_values(examples[index].request)
        # The prompt builder fills from the example's prompt too.
        return {**_tab_updates(tab, values), **tab.prompt_builder.builder_values(values["prompt"])}

    outputs = [*tab.inputs, *tab.prompt_builder.inputs]
    tab.examples.click(fill, inputs=tab.examples, outputs=outputs, api_visibility="private")


def _wire_keyframes(tab: TaskTab, handlers: Handlers, result: ResultColumn, task_tabs: gr.Tabs) -> None:
    pair = [tab.first_image, tab.last_image]
    tab.swap.click(swap_keyframes, inputs=pair, outputs=pair, queue=False, api_visibility="private")
    tab.use_last_frame.click(
        told_in_a_toast(handlers.use_last_frame, 1),
        inputs=result.last_result,
        outputs=tab.first_image,
        api_visibility="private",
    )

    def continue_in_fl2va(last_result: str | None) -> tuple[gr.Tabs, str]:
        return gr.Tabs(selected="fl2va"), handlers.use_last_frame(last_result)

    result.continue_in_fl2va.click(
        told_in_a_toast(continue_in_fl2va, 2),
        inputs=result.last_result,
        outputs=[task_tabs, tab.first_image],
        api_visibility="private",
    )
