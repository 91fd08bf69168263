"""The validation kit (issue 33) on tiny checkpoints: check-checkpoint, generate --capture, reference, compare.

Ours and diffusers' pipeline (the reference runner) must agree at every boundary within the fp32 bounds, in both
step conventions (T2VA, FL2VA and Ref2VA in the sglang one, FL2VA and Ref2VA in the diffusers one too); a
deliberately broken component (Q and K swapped in one block, the stereo channels flipped, a wrong flow shift) must
be named at the right first divergent boundary; a worker group of two CPU ranks captures on rank 0; split stage
groups capture what one process does, bit for bit. Everything runs through the CLI's `main` in this process (the
groups' ranks excepted), 2 forwards a run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from _parity_helpers import synthetic_image
from safetensors.torch import load_file, save_file

from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.cli.main import main
from h3engine.cli.validation.compare import compare_captures, parse_tolerances
from h3engine.engine import trace
from h3engine.models.audio_vae import AudioVAE
from h3engine.request.model import GenerationRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "A red fox runs. <d>[English] Look!</d>"
SEED = 5
# sglang: N steps are N forwards; diffusers: N grid points, N - 1 forwards. Two forwards either way.
STEPS = {"sglang": "2", "diffusers": "3"}
# Each case's step convention: FL2VA and Ref2VA in both (the sglang one serves diffusers our conditions' noise).
CASES = {
    "t2va": "sglang",
    "fl2va": "diffusers",
    "ref2va": "diffusers",
    "fl2va_sglang": "sglang",
    "ref2va_sglang": "sglang",
}


def generate(checkpoint: Path, folder: Path, recipe: str = "sglang", *extra: str) -> int:
    return main(
        ["generate", "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--seed", str(SEED), "--steps",
         STEPS[recipe], "--recipe", recipe, "--device", "cpu", "--dtype", "float32", "-q",
         "--out", str(folder.parent / f"{folder.name}.mp4"), "--capture", str(folder), *extra]
    )  # fmt: skip


def reference(checkpoint: Path, folder: Path, recipe: str = "sglang", *extra: str) -> int:
    return main(
        ["reference", "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--seed", str(SEED), "--steps",
         STEPS[recipe], "--recipe", recipe, "--capture", str(folder), *extra]
    )  # fmt: skip


def first_divergence(ours: Path, theirs: Path) -> str | None:
    _, first = compare_captures(ours, theirs, parse_tolerances([]))
    if first is None:
        return None
    return first.boundary if first.step is None else f"{first.boundary}[{first.step}]"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("diffusers", seed=3)


class Captures(dict):
    """`ours_CASE` / `reference_CASE` -> that side's capture of the case's request, made on first use (a test run
    of a few cases makes only theirs)."""

    def __init__(self, checkpoint: Path, root: Path, inputs: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.checkpoint, self.root, self.inputs = checkpoint, root, inputs

    def __missing__(self, key: str) -> Path:
        side, case = key.split("_", 1)
        run = {"ours": generate, "reference": reference}[side]
        extra = self.inputs[case.removesuffix("_sglang")]
        assert run(self.checkpoint, self.root / key, CASES[case], *extra) == 0
        self[key] = self.root / key
        return self[key]


@pytest.fixture(scope="module")
def captures(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Captures:
    """Ours and the reference's capture of the same request: T2VA in the sglang convention, FL2VA (a first
    keyframe) and Ref2VA (two image references) in both (`CASES`)."""
    root = tmp_path_factory.mktemp("captures")
    keyframe, wide, tall = root / "first.png", root / "wide.png", root / "tall.png"
    synthetic_image(72, 40, 1).save(keyframe)
    synthetic_image(80, 48, 2).save(wide)
    synthetic_image(40, 64, 3).save(tall)
    inputs = {
        "t2va": (),
        "fl2va": ("--first-frame", str(keyframe)),
        "ref2va": ("--ref", f"image:{wide}", "--ref", f"image:{tall}"),
    }
    return Captures(checkpoint, root, inputs)


@pytest.mark.parametrize("case", list(CASES))
def test_ours_matches_the_reference_runner_at_every_boundary(captures, case: str, capsys) -> None:
    ours, theirs = captures[f"ours_{case}"], captures[f"reference_{case}"]
    names = [
        (entry["name"], entry["step"])
        for entry in json.loads((ours / "index.json").read_text())["boundaries"]
    ]
    per_step = [(name, step) for step in (0, 1) for name in ("dit_prediction", "scheduler_output")]
    conditions = ["condition_rows"] if case != "t2va" else []
    fixed = ["processor_tokens", "text_states", *conditions, "initial_noise", "packed_layout"]
    tail = ["final_latents", "decoded_frames", "waveform"]
    assert names == [(name, None) for name in fixed] + per_step + [(name, None) for name in tail]
    theirs_index = json.loads((theirs / "index.json").read_text())
    assert [(e["name"], e["step"]) for e in theirs_index["boundaries"]] == names
    assert theirs_index["runner"] == "diffusers" and theirs_index["forwards"] == 2
    capsys.readouterr()
    assert main(["compare", str(ours), str(theirs)]) == 0
    table = capsys.readouterr().out
    assert "verdict: MATCH" in table and "PSNR" in table and "SNR" in table and "note:" not in table
    # Another request (the other task, another convention) differs from its first boundary on, and is noted.
    other = captures["reference_fl2va" if case == "t2va" else "reference_t2va"]
    assert main(["compare", str(ours), str(other)]) == 1
    table = capsys.readouterr().out
    assert (
        "verdict: DIVERGED first at processor_tokens" in table
        and "note: the two requests differ in task" in table
    )


def broken_qkv(checkpoint: Path, folder: Path) -> Path:
    """A copy of `checkpoint` whose first DiT block has its Q and K projections swapped."""
    copy = Path(shutil.copytree(checkpoint, folder))
    path = next((copy / "transformer").glob("*.safetensors"))
    state = load_file(str(path))
    q, k = "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_k.weight"
    state[q], state[k] = state[k], state[q]
    save_file(state, str(path), metadata={"format": "pt"})
    return copy


def test_broken_components_are_named_at_their_first_boundary(
    checkpoint, captures, tmp_path, monkeypatch
) -> None:
    reference_capture = captures["reference_t2va"]
    qkv = broken_qkv(checkpoint, tmp_path / "qkv")
    assert generate(qkv, tmp_path / "swapped_qkv", "sglang", "--capture-steps", "first") == 0
    assert first_divergence(tmp_path / "swapped_qkv", reference_capture) == "dit_prediction[0]"

    decode_stereo = AudioVAE.decode_stereo
    monkeypatch.setattr(AudioVAE, "decode_stereo", lambda self, latents: decode_stereo(self, latents).flip(0))
    assert generate(checkpoint, tmp_path / "flipped_audio", "sglang", "--capture-steps", "none") == 0
    assert first_divergence(tmp_path / "flipped_audio", reference_capture) == "waveform"
    # The step selections kept what they named: the first forward, none.
    for name, kept in (("swapped_qkv", {None, 0}), ("flipped_audio", {None})):
        index = json.loads((tmp_path / name / "index.json").read_text())
        assert {entry["step"] for entry in index["boundaries"]} == kept, name
    assert trace.active() is None  # nothing stays active after a run


def test_capture_steps_and_bad_flags(checkpoint, captures, tmp_path, capsys, monkeypatch) -> None:
    def failing(self, latents):
        raise RuntimeError("decoder broke")

    with monkeypatch.context() as patch:
        patch.setattr(AudioVAE, "decode_stereo", failing)
        assert generate(checkpoint, tmp_path / "failed", "sglang", "--capture-steps", "none") == 1
    index = json.loads((tmp_path / "failed" / "index.json").read_text())
    assert index["failed"] == "RuntimeError: decoder broke"
    assert [entry["name"] for entry in index["boundaries"]][-1] == "packed_layout"
    assert trace.active() is None
    capsys.readouterr()
    assert generate(checkpoint, tmp_path / "bad", "sglang", "--capture-steps", "2-x") == 2
    assert capsys.readouterr().err.startswith("error: --capture-steps:")
    assert generate(checkpoint, captures["ours_t2va"]) == 2  # a capture folder that holds files
    assert "--capture" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), str(captures["ours_t2va"])]) == 2
    assert "index.json: file is missing" in capsys.readouterr().err
    assert main(["compare", str(captures["ours_t2va"]), str(captures["ours_t2va"]), "--tol", "noise=1"]) == 2
    assert capsys.readouterr().err.startswith("error: --tol:")
    # The reference runner reads the diffusers layout only, and needs diffusers.
    assert reference(Path(__file__).parent, tmp_path / "ref") == 2
    assert reference(checkpoint.parent.parent / "nowhere", tmp_path / "ref2") == 2
    clip = captures["ours_t2va"].parent / "clip.mp4"
    assert reference(checkpoint, tmp_path / "ref3", "sglang", "--ref", f"video:{clip}@1.5") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 3 and "Traceback" not in error and "error: references:" in error
    assert not (tmp_path / "ref").exists() and not (tmp_path / "ref3").exists()  # refused before any folder


def test_reference_runner_without_diffusers_says_so(checkpoint, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(__import__("sys").modules, "diffusers", None)
    assert reference(checkpoint, tmp_path / "ref") == 2
    assert "needs diffusers" in capsys.readouterr().err


def test_tolerances_and_the_bf16_preset() -> None:
    fp32, bf16 = parse_tolerances([]), parse_tolerances(["bf16"])
    assert fp32["initial_noise"] == bf16["initial_noise"] == 0.0
    assert fp32["dit_prediction"] < bf16["dit_prediction"]
    assert parse_tolerances(["bf16", "waveform=0.5"])["waveform"] == 0.5
    assert trace.parse_steps("0,-1,2-3") == ("0", "-1", "2-3")
    assert [step for step in range(6) if trace.selected(("0", "-1", "2-3"), step, 6)] == [0, 2, 3, 5]


def rewrite(path: Path, change) -> None:
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_check_checkpoint_headers_and_deep(tiny_native, tmp_path, capsys) -> None:
    assert main(["check-checkpoint", str(tiny_native)]) == 0
    out = capsys.readouterr().out
    assert "verdict: OK" in out and "headers only" in out and "sha256" not in out
    assert main(["check-checkpoint", str(tiny_native), "--deep"]) == 0
    deep = capsys.readouterr().out
    assert "every tensor read and finite" in deep and deep.count("sha256") >= 5

    broken = Path(shutil.copytree(tiny_native, tmp_path / "broken"))
    island = "final_layer.video_out.weight"
    dit = next(
        path for path in (broken / "FL2VA" / "transformer").glob("*.safetensors") if island in load_file(path)
    )
    rewrite(dit, lambda state: state.__setitem__(island, state[island].bfloat16()))
    (broken / "Ref2VA" / "tokenizer" / "tokenizer.json").unlink()
    assert main(["check-checkpoint", str(broken)]) == 2
    out = capsys.readouterr().out
    assert "fp32 island stored as torch.bfloat16" in out and "verdict: BROKEN - 2 component(s) failed" in out
    assert "ref2va    tokenizer" in out and "the tokenizer has no token <|vision_start|>" in out

    nan = Path(shutil.copytree(tiny_native, tmp_path / "nan"))
    vae = next(path for path in nan.rglob("*.safetensors") if "audio_vae" in str(path))
    key = sorted(load_file(str(vae)))[0]
    rewrite(vae, lambda state: state[key].view(-1).__setitem__(0, float("nan")))
    assert main(["check-checkpoint", str(nan)]) == 0  # headers cannot see values
    capsys.readouterr()
    assert main(["check-checkpoint", str(nan), "--deep"]) == 2
    assert f"tensor '{key}' holds NaN or infinity" in capsys.readouterr().out
    assert main(["check-checkpoint", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_check_checkpoint_at_the_released_size_reads_headers_in_seconds(tmp_path, capsys) -> None:
    folder = make_placeholder_checkpoint(tmp_path / "released", seed=0)
    started = time.perf_counter()
    assert main(["check-checkpoint", str(folder)]) == 0
    elapsed = time.perf_counter() - started
    out = capsys.readouterr().out
    assert "verdict: OK" in out and " GB" in out
    assert elapsed < 30, elapsed


def test_a_worker_group_captures_on_rank_0_and_a_wrong_shift_is_named(checkpoint, captures, tmp_path) -> None:
    """Two CPU ranks: rank 0 writes the (gathered) boundaries into the folder its job command names. Run with a
    wrong flow shift, they match the reference's up to the first Euler step: the first sigma is 1 whatever the
    shift, so the first forward agrees."""
    group = tmp_path / "group"
    assert (
        generate(
            checkpoint, group, "sglang", "--world-size", "2", "--flow-shift", "5", "--capture-steps", "-2"
        )
        == 0
    )
    index = json.loads((group / "index.json").read_text())
    assert index["runner"].startswith("h3engine (worker group")
    assert [entry["name"] for entry in index["boundaries"]][-3:] == [
        "final_latents",
        "decoded_frames",
        "waveform",
    ]
    assert {entry["step"] for entry in index["boundaries"]} == {None, 0}  # forward -2 of 2
    assert first_divergence(group, captures["reference_t2va"]) == "scheduler_output[0]"


def test_split_stage_groups_capture_what_one_process_does(checkpoint, tmp_path) -> None:
    """Split stage groups of one rank each: each group's rank 0 writes the boundaries its step crosses, the front
    the one index, and the capture equals one process's bit for bit (as many threads as a split rank of one uses:
    the same computation). Groups of two ranks (gloo) capture the selected step within the fp32 bounds."""
    one, split, pair = tmp_path / "one", tmp_path / "split", tmp_path / "pair"
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        assert generate(checkpoint, one, "sglang") == 0
    finally:
        torch.set_num_threads(threads)
    assert generate(checkpoint, split, "sglang", "--stage-layout", "split") == 0
    index = json.loads((split / "index.json").read_text())
    assert index["runner"].startswith("h3engine (split stage groups") and "failed" not in index
    names = [
        (entry["name"], entry["step"]) for entry in json.loads((one / "index.json").read_text())["boundaries"]
    ]
    assert [(entry["name"], entry["step"]) for entry in index["boundaries"]] == names
    steps = [entry["file"].split("_")[0] for entry in index["boundaries"]]
    assert steps == ["encode"] * 2 + ["denoise"] * 6 + ["decode"] * 3
    assert sorted(path.name for path in split.iterdir()) == sorted(
        [trace.INDEX_NAME, *(entry["file"] for entry in index["boundaries"])]
    )
    exact = parse_tolerances([f"{name}=0" for name in trace.BOUNDARIES])
    assert compare_captures(split, one, exact)[1] is None
    last = ("--capture-steps", "last")
    assert generate(checkpoint, pair, "sglang", "--stage-layout", "split", "--world-size", "2", *last) == 0
    index = json.loads((pair / "index.json").read_text())
    kept = [(name, step) for name, step in names if step in (None, 1)]
    assert [(entry["name"], entry["step"]) for entry in index["boundaries"]] == kept
    assert first_divergence(pair, one) is None


def test_a_split_step_that_ends_its_job_leaves_what_it_recorded_for_the_index(tmp_path) -> None:
    """On the split layout a step that fails or is cancelled sends no report: its rank 0 leaves its entries beside
    its files (`keep_unreported`) and the front's index lists them after the reported steps' (`failed` said); a
    job that finished (a retry) drops such leftovers."""
    spec = trace.CaptureSpec(str(tmp_path / "capture"), "all")
    Path(spec.folder).mkdir()
    request = GenerationRequest(task="t2va", prompt="x", steps=2)
    with trace.stage_capture("encode", 0, spec) as encoded:
        trace.record("processor_tokens", input_ids=torch.arange(4))
    with trace.stage_capture("denoise", 0, spec) as denoised:
        trace.record("initial_noise", video=torch.ones(2, 3), audio=torch.zeros(2, 1))
    trace.keep_unreported(spec, "denoise", denoised)
    with trace.stage_capture("decode", 1, spec) as not_rank_0:
        trace.record("waveform", audio=torch.ones(2, 8))
    assert not_rank_0 == []
    unreported = ("denoise", "decode")
    trace.finish_stage_captures(spec, request, [encoded], "cancelled: Cancelled.", unreported)
    index = json.loads((Path(spec.folder) / trace.INDEX_NAME).read_text())
    assert [entry["name"] for entry in index["boundaries"]] == ["processor_tokens", "initial_noise"]
    assert index["failed"] == "cancelled: Cancelled."
    assert sorted(path.name for path in Path(spec.folder).iterdir()) == sorted(
        [trace.INDEX_NAME, *(entry["file"] for entry in index["boundaries"])]
    )
    trace.keep_unreported(spec, "denoise", denoised)
    trace.finish_stage_captures(spec, request, [encoded], None, unreported)
    index = json.loads((Path(spec.folder) / trace.INDEX_NAME).read_text())
    assert [entry["name"] for entry in index["boundaries"]] == ["processor_tokens"] and "failed" not in index
    assert not list(Path(spec.folder).glob(f"*{trace.UNREPORTED_SUFFIX}"))
