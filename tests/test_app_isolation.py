"""Users kept apart when the app is shared, probed over HTTP as an attacker would, and app.py's option errors.

What is compared, against the run's shared `python app.py` (conftest.shared_app: the embedded tiny default, in the
per-session mode) with two clients:
* `/config`, read anonymously after a generation, holds neither that result's prompt nor any server path (the
  outputs, cache, checkpoint or Gradio temp folder);
* a result is served to the client that made it, from the URL it was given; its file in the outputs folder and the
  stored copy of its upload (`outputs/inputs/`) are refused (403) to anyone asking by path;
* History, as the page loads it, lists a result for its own session only, and another session cannot restore it;
* Gradio's temp folder holds the app's files (the upload, served copies), and none of them after the app exits
  (checked as the shared app stops). (Without GRADIO_TEMP_DIR, an app's Gradio cache of its own, previews included,
  goes at its exit: tests/test_outputs_and_cancel.py, on the app that starts after a SIGKILLed one.)
Option errors (`--port` taken or out of range, `--max-file-size lots`, ...) exit 2 with one stderr line naming the
option, before any model is loaded (the tiny checkpoint is never made). The per-owner folders themselves are
checked in plain Python.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from _app_helpers import ASSETS, REPOSITORY_ROOT, call_event, event_index
from gradio_client import Client, handle_file

from ui.access import AccessPolicy, owner_folder

SECRET_PROMPT = "The lighthouse keeper's secret plan."
SETTINGS = dict(duration_seconds=5, aspect_ratio="auto", seed=4, randomize_seed=False, steps=2)


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


@pytest.fixture(scope="module")
def made(app, tmp_path_factory):
    """Client A's FL2VA result (with an uploaded first frame): (client, result)."""
    client = Client(app.url, verbose=False, download_files=str(tmp_path_factory.mktemp("a_downloads")))
    result = client.predict(
        prompt=SECRET_PROMPT,
        first_image=handle_file(ASSETS / "fl2va" / "first.png"),
        last_image=None,
        **SETTINGS,
        api_name="/fl2va",
    )
    assert result[0].startswith("Done"), result[0]
    return client, result


def _status(app, path: Path | str) -> int:
    try:
        with urllib.request.urlopen(f"{app.url}gradio_api/file={path}") as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_page_config_carries_no_prompt_and_no_server_path(app, made) -> None:
    config = httpx.get(f"{app.url}config").text
    assert SECRET_PROMPT not in config
    folder = app.outputs_dir.parent  # holds the outputs, the cache, the checkpoint and Gradio's temp folder
    assert str(folder) not in config
    (checkpoint,) = (folder / "cache").glob("tiny-checkpoint-*")  # the embedded default's
    assert f"Checkpoint: `{checkpoint.name}`" in config  # named by its folder, without the path


def test_a_result_is_served_to_its_client_only_from_its_url(app, made) -> None:
    _client, result = made
    video, sidecar = result[5]
    assert Path(video).read_bytes()[4:8] == b"ftyp"  # downloaded from the URL the app answered with
    assert json.loads(Path(sidecar).read_text())["request"]["prompt"] == SECRET_PROMPT
    written = [path for path in app.mp4_files() if path.name == Path(video).name]
    assert len(written) == 1 and written[0].parent.parent.name == "sessions"
    stored_inputs = list((app.outputs_dir / "inputs").rglob("first.png"))
    assert stored_inputs
    for path in (written[0], written[0].with_suffix(".json"), stored_inputs[0]):
        assert _status(app, path) == 403, path


def test_history_lists_and_restores_a_result_for_its_own_session_only(app, made) -> None:
    client, result = made
    stem = Path(result[2]).stem
    config = httpx.get(f"{app.url}config").json()
    load = event_index(config, "h3-history", "load")
    restore = event_index(config, "h3-history", "click")

    def history(session_hash: str) -> list[str]:
        message = call_event(app.url, session_hash, load, [])
        assert message["success"], message
        return [row[0] for row in message["output"]["data"][0]["samples"]]

    assert stem in history(client.session_hash)
    assert history("another-session-0123") == []
    # A click sends the row's index into the session's own rows: the first row is A's result for A only. The other
    # session is told in a toast (not an error, which would mark every input) and gets nothing of A's result.
    refused = call_event(app.url, "another-session-0123", restore, [0])
    assert SECRET_PROMPT not in json.dumps(refused), refused
    assert stem not in json.dumps(refused), refused
    restored = call_event(app.url, client.session_hash, restore, [0])
    assert restored["success"], restored
    assert SECRET_PROMPT in json.dumps(restored["output"]["data"])


