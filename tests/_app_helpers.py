"""Shared by the app tests: start `python app.py` on a fresh tiny checkpoint and read result MP4s back with PyAV."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import av
import pytest

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
        """Every result MP4, in any user's or session's folder (not the stored inputs)."""
        return {
            path
            for path in self.outputs_dir.rglob("*.mp4")
            if path.relative_to(self.outputs_dir).parts[0] != "inputs"
        }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_app(
    folder: Path,
    embedded_default: bool = False,
    extra_arguments: Sequence[str] = (),
    gradio_temp_dir: bool = True,
    checkpoint: Path | None = None,
) -> RunningApp:
    """Launch the app as a user would, with its own outputs, cache and Gradio temp folders.

    `embedded_default`: give no checkpoint, so the app makes its tiny random-weight default in the cache folder;
    otherwise a tiny checkpoint is made here and passed with --checkpoint. `extra_arguments` go to app.py as well.
    Without `gradio_temp_dir`, GRADIO_TEMP_DIR is left unset and the temp folder is `folder`/tmp. `checkpoint`: serve
    this one instead of a fresh tiny checkpoint.
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
    if not gradio_temp_dir:  # the app then makes a Gradio cache of its own in the temp folder
        (folder / "tmp").mkdir(exist_ok=True)
        environment.pop("GRADIO_TEMP_DIR")
        environment["TMPDIR"] = str(folder / "tmp")
    command = [sys.executable, str(REPOSITORY_ROOT / "app.py"), "--outputs", str(outputs_dir)]
    command += ["--port", str(port), "--devices", "cpu", *extra_arguments]
    if not embedded_default:
        command += ["--checkpoint", str(checkpoint or make_tiny_checkpoint(folder / "checkpoint", seed=0))]
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


@contextmanager
def refusing_writes(folder: Path) -> Iterator[None]:
    """While inside, `folder` (made if missing) refuses new entries, to the app's processes too: through its
    permissions, or for root (whom permissions do not stop) through the immutable attribute (`chattr +i`; a skip
    naming why when the file system or the machine does not allow it)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        mode = stat.S_IMODE(folder.stat().st_mode)
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(mode)
        return
    chattr = shutil.which("chattr")
    made = subprocess.run([chattr, "+i", str(folder)], capture_output=True, text=True) if chattr else None
    if made is None or made.returncode != 0:
        pytest.skip(f"running as root, and chattr +i cannot make {folder} immutable: {made and made.stderr}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=True)


def _children(pid: int) -> dict[int, bytes]:
    """pid -> command line of every child of `pid`, from /proc."""
    children = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or one that ended meanwhile
        if parent == pid:
            children[int(entry.name)] = command
    return children


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on."""
    children = list(_children(pid))
    return children + [grandchild for child in children for grandchild in descendants(child)]


def fork_servers_of(pid: int) -> list[int]:
    """The multiprocessing fork servers started by process `pid` (h3engine.runtime.rank_process.rank_context)."""
    return [child for child, command in _children(pid).items() if b"forkserver" in command]


def rank_processes_of(pid: int) -> list[int]:
    """The worker-group ranks started by process `pid`: the children of its fork server, which forks every rank."""
    return sorted(rank for server in fork_servers_of(pid) for rank in _children(server))


def rank_processes(app: RunningApp) -> list[int]:
    """The app's worker-group ranks."""
    return rank_processes_of(app.process.pid)


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


def event_index(config: dict, elem_id: str, trigger: str) -> int:
    """The fn_index of the event `trigger` ("load", "click") that reads or writes the component `elem_id`."""
    (component,) = [c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == elem_id]
    for index, dependency in enumerate(config["dependencies"]):
        triggers = {event for _target, event in dependency["targets"]}
        if trigger in triggers and component in dependency["inputs"] + dependency["outputs"]:
            return index
    raise LookupError(f"no {trigger} event touches #{elem_id}")


def call_event(url: str, session_hash: str, fn_index: int, data: list) -> dict:
    """Runs one event as the browser does (join the queue, read the session's event stream); returns the final
    message: {"success": bool, "output": {"data": [...]} or {"error": ...}}. For the app's private events, which
    gradio_client does not call."""
    import httpx

    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"data": data, "fn_index": fn_index, "session_hash": session_hash, "trigger_id": None}
        http.post("gradio_api/queue/join", json=body).raise_for_status()
        with http.stream("GET", "gradio_api/queue/data", params={"session_hash": session_hash}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    message = json.loads(line.removeprefix("data:"))
                    if message.get("msg") == "process_completed":
                        return message
    raise RuntimeError("the event stream ended without a result")
