"""The "Remix a clip" section (below the task tabs): "New sound for this video" (v2a), "New video for this sound"
(a2v), "Extend by N s" (extend), with optional masks in seconds drawn on a timeline strip (ui.mask_timeline); its
public endpoint `/remix`.

The source is an upload or the shown result ("Use the shown result"); the job runs through the engine front like
a tab's Generate and fills the shared result column; History records the request with its remix (mode, sources).
The model was trained for T2VA / FL2VA / Ref2VA only: these modes' quality on the released weights is unverified.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.request.model import GenerationRequest
from h3engine.request.remix import Remix, parse_ranges
from ui.components import as_sent
from ui.handlers import RANDOM_SEED_LIMIT, Handlers, result_update
from ui.mask_timeline import timeline_html, video_seconds_of
from ui.notices import told_in_a_toast, told_in_the_status
from ui.result import ResultColumn
from ui.takes import TakeSet

REMIX_ACTIONS = [
    ("New sound for this video", "v2a"),
    ("New video for this sound", "a2v"),
    ("Extend by N s", "extend"),
]
REMIX_PARAMETERS = (
    "prompt",
    "mode",
    "source_video",
    "source_audio",
    "seconds",
    "video_mask",
    "audio_mask",
    "seed",
    "steps",
)


@dataclass
class RemixTab:
    prompt: gr.Textbox
    mode: gr.Radio
    source_video: gr.File
    source_audio: gr.File
    seconds: gr.Number
    video_mask: gr.Textbox
    audio_mask: gr.Textbox
    seed: gr.Number
    steps: gr.Number
    use_result: gr.Button
    generate: gr.Button
    timeline: gr.HTML

    @property
    def inputs(self) -> list[gr.components.Component]:
        return [getattr(self, name) for name in REMIX_PARAMETERS]


def build_remix_tab(steps: int) -> RemixTab:
    gr.Markdown(
        "Keep one modality of a clip and generate the other, or continue a clip. The model was trained for text, "
        "keyframes and references only: **these modes' quality is unverified**."
    )
    prompt = gr.Textbox(label="Prompt", lines=3, elem_id="remix-prompt")
    mode = gr.Radio(REMIX_ACTIONS, value="v2a", label="Action")
    with gr.Row():
        source_video = gr.File(label="Source video (v2a, extend)", type="filepath", file_types=["video"])
        source_audio = gr.File(label="Source audio (a2v)", type="filepath", file_types=["audio"])
    # Disabled until there is a result (ui.blocks enables it).
    use_result = gr.Button(
        "Use the shown result as the source video",
        size="sm",
        interactive=False,
        elem_id="remix-use-result",
    )
    # As sent: Gradio's own bounds check would fail the Remix event and its players with a red "Error"; the request's
    # checks refuse a number out of range in the status instead.
    seconds = as_sent(
        gr.Number(
            value=5,
            label="Seconds (a2v: clip length; extend: N s added)",
            minimum=1,
            maximum=15,
            elem_id="remix-seconds",
        )
    )
    with gr.Row():
        video_mask = gr.Textbox(label="Regenerate video at (s)", placeholder="e.g. 1-2.5,4-5")
        audio_mask = gr.Textbox(label="Regenerate audio at (s)", placeholder="e.g. 0-1")
    timeline = gr.HTML(timeline_html("v2a", 5, None, "", ""), label="Mask timeline")
    with gr.Row():
        seed = gr.Number(value=0, label="Seed (-1: random)", precision=0)
        steps_input = gr.Number(value=steps, label="Steps", precision=0)
    generate = gr.Button("Remix", variant="primary", elem_id="remix-generate")
    return RemixTab(
        prompt,
        mode,
        source_video,
        source_audio,
        seconds,
        video_mask,
        audio_mask,
        seed,
        steps_input,
        use_result,
        generate,
        timeline,
    )


def remix_request(values: dict[str, Any], keep: Any = str) -> GenerationRequest:
    """The request of the Remix section's inputs (RequestError naming the field); `keep` maps each file to the path
    the request names."""
    mode = values["mode"]
    video, audio = values.get("source_video"), values.get("source_audio")
    remix = Remix(
        mode=mode,
        source_video=keep(video) if video and mode != "a2v" else None,
        source_audio=keep(audio) if audio and mode == "a2v" else None,
        video_mask=parse_ranges(values["video_mask"], "remix.video_mask") if values.get("video_mask") else (),
        audio_mask=parse_ranges(values["audio_mask"], "remix.audio_mask") if values.get("audio_mask") else (),
    )
    seed = values["seed"]
    if seed is None or seed < 0:
        seed = secrets.randbelow(RANDOM_SEED_LIMIT)
    return GenerationRequest(
        task="t2va",
        prompt=values["prompt"],
        duration_seconds=values["seconds"],
        seed=int(seed),
        steps=int(values["steps"]),
        remix=remix,
    )


def remix_generator(handlers: Handlers) -> Any:
    """The `/remix` endpoint: result-column updates while the job runs (a refusal raises a gr.Error naming the
    field)."""

    async def remix(
        prompt: str,
        mode: str,
        source_video: str | None,
        source_audio: str | None,
        seconds: float,
        video_mask: str,
        audio_mask: str,
        seed: int,
        steps: int,
        request: gr.Request = None,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's way of asking for progress)
    ) -> AsyncIterator[tuple[Any, ...]]:
        values = dict(
            zip(
                REMIX_PARAMETERS,
                (prompt, mode, source_video, source_audio, seconds, video_mask, audio_mask, seed, steps),
                strict=True,
            )
        )
        try:
            job = await asyncio.to_thread(_checked, handlers, values, request)
            handles = handlers._submit([job[0]], job[1])
        except RequestError as error:
            reason = f"{error.field}: {error.problem}" if error.field else error.problem
            yield result_update(status=f"⚠ Not started: {reason}")
            raise gr.Error(reason, title="Invalid request", print_exception=False) from None
        try:
            async for update in handlers._follow(TakeSet.of(handles), progress):
                yield update
        finally:
            for view in handles:
                handlers.jobs.cancel(view.job_id)

    return remix


def _checked(
    handlers: Handlers, values: dict[str, Any], caller: gr.Request | None
) -> tuple[ResolvedRequest, Any]:
    request = handlers.resolutions(remix_request(values, handlers.store.keep_file))
    results_dir = handlers.access.results_dir(caller)
    results_dir.mkdir(parents=True, exist_ok=True)
    return request, results_dir


def redraw_timeline(
    mode: str, seconds: float | None, source_video: str | None, video_mask: str, audio_mask: str
) -> str:
    """The mask timeline for the section's current values (the source video probed for its length)."""
    video_seconds = video_seconds_of(source_video) if mode in ("v2a", "extend") else None
    return timeline_html(mode, seconds, video_seconds, video_mask or "", audio_mask or "")


