"""How `python -m h3engine generate` shows its progress: tqdm bars, plain lines, JSON lines, or nothing.

`--progress auto` (default): bars on stderr when stderr is a terminal, else plain lines there (no carriage
returns); `bar` / `plain` force one; `json`: one JSON object per line on stdout, and nothing else there (stderr
keeps the one-line errors). `--quiet`: only warnings and errors on stderr, and the output path on stdout, which
the other modes but `json` print too (there the `done` event carries it). The phases: checkpoint loading per
component (a worker group loads in its own processes and counts as one component, `worker_group`), preparing
(inputs, conditioning, prompt), the denoising steps (rate and ETA from the engine's own clock), decode (the MP4 is
written while the video decodes), mux (the files are complete), done.
JSON events: `load_start` / `loaded` (component, partition, index, total; `loaded` adds seconds), `prepare` (task,
steps), `step` (step, total, elapsed_s, eta_s, steps_per_s), `decode`, `mux` (seconds, timings_s: the sidecar's
decode and mux timings), `done` (path, sidecar, seconds), `warning` (message), `error` (message, exit_code); each
also has `t_s`, seconds since the run began. Steps come in order; a worker group may skip some.
The same phrases serve the app's start-up log (`load_line`).
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # importing the model store imports torch, which the CLI's early checks never pay for
    from tqdm import tqdm

    from h3engine.engine.model_store import LoadEvent

PROGRESS_MODES = ("auto", "bar", "plain", "json")
COMPONENT_LABELS = {
    "tokenizer": "tokenizer",
    "text_encoder": "text encoder",
    "processor": "processor",
    "dit": "DiT",
    "video_vae": "video VAE",
    "audio_vae": "audio VAE",
    "worker_group": "worker group",
}
# Sidecar timings that belong to the decode and mux phase.
DECODE_TIMINGS = ("audio_decode_s", "video_decode_s", "decode_s", "mux_s", "mux_after_decode_s")
# Plain mode prints the first step, the last, and about this many in between.
PLAIN_STEP_LINES = 10
BAR_REFRESH_S = 0.5
DEFAULT_SIZE = (80, 24)  # columns, lines


def load_line(event: LoadEvent) -> str:
    """One line for a component loaded (the app's log; the CLI's plain mode says the same)."""
    return _loaded_text(event.component, event.index, event.total, event.partition, event.seconds)


def _loaded_text(component: str, index: int, total: int, partition: str, seconds: float) -> str:
    label = COMPONENT_LABELS.get(component, component)
    return f"loaded {label} ({index}/{total}, {partition}) in {seconds:.2f} s"


def _terminal_size(stream: TextIO) -> tuple[int, int]:
    try:
        return tuple(os.get_terminal_size(stream.fileno()))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return (0, 0)


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def _rate(steps_per_s: float) -> str:
    return f"{steps_per_s:.2f} steps/s" if steps_per_s >= 1 else f"{1 / steps_per_s:.2f} s/step"


class Progress:
    """The phases of one run; this base class shows nothing but warnings (`--quiet`). Not thread-safe: call it from
    the thread that runs the generation (the engine's `on_step` and `on_load` run there)."""

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.started = time.perf_counter()
        self._decode_started: float | None = None

    # --- what the CLI calls ---------------------------------------------------------------------------------

    def load_event(self, event: LoadEvent) -> None:
        """The engine's `on_load` (h3engine.engine.model_store.LoadEvent)."""
        fields = {
            "component": event.component,
            "partition": event.partition,
            "index": event.index,
            "total": event.total,
        }
        if event.seconds is None:
            self._emit("load_start", fields)
        else:
            self._emit("loaded", {**fields, "seconds": round(event.seconds, 3)})

    def group_loading(self, devices: tuple[str, ...], layout: str) -> None:
        fields = {"component": "worker_group", "partition": "all", "index": 1, "total": 1}
        self._emit("load_start", {**fields, "devices": list(devices), "layout": layout})

    def group_loaded(self, devices: tuple[str, ...], layout: str, seconds: float) -> None:
        fields = {"component": "worker_group", "partition": "all", "index": 1, "total": 1}
        self._emit(
            "loaded", {**fields, "devices": list(devices), "layout": layout, "seconds": round(seconds, 3)}
        )

    def memory_plan(self, lines: list[str]) -> None:
        """The engine's memory plan in words (h3engine.memory), once it is loaded."""
        self._emit("memory_plan", {"lines": lines})

    def prepare(self, task: str, steps: int) -> None:
        self._emit("prepare", {"task": task, "steps": steps})

    def step(self, step: int, total: int, elapsed_s: float, eta_s: float | None = None) -> None:
        """After denoising step `step` of `total`; the decode starts right after the last one."""
        if eta_s is None:
            eta_s = elapsed_s / step * (total - step)
        steps_per_s = step / elapsed_s if elapsed_s > 0 else 0.0
        fields = {"step": step, "total": total, "elapsed_s": round(elapsed_s, 3), "eta_s": round(eta_s, 3)}
        self._emit("step", {**fields, "steps_per_s": round(steps_per_s, 4)})
        if step == total:
            self._decode()

    def finished(self, video: Path, sidecar: Path, timings_s: dict[str, float]) -> None:
        """The MP4 and its sidecar are complete (`timings_s`: the sidecar's)."""
        if self._decode_started is None:  # a worker group's reader may have missed the last step
            self._decode()
        decode_timings = {name: round(timings_s[name], 3) for name in DECODE_TIMINGS if name in timings_s}
        seconds = time.perf_counter() - self._decode_started
        self._emit("mux", {"seconds": round(seconds, 3), "timings_s": decode_timings})
        self._emit("done", {"path": str(video), "sidecar": str(sidecar), "seconds": round(self._since(), 3)})
        self._print_path(video)

    def warning(self, message: str) -> None:
        self._emit("warning", {"message": message})

    def failed(self, line: str, exit_code: int) -> None:
        """The run ends with `line` (already formatted, `error: ...`), which the caller prints on stderr."""
        self.close()
        self._emit("error", {"message": line, "exit_code": exit_code})

    def close(self) -> None:
        """Stop drawing (idempotent)."""

    # --- what each mode shows -------------------------------------------------------------------------------

    def _decode(self) -> None:
        self._decode_started = time.perf_counter()
        self._emit("decode", {})

    def _since(self) -> float:
        return time.perf_counter() - self.started

    def _print_path(self, video: Path) -> None:
        print(video, file=self.stdout, flush=True)

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if event == "warning":
            print(f"warning: {fields['message']}", file=self.stderr, flush=True)


class JsonProgress(Progress):
    """One JSON object per line on stdout; the path travels in `done`."""

    def _print_path(self, video: Path) -> None:
        pass

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        record = {"event": event, **fields, "t_s": round(self._since(), 3)}
        print(json.dumps(record, ensure_ascii=False), file=self.stdout, flush=True)


class PlainProgress(Progress):
    """Plain lines on stderr: one per component, phase and batch of steps."""

    _last_step = 0

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        line = self._line(event, fields)
        if line is not None:
            print(line, file=self.stderr, flush=True)

    def _line(self, event: str, fields: dict[str, Any]) -> str | None:
        if event == "load_start" and fields["component"] == "worker_group":
            return f"starting a worker group on {', '.join(fields['devices'])} ({fields['layout']})"
        if event == "load_start":
            return (
                f"loading the {fields['partition']} models ({fields['total']} components)"
                if fields["index"] == 1
                else None
            )
        if event == "loaded":
            return _loaded_text(
                *(fields[name] for name in ("component", "index", "total", "partition", "seconds"))
            )
        if event == "memory_plan":
            return "\n".join(fields["lines"])
        if event == "prepare":
            return f"preparing {fields['task']}: reading the inputs, encoding the prompt ({fields['steps']} steps)"
        if event == "step":
            # A line when a step crosses into the next batch (a worker group's reader may miss single steps).
            step, total, last = fields["step"], fields["total"], self._last_step
            every = max(1, total // PLAIN_STEP_LINES)
            self._last_step = step
            if step not in (1, total) and step // every == last // every:
                return None
            rate = _rate(fields["steps_per_s"]) if fields["steps_per_s"] else "-"
            return (
                f"denoising: step {step}/{total}, {fields['elapsed_s']:.1f} s elapsed, {rate}, "
                f"about {_clock(fields['eta_s'])} left"
            )
        if event == "decode":
            return "decoding the video and the audio, writing the MP4"
        if event == "mux":
            return f"decoded and written in {fields['seconds']:.1f} s"
        if event == "done":
            return f"done in {fields['seconds']:.1f} s"
        if event == "warning":
            return f"warning: {fields['message']}"
        return None


class BarProgress(Progress):
    """tqdm bars on stderr, one phase at a time, redrawn every BAR_REFRESH_S so that the clock moves while a large
    component loads or a slow step runs."""

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        super().__init__(stdout, stderr)
        self._bar: tqdm | None = None
        self._phase = ""
        self._resume_prepare: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="cli-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(BAR_REFRESH_S):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()

    def _open(self, phase: str, desc: str, total: int | None, bar_format: str, leave: bool = True) -> None:
        from tqdm import tqdm

        self._close_bar()
        self._phase = phase
        # A terminal that reports no size (a bare pty) would get no bars at all: draw those on 80 x 24.
        known_size = min(_terminal_size(self.stderr)) > 0
        self._bar = tqdm(
            total=total,
            desc=desc,
            file=self.stderr,
            bar_format=bar_format,
            leave=leave,
            dynamic_ncols=known_size,
            ncols=None if known_size else DEFAULT_SIZE[0],
            nrows=None if known_size else DEFAULT_SIZE[1],
        )

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar, self._phase = None, ""

    def close(self) -> None:
        with self._lock:
            self._close_bar()
        self._stop.set()

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        with self._lock:
            self._draw(event, fields)

    def _draw(self, event: str, fields: dict[str, Any]) -> None:
        counted = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
        label = COMPONENT_LABELS.get(fields.get("component", ""), fields.get("component"))
        if event == "load_start":
            if self._phase != "load":
                if self._phase == "prepare":
                    self._resume_prepare = (self._bar.desc, int(self._bar.total))
                group = fields["component"] == "worker_group"
                desc = "starting the worker group" if group else f"loading {fields['partition']}"
                self._open("load", desc, fields["total"], counted)
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(fields["index"] - 1 - self._bar.n)
        elif event == "loaded" and self._phase == "load":
            self._bar.set_postfix_str(f"{label} {fields['seconds']:.1f} s", refresh=False)
            self._bar.update(fields["index"] - self._bar.n)
            if fields["index"] == fields["total"]:
                self._close_bar()
                if self._resume_prepare is not None:
                    self._open("prepare", *self._resume_prepare, counted)
                    self._resume_prepare = None
        elif event == "prepare":
            self._open("prepare", f"preparing {fields['task']}", fields["steps"], counted)
        elif event == "step":
            if self._phase not in ("prepare", "denoise"):
                self._open("denoise", "denoising", fields["total"], counted)
            self._phase = "denoise"
            self._bar.set_description_str("denoising", refresh=False)
            rate = _rate(fields["steps_per_s"]) if fields["steps_per_s"] else "-"
            self._bar.set_postfix_str(f"{rate}, ETA {_clock(fields['eta_s'])}", refresh=False)
            self._bar.update(fields["step"] - self._bar.n)
        elif event == "decode":
            self._open("decode", "decoding, writing the MP4", None, "{desc} [{elapsed}]")
        elif event == "mux":
            self._close_bar()
        elif event == "done":
            print(f"done in {fields['seconds']:.1f} s", file=self.stderr, flush=True)
        elif event in ("warning", "memory_plan"):
            from tqdm import tqdm

            lines = fields["lines"] if event == "memory_plan" else [f"warning: {fields['message']}"]
            for line in lines:
                tqdm.write(line, file=self.stderr)


def make_progress(mode: str, quiet: bool) -> Progress:
    """The `Progress` of `--progress MODE` (one of PROGRESS_MODES) and `--quiet`, on this process's streams."""
    if quiet:
        return Progress()
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "plain"
    return {"bar": BarProgress, "plain": PlainProgress, "json": JsonProgress}[mode]()
