"""Boundary capture: a request's tensors at fixed points, written as safetensors plus a JSON index.

`capturing(Capture(folder, steps))` makes a capture active for the block; the pipeline calls `record(...)` at each
boundary (`BOUNDARIES`, in order) and does nothing else while none is active (one global read). Per-step boundaries
carry the step (the forward's index, 0-based) and are kept only for the steps the selection names
(`parse_steps`: "all", "none", "first", "last", "0,2,-1", "1-3"). `Capture.finish(record)` writes `index.json`:
the request, the versions, the seeds and each boundary's file and tensors. The reference runner writes the same
names, so two captures compare boundary by boundary (h3engine.cli.validation.compare). A worker group's rank 0 records
its job's (`group_capture`); on the split layout each stage group's rank 0 records its own steps' (`stage_capture`)
and the front writes the one index (`finish_stage_captures`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# In the order a request crosses them; the per-step ones repeat for each selected step.
BOUNDARIES = (
    "processor_tokens",
    "text_states",
    "condition_rows",
    "initial_noise",
    "packed_layout",
    "dit_prediction",
    "scheduler_output",
    "final_latents",
    "decoded_frames",
    "waveform",
)
PER_STEP = ("dit_prediction", "scheduler_output")
INDEX_NAME = "index.json"
# A split stage's entries of a step that ended its job without a report: "<step>_unreported.json" until the index.
UNREPORTED_SUFFIX = "_unreported.json"

_lock = threading.Lock()
_active: Capture | None = None


def parse_steps(text: str) -> tuple[str, ...]:
    """A `--capture-steps` text -> its parts (ValueError naming the bad part); `selected` applies them."""
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    if not parts:
        raise ValueError(
            "expected all, none, first, last, step numbers (0 is the first forward, -1 the last) or A-B"
        )
    for part in parts:
        if part in ("all", "none", "first", "last"):
            continue
        start, dash, stop = part.lstrip("-").partition("-")
        try:
            int(part) if not dash else (int(start), int(stop))
        except ValueError:
            raise ValueError(
                f"'{part}' is not all, none, first, last, a step number or a range A-B"
            ) from None
    return parts


def selected(parts: tuple[str, ...], step: int, total: int) -> bool:
    """Whether forward `step` (0-based) of `total` is in the selection `parts`."""
    for part in parts:
        if part == "all" or (part == "first" and step == 0) or (part == "last" and step == total - 1):
            return True
        if part in ("none", "first", "last"):
            continue
        start, dash, stop = part.lstrip("-").partition("-")
        if dash and not part.startswith("-"):
            if int(start) <= step <= int(stop):
                return True
        elif int(part) % total == step:
            return True
    return False


class Capture:
    """One request's boundaries under `folder` (created, must be empty or absent); `prefix` starts its file names
    (a split stage's own files, beside the other stages')."""

    def __init__(self, folder: str | Path, steps: tuple[str, ...] = ("all",), prefix: str = "") -> None:
        self.folder = Path(folder)
        self.steps = steps
        self.prefix = prefix
        self.entries: list[dict[str, Any]] = []

    def prepare(self) -> None:
        """Create the folder; refuse one that already holds files (ValueError naming it)."""
        if self.folder.exists() and (not self.folder.is_dir() or any(self.folder.iterdir())):
            raise ValueError(f"{self.folder} exists and is not an empty folder")
        self.folder.mkdir(parents=True, exist_ok=True)

    def wants(self, step: int, total: int) -> bool:
        return selected(self.steps, step, total)

    def record(self, name: str, tensors: dict[str, torch.Tensor], step: int | None = None) -> None:
        from safetensors.torch import save_file

        if name not in BOUNDARIES:
            raise ValueError(f"unknown boundary '{name}'")
        host = {key: value.detach().to("cpu").contiguous().clone() for key, value in tensors.items()}
        file = (
            f"{self.prefix}{len(self.entries):03d}_{name}"
            + ("" if step is None else f"_step{step:03d}")
            + ".safetensors"
        )
        save_file(host, str(self.folder / file))
        described = {
            key: {"shape": list(value.shape), "dtype": str(value.dtype)} for key, value in host.items()
        }
        self.entries.append({"name": name, "step": step, "file": file, "tensors": described})

    def finish(self, record: dict[str, Any]) -> Path:
        """Write the index (`record`: the request, versions, seeds...) and return its path."""
        index = {**record, "boundaries": self.entries}
        path = self.folder / INDEX_NAME
        path.write_text(json.dumps(index, indent=2, default=str) + "\n", encoding="utf-8")
        return path


@contextmanager
def capturing(capture: Capture | None) -> Iterator[Capture | None]:
    """Make `capture` the active one for the block (None: nothing changes)."""
    global _active
    if capture is None:
        yield None
        return
    with _lock:
        if _active is not None:
            raise RuntimeError("a capture is already active in this process")
        _active = capture
    try:
        yield capture
    finally:
        _active = None


def active() -> Capture | None:
    """The active capture, None almost always (the pipeline's guard)."""
    return _active


def record(name: str, step: int | None = None, total: int | None = None, **tensors: torch.Tensor) -> None:
    """Record a boundary on the active capture (nothing without one; a per-step one only for selected steps)."""
    capture = _active
    if capture is None or (step is not None and not capture.wants(step, total)):
        return
    capture.record(name, tensors, step)


def index_record(request: Any, runner: str, steps: str) -> dict[str, Any]:
    """What an index says about the run besides its boundaries: the runner, the request, seeds and versions."""
    from dataclasses import asdict

    return {
        "runner": runner,
        "request": asdict(request),
        "seeds": {"seed": request.seed, "recipe": request.recipe},
        "capture_steps": steps,
        "versions": versions(),
    }


@dataclass(frozen=True)
class CaptureSpec:
    """A worker group job's capture, carried in its command (`RunJob.capture`): the folder and the step selection."""

    folder: str
    steps: str = "all"


@contextmanager
def group_capture(rank: int, request: Any, spec: CaptureSpec | None) -> Iterator[Capture | None]:
    """A worker group's job: rank 0 records into the folder its job names (the other ranks, and a job without a
    capture, record nothing) and writes the index after the job."""
    if rank != 0 or spec is None:
        yield None
        return
    steps = spec.steps
    capture = Capture(spec.folder, parse_steps(steps))
    record = index_record(request, "h3engine (worker group, rank 0)", steps)
    try:
        with capturing(capture):
            yield capture
    except BaseException as error:  # the boundaries reached so far stay readable
        capture.finish({**record, "failed": f"{type(error).__name__}: {error}"})
        raise
    capture.finish(record)


@contextmanager
def stage_capture(step: str, rank: int, spec: CaptureSpec | None) -> Iterator[list[dict[str, Any]]]:
    """A split stage group's `step` of a job: its rank 0 records into the folder the job names, its files named
    after the step. Yields the step's index entries (filled as it records; empty elsewhere), which its report
    carries to the front (`StageDone.captured`) for `finish_stage_captures`."""
    if rank != 0 or spec is None:
        yield []
        return
    capture = Capture(spec.folder, parse_steps(spec.steps), prefix=f"{step}_")
    with capturing(capture):
        yield capture.entries


def keep_unreported(spec: CaptureSpec, step: str, entries: list[dict[str, Any]]) -> None:
    """A split stage's `step` that ends its job without a report (it failed, or was cancelled): its rank 0 leaves
    the entries it recorded beside its files, for the index the front writes (`finish_stage_captures`)."""
    if entries:
        (Path(spec.folder) / f"{step}{UNREPORTED_SUFFIX}").write_text(json.dumps(entries))


def finish_stage_captures(
    spec: CaptureSpec,
    request: Any,
    parts: list[list[dict[str, Any]]],
    failed: str | None = None,
    unreported_steps: tuple[str, ...] = (),
) -> Path:
    """The split layout's index, written by the front once the job ended: the entries each stage reported, in the
    job's order (`parts`), then (a job that did not finish: `failed` says how) those the steps that reported nothing
    left behind (`keep_unreported`), in `unreported_steps`' order."""
    capture = Capture(spec.folder, parse_steps(spec.steps))
    capture.entries = [entry for part in parts for entry in part]
    for step in unreported_steps:
        left = Path(spec.folder) / f"{step}{UNREPORTED_SUFFIX}"
        if left.exists():
            if failed is not None:
                capture.entries += json.loads(left.read_text())
            left.unlink()
    record = index_record(request, "h3engine (split stage groups, each group's rank 0)", spec.steps)
    return capture.finish(record if failed is None else {**record, "failed": failed})


def versions() -> dict[str, str]:
    """The versions a capture was made with (torch, the engine, diffusers when installed)."""
    from importlib import metadata

    found = {"torch": torch.__version__}
    for package in ("h3engine", "diffusers", "transformers", "safetensors"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def record_request_start(
    condition_video_rows: torch.Tensor, condition_audio_rows: torch.Tensor, noise: Any, layout: Any
) -> None:
    """The boundaries before the first step: condition rows (when any), the seed's noise, the packed layout."""
    if condition_video_rows.numel() or condition_audio_rows.numel():
        record("condition_rows", video=condition_video_rows, audio=condition_audio_rows)
    record("initial_noise", video=noise.video_rows, audio=noise.audio_rows)
    fields = ("tags", "positions", "video_index", "audio_index", "text_index")
    record("packed_layout", **{name: getattr(layout, name) for name in fields})


def record_step(step: int, total: int, generated: tuple[int, int], *rows: torch.Tensor) -> None:
    """One step's DiT predictions (of the generated rows already) and scheduler outputs (all rows; `generated`: the
    first generated one of each modality), generated rows only."""
    video_velocity, audio_velocity, video_rows, audio_rows = rows
    first_video, first_audio = generated
    record("dit_prediction", step, total, video=video_velocity, audio=audio_velocity)
    record("scheduler_output", step, total, video=video_rows[first_video:], audio=audio_rows[first_audio:])
