"""Few-step Turbo generation: a request's own `rungs`, a LoRA folder as the app lists it, and the Turbo preset (from an
adapter's `minimax_h3` metadata, else the table) on the CLI; the app's panel is tested in test_app_loras.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _lora_helpers import random_lora, write_lora
from _refusals import cli_refused, refused
from safetensors.torch import load_file, save_file

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.cli import main as cli
from h3engine.engine.engine import Engine
from h3engine.engine.lora.library import TURBO_TABLE, LoraLibrary, TurboSettings, file_turbo, turbo_settings
from h3engine.engine.resolved import effective_rungs
from h3engine.errors import RequestError
from h3engine.models.dit_config import DiTConfig
from h3engine.request.model import GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.request.validate import validate

RUNGS = (999, 750, 500, 250)


def request(**fields: object) -> GenerationRequest:
    values = dict(task="t2va", prompt="a fox in the snow", duration_seconds=4.0, steps=4, seed=7) | fields
    return GenerationRequest(**values)


def dit_config(checkpoint: Path) -> DiTConfig:
    layout = detect_layout(checkpoint)
    return dit_source(layout, layout.for_task("t2va"), torch.float32).config


def with_metadata(path: Path, **metadata: str) -> Path:
    save_file(load_file(str(path)), str(path), metadata=metadata)
    return path


def turbo_json(**fields: object) -> str:
    return json.dumps(fields)


# --- the request's rungs --------------------------------------------------------------------------------------------


def test_rungs_round_trip_and_fix_the_step_count() -> None:
    turbo = request(rungs=RUNGS)
    assert validate(turbo) == []
    assert from_dict(json.loads(json.dumps(turbo.to_dict()))) == turbo
    assert turbo.to_dict()["rungs"] == list(RUNGS) and request().to_dict()["rungs"] == []
    # The diffusers recipe counts the terminal grid point: 4 rungs are 5 of its steps.
    assert validate(request(rungs=RUNGS, steps=5, recipe="diffusers")) == []
    # The rungs' own rules, with their wording; the step count they fix is test_dmd_rungs.py's rule (its wording
    # is checked there).
    cases = [
        (request(rungs=RUNGS, steps=8), "steps", None),
        (request(rungs=RUNGS, recipe="diffusers"), "steps", None),
        (request(rungs=(250, 500), steps=2), "rungs", "must be strictly decreasing integers in (0, 1000], got [250, 500] (list)"),
        (request(rungs=(1001,), steps=1), "rungs", "must be strictly decreasing integers in (0, 1000], got [1001] (list)"),
        (request(rungs="999"), "rungs", "must be a list of timesteps such as [999, 750, 500, 250], got '999'"),
    ]  # fmt: skip
    for bad, field, problem in cases:
        with refused(RequestError, field=field) as caught:
            validate(bad)
        assert problem is None or caught.value.problem == problem


def test_a_distilled_checkpoint_runs_only_its_own_rungs() -> None:
    assert effective_rungs((), None) is None
    assert effective_rungs(RUNGS, None) == RUNGS
    assert effective_rungs((), RUNGS) == RUNGS and effective_rungs(RUNGS, RUNGS) == RUNGS
    with refused(RequestError, field="rungs", says="this checkpoint is step-distilled to the rungs 999, 750"):
        effective_rungs((900, 100), RUNGS)


def test_a_request_with_rungs_equals_a_checkpoint_distilled_on_them(
    tiny_native: Path, tmp_path: Path
) -> None:
    """The same weights (seed 0): rungs asked for by the request, or declared by the checkpoint, give equal tensors;
    the request's grid is the rungs, not the 4-step grid."""
    distilled = Engine.from_checkpoint(
        make_tiny_checkpoint(tmp_path / "dmd", seed=0, dmd_steps=list(RUNGS)),
        device="cpu",
        dtype=torch.float32,
    )
    plain = Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)
    expected, _ = distilled.generate(request())
    output, _ = plain.generate(request(rungs=RUNGS))
    assert torch.equal(output.video, expected.video) and torch.equal(output.audio, expected.audio)
    grid, _ = plain.generate(request())
    assert not torch.equal(grid.video, expected.video)
    with refused(RequestError, field="rungs"):
        distilled.validate(request(rungs=(990, 600, 300, 100)))


