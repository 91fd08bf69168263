"""The app's Remix section's endpoint (`/remix`, ui.remix) against a stand-in engine front, History's remix title,
and the mask timeline strip (ui.mask_timeline)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import gradio as gr
import pytest
from _refusals import refused

from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.request.files import MediaFacts
from h3engine.request.geometry import FPS, Geometry, frames_for_duration
from h3engine.request.remix import Remix, remix_seconds
from h3engine.runtime.front import JobHandle
from h3engine.runtime.messages import JobFinished, JobStarted
from ui.access import AccessPolicy
from ui.handlers import Handlers
from ui.history import _task_title
from ui.mask_timeline import timeline_html, video_seconds_of
from ui.remix import redraw_timeline, remix_generator
from ui.result import RESULT_FIELDS

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
STATUS = RESULT_FIELDS.index("status")


# The canvas the stand-in front says a request resolves to (the job service records it).
STAND_IN_GEOMETRY = Geometry.from_canvas(48, 64, 22, vae_spatial_ratio=4, patch=2)


class StandInFront:
    """`resolve` (raises `refusal` when set), `submit` (finishes at once), `cancel`."""

    replicas = 1

    def __init__(self, refusal: RequestError | None = None) -> None:
        self.refusal = refusal
        self.requests = []

    def resolve(self, request) -> ResolvedRequest:  # noqa: ANN001
        if self.refusal is not None:
            raise self.refusal
        return ResolvedRequest(request, (), MediaFacts(lambda entry: None), 4.0, STAND_IN_GEOMETRY, None)

    def submit(self, resolved, out_path) -> JobHandle:  # noqa: ANN001
        self.requests.append(resolved.request)
        handle = JobHandle(f"job{len(self.requests)}", resolved, Path(out_path))
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
    assert updates[-1][STATUS].startswith("⚠ Not started: remix.video_mask: ")


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
    with refused(RequestError, field="remix.video_mask") as caught:
        request_from_fields({"prompt": "surf", "task": "a2v", "video_mask": "1-"}, tmp_path, facts)
    # The mask syntax's wording (h3engine.request.remix), once; the API names its own field for it.
    assert caught.value.problem == "must be START-END[,START-END...] in seconds, got '1-'"
    param = api_param(caught.value, None, False)
    assert param == "video_mask" and api_message(caught.value, param) == f"video_mask: {caught.value.problem}"


def _spans(strip: str) -> list[tuple[str, float, float]]:
    """(lane, left %, width %) of each shaded span of a timeline strip."""
    found = re.findall(r"data-lane='(\w+)'.*?left:([\d.]+)%;width:([\d.]+)%", strip)
    return [(lane, float(left), float(width)) for lane, left, width in found]


def test_the_mask_timeline_shades_the_regenerated_spans_over_the_clip_the_remix_makes() -> None:
    length = frames_for_duration(4) / FPS  # a2v: the seconds asked for, on the frame grid
    strip = timeline_html("a2v", 4, None, "0-0.5", "1-2,3-3.5")
    assert f"data-seconds='{length:.3f}'" in strip
    assert _spans(strip) == [
        ("video", 0.0, pytest.approx(100 * 0.5 / length, abs=1e-3)),
        ("audio", pytest.approx(100 / length, abs=1e-3), pytest.approx(100 / length, abs=1e-3)),
        ("audio", pytest.approx(300 / length, abs=1e-3), pytest.approx(50 / length, abs=1e-3)),
    ]
    assert _spans(timeline_html("a2v", 4, None, "", "")) == []  # nothing regenerated: all kept


def test_the_mask_timeline_says_what_is_wrong_naming_the_field() -> None:
    outside = timeline_html("a2v", 4, None, "", "4-9")
    assert "remix.audio_mask[0]: " in outside
    assert "remix.video_mask: " in timeline_html("a2v", 4, None, "soon", "")
    assert "Choose the source video" in timeline_html("v2a", 5, None, "", "")


def test_the_mask_timeline_of_a_source_video_is_its_trimmed_clip_and_extend_adds_the_seconds() -> None:
    source = str(REPOSITORY_ROOT / "assets" / "ref2va" / "video1.mp4")  # 3 s
    seconds = video_seconds_of(source)
    assert seconds == pytest.approx(3.0, abs=0.05)
    trimmed = remix_seconds(Remix(mode="v2a"), 5, seconds)
    assert f"data-seconds='{frames_for_duration(trimmed) / FPS:.3f}'" in redraw_timeline(
        "v2a", 5, source, "", ""
    )
    extended = remix_seconds(Remix(mode="extend"), 2, seconds)
    assert f"data-seconds='{frames_for_duration(extended) / FPS:.3f}'" in redraw_timeline(
        "extend", 2, source, "", ""
    )
    assert "Choose the source video" in redraw_timeline("v2a", 5, str(REPOSITORY_ROOT / "README.md"), "", "")
