"""README's "/v1/videos API" section, run as a user would: its bash block (curl) and its Python block (the real
`openai` SDK) against `python app.py` on the tiny checkpoint (loopback, no keys), in a folder holding the files the
blocks name (first.png, last.png, robot.png, voice.wav from assets/).

Two substitutions only: the address (the test app's port for 7860) and the size (README's 1344x768 is the released
16:9 canvas; on the tiny checkpoint it is an explicit 1344 x 768 canvas, far too slow for a CPU test, so its own
16:9 canvas, 56x32, stands in).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from _app_helpers import ASSETS, REPOSITORY_ROOT, RunningApp, assert_browser_playable, start_app, stop_app
from PIL import Image

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FILES = {
    "first.png": ASSETS / "fl2va" / "first.png",
    "last.png": ASSETS / "fl2va" / "last.png",
    "robot.png": ASSETS / "ref2va" / "picture1.png",
    "voice.wav": ASSETS / "ref2va" / "audio1.wav",
}
FOUR_SECOND_FRAMES = 107


def readme_api_blocks() -> tuple[str, str]:
    """The bash and the Python block of README's API section (the first of each there)."""
    text = (REPOSITORY_ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## The /v1/videos API") :]
    section = section[: section.index("\n## ", 4)]
    bash = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    python = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert bash and python, "README's API section lost its bash or Python block"
    return bash.group(1), python.group(1)


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_native) -> RunningApp:
    running = start_app(tmp_path_factory.mktemp("readme_api"), checkpoint=tiny_native)
    yield running
    assert stop_app(running) == 0, running.log_tail()


def _as_here(block: str, app: RunningApp) -> str:
    address = app.url.removeprefix("http://").rstrip("/")
    block = block.replace("localhost:7860", address).replace("127.0.0.1:7860", address)
    return block.replace("1344x768", "56x32")


def _jobs(app: RunningApp) -> list[dict]:
    return httpx.get(f"{app.url}v1/videos", params={"limit": 100}).json()["data"]


def test_readme_api_section_runs_end_to_end(app, tmp_path) -> None:
    for name, source in FILES.items():
        shutil.copyfile(source, tmp_path / name)
    bash, python = readme_api_blocks()
    environment = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    ran = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", _as_here(bash, app)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert ran.returncode == 0, ran.stderr + ran.stdout
    assert "event: done" in ran.stdout
    assert_browser_playable(tmp_path / "kite.mp4", FOUR_SECOND_FRAMES)
    for name in ("kite.jpg", "kite-frames.jpg"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "JPEG"
    ran = subprocess.run(
        [sys.executable, "-c", _as_here(python, app)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )
    assert ran.returncode == 0, ran.stderr + ran.stdout
    assert ran.stdout.startswith("completed 56x32 {"), ran.stdout
    # Every job the blocks made ends completed (the two deleted are gone from the list), one per task.
    deadline = time.monotonic() + 300
    while (
        any(job["status"] in ("queued", "in_progress") for job in _jobs(app)) and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    jobs = _jobs(app)
    assert [job["status"] for job in jobs] == ["completed"] * 7, json.dumps(jobs, indent=1)[:3000]
    assert sorted(job["h3"]["task"] for job in jobs) == ["fl2va"] * 3 + ["ref2va"] * 3 + ["t2va"]
    assert httpx.get(f"{app.url}v1/files").json()["data"] == []  # the block deleted its uploads
