"""The app's LoRA panels and the endpoints' `loras` and `rungs` parameters, on a tiny checkpoint with `--lora-dir`:
the parameter's shape and refusals, History restoring the adapters, the API running them (recorded in the sidecar,
the output changed), and in a browser (Debian's chromium) the panel, the Turbo preset and a restore."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _app_helpers import RunningApp, start_app, stop_app
from _browser_helpers import browser_page, needs_chromium, open_advanced, screenshot
from _lora_helpers import random_lora, write_lora
from _refusals import refused, ui_refused
from gradio_client import Client
from gradio_client.exceptions import ValidationError
from safetensors.torch import load_file, save_file

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source
from h3engine.engine.lora.library import LoraLibrary, lora_choices
from h3engine.errors import RequestError
from h3engine.request.checks import parse_rungs
from h3engine.request.model import GenerationRequest, LoraChoice
from h3engine.request.validate import validate
from ui.loras import LORA_SLOTS, lora_values, loras_to_rows, rows_to_loras

SETTINGS = dict(duration_seconds=4, aspect_ratio="auto", randomize_seed=False, seed=5, steps=2)


def lora_folder(checkpoint: Path, folder: Path) -> Path:
    """style.safetensors (no DiT named), ref/only.safetensors (transformer_ref.), turbo.safetensors (Turbo metadata)."""
    layout = detect_layout(checkpoint)
    config = dit_source(layout, layout.for_task("t2va"), torch.float32).config
    (folder / "ref").mkdir(parents=True)
    write_lora(folder / "style.safetensors", random_lora(config, 1), "kohya", config)
    write_lora(folder / "ref" / "only.safetensors", random_lora(config, 2), "diffusers_ref", config)
    turbo = folder / "turbo.safetensors"
    write_lora(turbo, random_lora(config, 3), "original", config)
    metadata = {"minimax_h3": json.dumps({"dmd_denoising_steps": [999, 500], "flow_shift": 5.0})}
    save_file(load_file(str(turbo)), str(turbo), metadata=metadata)
    return folder


@pytest.fixture(scope="module")
def loras(tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_folder(tiny_native, tmp_path_factory.mktemp("loras") / "adapters")


@pytest.fixture(scope="module")
def app(loras: Path, tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApp]:
    """One app over the adapters folder for the API and the browser test (each counts only its own results)."""
    running = start_app(
        tmp_path_factory.mktemp("app_loras"),
        extra_arguments=["--lora-dir", str(loras)],
        checkpoint=tiny_native,
    )
    yield running
    stop_app(running)


def test_the_parameter_becomes_the_requests_adapters_and_back(loras: Path) -> None:
    library = LoraLibrary(loras)
    value = [{"name": "style.safetensors", "strength": 0.5}, {"name": "turbo.safetensors"}]
    choices = lora_choices(value, "t2va", library)
    assert choices == (
        LoraChoice(str(loras / "style.safetensors"), 0.5, "transformer"),
        LoraChoice(str(loras / "turbo.safetensors"), 1.0, "transformer"),
    )
    # The Ref2VA tab puts every adapter on its own DiT.
    assert lora_choices([{"name": "ref/only.safetensors"}], "ref2va", library)[0].target == "transformer_ref"
    request = GenerationRequest(
        task="t2va", prompt="p", loras=choices + (LoraChoice("/elsewhere/x.safetensors"),)
    )
    assert lora_values(request, library) == [
        {"name": "style.safetensors", "strength": 0.5},
        {"name": "turbo.safetensors", "strength": 1.0},
    ]
    assert lora_choices(None, "t2va", library) == () == lora_choices([], "t2va", library)
    refusals = {
        "loras[0].name: no adapter named '../x'; available: ref/only.safetensors, style.safetensors, "
        "turbo.safetensors": [{"name": "../x"}],
        "loras[0].name: 'ref/only.safetensors' is for the transformer_ref DiT; this task runs transformer": [
            {"name": "ref/only.safetensors"}
        ],
        "loras[1]: must be an object {\"name\": ..., \"strength\": ...}, got {'name': 'style.safetensors', "
        "'path': '/etc'}": [{"name": "style.safetensors"}, {"name": "style.safetensors", "path": "/etc"}],
        'loras: must be a list such as [{"name": "style.safetensors", "strength": 0.8}], got 5': 5,
        "loras[0].name: no adapter named 'style'; available: ref/only.safetensors, style.safetensors, "
        "turbo.safetensors": "style",  # a bare name is a list of one
    }
    for message, bad in refusals.items():  # "field: problem", the library's own messages
        field, problem = message.split(": ", 1)
        with refused(RequestError, field=field) as caught:
            lora_choices(bad, "t2va", library)
        assert caught.value.problem == problem
    too_many = lora_choices([{"name": "style.safetensors"}] * 9, "t2va", library)  # the checker counts them
    with refused(RequestError, field="loras"):
        validate(GenerationRequest(task="t2va", prompt="x", loras=too_many))


def test_the_rows_and_the_parameter_mirror_each_other() -> None:
    slots = ["a.safetensors", 0.5, "", 1.0, "b.safetensors", -1.0] + ["", 1.0] * (LORA_SLOTS - 3)
    value = rows_to_loras(*slots)
    assert value == [{"name": "a.safetensors", "strength": 0.5}, {"name": "b.safetensors", "strength": -1.0}]
    updates = loras_to_rows(value)
    rows, values = updates[:LORA_SLOTS], updates[LORA_SLOTS:]
    # The two filled rows and one empty row to add another.
    assert [row.visible for row in rows] == [True, True, True] + [False] * (LORA_SLOTS - 3)
    assert values[:6] == ["a.safetensors", 0.5, "b.safetensors", -1.0, "", 1.0]
    assert rows_to_loras(*values) == value


def test_the_rungs_field() -> None:
    assert parse_rungs("") == () == parse_rungs("  ") == parse_rungs(None)
    assert parse_rungs("999, 750,500") == (999, 750, 500)
    with refused(
        RequestError, field="rungs", says="expected comma-separated integers such as 999,750,500,250"
    ):
        parse_rungs("999;500")


def test_the_api_runs_named_adapters_and_rungs(app: RunningApp, loras: Path, tmp_path: Path) -> None:
    before = app.mp4_files()
    client = Client(app.url, verbose=False, download_files=str(tmp_path / "downloads"))
    base = client.predict(prompt="A kite.", **SETTINGS, api_name="/t2va")
    adapted = client.predict(
        prompt="A kite.",
        loras=[{"name": "style.safetensors", "strength": 0.75}],
        **SETTINGS,
        api_name="/t2va",
    )
    assert adapted[0].startswith("Done"), adapted[0]
    sidecar_path = next(path for path in adapted[5] if path.endswith(".json"))
    sidecar = json.loads(Path(sidecar_path).read_text())
    style = loras / "style.safetensors"
    assert sidecar["request"]["loras"] == [{"path": str(style), "strength": 0.75, "target": "transformer"}]
    assert sidecar["adapters"] == [
        {"file": "style.safetensors", "sha256": hashlib.sha256(style.read_bytes()).hexdigest()}
        | {"strength": 0.75, "target": "transformer"}
    ]
    assert Path(adapted[2]).read_bytes() != Path(base[2]).read_bytes()  # the video files
    # Turbo rungs through the API: two forwards.
    turbo = client.predict(prompt="A kite.", rungs="999,500", **SETTINGS, api_name="/t2va")
    assert turbo[0].startswith("Done"), turbo[0]
    with pytest.raises(ValidationError) as invalid:
        client.predict(
            prompt="A kite.", loras=[{"name": "missing.safetensors"}], **SETTINGS, api_name="/t2va"
        )
    assert "'missing.safetensors'" in ui_refused(invalid.value, "loras")
    with pytest.raises(ValidationError) as invalid:
        client.predict(prompt="A kite.", rungs="999,500", **(SETTINGS | {"steps": 3}), api_name="/t2va")
    ui_refused(invalid.value, "steps")
    # A file gone from the folder: the request names it and nothing is written.
    moved = tmp_path / "moved.safetensors"
    shutil.copyfile(style, moved)
    style.unlink()
    try:
        with pytest.raises(ValidationError) as invalid:
            client.predict(
                prompt="A kite.", loras=[{"name": "style.safetensors"}], **SETTINGS, api_name="/t2va"
            )
        assert "'style.safetensors'" in ui_refused(invalid.value, "loras")
    finally:
        shutil.move(moved, style)
    assert len(app.mp4_files() - before) == 3


def test_a_missing_lora_folder_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    from _app_helpers import REPOSITORY_ROOT

    done = subprocess.run(
        [
            sys.executable,
            str(REPOSITORY_ROOT / "app.py"),
            "--lora-dir",
            str(tmp_path / "nope"),
            "--devices",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr == f"error: --lora-dir: no such folder: {tmp_path / 'nope'}\n"


@needs_chromium
def test_the_panel_the_turbo_preset_and_a_restore_in_a_browser(app: RunningApp, loras: Path) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url) as page:
        page.locator("#t2va-prompt textarea").fill("A kite over the sea.")
        page.locator("#t2va-loras").get_by_text("LoRA adapters").click()
        expect(page.locator("#t2va-lora-note")).to_contain_text(
            "2 of 3 adapter(s) in adapters fit this tab's DiT"
        )
        # The Text tab offers the adapters that fit its DiT: not the transformer_ref one.
        page.locator("#t2va-lora-0 input").click()
        options = page.get_by_role("option")
        expect(options).to_have_count(3)  # none, style, turbo
        page.get_by_role("option", name="turbo.safetensors", exact=False).click()
        expect(page.locator("#t2va-lora-row-1")).to_be_visible()  # a row to add another
        page.locator("#t2va-lora-strength-0 input[type=number]").fill("0.6")
        page.locator("#t2va-lora-strength-0 input[type=number]").press("Tab")
        page.locator("#t2va-turbo").click()
        expect(page.locator("#t2va-lora-note")).to_contain_text(
            "Turbo preset: 2 steps, flow shifts 5 / 3, rungs 999, 500 (from turbo.safetensors's metadata)"
        )
        open_advanced(page, "t2va")
        expect(page.locator("#t2va-steps input")).to_have_value("2")
        expect(page.locator("#t2va-rungs textarea")).to_have_value("999,500")
        screenshot(page, "loras-turbo", readme=True)
        page.locator("#t2va-randomize input").uncheck()
        page.locator("#t2va-generate").click()
        expect(page.locator("#h3-status")).to_contain_text("Done", timeout=120_000)
        sidecar = next(
            json.loads(path.read_text())
            for path in app.outputs_dir.rglob("*.json")
            if '"A kite over the sea."' in path.read_text()
        )
        assert sidecar["request"]["loras"] == [
            {"path": str(loras / "turbo.safetensors"), "strength": 0.6, "target": "transformer"}
        ]
        assert sidecar["request"]["rungs"] == [999, 500] and sidecar["request"]["flow_shift"] == 5.0

        # Emptied panel and fields; History's row brings the adapter, its strength and the rungs back.
        page.locator("#t2va-lora-0 input").click()
        page.get_by_role("option", name="none", exact=True).click()
        expect(page.locator("#t2va-lora-row-1")).to_be_hidden()
        page.locator("#t2va-rungs textarea").fill("")
        page.locator("#h3-history tbody tr", has_text="A kite over the sea.").first.click()
        expect(page.locator("#t2va-lora-0 input")).to_have_value(
            re.compile(r"^turbo\.safetensors \(\d+ KiB · Turbo\)$")
        )
        expect(page.locator("#t2va-lora-strength-0 input[type=number]")).to_have_value("0.6")
        expect(page.locator("#t2va-rungs textarea")).to_have_value("999,500")