def shown_result(last_result: str | None) -> str:
    """The shown result's MP4, as the source video (a gr.Error when there is none, or its file went away)."""
    if not last_result or not Path(last_result).is_file():
        raise gr.Error(
            "The result shown is no longer on the server (its video was removed); generate or pick another."
            if last_result
            else "There is no result yet: generate (or pick) one first.",
            title="No result to use",
            print_exception=False,
        )
    return last_result


def wire_remix_tab(
    tab: RemixTab, handlers: Handlers, result: ResultColumn, max_jobs: int, concurrency_id: str
) -> None:
    tab.use_result.click(
        told_in_a_toast(shown_result, 1),
        inputs=result.last_result,
        outputs=tab.source_video,
        api_visibility="private",
    )
    timeline_inputs = [tab.mode, tab.seconds, tab.source_video, tab.video_mask, tab.audio_mask]
    for component in timeline_inputs:
        component.change(
            redraw_timeline,
            inputs=timeline_inputs,
            outputs=tab.timeline,
            api_visibility="private",
            queue=False,
        )
    # The page's Remix: a failure ends in the status line, never as Gradio's error state over the player.
    tab.generate.click(
        told_in_the_status(remix_generator(handlers)),
        inputs=tab.inputs,
        outputs=result.outputs,
        api_visibility="private",
        concurrency_limit=max_jobs,
        concurrency_id=concurrency_id,
        show_progress_on=[result.video],
    )
    # The public endpoint, raising a failure's words for API clients; its trigger is never shown.
    gr.Button(visible=False, elem_id="remix-api").click(
        remix_generator(handlers),
        inputs=tab.inputs,
        outputs=result.outputs,
        api_name="remix",
        api_description="Remix a clip: mode v2a (new sound for source_video), a2v (new video for source_audio) or "
        "extend (source_video plus `seconds`); masks 'START-END,...' in seconds regenerate those spans. Unverified "
        "on the released weights. Returns status, preview, video, seed used, details, downloads, takes.",
        concurrency_limit=max_jobs,
        concurrency_id=concurrency_id,
    )
