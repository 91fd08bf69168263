"""The repository runs as a Hugging Face Gradio Space as it is (issue 19, point 13): README.md's front matter
configures the Space (gradio at the locked version, app.py); app.py binds where a Space says
(GRADIO_SERVER_NAME / GRADIO_SERVER_PORT); with no checkpoint, a read-only checkout and an unwritable HOME it still
serves the tiny random-weight demo, its outputs and cache moved to the temp folder (and logged).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from _app_helpers import REPOSITORY_ROOT

import app

# The Space card's keys (https://huggingface.co/docs/hub/spaces-config-reference) that this repository sets.
SPACE_KEYS = {
    "title",
    "emoji",
    "colorFrom",
    "colorTo",
    "sdk",
    "sdk_version",
    "python_version",
    "app_file",
    "pinned",
    "short_description",
    "license",
}
SPACE_COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
STARTUP_TIMEOUT_S = 180


def locked_version(package: str) -> str:
    text = (REPOSITORY_ROOT / "requirements.txt").read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(package)}==(\S+)", text, flags=re.MULTILINE)
    assert match is not None, f"{package} is not in requirements.txt"
    return match.group(1)


def front_matter(readme: Path) -> dict:
    """The YAML block between the `---` lines that open the file (what the Hub reads)."""
    text = readme.read_text(encoding="utf-8")
    match = re.match(r"---\n(.*?)\n---\n", text, flags=re.DOTALL)
    assert match is not None, (
        f"{readme.name} does not open with a YAML front matter block between '---' lines"
    )
    return yaml.safe_load(match.group(1))


def test_the_readme_configures_a_gradio_space() -> None:
    card = front_matter(REPOSITORY_ROOT / "README.md")
    assert SPACE_KEYS <= card.keys(), f"missing: {sorted(SPACE_KEYS - card.keys())}"
    assert card["sdk"] == "gradio"
    assert card["sdk_version"] == locked_version("gradio")
    # A string: unquoted, YAML reads 3.11 as a float (and 3.10 as 3.1).
    assert card["python_version"] == "3.11"
    assert (REPOSITORY_ROOT / card["app_file"]).is_file()
    assert {card["colorFrom"], card["colorTo"]} <= SPACE_COLORS
    assert isinstance(card["pinned"], bool)
    assert isinstance(card["short_description"], str) and 0 < len(card["short_description"]) <= 60
    assert isinstance(card["title"], str) and isinstance(card["license"], str)
    assert len(card["emoji"]) <= 2 and not card["emoji"].isascii()


# ---------------------------------------------------------------------------------------------------------------
# Where the app listens


def test_a_space_chooses_the_address_and_port() -> None:
    space = {"GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "7861"}
    config = app.parse_config([], space)
    assert (config.host, config.port) == ("0.0.0.0", 7861)
    # Without them: loopback on Gradio's port; our own variables and the flags win over a Space's.
    assert (app.parse_config([], {}).host, app.parse_config([], {}).port) == ("127.0.0.1", 7860)
    config = app.parse_config([], {**space, "H3_HOST": "127.0.0.2", "H3_PORT": "7000"})
    assert (config.host, config.port) == ("127.0.0.2", 7000)
    config = app.parse_config(["--host", "127.0.0.3", "--port", "7001"], space)
    assert (config.host, config.port) == ("127.0.0.3", 7001)
    with pytest.raises(app.ConfigError, match="^--port: invalid int value: 'http'"):
        app.parse_config([], {"GRADIO_SERVER_PORT": "http"})
    with pytest.raises(app.ConfigError, match="^--port: must be within 1-65535, got 70000"):
        app.parse_config([], {"GRADIO_SERVER_PORT": "70000"})


# ---------------------------------------------------------------------------------------------------------------
# A read-only checkout and an unwritable HOME


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def read_only_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The working folder cannot hold `outputs` and HOME cannot hold `.cache` (files stand in the way: refused even
    to root), the temp folder is tmp_path/tmp; returns the environment of such a start."""
    (tmp_path / "checkout").mkdir()
    (tmp_path / "checkout" / "outputs").write_text("not a folder")
    (tmp_path / "home").write_text("not a folder")
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return {"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp")}


