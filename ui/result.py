"""The shared result column (status, live preview, the MP4, seed, details, downloads, cancel) and the history.

Contract: `build_result_column()` and `build_history()` only lay components out; `ResultColumn.outputs` is the
fixed output order of every generate handler (`RESULT_FIELDS`; ui.handlers builds its updates in that order).
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from ui.history import HISTORY_HEADERS

# The output order of every generate handler.
RESULT_FIELDS = ("status", "preview", "video", "seed_used", "details", "downloads", "last_result")


@dataclass
class ResultColumn:
    status: gr.Markdown
    preview: gr.Image
    video: gr.Video
    seed_used: gr.Number
    details: gr.Markdown
    downloads: gr.File
    cancel: gr.Button
    last_result: gr.State

    @property
    def outputs(self) -> list[gr.components.Component]:
        return [getattr(self, name) for name in RESULT_FIELDS]


@dataclass
class HistoryPanel:
    table: gr.Dataset
    refresh: gr.Button


def build_result_column() -> ResultColumn:
    with gr.Row(equal_height=True):
        with gr.Column(scale=4):
            status = gr.Markdown("Ready.", label="Status", elem_id="h3-status")
        with gr.Column(scale=1, min_width=100):
            cancel = gr.Button("Cancel", variant="stop", size="sm", elem_id="h3-cancel")
    preview = gr.Image(
        label="Live preview (approximate, from the latents)",
        type="numpy",
        interactive=False,
        height=220,
        elem_id="h3-preview",
    )
    video = gr.Video(
        label="Result", format="mp4", interactive=False, buttons=["download"], elem_id="h3-video"
    )
    seed_used = gr.Number(label="Seed used", precision=0, interactive=False, elem_id="h3-seed-used")
    details = gr.Markdown(label="Details", elem_id="h3-details")
    downloads = gr.File(
        label="Download (MP4 and JSON sidecar)", file_count="multiple", interactive=False, height=140
    )
    return ResultColumn(status, preview, video, seed_used, details, downloads, cancel, gr.State(None))


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
