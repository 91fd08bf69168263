"""The command line's progress (issue 19, point 12): the model store reports each component as it loads; the CLI
shows loading, denoising, decode and mux as JSON events (`--progress json`, stdout), plain lines (not a terminal:
no carriage returns) or tqdm bars (a terminal), and nothing but the output path under `--quiet`; the app logs the
same loading at start-up.
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import app
from h3engine.cli.main import main
from h3engine.cli.progress import BarProgress, PlainProgress
from h3engine.engine.engine import Engine
from h3engine.engine.model_store import COMPONENTS, LoadEvent

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def generate_arguments(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return [
        "generate",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "a fox in the snow",
        "--steps",
        str(STEPS),
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


def json_events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def expected_load_events(partition: str, components: tuple[str, ...]) -> list[tuple]:
    return [
        (name, partition, index, len(components), done)
        for index, name in enumerate(components, start=1)
        for done in (False, True)
    ]


# ---------------------------------------------------------------------------------------------------------------
# The store's events


def test_the_store_reports_each_component_as_it_loads(tiny_native: Path, tiny_diffusers: Path) -> None:
    events: list[LoadEvent] = []
    engine = Engine.from_checkpoint(tiny_native, on_load=events.append)
    seen = [(e.component, e.partition, e.index, e.total, e.seconds is not None) for e in events]
    assert seen == expected_load_events("fl2va", COMPONENTS)
    assert all(event.seconds >= 0 for event in events if event.seconds is not None)
    # The other partition loads on first use, and reports then: its DiT only, since the native layout's partitions
    # carry identical copies of everything else (loaded once).
    events.clear()
    engine.store.models_for_partition("ref2va")
    assert [(e.component, e.partition, e.index) for e in events if e.seconds] == [("dit", "ref2va", 1)]
    # The diffusers layout shares all but the DiT: only that one loads (and counts) for the second partition.
    engine = Engine.from_checkpoint(tiny_diffusers)
    events.clear()
    engine.store.on_load = events.append
    engine.store.models_for_partition("ref2va")
    assert [(e.component, e.index, e.total, e.seconds is not None) for e in events] == [
        ("dit", 1, 1, False),
        ("dit", 1, 1, True),
    ]


def test_a_partition_whose_text_encoder_differs_loads_its_own(tiny_native: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_native, checkpoint)
    weights = sorted((checkpoint / "Ref2VA" / "text_encoder").glob("*.safetensors"))[-1]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's last value
    weights.write_bytes(bytes(data))
    events: list[LoadEvent] = []
    engine = Engine.from_checkpoint(checkpoint, on_load=events.append)
    events.clear()
    engine.store.models_for_partition("ref2va")
    assert [e.component for e in events if e.seconds is not None] == ["text_encoder", "dit"]


# ---------------------------------------------------------------------------------------------------------------
# The CLI's modes


def test_json_progress_lists_every_phase_in_order(capsys, tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "clip.mp4"
    assert main(generate_arguments(tiny_native, out, "--progress", "json")) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    events = json_events(captured.out)
    names = [event["event"] for event in events]
    loads = [
        (e["component"], e["partition"], e["index"], e["total"], e["event"] == "loaded")
        for e in events
        if e["event"] in ("load_start", "loaded")
    ]
    assert loads == expected_load_events("fl2va", COMPONENTS)
    assert names[len(loads) :] == ["memory_plan", "prepare"] + ["step"] * STEPS + ["decode", "mux", "done"]
    assert events[len(loads)]["lines"][0] == "memory plan (auto, bf16 weights, cpu): no GPU budget"
    steps = [event for event in events if event["event"] == "step"]
    assert [(e["step"], e["total"]) for e in steps] == [(step, STEPS) for step in range(1, STEPS + 1)]
    assert all(e["eta_s"] >= 0 and e["elapsed_s"] > 0 and e["steps_per_s"] > 0 for e in steps)
    assert steps[-1]["eta_s"] == 0
    assert {"video_decode_s", "audio_decode_s", "mux_s"} <= events[-2]["timings_s"].keys()
    assert events[-1]["path"] == str(out) and events[-1]["sidecar"] == str(tmp_path / "clip.json")
    assert out.is_file()
    times = [event["t_s"] for event in events]
    assert times == sorted(times)


def test_json_progress_ends_with_an_error_event(capsys, tmp_path: Path) -> None:
    arguments = generate_arguments(tmp_path / "none", tmp_path / "clip.mp4", "--progress", "json")
    assert main([*arguments, "--duration", "30"]) == 2
    captured = capsys.readouterr()
    message = "error: duration_seconds: must be within [4, 15] s, got 30"
    assert captured.err.startswith(message) and captured.err.count("\n") == 1
    events = json_events(captured.out)
    assert [event["event"] for event in events] == ["error"]
    assert events[0]["exit_code"] == 2 and events[0]["message"] == captured.err.strip()


def test_plain_progress_without_a_terminal(capsys, tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "clip.mp4"
    assert main(generate_arguments(tiny_native, out)) == 0  # auto: stderr is no terminal here
    captured = capsys.readouterr()
    assert captured.out == f"{out}\n"
    assert "\r" not in captured.err
    lines = captured.err.splitlines()
    assert lines[0] == "loading the fl2va models (6 components)"
    assert [line.split(" (")[0] for line in lines[1:7]] == [
        "loaded tokenizer",
        "loaded text encoder",
        "loaded processor",
        "loaded DiT",
        "loaded video VAE",
        "loaded audio VAE",
    ]
    # The memory plan (on the CPU: every model resident), then the request.
    assert lines[7:12] == ["memory plan (auto, bf16 weights, cpu): no GPU budget"] + [
        f"  {model}: resident" for model in ("text_encoder", "dit", "video_vae", "audio_vae")
    ]
    lines = lines[:7] + lines[12:]
    assert lines[7].startswith("preparing t2va: ")
    assert [line.split(",")[0] for line in lines[8:11]] == [
        f"denoising: step {step}/{STEPS}" for step in range(1, STEPS + 1)
    ]
    assert lines[11:13] == ["decoding the video and the audio, writing the MP4", lines[12]]
    assert lines[12].startswith("decoded and written in ") and lines[13].startswith("done in ")
    assert len(lines) == 14


def test_plain_progress_prints_steps_in_batches() -> None:
    stream = io.StringIO()
    progress = PlainProgress(stdout=stream, stderr=stream)
    for step in range(1, 51):
        progress.step(step, 50, elapsed_s=2.0 * step)
    steps = [line for line in stream.getvalue().splitlines() if line.startswith("denoising")]
    assert [line.split(",")[0] for line in steps] == [
        f"denoising: step {step}/50" for step in (1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50)
    ]
    assert steps[1] == "denoising: step 5/50, 10.0 s elapsed, 2.00 s/step, about 1:30 left"
    # A worker group's reader may miss steps: a batch still gets its line, from the first step seen in it.
    stream = io.StringIO()
    progress = PlainProgress(stdout=stream, stderr=stream)
    for step in (1, 2, 4, 6, 7, 11, 12, 49, 50):
        progress.step(step, 50, elapsed_s=2.0 * step)
    steps = [line.split(",")[0] for line in stream.getvalue().splitlines() if line.startswith("denoising")]
    assert steps == [f"denoising: step {step}/50" for step in (1, 6, 11, 49, 50)]


def test_quiet_prints_only_the_output_path(capsys, tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "clip.mp4"
    assert main(generate_arguments(tiny_native, out, "--quiet")) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == f"{out}\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--progress", "fancy"],
            "error: argument --progress: invalid choice: 'fancy' (choose from 'auto', 'bar', 'plain', 'json') "
            "(see python -m h3engine generate --help)",
        ),
        (
            ["--quiet", "--progress", "json"],
            "error: --quiet: shows no progress, so it cannot go with --progress json",
        ),
    ],
    ids=["unknown-mode", "quiet-and-json"],
)
def test_bad_progress_options_exit_2_with_one_line(capsys, tmp_path: Path, extra: list, message: str) -> None:
    assert main(generate_arguments(tmp_path / "none", tmp_path / "clip.mp4", *extra)) == 2
    captured = capsys.readouterr()
    assert captured.err == message + "\n"
    assert captured.out == ""


def read_until_exit(master: int, process: subprocess.Popen, timeout: float) -> bytes:
    """Everything the child writes to its terminal until it exits (EIO on the master once it has)."""
    output = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            if process.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed its side
            break
        if not data:
            break
        output.extend(data)
    process.wait(timeout=max(1.0, deadline - time.monotonic()))
    return bytes(output)


def test_a_terminal_gets_progress_bars(tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "clip.mp4"
    master, terminal = pty.openpty()
    termios_size = struct.pack("HHHH", 30, 100, 0, 0)  # rows, columns
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, termios_size)
    command = [sys.executable, "-m", "h3engine", *generate_arguments(tiny_native, out)]
    process = subprocess.Popen(command, cwd=REPOSITORY_ROOT, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    try:
        output = read_until_exit(master, process, timeout=240).decode("utf-8", "replace")
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "\r" in output.replace("\r\n", "\n")  # bars redraw in place
    assert "loading fl2va: 100%|" in output and "6/6" in output
    assert "denoising: 100%|" in output and f"{STEPS}/{STEPS}" in output and "ETA 0:00" in output
    assert "decoding, writing the MP4 [" in output
    assert output.rstrip().endswith(str(out))


def test_bars_draw_on_a_terminal_that_reports_no_size() -> None:
    master, terminal = pty.openpty()  # a fresh pty reports 0 x 0, where tqdm would draw nothing
    stream = os.fdopen(terminal, "w", encoding="utf-8")
    progress = BarProgress(stdout=stream, stderr=stream)
    try:
        progress.prepare("t2va", 4)
        for step in range(1, 5):
            progress.step(step, 4, elapsed_s=2.0 * step)
        progress.close()
        stream.flush()
        # A pty hands its bytes over in pieces (one read returned only the first bar line in a loaded full run).
        chunks = []
        while select.select([master], [], [], 0.5)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        output = b"".join(chunks).decode("utf-8", "replace")
    finally:
        stream.close()
        os.close(master)
    assert "denoising: 100%|" in output and "4/4 [" in output and "2.00 s/step, ETA 0:00" in output


# ---------------------------------------------------------------------------------------------------------------
# Worker groups and the app


def test_a_worker_group_reports_its_loading_whole_and_every_step(
    capsys, tiny_native: Path, tmp_path: Path
) -> None:
    out = tmp_path / "clip.mp4"
    arguments = generate_arguments(tiny_native, out, "--world-size", "2", "--progress", "json")
    assert main(arguments) == 0
    captured = capsys.readouterr()
    events = json_events(captured.out)
    names = [event["event"] for event in events]
    assert names[:3] == ["load_start", "loaded", "prepare"]
    assert {events[0]["component"], events[1]["component"]} == {"worker_group"}
    assert events[1]["devices"] == ["cpu", "cpu"] and events[1]["seconds"] > 0
    steps = [event["step"] for event in events if event["event"] == "step"]
    assert steps == sorted(steps) and steps[-1] == STEPS
    assert names[-3:] == ["decode", "mux", "done"] and events[-1]["path"] == str(out)


def test_the_app_logs_each_component_loaded(caplog, tiny_native: Path, tmp_path: Path) -> None:
    config = app.parse_config(
        ["--checkpoint", str(tiny_native), "--devices", "cpu", "--outputs", str(tmp_path)], {}
    )
    with caplog.at_level(logging.INFO, logger="h3app"):
        engines = app._load_engines(tiny_native, config)
    assert len(engines) == 1
    lines = [record.getMessage() for record in caplog.records if record.name == "h3app"]
    assert [line.split(" (")[0] for line in lines] == [
        "cpu: loaded tokenizer",
        "cpu: loaded text encoder",
        "cpu: loaded processor",
        "cpu: loaded DiT",
        "cpu: loaded video VAE",
        "cpu: loaded audio VAE",
    ]
    assert all(line.endswith(" s") and ", fl2va) in " in line for line in lines)
