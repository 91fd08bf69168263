"""The serving parts in-process, no model: the job store (its start-up errors, pages, owners), restart recovery's
decisions, the size rule, field errors, webhooks' bounded retries, retention, the flags and the loopback rule."""

from __future__ import annotations

import http.server
import socket
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from _app_helpers import refusing_writes
from starlette.requests import Request

import app
from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import CanvasRules
from h3engine.errors import RequestError
from h3engine.media.outputs import OutputFiles, StagedOutputs
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront, JobHandle
from h3engine.runtime.messages import ENGINE_FAILURE_MESSAGE, output_failure_message
from h3engine.serving.errors import ApiError
from h3engine.serving.inputs import ClientFiles, QuotaExceeded, write_input
from h3engine.serving.jobs import MAX_ATTEMPTS, VideoJobs
from h3engine.serving.metrics import Metrics
from h3engine.serving.retention import Retention
from h3engine.serving.service import ApiSettings, Serving
from h3engine.serving.store import STORE_NAME, JobRecord, JobStore, StoreError
from h3engine.serving.videos import (
    ApiFieldError,
    api_message,
    api_param,
    request_from_fields,
    size_fields,
    supported_sizes,
)
from h3engine.serving.webhooks import Webhooks

RELEASED = CheckpointFacts(
    tasks=("t2va", "fl2va", "ref2va"), canvas=CanvasRules(), vae_spatial_ratio=16, patch=2
)


def _record(
    job_id: str,
    out: Path,
    status: str = "queued",
    owner: str = "o",
    created: float = 0.0,
    source="api",
    **more,
) -> JobRecord:
    request = GenerationRequest(task="t2va", prompt="x", steps=1).to_dict()
    return JobRecord(
        job_id, owner, source, status, created or time.time(), request, str(out / f"{job_id}.mp4"), **more
    )


def test_a_corrupt_or_foreign_store_is_one_line_not_a_reset(tmp_path) -> None:
    (tmp_path / STORE_NAME).write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError) as raised:
        JobStore.open(tmp_path, "--state-dir")
    message = str(raised.value)
    assert (
        "\n" not in message and message.startswith("--state-dir: the job store") and "move it away" in message
    )
    assert (tmp_path / STORE_NAME).read_bytes().startswith(b"this is not")  # untouched