# --- the LoRA folder and the Turbo preset --------------------------------------------------------------------------


def test_the_library_lists_adapters_by_header(tiny_native: Path, tmp_path: Path) -> None:
    config = dit_config(tiny_native)
    folder = tmp_path / "loras"
    (folder / "styles").mkdir(parents=True)
    write_lora(folder / "styles" / "ink.safetensors", random_lora(config, 1), "kohya", config)
    write_lora(folder / "ref.safetensors", random_lora(config, 2), "diffusers_ref", config)
    write_lora(folder / "fl.safetensors", random_lora(config, 3), "diffusers", config)
    turbo = with_metadata(
        write_lora_path(folder / "turbo.safetensors", config),
        minimax_h3=turbo_json(dmd_denoising_steps=list(RUNGS), flow_shift=5),
    )
    (folder / "broken.safetensors").write_bytes(b"not a safetensors file")
    with_metadata(write_lora_path(folder / "bad-turbo.safetensors", config), minimax_h3="{not json")
    library = LoraLibrary(folder)
    names = [entry.name for entry in library.entries]
    assert names == [
        "bad-turbo.safetensors", "broken.safetensors", "fl.safetensors", "ref.safetensors", "styles/ink.safetensors",
        "turbo.safetensors",
    ]  # fmt: skip
    by_name = {entry.name: entry for entry in library.entries}
    assert by_name["fl.safetensors"].targets == ("transformer",)
    assert by_name["ref.safetensors"].targets == ("transformer_ref",)
    assert by_name["styles/ink.safetensors"].targets == ()  # names no DiT: runs on either
    assert [entry.name for entry in library.usable("transformer_ref")] == [
        "ref.safetensors", "styles/ink.safetensors", "turbo.safetensors"
    ]  # fmt: skip
    assert by_name["broken.safetensors"].problem.startswith("not a readable .safetensors file")
    assert (
        by_name["bad-turbo.safetensors"].problem
        == "'bad-turbo.safetensors': __metadata__ 'minimax_h3' is not JSON"
    )
    assert by_name["turbo.safetensors"].turbo == TurboSettings(
        4, 5.0, 3.0, RUNGS, "turbo.safetensors's metadata"
    )
    assert library.name_of(turbo) == "turbo.safetensors" and library.name_of(tmp_path / "x") is None
    assert (
        library.entry("styles/ink.safetensors", "loras[0].name").path == folder / "styles" / "ink.safetensors"
    )
    # The library's refusals (their wording is checked here and in tests/test_app_loras.py's lora_choices table).
    with refused(RequestError, field="loras[1].name") as caught:
        library.entry("../../etc/passwd", "loras[1].name")
    # The usable adapters, the unusable ones left out.
    assert caught.value.problem.endswith(
        "'../../etc/passwd'; available: fl.safetensors, ref.safetensors, styles/ink.safetensors, turbo.safetensors"
    )
    with refused(
        RequestError, field="loras[0].name", says="'broken.safetensors' cannot be used: not a readable"
    ):
        library.entry("broken.safetensors", "loras[0].name")
    with refused(RequestError, field="loras[0].name", says="no LoRA folder was given (--lora-dir)"):
        LoraLibrary(None).entry("fl.safetensors", "loras[0].name")
    # A file added later appears after a rescan.
    write_lora(folder / "new.safetensors", random_lora(config, 5), "peft", config)
    assert "new.safetensors" in [entry.name for entry in library.rescan()]


def write_lora_path(path: Path, config: DiTConfig) -> Path:
    write_lora(path, random_lora(config, 9), "original", config)
    return path


