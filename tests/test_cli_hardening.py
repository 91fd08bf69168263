"""The CLI refuses what it can before any work (issue 17, "Hardening"): a bad request, input file or output flag
costs neither a torch import nor a checkpoint load, exits 2 and prints one line naming the field or flag; the
prompt's token bound is checked with the checkpoint's tokenizer before the checkpoint loads; `--fp8-linear` is
refused where it would do nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _refusals import cli_refused, refused

from h3engine.cli.main import main

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
# Runs `python -m h3engine` in a fresh interpreter, then reports its exit code and whether torch was imported.
RUNNER = """
import json, runpy, sys
try:
    runpy.run_module("h3engine", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as done:
    code = done.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""
# A long but fair prompt: ~15,000 characters (under the character bound) that the tiny test tokenizer turns
# into ~10,800 tokens (over the token bound).
LONG_PROMPT = "Waves roll onto a beach. " * 600


def run_cli(capsys, *arguments: str) -> tuple[int, str]:
    code = main(["generate", *arguments])
    return code, capsys.readouterr().err


def cli_arguments(tmp_path: Path, *extra: str | bytes, checkpoint: Path | None = None) -> list[str | bytes]:
    return [
        "generate",
        "--checkpoint",
        str(checkpoint or tmp_path / "no-checkpoint"),
        "--prompt",
        "a fox in the snow",
        "--out",
        str(tmp_path / "clip.mp4"),
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "field", "says"),
    [
        # The request's own rules (their wording: tests/test_request.py, tests/test_request_bounds.py).
        (["--duration", "30"], "duration_seconds", None),
        (["--short-edge", "100000"], "short_edge", None),
        (["--prompt", b"a fox \xff in snow"], "prompt", None),
        (["--first-frame", "/nonexistent/first.png"], "keyframes[0]", "'/nonexistent/first.png'"),
        (["--out", "{tmp}/folder.mp4"], "--out", None),
        (["--save-tensors", "{tmp}/missing/t.safetensors"], "--save-tensors", None),
        (["--lora", "{tmp}/style.safetensors:0.5"], "loras[0].path", None),
        (["--lora", "{tmp}/folder.mp4"], "loras[0].path", None),
        (["--lora", f"{__file__}:4.5"], "loras[0].strength", None),
        (["--lora", __file__, "--lora-target", "transformer_ref"], "loras[0].target", None),
        # The command line's own (its wording is checked here).
        (["--dtype", "float16"], "--dtype", "expected bfloat16 or float32, got 'float16'"),
        (["--lora", "{tmp}/style.safetensors:strong"], "--lora", "expected PATH[:STRENGTH] with STRENGTH a "),
        (["--lora", __file__, "--lora-target", "vae"], "argument --lora-target", "invalid choice: 'vae'"),
        (["--lora-target", "transformer"], "--lora-target", "given without --lora"),
    ],
    ids=[
        "duration",
        "short-edge",
        "non-utf8-prompt",
        "missing-keyframe",
        "out-is-folder",
        "tensors-folder",
        "lora-missing",
        "lora-folder",
        "lora-strength-range",
        "lora-target-other-task",
        "dtype",
        "lora-strength-text",
        "lora-target-unknown",
        "lora-target-alone",
    ],
)
def test_bad_requests_exit_2_without_importing_torch(
    tmp_path: Path, extra: list, field: str, says: str | None
) -> None:
    (tmp_path / "folder.mp4").mkdir()
    extra = [item.replace("{tmp}", str(tmp_path)) if isinstance(item, str) else item for item in extra]
    command = [sys.executable, "-c", RUNNER, *cli_arguments(tmp_path, *extra)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, timeout=120)
    elapsed = time.monotonic() - started
    stderr = result.stderr.decode("utf-8", "replace")
    report = json.loads(result.stdout.decode().strip().splitlines()[-1])
    assert report == {"code": 2, "torch": False}, stderr
    problem = cli_refused(stderr, field)
    assert says is None or says in problem, stderr
    # ~0.5 s on an idle 2-core CPU (it was ~7 s with the torch import); generous for a loaded machine.
    assert elapsed < 10, elapsed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["folder.mp4"]


# ---------------------------------------------------------------------------------------------------------------
# Output flags, checked up front


def test_out_must_not_be_a_folder(capsys, tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").mkdir()
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path)[1:])
    # The outputs' wording: tests/test_outputs_and_cancel.py; here the flag and the file at fault.
    assert code == 2 and f"'{tmp_path / 'clip.mp4'}'" in cli_refused(stderr, "--out")


def test_out_sidecar_must_not_be_a_folder(capsys, tmp_path: Path) -> None:
    (tmp_path / "clip.json").mkdir()
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path)[1:])
    assert code == 2 and f"'{tmp_path / 'clip.json'}'" in cli_refused(stderr, "--out")


def test_out_folder_must_be_writable(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root may write anywhere, so the folder's refusal is simulated where the CLI asks for it.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path, "--out", str(locked / "clip.mp4"))[1:])
    assert code == 2 and f"'{locked}'" in cli_refused(stderr, "--out")


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("missing/t.safetensors", "'{tmp}/missing'"),
        ("t.pt", "'{tmp}/t.pt'"),
        ("t.safetensors/", "'{tmp}/t.safetensors'"),
        ("to-sidecar.safetensors", "'{tmp}/to-sidecar.safetensors'"),
    ],
    ids=["missing-folder", "suffix", "folder", "same-as-sidecar"],
)
def test_save_tensors_is_checked_up_front(capsys, tmp_path: Path, name: str, named: str) -> None:
    (tmp_path / "t.safetensors").mkdir()
    (tmp_path / "to-sidecar.safetensors").symlink_to(tmp_path / "clip.json")
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path, "--save-tensors", str(tmp_path / name))[1:])
    # The flag and the path at fault (the outputs' wording: tests/test_outputs_and_cancel.py).
    assert code == 2 and named.replace("{tmp}", str(tmp_path)) in cli_refused(stderr, "--save-tensors")


