"""Step-distilled checkpoints (`_minimax_h3.dmd_denoising_steps`): the rung grid, one DiT forward per rung, the
refusal of any other step count (engine, front checks, CLI, the app's API), malformed keys, the tiny maker's option."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from _app_helpers import start_app, stop_app
from _refusals import cli_refused, refused, ui_refused
from gradio_client import Client
from gradio_client.exceptions import ValidationError

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import CanvasRules, detect_layout
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.pipeline import prepare_request, run_generation
from h3engine.engine.resolved import resolve_request
from h3engine.engine.sampling.schedule import Schedule, rung_sigmas
from h3engine.errors import CheckpointError, RequestError
from h3engine.request.model import GenerationRequest
from h3engine.request.validate import check_steps_for_rungs
from h3engine.runtime.front import WARM_UP_REQUEST, warm_up_request

RUNGS = (999, 750, 500, 250)
REFUSAL = "steps: this checkpoint is step-distilled to 4 steps (rungs 999, 750, 500, 250), got "


@pytest.fixture(scope="module")
def dmd_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dmd") / "checkpoint"
    return make_tiny_checkpoint(folder, seed=0, dmd_steps=list(RUNGS))


@pytest.fixture(scope="module")
def dmd_engine(dmd_checkpoint: Path) -> Engine:
    return Engine.from_checkpoint(dmd_checkpoint, device="cpu", dtype=torch.float32)


def request(task: str = "t2va", steps: int = 4, **fields: object) -> GenerationRequest:
    return GenerationRequest(
        task=task, prompt="a fox in the snow", duration_seconds=4.0, steps=steps, **fields
    )


# --- the grid -------------------------------------------------------------------------------------------------------


def test_the_rung_grid_is_the_shifted_positions_then_zero() -> None:
    for shift in (12.0, 3.0, 6.0):
        base = torch.tensor([999 / 1000, 750 / 1000, 500 / 1000, 250 / 1000, 0.0], dtype=torch.float32)
        expected = shift * base / (1 + (shift - 1) * base)  # fp32, SGLang's operation order
        assert torch.equal(rung_sigmas(RUNGS, shift), expected)
    # Shift 1 leaves the positions themselves: rung / 1000, then the terminal 0.
    positions = torch.tensor([0.999, 0.75, 0.5, 0.25, 0.0], dtype=torch.float32)
    assert torch.equal(rung_sigmas(RUNGS, 1.0), positions)
    schedule = Schedule.from_rungs(RUNGS, video_shift=12.0, audio_shift=3.0)
    assert schedule.num_steps == len(RUNGS)
    assert torch.equal(schedule.video_sigmas, rung_sigmas(RUNGS, 12.0))
    assert torch.equal(schedule.audio_sigmas, rung_sigmas(RUNGS, 3.0))
    assert schedule.video_sigmas[-1].item() == 0.0 and schedule.audio_sigmas[-1].item() == 0.0
    single = Schedule.from_rungs((1000,))
    assert single.num_steps == 1 and single.video_sigmas.tolist() == [1.0, 0.0]


def test_only_the_distilled_count_passes() -> None:
    subject = "this checkpoint is step-distilled to"
    check_steps_for_rungs(4, "sglang", RUNGS, subject)
    check_steps_for_rungs(
        5, "diffusers", RUNGS, subject
    )  # the diffusers recipe counts the terminal grid point
    # The rule's messages (the wording is checked here; the doors' tests check the field).
    with refused(RequestError, field="steps") as caught:
        check_steps_for_rungs(50, "sglang", RUNGS, subject)
    assert str(caught.value) == REFUSAL + "50"
    with refused(
        RequestError,
        field="steps",
        says="to 5 steps (rungs 999, 750, 500, 250; the diffusers recipe counts the terminal grid",
    ):
        check_steps_for_rungs(4, "diffusers", RUNGS, subject)
    # One rule for a request's own rungs too.
    with refused(RequestError, field="steps") as caught:
        resolve_request(request(steps=3, rungs=RUNGS), None)
    assert caught.value.problem == "its rungs run 4 steps (rungs 999, 750, 500, 250), got 3"
    assert resolve_request(request(steps=None, rungs=RUNGS), None).request.steps == 4


# --- a whole generation -----------------------------------------------------------------------------------------------


def test_a_generation_takes_one_forward_per_rung_and_equals_the_explicit_grid(
    dmd_engine: Engine, tiny_native: Path
) -> None:
    forwards = []
    dit = dmd_engine.store.models_for_task("t2va").dit
    hook = dit.register_forward_hook(lambda module, args, output: forwards.append(args[3].clone()))
    try:
        output, _ = dmd_engine.generate(request(seed=7))
    finally:
        hook.remove()
    assert len(forwards) == len(RUNGS)
    schedule = Schedule.from_rungs(RUNGS, video_shift=12.0, audio_shift=3.0)
    # Each forward saw its rung's timesteps 1 - sigma (video rows and audio rows among them).
    for step, row_timesteps in enumerate(forwards):
        seen = set(row_timesteps.unique().tolist())
        assert schedule.video_timesteps[step].item() in seen
        assert schedule.audio_timesteps[step].item() in seen

    # The same weights (seed 0) without the key, driven by that grid explicitly, give the same tensors.
    plain = Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)
    plain_request = request(seed=7)
    resolved = plain.resolve(plain_request)
    models = plain.store.models_for_task("t2va")
    prepared = replace(prepare_request(resolved, models, plain.layout.canvas), schedule=schedule)
    with torch.inference_mode():
        expected = run_generation(models, prepared, plain.device)
    assert torch.equal(output.video, expected.video)
    assert torch.equal(output.audio, expected.audio)


def test_the_engine_refuses_another_step_count(dmd_engine: Engine) -> None:
    assert dmd_engine.layout.dmd_steps_for("t2va") == RUNGS
    assert dmd_engine.layout.dmd_steps_for("ref2va") == RUNGS
    for steps in (1, 3, 5, 50):
        with refused(RequestError, field="steps"):
            dmd_engine.validate(request(steps=steps))
    with refused(RequestError, field="steps"):
        dmd_engine.generate(request(steps=50))
    assert dmd_engine.validate(request()) == []


def test_the_front_checks_refuse_it_and_the_warm_up_runs_the_rungs(dmd_engine: Engine) -> None:
    facts = CheckpointFacts.from_engine(dmd_engine)
    assert facts.dmd_steps == {"t2va": RUNGS, "fl2va": RUNGS, "ref2va": RUNGS}
    assert facts.distilled_steps("t2va") == 4 and facts.distilled_steps("t2va", "diffusers") == 5
    with refused(RequestError, field="steps"):
        resolve_request(request(steps=50), facts)
    assert resolve_request(request(), facts).warnings == ()
    assert warm_up_request(facts).steps == 4
    # An undistilled checkpoint keeps every count and the one-step warm-up.
    plain = CheckpointFacts(
        tasks=("t2va",), canvas=CanvasRules(32, 32 * 56, 64), vae_spatial_ratio=4, patch=2
    )
    assert plain.distilled_steps("t2va") is None and warm_up_request(plain) is WARM_UP_REQUEST


# --- malformed keys ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "999,750,500,250",
        4,
        [],
        [750, 999],
        [999, 500, 500],
        [1001, 500],
        [500, 0],
        [999, -1],
        [999.0, 500],
        [True],
    ],
)
def test_a_malformed_key_is_a_checkpoint_error_naming_file_and_key(
    dmd_checkpoint: Path, tmp_path: Path, value: object
) -> None:
    copy = shutil.copytree(dmd_checkpoint, tmp_path / "checkpoint")
    index_path = copy / "Ref2VA" / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_minimax_h3"]["dmd_denoising_steps"] = value
    index_path.write_text(json.dumps(index))
    # The file, the key and the value; the rule's wording once (this is the layout's test).
    names = (str(index_path), "_minimax_h3.dmd_denoising_steps", f"got {json.dumps(value)}")
    with refused(CheckpointError, names=names, says="must be a non-empty list of strictly") as caught:
        detect_layout(copy)
    assert "\n" not in str(caught.value)


def test_a_checkpoint_without_the_key_runs_any_count(tiny_native: Path, tiny_diffusers: Path) -> None:
    for folder in (tiny_native, tiny_diffusers):
        layout = detect_layout(folder)
        assert all(layout.dmd_steps_for(task) is None for task in layout.tasks)


# --- the tiny maker and the CLI ------------------------------------------------------------------------------------------


def test_the_tiny_maker_writes_the_key_in_both_native_partitions(
    dmd_checkpoint: Path, tmp_path: Path
) -> None:
    for partition in ("FL2VA", "Ref2VA"):
        release = json.loads((dmd_checkpoint / partition / "model_index.json").read_text())["_minimax_h3"]
        assert release["dmd_denoising_steps"] == list(RUNGS)
    with pytest.raises(ValueError, match="^dmd_steps: only the native layout"):
        make_tiny_checkpoint(tmp_path / "diffusers", layout="diffusers", dmd_steps=[999, 500])
    with pytest.raises(ValueError, match=r"^dmd_steps: must be strictly decreasing integers in \(0, 1000\]"):
        make_tiny_checkpoint(tmp_path / "bad", dmd_steps=[500, 750])
    assert not (tmp_path / "diffusers").exists() and not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        # Three rules on one flag: a short fragment tells which refused (their wording: test_the_rungs_field in
        # tests/test_app_loras.py, test_the_tiny_maker_writes_the_key_in_both_native_partitions above).
        (["--dmd-steps", "999,x"], "comma-separated"),
        (["--dmd-steps", "250,500"], "strictly decreasing"),
        (["--dmd-steps", "999,1", "--layout", "diffusers"], "only the native layout"),
    ],
)
def test_the_tiny_maker_cli_refuses_bad_rungs(capsys, tmp_path: Path, extra: list, rule: str) -> None:
    code = main(["make-tiny-checkpoint", str(tmp_path / "checkpoint"), *extra])
    stderr = capsys.readouterr().err
    assert code == 2 and rule in cli_refused(stderr, "--dmd-steps")
    assert not (tmp_path / "checkpoint").exists()


def generate_arguments(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    request = ["--checkpoint", str(checkpoint), "--prompt", "a fox"]
    return ["generate", *request, "--out", str(out), "--device", "cpu", *extra]


def test_the_cli_refuses_another_count_before_loading(
    capsys, dmd_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint must not load")

    monkeypatch.setattr("h3engine.cli.main.load_engine", no_load)
    code = main(generate_arguments(dmd_checkpoint, tmp_path / "clip.mp4", "--steps", "50"))
    stderr = capsys.readouterr().err
    assert code == 2
    cli_refused(stderr, "steps")


def test_the_cli_steps_default_to_the_distilled_count(capsys, dmd_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "clip.mp4"
    code = main(generate_arguments(dmd_checkpoint, out, "--duration", "4", "--progress", "json"))
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [(event["step"], event["total"]) for event in events if event["event"] == "step"] == [
        (step, 4) for step in range(1, 5)
    ]
    assert json.loads(out.with_suffix(".json").read_text())["request"]["steps"] == 4


def test_the_app_api_refuses_another_count_and_runs_the_rungs(dmd_checkpoint: Path, tmp_path: Path) -> None:
    app = start_app(tmp_path, checkpoint=dmd_checkpoint)
    try:
        # The page starts at the distilled count, so its canvas line and Generate are valid as they stand.
        components = httpx.get(f"{app.url}config").json()["components"]
        by_id = {component["props"].get("elem_id"): component["props"] for component in components}
        for task in ("t2va", "fl2va", "ref2va"):
            assert by_id[f"{task}-steps"]["value"] == 4
        assert by_id["t2va-derived"]["value"].startswith("Canvas **"), by_id["t2va-derived"]["value"]
        client = Client(app.url, verbose=False, download_files=str(tmp_path / "downloads"))
        settings = dict(duration_seconds=4, aspect_ratio="auto", randomize_seed=False)
        with pytest.raises(ValidationError) as invalid:
            client.predict(prompt="A kite.", steps=50, **settings, api_name="/t2va")
        ui_refused(invalid.value, "steps")
        assert app.mp4_files() == set()
        status, *_rest, downloads, _takes = client.predict(
            prompt="A kite.", steps=4, **settings, api_name="/t2va"
        )
        assert status.startswith("Done"), status
        sidecar = next(path for path in downloads if path.endswith(".json"))
        assert json.loads(Path(sidecar).read_text())["request"]["steps"] == 4
    finally:
        assert stop_app(app) == 0, app.log_tail()
