"""Helpers of the worker-group tests (tests/test_runtime_workers.py and tests/test_split_stages.py on the CPU,
tests/test_runtime_gpu.py on GPUs)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import JobHandle
from h3engine.runtime.messages import TERMINAL_EVENTS, StepProgress


def events_until_done(handle: JobHandle, timeout_s: float) -> list:
    """Every message of the job up to its terminal one; fails when none comes within `timeout_s`."""
    events = []
    while not events or not isinstance(events[-1], TERMINAL_EVENTS):
        event = handle.next_event(timeout=timeout_s)
        assert event is not None, f"no message within {timeout_s} s; so far: {events}"
        events.append(event)
    return events


def wait_for_step(handle: JobHandle, step: int, timeout_s: float) -> None:
    """Read the job's messages until it reports `step`; fails if it ends or stalls first."""
    while True:
        event = handle.next_event(timeout=timeout_s)
        assert event is not None and not isinstance(event, TERMINAL_EVENTS), event
        if isinstance(event, StepProgress) and event.step >= step:
            return


def max_relative_errors(got_path: Path, expected_path: Path) -> dict[str, float]:
    """max |got - expected| / max |expected| of each tensor of two `--save-tensors` files (same names and shapes)."""
    got, expected = load_file(got_path), load_file(expected_path)
    assert set(got) == set(expected) == {"video", "audio", "video_latents", "audio_latents"}
    errors = {}
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        errors[name] = ((got[name] - tensor).abs().max() / tensor.abs().max()).item()
    return errors


def process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended (not yet reaped)
    except OSError:
        return False


def still_running(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The processes of `pids` that have not ended after waiting up to `within_s` for all of them."""
    deadline = time.monotonic() + within_s
    while any(process_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if process_exists(pid)]


ASSETS = Path(__file__).resolve().parent.parent / "assets"


def parity_requests(steps: int, seed: int) -> dict[str, GenerationRequest]:
    """task -> the request a worker test compares with the in-process engine: T2VA, FL2VA (a keyframe PNG) and
    Ref2VA (an image and an audio reference), 4 s each."""
    common = {"steps": steps, "seed": seed, "duration_seconds": 4.0}
    return {
        "t2va": GenerationRequest(task="t2va", prompt="a red kite over the hills", **common),
        "fl2va": GenerationRequest(
            task="fl2va",
            prompt="<Picture 1> the kite rises with the sun",
            keyframes=(Keyframe(str(ASSETS / "fl2va" / "first.png"), "first"),),
            **common,
        ),
        "ref2va": GenerationRequest(
            task="ref2va",
            prompt="<Picture 1> sings <Audio 1>",
            references=(
                Reference("image", str(ASSETS / "ref2va" / "picture1.png")),
                Reference("audio", str(ASSETS / "ref2va" / "audio1.wav")),
            ),
            **common,
        ),
    }


def at_path(value: Any, path: str) -> Any:
    """The item at a dotted path (h3engine.runtime.stages.detach_tensors's): dataclass attributes, list and tuple
    indices, dict keys."""
    for part in path.split("."):
        if isinstance(value, dict):
            value = value[part]
        elif isinstance(value, (list, tuple)):
            value = value[int(part)]
        else:
            value = getattr(value, part)
    return value