def test_non_utf8_output_and_checkpoint_paths_are_refused(capsys, tmp_path: Path) -> None:
    bad = os.fsdecode(b"clip-\xff.mp4")
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path, "--out", str(tmp_path / bad))[1:])
    assert code == 2 and cli_refused(stderr, "--out").startswith("must be valid UTF-8 text"), stderr
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path, checkpoint=tmp_path / os.fsdecode(b"\xfe"))[1:])
    assert code == 2
    cli_refused(stderr, "--checkpoint")


# ---------------------------------------------------------------------------------------------------------------
# Checks that need torch (devices) or the checkpoint's tokenizer, still before any model loads


def test_fp8_linear_is_refused_on_the_cpu(capsys, tmp_path: Path) -> None:
    code, stderr = run_cli(capsys, *cli_arguments(tmp_path, "--device", "cpu", "--fp8-linear")[1:])
    assert code == 2, stderr
    assert cli_refused(stderr, "--fp8-linear").startswith("FP8 linear layers need a CUDA GPU"), stderr
    assert list(tmp_path.iterdir()) == []


def test_fp8_linear_needs_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from h3engine.engine.options import check_fp8_device
    from h3engine.errors import RequestError

    gpu = torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with refused(RequestError, field="--fp8-linear", says="8.9 or newer, cuda:0 has 8.0"):
        check_fp8_device(gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    check_fp8_device(gpu)


def test_device_names_are_checked_against_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from h3engine.engine.options import resolve_device
    from h3engine.errors import RequestError

    assert resolve_device("cpu") == torch.device("cpu")
    # The device rules' messages (made by resolve_device; the wording is checked here).
    with refused(RequestError, field="--device", says="unknown device 'gpu'"):
        resolve_device("gpu")
    with refused(RequestError, field="--devices", says="only cpu and cuda are supported, got 'meta'"):
        resolve_device("meta", "--devices")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with refused(RequestError, field="--device", says="CUDA was asked for but no GPU is available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with refused(RequestError, field="--device", says="cuda:3 asked for, but 1 GPU is visible"):
        resolve_device("cuda:3")


@pytest.fixture(scope="module")
def tokenizer_only_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny native checkpoint whose weight files are gone but the DiTs' (whose headers tell the AdaLN form, which
    decides the LoRAs that fit): loading it would fail, so a refusal that names the prompt proves the token check
    ran on the checkpoint's config files and headers, before the checkpoint loads."""
    from h3engine.checkpoint.tiny import make_tiny_checkpoint

    root = make_tiny_checkpoint(tmp_path_factory.mktemp("tokenizer-only") / "checkpoint")
    weights = sorted(path for path in root.rglob("*.safetensors") if path.parent.name != "transformer")
    assert weights
    for path in weights:
        path.unlink()
    return root


def test_prompt_token_counter_counts_what_the_text_encoder_reads(tokenizer_only_checkpoint: Path) -> None:
    from h3engine.checkpoint.text_encoder_files import load_tokenizer
    from h3engine.engine.conditioning.presentation import prompt_token_counter, text_presentation

    folder = tokenizer_only_checkpoint / "FL2VA" / "tokenizer"
    count = prompt_token_counter(folder)
    tokenizer = load_tokenizer(folder)
    for prompt in ("a fox", "<d>[English] Hello there.</d> <Picture 1> 你好, café", LONG_PROMPT):
        assert count(prompt) == text_presentation(tokenizer, prompt).num_rows
    assert 8_192 < count(LONG_PROMPT) and len(LONG_PROMPT) < 32_768


def test_check_request_applies_the_token_bound(tokenizer_only_checkpoint: Path) -> None:
    from h3engine.checkpoint.facts import CheckpointFacts
    from h3engine.checkpoint.layout import CanvasRules
    from h3engine.engine.resolved import resolve_request
    from h3engine.errors import RequestError
    from h3engine.request.model import GenerationRequest

    facts = CheckpointFacts(
        tasks=("t2va", "fl2va"),
        canvas=CanvasRules(),
        vae_spatial_ratio=16,
        patch=2,
        tokenizer=tokenizer_only_checkpoint / "FL2VA" / "tokenizer",
    )
    assert resolve_request(GenerationRequest(task="t2va", prompt="a fox"), facts).warnings == ()
    # The bound's wording: tests/test_request_bounds.py.
    with refused(RequestError, field="prompt"):
        resolve_request(GenerationRequest(task="t2va", prompt=LONG_PROMPT), facts)


def test_cli_checks_the_token_bound_before_loading(
    capsys, tmp_path: Path, tokenizer_only_checkpoint: Path
) -> None:
    arguments = cli_arguments(tmp_path, "--device", "cpu", checkpoint=tokenizer_only_checkpoint)[1:]
    arguments[arguments.index("--prompt") + 1] = LONG_PROMPT
    code, stderr = run_cli(capsys, *arguments)
    assert code == 2, stderr
    # The token count of the checkpoint's own tokenizer (not the character bound, which this prompt passes).
    assert "tokens of the checkpoint's tokenizer" in cli_refused(stderr, "prompt"), stderr
