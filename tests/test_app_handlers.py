"""The generate handler's endings, in plain Python against a stand-in engine front (no model, no server).

What is compared: every way a press can end states itself in the last update's status and, unless the job was done
or cancelled, raises a gr.Error carrying the same words (API clients read it; the page re-enables Generate on it):
an outputs folder that refuses writes (the results folder cannot be made; the front refuses the output path), a
full disk (with the free space, from shutil.disk_usage of the outputs folder), a failed job (the front's sentence),
an unexpected exception; no server path is shown, and a press that made no job leaves none behind. The front's
checks (which probe media) run in a worker thread, never on the event loop. Storing a result's last frame on a full
disk is one sentence too.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import threading
from collections import namedtuple
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
from _app_helpers import ASSETS

from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.request.files import MediaFacts
from h3engine.request.geometry import Geometry
from h3engine.runtime.front import JobHandle
from h3engine.runtime.messages import JobFailed, JobFinished, JobStarted, size_text
from ui.access import AccessPolicy
from ui.handlers import Handlers
from ui.result import RESULT_FIELDS
from ui.tabs import DEFAULT_VALUES
from ui.task_values import parameter_names

STATUS = RESULT_FIELDS.index("status")


# The canvas the stand-in front says a request resolves to (the job service records it).
STAND_IN_GEOMETRY = Geometry.from_canvas(48, 64, 22, vae_spatial_ratio=4, patch=2)


class StandInFront:
    """What Handlers needs of an EngineFront: `resolve`, `submit`, `cancel`; each job ends with `ending(handle)`."""

    replicas = 1

    def __init__(self, ending=None, check_error: Exception | None = None, submit_error=None) -> None:
        self.ending = ending
        self.check_error = check_error
        self.submit_error = submit_error
        self.handles: list[JobHandle] = []
        self.check_threads: list[int] = []
        self.loop_running_in_check: list[bool] = []

    def resolve(self, request) -> ResolvedRequest:
        self.check_threads.append(threading.get_ident())
        try:
            asyncio.get_running_loop()
            self.loop_running_in_check.append(True)
        except RuntimeError:
            self.loop_running_in_check.append(False)
        if self.check_error is not None:
            raise self.check_error
        return ResolvedRequest(request, (), MediaFacts(lambda entry: None), 4.0, STAND_IN_GEOMETRY, None)

    def submit(self, request, out_path) -> JobHandle:
        if self.submit_error is not None:
            raise self.submit_error
        handle = JobHandle(f"job{len(self.handles)}", request, Path(out_path))
        self.handles.append(handle)
        if self.ending is not None:
            handle.publish(JobStarted(handle.job_id, 0, 0.0, 64, 48, 24, 24, 2))
            handle._finish(self.ending(handle))
        return handle

    def cancel(self, handle: JobHandle) -> None:
        handle._cancel_requested.set()


def _inputs(task: str, **values: Any) -> list[Any]:
    chosen = {**DEFAULT_VALUES, "prompt": "A kite.", "steps": 2, "randomize_seed": False, **values}
    return [chosen[name] for name in parameter_names(task)]


def _press(handlers: Handlers, task: str = "t2va", **values: Any) -> tuple[list[tuple], gr.Error | None]:
    """Run the task's generate endpoint to its end: (its updates, the gr.Error it raised or None)."""

    async def run() -> tuple[list[tuple], gr.Error | None]:
        updates = []
        try:
            async for update in handlers.generator(task)(
                *_inputs(task, **values), None, lambda *a, **k: None
            ):
                updates.append(update)
        except gr.Error as error:
            return updates, error
        return updates, None

    return asyncio.run(run())


def _finished(handle: JobHandle) -> JobFinished:
    video = handle.out_path
    video.write_bytes(b"mp4")
    video.with_suffix(".json").write_text("{}")
    return JobFinished(handle.job_id, str(video), str(video.with_suffix(".json")), 3, 64, 48, 24, 24, {})


@pytest.fixture()
def outputs(tmp_path) -> Path:
    folder = tmp_path / "outputs"
    folder.mkdir()
    return folder


def _handlers(front: StandInFront, outputs: Path, tmp_path: Path) -> Handlers:
    return Handlers(front, AccessPolicy(outputs, serve_dir=tmp_path / "served"))


def test_a_done_job_says_so_and_raises_nothing(outputs, tmp_path) -> None:
    front = StandInFront(ending=_finished)
    updates, error = _press(_handlers(front, outputs, tmp_path))
    assert error is None and updates[-1][STATUS].startswith("Done in "), updates[-1][STATUS]


def test_the_checks_run_in_a_worker_thread_not_on_the_event_loop(outputs, tmp_path) -> None:
    front = StandInFront(ending=_finished)
    _press(_handlers(front, outputs, tmp_path), takes=2)
    assert front.loop_running_in_check == [False]  # one resolve a press, whatever its takes
    assert threading.get_ident() not in front.check_threads


