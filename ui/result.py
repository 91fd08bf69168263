"""The shared result column (status, live preview, the MP4, seed, details, downloads, cancel) and the history.

Contract: `build_result_column()` and `build_history()` only lay components out; `ResultColumn.outputs` is the
fixed output order of every generate handler (`RESULT_FIELDS`; ui.handlers builds its updates in that order).
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from ui.history import HISTORY_HEADERS

# The output order of every generate handler.
# Components the API returns come first; the two states (the shown result's MP4, the takes' MP4s) stay private.
RESULT_FIELDS = (
    "status",
    "preview",
    "video",
    "seed_used",
    "details",
    "downloads",
    "takes",
    "last_result",
    "take_paths",
)


@dataclass
class ResultColumn:
    status: gr.Markdown
    preview: gr.Image
    video: gr.Video
    seed_used: gr.Number
    details: gr.Markdown
    downloads: gr.File
    takes: gr.Gallery
    cancel: gr.Button
    restore: gr.Button
    continue_in_fl2va: gr.Button
    rerun: gr.Button
    last_result: gr.State
    take_paths: gr.State
    # Never shown: the task whose Generate a Rerun presses once its settings are back ("" when they could not be).
    rerun_task: gr.Textbox

    @property
    def outputs(self) -> list[gr.components.Component]:
        return [getattr(self, name) for name in RESULT_FIELDS]


@dataclass
class HistoryPanel:
    table: gr.Dataset
    refresh: gr.Button


def build_result_column() -> ResultColumn:
    """Laid out in a column that stays in view on wide windows (ui.theme), status and Cancel at its top."""
    with gr.Row(equal_height=True):
        with gr.Column(scale=4):
            status = gr.Markdown("Ready.", label="Status", elem_id="h3-status")
        with gr.Column(scale=1, min_width=100):
            cancel = gr.Button("Cancel", variant="stop", size="sm", elem_id="h3-cancel")
    gr.Markdown("Live preview (approximate, from the latents)", elem_classes="h3-caption")
    preview = gr.Image(show_label=False, type="numpy", interactive=False, height=220, elem_id="h3-preview")
    video = gr.Video(
        label="Result", format="mp4", interactive=False, buttons=["download"], elem_id="h3-video"
    )
    takes = gr.Gallery(
        label="Takes (click one to show it)",
        columns=3,
        height="auto",
        allow_preview=False,
        visible=False,
        elem_id="h3-takes",
    )
    # They act on the result shown: disabled until there is one (ui.blocks enables them).
    with gr.Row():
        restore = gr.Button("Restore its settings", size="sm", interactive=False, elem_id="h3-restore-result")
        rerun = gr.Button("Rerun", size="sm", interactive=False, elem_id="h3-rerun")
        continue_in_fl2va = gr.Button(
            "Continue from its last frame (FL2VA)",
            size="sm",
            interactive=False,
            elem_id="h3-continue-fl2va",
        )
    # Shown once there is a result: an empty number field would read as 0.
    seed_used = gr.Number(
        value=None, label="Seed used", precision=0, interactive=False, visible=False, elem_id="h3-seed-used"
    )
    details = gr.Markdown(label="Details", elem_id="h3-details")
    downloads = gr.File(
        label="Download (MP4 and JSON sidecar)", file_count="multiple", interactive=False, height=140
    )
    return ResultColumn(
        status,
        preview,
        video,
        seed_used,
        details,
        downloads,
        takes,
        cancel,
        restore,
        continue_in_fl2va,
        rerun,
        gr.State(None),
        gr.State([]),
        gr.Textbox("", visible=False),
    )


def build_history() -> HistoryPanel:
    """Empty: the rows are the caller's own results, filled in per session (ui.blocks)."""
    with gr.Accordion("History (click a result to restore its settings)", open=True):
        table = gr.Dataset(
            components=["textbox"] * len(HISTORY_HEADERS),
            headers=HISTORY_HEADERS,
            samples=[],
            type="values",
            layout="table",
            samples_per_page=10,
            label="Past results, newest first",
            elem_id="h3-history",
        )
        refresh = gr.Button("Refresh", size="sm", elem_id="h3-history-refresh")
    return HistoryPanel(table, refresh)
