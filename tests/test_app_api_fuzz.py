"""Generated malformed API calls: each one is refused before queueing with a ValidationError naming its field.

Cases are drawn from the three endpoints' parameters (tests/test_fuzz_inputs.py does the same for request payloads
and the command line): one parameter at a time set to a wrong type, an out-of-range number or an unknown choice;
prompts that are empty, too long, of the wrong type or carry reserved tokens (lone surrogates cannot travel in the
client's JSON: tests/test_fuzz_inputs.py has them); broken reference uploads (empty, truncated, not an image, too
small). Each must raise gradio_client's ValidationError that marks the parameter (and it alone), within `CASE_SECONDS`, and no result may be written. Broken FL2VA frames: tests/test_app_api.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from _app_helpers import ASSETS
from _refusals import ui_refused
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from PIL import Image

CASE_SECONDS = 5.0
SEED = 20261204
SETTINGS = dict(duration_seconds=5, aspect_ratio="auto", seed=1, randomize_seed=False, steps=2)
BAD_SETTINGS = {
    "duration_seconds": [3, 15.5, -1, 0, "five", None, [], 1e300],
    "aspect_ratio": ["7:5", "", "16/9", 169, None, "AUTO"],
    "seed": [-1, 2.5, "abc", 2**64, None],
    "randomize_seed": ["no", 2, None, []],
    # None is no value: the checkpoint's own count (50, or a step-distilled checkpoint's), as from every door.
    "steps": [0, -1, 2.5, 5000, "ten", 10**15],
    "flow_shift": [0, -1.0, "x", 1e9, None],
    "audio_flow_shift": [0, -3.0, [], 1e9],
    "short_edge": [0, -768, 100_000, 7.5, "big"],
}
BAD_PROMPTS = ["", "   ", "x" * 40_000, "<|vision_start|> smuggled", ["x"], 7, None]


# What a parameter is called in the messages: itself, or the request field it becomes.
@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


@pytest.fixture(scope="module")
def bad_uploads(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("uploads")
    picture = (ASSETS / "ref2va" / "picture1.png").read_bytes()
    uploads = {"empty.png": b"", "truncated.png": picture[:100], "text.png": b"no picture\n" * 20}
    for name, data in uploads.items():
        (folder / name).write_bytes(data)
    Image.new("RGB", (2, 2)).save(folder / "two-pixels.png")
    return {name: folder / name for name in [*uploads, "two-pixels.png"]}


def generated_calls(bad_uploads: dict[str, Path]) -> list[tuple[str, str, dict, str]]:
    """(case name, endpoint, arguments, pattern of the name the message must give)."""
    chooser = random.Random(SEED)
    picture = handle_file(ASSETS / "ref2va" / "picture1.png")
    bases = {
        "/t2va": dict(prompt="A kite.", **SETTINGS),
        "/fl2va": dict(
            prompt="A kite.",
            first_image=handle_file(ASSETS / "fl2va" / "first.png"),
            last_image=None,
            **SETTINGS,
        ),
        "/ref2va": dict(
            prompt="<Picture 1> waves.", references=[picture], duration_from_reference=False, **SETTINGS
        ),
    }
    calls = []
    for endpoint, base in bases.items():
        for parameter, values in BAD_SETTINGS.items():
            for value in values:
                calls.append(
                    (f"{endpoint}-{parameter}={value!r}", endpoint, {**base, parameter: value}, parameter)
                )
        for prompt in BAD_PROMPTS:
            calls.append(
                (f"{endpoint}-prompt={str(prompt)[:20]!r}", endpoint, {**base, "prompt": prompt}, "prompt")
            )
    for name, path in bad_uploads.items():
        references = [picture, handle_file(path)]
        calls.append(
            (f"/ref2va-ref={name}", "/ref2va", {**bases["/ref2va"], "references": references}, "references")
        )
    for value in ("yes", 1, None):
        arguments = {**bases["/ref2va"], "duration_from_reference": value}
        calls.append((f"/ref2va-from-reference={value!r}", "/ref2va", arguments, "duration_from_reference"))
    chooser.shuffle(calls)
    return calls


def test_a_hundred_generated_api_calls_are_refused_naming_their_parameter(app, bad_uploads, tmp_path) -> None:
    client = Client(app.url, verbose=False, download_files=str(tmp_path))
    calls = generated_calls(bad_uploads)
    assert len(calls) >= 100
    before = app.mp4_files()
    for name, endpoint, arguments, parameter in calls:
        started = time.perf_counter()
        with pytest.raises(ValidationError) as refused:
            client.predict(**arguments, api_name=endpoint)
        elapsed = time.perf_counter() - started
        ui_refused(refused.value, parameter)
        assert elapsed < CASE_SECONDS, f"{name}: {elapsed:.1f} s"
    assert app.mp4_files() == before
