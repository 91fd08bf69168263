"""The app's Remix section's endpoint (`/remix`, ui.remix) against a stand-in engine front, and History's remix title."""

from __future__ import annotations

import asyncio
from pathlib import Path

import gradio as gr
import pytest

from h3engine.errors import RequestError
from h3engine.runtime.front import JobHandle
from h3engine.runtime.messages import JobFinished, JobStarted
from ui.access import AccessPolicy
from ui.handlers import Handlers
from ui.history import _task_title
from ui.remix import remix_generator
from ui.result import RESULT_FIELDS

STATUS = RESULT_FIELDS.index("status")


class StandInFront:
    """`check` (raises `refusal` when set), `submit` (finishes at once), `cancel`."""

    replicas = 1

    def __init__(self, refusal: RequestError | None = None) -> None:
        self.refusal = refusal
        self.requests = []

    def check(self, request) -> list[str]:  # noqa: ANN001
        if self.refusal is not None:
            raise self.refusal
        return []

    def submit(self, request, out_path) -> JobHandle:  # noqa: ANN001
        self.requests.append(request)
        handle = JobHandle(f"job{len(self.requests)}", request, Path(out_path))
        handle.publish(JobStarted(handle.job_id, 0, 0.0, 64, 48, 24, 24, 2))
        video = handle.out_path
        video.write_bytes(b"mp4")
        video.with_suffix(".json").write_text("{}")
        handle._finish(
            JobFinished(handle.job_id, str(video), str(video.with_suffix(".json")), 3, 64, 48, 24, 24, {})
        )
        return handle

    def cancel(self, handle: JobHandle) -> None:
        handle._cancel_requested.set()


def press(front: StandInFront, outputs: Path, tmp_path: Path, *inputs) -> tuple[list, gr.Error | None]:  # noqa: ANN002
    handlers = Handlers(front, AccessPolicy(outputs, serve_dir=tmp_path / "served"))

    async def run() -> tuple[list, gr.Error | None]:
        updates = []
        try:
            async for update in remix_generator(handlers)(*inputs, None, lambda *a, **k: None):
                updates.append(update)
        except gr.Error as error:
            return updates, error
        return updates, None

    return asyncio.run(run())


@pytest.fixture()
def upload(tmp_path: Path) -> Path:
    path = tmp_path / "upload" / "beach.mp4"
    path.parent.mkdir()
    path.write_bytes(b"not really a video")
    return path


def test_new_sound_for_a_video_submits_a_v2a_remix_of_a_kept_copy(tmp_path: Path, upload: Path) -> None:
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    front = StandInFront()
    updates, error = press(front, outputs, tmp_path, "surf", "v2a", str(upload), None, 5, "", "1-2", 7, 2)
    assert error is None and updates[-1][STATUS].startswith("Done in ")
    (request,) = front.requests
    assert request.task == "t2va" and request.seed == 7 and request.steps == 2
    assert request.remix.mode == "v2a" and request.remix.audio_mask == ((1.0, 2.0),)
    kept = Path(request.remix.source_video)
    assert kept != upload and kept.is_relative_to(outputs) and kept.read_bytes() == upload.read_bytes()
    assert _task_title(request.to_dict()) == f"Remix v2a ({kept.name})"


def test_a_refused_remix_is_a_status_and_an_error_naming_the_field(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    refusal = RequestError("remix.source_audio", "is required for 'a2v'")
    updates, error = press(StandInFront(refusal), outputs, tmp_path, "x", "a2v", None, None, 5, "", "", 0, 2)
    assert updates[-1][STATUS] == "⚠ Not started: remix.source_audio: is required for 'a2v'"
    assert error is not None and "remix.source_audio" in str(error)
    updates, error = press(StandInFront(), outputs, tmp_path, "x", "extend", None, None, 5, "1-x", "", 0, 2)
    assert updates[-1][STATUS].startswith("⚠ Not started: remix.video_mask: must be START-END")


def test_the_videos_api_reads_remix_fields_and_names_them_in_errors(
    tiny_native: Path, tmp_path: Path
) -> None:
    from h3engine.checkpoint.facts import CheckpointFacts
    from h3engine.checkpoint.layout import detect_layout
    from h3engine.serving.videos import Upload, api_message, api_param, request_from_fields

    facts = CheckpointFacts.from_layout(detect_layout(tiny_native))
    fields = {"prompt": "surf", "task": "v2a", "source_video": Upload("beach.mp4", b"x"), "audio_mask": "0-1"}
    built = request_from_fields(fields, tmp_path, facts)
    request = built.request
    assert (
        request.task == "t2va" and request.remix.mode == "v2a" and request.remix.audio_mask == ((0.0, 1.0),)
    )
    assert built.file_fields[request.remix.source_video] == "source_video"
    assert Path(request.remix.source_video).is_relative_to(tmp_path)
    with pytest.raises(RequestError) as refused:
        request_from_fields({"prompt": "surf", "task": "a2v", "video_mask": "1-"}, tmp_path, facts)
    param = api_param(refused.value, None, False)
    assert param == "video_mask"
    assert api_message(refused.value, param) == (
        "video_mask: must be START-END[,START-END...] in seconds, got '1-'"
    )