def test_the_turbo_preset_takes_metadata_else_the_table(tiny_native: Path, tmp_path: Path) -> None:
    config = dit_config(tiny_native)
    assert turbo_settings([]) == TURBO_TABLE == TurboSettings(8, 6.0, 3.0, ())
    declared = TurboSettings(4, 6.0, 3.0, RUNGS, "x's metadata")
    assert turbo_settings([None, declared]) == declared
    assert turbo_settings([declared], recipe="diffusers").steps == 5
    assert TURBO_TABLE.describe() == "8 steps, flow shifts 6 / 3 (from the Turbo table)"
    path = write_lora_path(tmp_path / "t.safetensors", config)
    assert file_turbo(path) is None
    bad = {
        turbo_json(num_inference_steps=0): "num_inference_steps must be an integer in [1, 1000]",
        turbo_json(dmd_denoising_steps=[250, 500]): "dmd_denoising_steps must be strictly decreasing",
        turbo_json(
            dmd_denoising_steps=[999, 500], num_inference_steps=8
        ): "num_inference_steps 8 but 2 rungs",
        turbo_json(flow_shift=-1): "flow_shift must be a positive number",
        turbo_json(other=1): "must be a JSON object with any of",
    }
    for text, problem in bad.items():
        with refused(RequestError, field="loras", says=problem) as caught:
            file_turbo(with_metadata(path, minimax_h3=text))
        assert caught.value.problem.startswith("'t.safetensors': __metadata__ 'minimax_h3'")
    with_metadata(path, minimax_h3=turbo_json(num_inference_steps=6, audio_flow_shift=2.5))
    assert file_turbo(path) == TurboSettings(6, 6.0, 2.5, (), "t.safetensors's metadata")


# --- the CLI --------------------------------------------------------------------------------------------------------


def generate(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--checkpoint", str(checkpoint), "--prompt", "A fox in the snow.", "--device", "cpu"] + [
        "--dtype", "float32", "--duration", "4", "--out", str(out), "--progress", "plain", *extra
    ]  # fmt: skip


def sidecar_request(out: Path) -> dict:
    return json.loads(out.with_suffix(".json").read_text())["request"]


def test_the_cli_turbo_preset_and_rungs(capsys, tmp_path: Path, tiny_native: Path) -> None:
    config = dit_config(tiny_native)
    plain = write_lora_path(tmp_path / "style.safetensors", config)
    turbo = with_metadata(
        write_lora_path(tmp_path / "turbo.safetensors", config),
        minimax_h3=turbo_json(dmd_denoising_steps=[999, 500], flow_shift=5.0),
    )
    out = tmp_path / "a.mp4"
    assert cli.main(generate(tiny_native, out, "--lora", str(plain), "--lora", str(turbo), "--turbo")) == 0
    assert {key: sidecar_request(out)[key] for key in ("steps", "rungs", "flow_shift", "audio_flow_shift")} == {
        "steps": 2, "rungs": [999, 500], "flow_shift": 5.0, "audio_flow_shift": 3.0
    }  # fmt: skip
    # No metadata: the table, except the flag given explicitly.
    out = tmp_path / "b.mp4"
    assert (
        cli.main(generate(tiny_native, out, "--lora", str(plain), "--turbo", "--audio-flow-shift", "2")) == 0
    )
    assert {key: sidecar_request(out)[key] for key in ("steps", "rungs", "flow_shift", "audio_flow_shift")} == {
        "steps": 8, "rungs": [], "flow_shift": 6.0, "audio_flow_shift": 2.0
    }  # fmt: skip
    # --rungs alone: --steps defaults to their count.
    out = tmp_path / "c.mp4"
    assert cli.main(generate(tiny_native, out, "--rungs", "999,500,100")) == 0
    assert sidecar_request(out)["steps"] == 3 and sidecar_request(out)["rungs"] == [999, 500, 100]
    capsys.readouterr()
    refusals = {
        ("--turbo",): "--turbo",  # the command line's own: "needs a --lora" (its wording, once)
        ("--rungs", "999,x"): "--rungs",
        ("--rungs", "999,500", "--steps", "5"): "steps",
    }
    for flags, field in refusals.items():
        assert cli.main(generate(tiny_native, tmp_path / "d.mp4", *flags)) == 2
        problem = cli_refused(capsys.readouterr().err, field)
        assert field != "--turbo" or problem == "needs a --lora (the preset is for step-distilled adapters)"
    assert not (tmp_path / "d.mp4").exists()