def test_a_results_folder_that_cannot_be_made_is_a_status_and_an_error_naming_no_path(
    outputs, tmp_path
) -> None:
    (outputs / "sessions").write_text("a file where the folder of every session's results goes")
    front = StandInFront(ending=_finished)
    updates, error = _press(_handlers(front, outputs, tmp_path))
    reason = "the outputs folder refuses writes (Not a directory); the details are in the server log."
    assert updates[-1][STATUS] == f"⚠ Not started: {reason}"
    assert error is not None and error.message == reason and error.title == "Cannot write the outputs"
    assert front.handles == []


def test_an_output_path_the_front_refuses_is_a_status_without_the_fronts_field_or_path(
    outputs, tmp_path
) -> None:
    refusal = RequestError("out_path", f"folder '{outputs}/sessions/x' is not writable")
    front = StandInFront(submit_error=refusal)
    updates, error = _press(_handlers(front, outputs, tmp_path))
    assert (
        updates[-1][STATUS]
        == "⚠ Not started: the outputs folder refuses writes (its files cannot be made there); the details are in "
        "the server log."
    )
    assert error is not None and str(outputs) not in error.message and "out_path" not in error.message


def test_a_full_disk_says_so_with_the_free_space(outputs, tmp_path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 12_800, 12_800))

    def no_space(source, target) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("ui.inputs.shutil.copyfile", no_space)
    front = StandInFront(ending=_finished)
    updates, error = _press(
        _handlers(front, outputs, tmp_path), "fl2va", first_image=str(ASSETS / "fl2va" / "first.png")
    )
    reason = "the disk of the outputs folder is full (12.5 KB free); free some space and try again."
    assert updates[-1][STATUS] == f"⚠ Not started: {reason}"
    assert error is not None and error.message == reason and error.title == "Disk full"
    assert front.handles == []


def test_a_failed_job_ends_with_the_fronts_sentence_as_status_and_error(outputs, tmp_path) -> None:
    sentence = "A worker process died (rank 1, exit code -9); the worker group is restarting."
    front = StandInFront(ending=lambda handle: JobFailed(handle.job_id, "engine", sentence))
    updates, error = _press(_handlers(front, outputs, tmp_path))
    assert updates[-1][STATUS] == f"Failed: {sentence}"
    assert error is not None and error.message == sentence and error.title == "Generation failed"


def test_a_cancelled_job_says_so_and_raises_nothing(outputs, tmp_path) -> None:
    front = StandInFront(ending=lambda handle: JobFailed(handle.job_id, "cancelled", "Cancelled."))
    updates, error = _press(_handlers(front, outputs, tmp_path))
    assert error is None and updates[-1][STATUS] == "Cancelled while encoding the prompt."


def test_an_unexpected_exception_is_one_sentence_and_the_traceback_goes_to_the_log(
    outputs, tmp_path, caplog
) -> None:
    front = StandInFront(check_error=KeyError("a bug"))
    updates, error = _press(_handlers(front, outputs, tmp_path))
    reason = "the app met an unexpected error; the details are in the server log."
    assert updates[-1][STATUS] == f"⚠ Not started: {reason}"
    assert error is not None and error.message == reason
    assert any(record.exc_info and "a bug" in str(record.exc_info[1]) for record in caplog.records)


def test_sizes_read_in_the_units_of_the_upload_limit() -> None:
    assert [size_text(size) for size in (0, 1023, 1536, 5 * 1024**3, 3 * 1024**5)] == [
        "0 bytes",
        "1023 bytes",
        "1.5 KB",
        "5.0 GB",
        "3072.0 TB",
    ]


def test_storing_the_last_frame_on_a_full_disk_is_one_sentence(outputs, tmp_path, monkeypatch) -> None:
    result = tmp_path / "result.mp4"
    result.write_bytes(b"mp4")

    def no_space(video_path, store) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("ui.handlers.last_frame_png", no_space)
    with pytest.raises(gr.Error) as refused:
        _handlers(StandInFront(), outputs, tmp_path).use_last_frame(str(result))
    assert refused.value.message.startswith("the disk of the outputs folder is full (")


def test_an_upload_that_went_away_is_named_as_an_input_not_as_the_outputs_folder(outputs, tmp_path) -> None:
    front = StandInFront(ending=_finished)
    updates, error = _press(
        _handlers(front, outputs, tmp_path), "fl2va", first_image=str(tmp_path / "gone.png")
    )
    reason = "an input file could not be read (No such file or directory); add it again."
    assert updates[-1][STATUS] == f"⚠ Not started: {reason}" and error is not None and error.message == reason
    assert front.handles == []