def test_the_app_refuses_to_start_on_a_corrupt_store(tmp_path, capsys) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / STORE_NAME).write_bytes(b"garbage" * 1000)
    arguments = [
        "--outputs",
        str(tmp_path / "out"),
        "--state-dir",
        str(tmp_path / "state"),
        "--devices",
        "cpu",
    ]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    assert app.main([*arguments, "--port", port, "--checkpoint", str(tmp_path / "none")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --state-dir: the job store"), lines


def test_an_unwritable_store_is_refused_at_open(tmp_path) -> None:
    JobStore.open(tmp_path / "state").close()
    store_file = tmp_path / "state" / STORE_NAME
    for suffix in ("-wal", "-shm"):
        Path(f"{store_file}{suffix}").unlink(missing_ok=True)
    with refusing_writes(tmp_path / "state"):
        with pytest.raises(StoreError, match="cannot"):
            JobStore.open(tmp_path / "state").close()


def test_store_pages_owners_and_wal(tmp_path) -> None:
    store = JobStore.open(tmp_path)
    try:
        assert sqlite3.connect(tmp_path / STORE_NAME).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        for index in range(5):
            store.insert(_record(f"j{index}", tmp_path, created=1000.0 + index))
        store.insert(_record("other", tmp_path, owner="someone else"))
        assert [r.id for r in store.list("o", limit=2)] == ["j4", "j3"]
        assert [r.id for r in store.list("o", after="j3", limit=2)] == ["j2", "j1"]
        assert [r.id for r in store.list("o", order="asc", after="j3")] == ["j4"]
        assert store.get("other", "o") is None and store.get("other", "someone else") is not None
        store.update("j0", deleted=True)
        assert store.get("j0") is None and store.count("o") == 4
    finally:
        store.close()


class _FakeFront:
    facts = RELEASED
    waiting, running, replicas = 0, 0, 1

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, request, out_path=None):
        self.submitted.append(str(out_path))
        return JobHandle("h", request, Path(out_path))


def test_recovery_runs_queued_jobs_reruns_a_running_one_once_and_never_twice_to_completion(tmp_path) -> None:
    store = JobStore.open(tmp_path)
    done = _record("done", tmp_path, "in_progress", attempts=1)  # its files were written before the crash
    Path(done.out_path).write_bytes(b"mp4")
    Path(done.out_path).with_suffix(".json").write_text(
        '{"seed": 3, "geometry": {"width": 8}, "timings_s": {}}'
    )
    records = [
        _record("queued", tmp_path),
        _record("running", tmp_path, "in_progress", attempts=1),
        _record("twice", tmp_path, "in_progress", attempts=MAX_ATTEMPTS),
        done,
        _record("deleted", tmp_path, "in_progress", deleted=True),
        _record("page", tmp_path, owner="ui:sessions/0123", source="ui"),  # its page is gone
        _record("browser", tmp_path, owner="ui:browsers/0123", source="ui"),  # its browser comes back
    ]
    for record in records:
        store.insert(record)
    front = _FakeFront()
    jobs = VideoJobs(front, store, tmp_path)
    counts = jobs.recover()
    assert counts == {"completed": 1, "requeued": 2, "rerun": 1, "failed": 2, "removed": 1}
    assert sorted(Path(path).stem for path in front.submitted) == ["browser", "queued", "running"]
    assert store.get("page").error_code == "interrupted"
    assert store.get("twice").status == "failed" and store.get("twice").error_code == "interrupted"
    assert store.get("done").status == "completed" and store.get("done").result["seed"] == 3
    assert {r.id for r in store.unfinished()} == {"queued", "running", "browser"}
    assert all(r.status == "queued" for r in store.unfinished())  # nothing left in_progress
    store.close()


def test_sizes_follow_the_canvas_rule() -> None:
    assert supported_sizes(RELEASED)[1] == "1344x768"  # 16:9 at the released short edge
    assert size_fields("1344x768", RELEASED) == {"aspect_ratio": "16:9"}
    assert size_fields("768x768", RELEASED) == {"aspect_ratio": "1:1"}
    assert size_fields("auto", RELEASED) == {}
    assert size_fields("512x512", RELEASED) == {"aspect_ratio": "1:1", "short_edge": 512}
    assert size_fields("896x512", RELEASED) == {"aspect_ratio": "16:9", "short_edge": 512}
    assert size_fields("640x512", RELEASED) == {"width": 640, "height": 512}  # 5:4, not a preset
    # Any other WxH is an explicit canvas, judged by the one checker as --width/--height are.
    assert size_fields("1280x720", RELEASED) == {"width": 1280, "height": 720}
    assert size_fields("1344x769", RELEASED) == {"width": 1344, "height": 769}
    for size in ("0x0", "big", "1344", "-5x3"):
        with pytest.raises(ApiFieldError, match=r"supported: auto, .*1344x768") as raised:
            size_fields(size, RELEASED)
        assert raised.value.param == "size"


@pytest.mark.parametrize("size", ["auto", "1344x768", "768x768", "512x512", "896x512", "640x512", "768x1344"])
def test_every_size_the_rule_makes_passes_the_checker(tmp_path, size) -> None:
    """Each size the API accepts becomes a request the one checker accepts too (the size was once turned into an
    aspect ratio the checker refuses)."""
    from h3engine.request.validate import validate

    request = request_from_fields({"prompt": "x", "size": size}, tmp_path, RELEASED).request
    validate(request, canvas_multiple=RELEASED.canvas_multiple)


def test_fields_read_multipart_text_and_refuse_the_unknown(tmp_path) -> None:
    built = request_from_fields(
        {"prompt": "x", "seconds": "8", "steps": "3", "seed": "5", "rungs": "[]"}, tmp_path, RELEASED
    )
    request = built.request
    assert (request.duration_seconds, request.steps, request.seed, request.task) == (8.0, 3, 5, "t2va")
    assert built.meta["seconds"] == "8"
    assert (
        request_from_fields({"prompt": "x", "steps": "2.5"}, tmp_path, RELEASED).request.steps == 2.5
    )  # the checker refuses it
    for fields, param in (
        ({"seconds": "4"}, "prompt"),
        ({"prompt": "x", "negative_prompt": "y"}, "negative_prompt"),
        ({"prompt": "x", "colour": "red"}, "colour"),
    ):
        with pytest.raises(ApiFieldError) as raised:
            request_from_fields(fields, tmp_path, RELEASED)
        assert raised.value.param == param
    assert raised.value.message.startswith("colour: unknown field; accepted: prompt, ")  # its wording, once


@pytest.mark.parametrize(
    ("error", "size_given", "param", "message"),
    [
        (RequestError("duration_seconds", "must be within [4, 15] s, got 3"), False, "seconds", "seconds: must be within [4, 15] s, got 3"),
        (RequestError("height", "must be a multiple of 8, got 10"), True, "size", "size: height: must be a multiple of 8, got 10"),
        (RequestError("width, height", "resolved ratio must be within 1:4 to 4:1"), True, "size", "size: width, height: resolved ratio must be within 1:4 to 4:1"),
        (RequestError("keyframes", "task 'fl2va' needs a first and/or a last keyframe"), False, "input_reference", "input_reference: task 'fl2va' needs a first and/or a last keyframe"),
        (RequestError("keyframes[0]", "cannot open the image file", "/srv/h3/inputs/job/first.png"), False, "input_reference", "input_reference: 'first.png': cannot open the image file"),
        (RequestError("steps", "must be <= 1000, got 5000"), False, "steps", "steps: must be <= 1000, got 5000"),
    ],
    ids=["seconds", "size", "pair", "keyframes", "file", "same-name"],
)  # fmt: skip
def test_the_api_names_its_own_field_and_the_checkers_sentence(error, size_given, param, message) -> None:
    """The one presenter of a RequestError to an API client: the API's field for the request's (`param`), the
    checker's sentence under it, a file by its base name (never the server's path)."""
    assert api_param(error, None, size_given) == param
    assert api_message(error, param) == message


def test_webhook_retries_are_bounded(tmp_path) -> None:
    hits: list[float] = []

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            hits.append(time.monotonic())
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hooks = Webhooks("s", attempts=3, backoff_s=0.05)
    try:
        hooks.send(f"http://127.0.0.1:{server.server_address[1]}/", {"a": 1})
        deadline = time.monotonic() + 10
        while hooks.dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert len(hits) == 3 and hooks.dropped == 1
        assert hits[2] - hits[1] >= hits[1] - hits[0] >= 0.04  # backoff doubles
    finally:
        hooks.close()
        server.shutdown()
        server.server_close()


def test_retention_expires_the_oldest_results(tmp_path) -> None:
    store = JobStore.open(tmp_path)
    old_time = time.time() - 10 * 86400
    for job_id, completed, size in (
        ("old", old_time, 10),
        ("a", time.time() - 20, 600_000),
        ("b", time.time(), 600_000),
    ):
        record = _record(job_id, tmp_path, "completed", completed_at=completed)
        Path(record.out_path).write_bytes(b"0" * size)
        store.insert(record)
    removed = Retention(store, keep_days=7, max_outputs_gb=1e-3).sweep()  # ~1 MB: one of the two must go
    assert removed == 2
    assert [store.get(i).expired for i in ("old", "a", "b")] == [True, True, False]
    assert not (tmp_path / "old.mp4").exists() and (tmp_path / "b.mp4").exists()
    store.close()


def test_inputs_go_with_their_job_and_uploaded_files_expire(tmp_path) -> None:
    """Retention removes an expired result's inputs, an old failed job's inputs and old uploaded files; at start the
    sweep removes job folders no job owns and file folders without their row, and keeps the rest."""
    store = JobStore.open(tmp_path)
    files = ClientFiles(tmp_path, store)
    old = time.time() - 10 * 86400
    folders = {}
    for job_id, status in (
        ("video_" + "a" * 24, "completed"),
        ("video_" + "b" * 24, "failed"),
        ("video_" + "c" * 24, "completed"),
    ):
        folder = files.job_folder("o", job_id)
        write_input(folder, "first.png", b"png")
        record = _record(job_id, tmp_path, status, completed_at=old if job_id[-1] != "c" else time.time())
        record.meta = {"inputs": str(folder)}
        Path(record.out_path).write_bytes(b"0")
        store.insert(record)
        folders[job_id[-1]] = folder
    kept_file = files.add_file("o", "new.png", b"new", "vision")
    old_file = files.add_file("o", "old.png", b"old", "vision")
    store._execute("UPDATE files SET created_at = ? WHERE id = ?", (old, old_file.id))
    assert Retention(store, keep_days=7, max_outputs_gb=None, inputs=files).sweep() == 1
    assert [folders[name].exists() for name in "abc"] == [False, False, True]
    assert files.get_file("o", old_file.id) is None and not Path(old_file.path).exists()
    assert files.get_file("o", kept_file.id) is not None
    orphan = files.job_folder("o", "video_" + "d" * 24)
    stray = files.owner_folder("o") / "files" / ("file-" + "e" * 24)
    write_input(orphan, "x.png", b"x")
    write_input(stray, "y.png", b"y")
    assert files.sweep_orphans() == 2
    assert (
        not orphan.exists() and not stray.exists() and folders["c"].exists() and Path(kept_file.path).exists()
    )
    assert files.used_bytes("o") == len(b"png") + len(b"new")
    with pytest.raises(QuotaExceeded, match="delete uploaded files"):
        ClientFiles(tmp_path, store, quota_bytes=8).check_quota("o", 3)
    store.close()


def test_staging_files_go_even_when_their_folder_was_moved(tmp_path) -> None:
    """A results folder moved (and replaced by a file) mid-job: discarding still removes the staging files, through
    the folder held open, and raises nothing over the job's own error."""
    results = tmp_path / "results"
    results.mkdir()
    staging = StagedOutputs(OutputFiles(results / "a.mp4", results / "a.json"))
    moved = tmp_path / "moved"
    results.rename(moved)
    results.write_text("a file now")
    assert len(list(moved.glob(".*.partial"))) == 2
    staging.discard()
    assert list(moved.iterdir()) == []
    error = NotADirectoryError(20, "Not a directory", str(results / ".a.mp4.partial"))
    wrapped = RuntimeError("the MP4 writer failed")
    wrapped.__cause__ = error
    assert output_failure_message(wrapped, results) == (
        "The outputs folder refuses writes (Not a directory); the details are in the server log."
    )
    assert (
        output_failure_message(FileNotFoundError(2, "No such file", "/elsewhere/x"), results)
        == ENGINE_FAILURE_MESSAGE
    )


def test_serving_flags_and_their_defaults(tmp_path) -> None:
    (tmp_path / "keys").write_text("# ours\nfile-key-12345678\n")
    config = app.parse_config(
        ["--api-key", "flag-key-12345678", "--api-key-file", str(tmp_path / "keys")],
        {"H3_API_KEYS": "env-key-12345678"},
    )
    assert config.serving.api_keys == ("flag-key-12345678", "env-key-12345678", "file-key-12345678")
    assert app.parse_config([], {}).serving == app.ServingOptions()
    for arguments in (
        ["--api-key", "short"],
        ["--max-queue", "0"],
        ["--max-body-size", "lots"],
        ["--max-inputs-size", "lots"],
        ["--webhook-url", "ftp://x"],
    ):
        with pytest.raises(app.ConfigError):
            app.parse_config(arguments, {})


def test_without_keys_v1_answers_only_on_loopback(tmp_path) -> None:
    def caller(headers: dict[str, str]) -> Request:
        raw = [(key.lower().encode(), value.encode()) for key, value in headers.items()]
        return Request({"type": "http", "method": "GET", "path": "/", "headers": raw})

    def serving(settings: ApiSettings) -> Serving:
        return Serving(None, settings, Metrics(_FakeFront()))  # type: ignore[arg-type]

    assert serving(ApiSettings(loopback=True)).owner(caller({})) == "local"
    with pytest.raises(ApiError) as raised:
        serving(ApiSettings(loopback=False)).owner(caller({}))
    assert raised.value.status == 401 and raised.value.code == "api_keys_required"
    keyed = serving(ApiSettings(keys=("k-12345678",), loopback=False))
    assert keyed.owner(caller({"Authorization": "Bearer k-12345678"})).startswith("key:")
    with pytest.raises(ApiError, match="Missing API key"):
        keyed.owner(caller({}))


class _WaitingReplica:
    """A replica whose job runs until it is cancelled."""

    facts = RELEASED

    def run(self, handle, replica_index, preview_every):
        from h3engine.runtime.messages import JobFailed, job_started

        handle.publish(
            job_started(handle.job_id, replica_index, handle.submitted_at, handle.resolved.geometry)
        )
        while not handle.cancel_requested:
            time.sleep(0.01)
        return JobFailed(handle.job_id, "cancelled", "Cancelled.")

    def close(self) -> None:
        pass


def test_a_stop_leaves_running_and_waiting_api_jobs_queued_for_the_next_start(tmp_path) -> None:
    store = JobStore.open(tmp_path)
    front = EngineFront([_WaitingReplica()], tmp_path)
    jobs = VideoJobs(front, store, tmp_path)
    jobs.start()
    request = GenerationRequest(task="t2va", prompt="x", steps=1)
    first, _ = jobs.create("o", front.resolve(request), {})
    second, _ = jobs.create("o", front.resolve(request), {})
    deadline = time.monotonic() + 10
    while store.get(first.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    jobs.stop_taking()  # what app.py does first on Ctrl-C or SIGTERM
    front.shutdown()
    jobs.close()
    assert [store.get(job.id).status for job in (first, second)] == ["queued", "queued"]
    assert store.get(first.id).attempts == 1
    store.close()


def test_shared_history_makes_the_page_and_the_keyless_api_one_owner(tmp_path) -> None:
    store = JobStore.open(tmp_path)
    shared, apart = (VideoJobs(_FakeFront(), store, tmp_path, shared=flag) for flag in (True, False))
    assert shared.results_dir("local") == tmp_path and shared.ui_owner(tmp_path) == "local"
    assert apart.results_dir("local").parent == tmp_path / "api"
    assert apart.ui_owner(tmp_path / "browsers" / "ab") == "ui:browsers/ab"
    store.close()


def test_a_share_link_turns_keyless_v1_off(tmp_path) -> None:
    from h3engine.serving.options import ServingOptions
    from h3engine.serving.server import start_serving

    for share, loopback in ((False, True), (True, False)):
        runtime = start_serving(
            _FakeFront(),
            JobStore.open(tmp_path),
            tmp_path,
            ServingOptions(),
            "127.0.0.1",
            1024,
            4,
            share=share,
        )
        try:
            assert runtime.serving.settings.loopback is loopback
        finally:
            runtime.close()
