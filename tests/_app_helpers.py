"""Shared by the app tests: start `python app.py` on a fresh tiny checkpoint and read result MP4s back with PyAV."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import av

from h3engine.checkpoint.tiny import make_tiny_checkpoint

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
ASSETS = REPOSITORY_ROOT / "assets"
STARTUP_TIMEOUT_S = 180
AAC_FRAME_SECONDS = 1024 / 32_000


@dataclass
class RunningApp:
    url: str
    outputs_dir: Path
    log_path: Path
    process: subprocess.Popen

    def log_tail(self, characters: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-characters:]

    def mp4_files(self) -> set[Path]:
        return set(self.outputs_dir.glob("*.mp4"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_app(
    folder: Path, embedded_default: bool = False, extra_arguments: Sequence[str] = ()
) -> RunningApp:
    """Launch the app as a user would, with its own outputs, cache and Gradio temp folders.

    `embedded_default`: give no checkpoint, so the app makes its tiny random-weight default in the cache folder;
    otherwise a tiny checkpoint is made here and passed with --checkpoint. `extra_arguments` go to app.py as well.
    """
    outputs_dir = folder / "outputs"
    port = _free_port()
    log_path = folder / "app.log"
    environment = {
        **os.environ,
        "GRADIO_TEMP_DIR": str(folder / "gradio"),
        "H3_CACHE_DIR": str(folder / "cache"),
    }
    environment.pop("H3_CHECKPOINT", None)
    command = [sys.executable, str(REPOSITORY_ROOT / "app.py"), "--outputs", str(outputs_dir)]
    command += ["--port", str(port), "--devices", "cpu", *extra_arguments]
    if not embedded_default:
        command += ["--checkpoint", str(make_tiny_checkpoint(folder / "checkpoint", seed=0))]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=folder)
    app = RunningApp(f"http://127.0.0.1:{port}/", outputs_dir, log_path, process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app.py exited with {process.returncode} during start-up:\n{app.log_tail()}")
        try:
            with urllib.request.urlopen(app.url, timeout=2) as response:
                if response.status == 200:
                    return app
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    stop_app(app)
    raise RuntimeError(f"app.py did not answer within {STARTUP_TIMEOUT_S} s:\n{app.log_tail()}")


def stop_app(app: RunningApp) -> int:
    """SIGTERM, as `docker stop` sends; returns the exit code."""
    app.process.terminate()
    try:
        return app.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        app.process.kill()
        return app.process.wait()


@dataclass(frozen=True)
class StreamFacts:
    video_codec: str
    pix_fmt: str
    fps: float
    frame_count: int
    audio_codec: str
    sample_rate: int
    channels: int
    audio_layout: str
    audio_seconds: float

    @property
    def video_seconds(self) -> float:
        return self.frame_count / self.fps


def read_streams(path: str | Path) -> StreamFacts:
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0]
        facts = dict(
            video_codec=video.codec_context.name,
            pix_fmt=video.codec_context.format.name,
            fps=float(video.average_rate),
            audio_codec=audio.codec_context.name,
            sample_rate=audio.codec_context.sample_rate,
            channels=audio.codec_context.channels,
            audio_layout=audio.codec_context.layout.name,
            # The track duration after the edit list, i.e. without the AAC encoder's priming samples.
            audio_seconds=float(audio.duration * audio.time_base),
        )
        frame_count = sum(1 for _ in container.decode(video=0))
    return StreamFacts(frame_count=frame_count, **facts)


def assert_browser_playable(path: str | Path, expected_frames: int) -> StreamFacts:
    facts = read_streams(path)
    assert (facts.video_codec, facts.pix_fmt) == ("h264", "yuv420p")
    assert facts.fps == 24.0
    assert facts.frame_count == expected_frames
    assert (facts.audio_codec, facts.sample_rate, facts.channels, facts.audio_layout) == (
        "aac",
        32_000,
        2,
        "stereo",
    )
    assert abs(facts.audio_seconds - facts.video_seconds) <= AAC_FRAME_SECONDS + 1e-3, facts
    return facts