def test_gradio_temp_folder_holds_the_apps_files_while_it_runs(app, made) -> None:
    """The upload and the served copies; at exit the shared app must leave none of them (conftest.shared_app)."""
    temp_folder = app.outputs_dir.parent / "gradio"
    assert any(path.name == "first.png" for path in temp_folder.rglob("*")), list(temp_folder.rglob("*"))
    assert any(path.parent.name.startswith("h3-") for path in temp_folder.rglob("*.mp4"))


def _run_app(folder: Path, *arguments: str) -> tuple[subprocess.CompletedProcess, float]:
    # The run's temp folder (conftest.py) too: importing torch makes a folder in the temp folder.
    environment = {
        "PATH": "/usr/bin:/bin",
        "H3_CACHE_DIR": str(folder / "cache"),
        "TMPDIR": tempfile.gettempdir(),
    }
    environment["GRADIO_TEMP_DIR"] = str(folder / "gradio")
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, str(REPOSITORY_ROOT / "app.py"), "--outputs", str(folder / "outputs"), *arguments],
        capture_output=True,
        text=True,
        env=environment,
        cwd=folder,
        timeout=120,
    )
    return finished, time.monotonic() - started


@pytest.fixture(scope="module")
def taken_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--port", "99999"], "--port"),
        (["--port", "taken"], "--port"),
        (["--port", "seven"], "--port"),
        (["--max-file-size", "lots"], "--max-file-size"),
        (["--queue-size", "0"], "--queue-size"),
        (["--world-size", "two"], "--world-size"),
        (["--memory-profile", "tiny"], "--memory-profile"),
        (["--dtype", "float16"], "--dtype"),
        (["--devices", "cuda:7"], "--devices"),
        (["--auth", "nopassword"], "--auth"),
        (["--host", "no such host."], "--host"),
        (["--outputs", "/proc/no/such/folder"], "--outputs"),
        (["--no-such-option"], "--no-such-option"),
    ],
)
def test_option_errors_exit_2_with_one_line_before_loading_a_model(
    tmp_path, taken_port, arguments, named
) -> None:
    arguments = [str(taken_port) if argument == "taken" else argument for argument in arguments]
    finished, seconds = _run_app(tmp_path, *arguments)
    assert finished.returncode == 2, finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], finished.stderr
    # The tiny checkpoint was not made, so no model was loaded (the cache folder itself may hold TorchInductor's).
    assert not list((tmp_path / "cache").glob("tiny-checkpoint-*"))
    assert seconds < 60


def test_each_user_or_session_has_its_own_results_folder(tmp_path) -> None:
    per_owner = AccessPolicy(tmp_path)
    alice = SimpleNamespace(username="alice", session_hash="s1")
    assert per_owner.results_dir(alice) == per_owner.results_dir(
        SimpleNamespace(username="alice", session_hash="s2")
    )
    assert per_owner.results_dir(alice).parent == tmp_path / "users"
    one, two = (SimpleNamespace(username=None, session_hash=name) for name in ("s1", "s2"))
    assert per_owner.results_dir(one) != per_owner.results_dir(two)
    assert (
        owner_folder(None, "../../etc").parts[0] == "sessions"
        and ".." not in owner_folder(None, "../..").parts
    )
    assert AccessPolicy(tmp_path, shared=True).results_dir(one) == tmp_path


def test_published_copies_have_unguessable_names_and_are_made_once(tmp_path) -> None:
    result = tmp_path / "outputs" / "r.mp4"
    result.parent.mkdir()
    result.write_bytes(b"video")
    policy = AccessPolicy(tmp_path / "outputs", serve_dir=tmp_path / "cache")
    copy = Path(policy.publish(result))
    assert copy.read_bytes() == b"video" and copy.name == "r.mp4" and copy.is_relative_to(tmp_path / "cache")
    assert policy.publish(result) == str(copy)
    assert AccessPolicy(tmp_path / "outputs", serve_dir=tmp_path / "cache").publish(result) != str(copy)