def test_unwritable_default_folders_move_to_the_temp_folder(
    read_only_place: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = app.parse_config(["--port", str(free_port())], read_only_place)
    with pytest.raises(app.ConfigError, match="^--outputs: cannot write to "):
        app.check_before_loading(config)
    with caplog.at_level(logging.WARNING, logger="h3app"):
        settled = app.settle_folders(config)
    folder = settled.outputs_dir.parent
    assert folder.parent == tmp_path / "tmp" and folder.name.startswith(f"h3-app-{os.getpid()}-")
    assert (settled.outputs_dir, settled.cache_dir) == (folder / "outputs", folder / "cache")
    app.check_before_loading(settled)
    assert settled.outputs_dir.is_dir() and settled.cache_dir.is_dir()
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2
    assert (
        warnings[0].startswith(f"cannot write to {config.outputs_dir} (")
        and str(folder / "outputs") in warnings[0]
    )
    assert (
        warnings[1].startswith(f"cannot write to {config.cache_dir} (")
        and str(folder / "cache") in warnings[1]
    )
    # A later start removes the folder of a process that has ended (and leaves a live one's).
    stale = tmp_path / "tmp" / f"h3-app-{_ended_pid()}-abc"
    stale.mkdir()
    app.remove_leftovers(settled.outputs_dir)
    assert not stale.exists() and folder.is_dir()


def _ended_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_named_folders_that_cannot_be_written_are_refused(
    read_only_place: dict[str, str], tmp_path: Path
) -> None:
    blocked = tmp_path / "home" / "below-a-file"
    port = ["--port", str(free_port())]
    config = app.settle_folders(app.parse_config(["--outputs", str(blocked), *port], read_only_place))
    with pytest.raises(app.ConfigError, match=f"^--outputs: cannot write to {re.escape(str(blocked))} "):
        app.check_before_loading(config)
    environ = {**read_only_place, "H3_CACHE_DIR": str(blocked)}
    config = app.settle_folders(app.parse_config(["--outputs", str(tmp_path / "out"), *port], environ))
    with pytest.raises(app.ConfigError, match=f"^H3_CACHE_DIR: cannot write to {re.escape(str(blocked))} "):
        app.check_before_loading(config)
    # With a checkpoint the cache is not needed, so it is not checked.
    named = app.parse_config(["--outputs", str(tmp_path / "out"), "--checkpoint", "ckpt", *port], environ)
    app.check_before_loading(app.settle_folders(named))


@pytest.mark.slow
def test_the_demo_runs_as_a_space_starts_it(read_only_place: dict[str, str], tmp_path: Path) -> None:
    """`python app.py` with nothing but what a Space sets: no checkpoint, no flag, a checkout it cannot write to."""
    from gradio_client import Client

    port = free_port()
    environment = {
        name: value for name, value in os.environ.items() if not name.startswith(("H3_", "GRADIO_"))
    }
    environment.pop("XDG_CACHE_HOME", None)
    # A Space binds 0.0.0.0; loopback here keeps the test's server off the network.
    environment |= read_only_place | {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    log_path = tmp_path / "app.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(REPOSITORY_ROOT / "app.py")],
            cwd=tmp_path / "checkout",
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_page(f"http://127.0.0.1:{port}/", process, log_path)
        client = Client(
            f"http://127.0.0.1:{port}/", verbose=False, download_files=str(tmp_path / "downloads")
        )
        settings = dict(duration_seconds=4, aspect_ratio="auto", randomize_seed=False, steps=2)
        client.predict(prompt="A kite.", seed=3, **settings, api_name="/t2va")
    finally:
        process.terminate()
        exit_code = process.wait(timeout=60)
    log = log_path.read_text(errors="replace")
    assert exit_code == 0, log[-4000:]
    moved = re.findall(r"cannot write to \S+ \(.*?\); using (\S+) instead", log)
    assert [Path(folder).name for folder in moved] == ["outputs", "cache"], log[-4000:]
    assert list(Path(moved[0]).rglob("*.mp4")), log[-4000:]
    assert list(Path(moved[1]).glob("tiny-checkpoint-*")), log[-4000:]


def _wait_for_page(url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise AssertionError(
        f"no page within {STARTUP_TIMEOUT_S} s: {log_path.read_text(errors='replace')[-4000:]}"
    )
