"""Checkpoint discovery, the tiny maker, and refusing broken checkpoints with a message naming the problem."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _refusals import refused
from safetensors.torch import load_file, save_file

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.cli.main import main as cli_main
from h3engine.engine.engine import Engine
from h3engine.errors import CheckpointError
from h3engine.models.dit import FP32_PARAMETER_NAMES

REPO = Path(__file__).resolve().parents[1]


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h3engine", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def native(tiny_native: Path) -> Path:
    return tiny_native


@pytest.fixture(scope="module")
def diffusers_root(tiny_diffusers: Path) -> Path:
    return tiny_diffusers


@pytest.mark.parametrize("layout", ["native", "diffusers"])
def test_tiny_checkpoint_is_deterministic_and_small(tmp_path, layout: str) -> None:
    first = make_tiny_checkpoint(tmp_path / "a", seed=4, layout=layout)
    second = make_tiny_checkpoint(tmp_path / "b", seed=4, layout=layout)
    other = make_tiny_checkpoint(tmp_path / "c", seed=5, layout=layout)
    assert tree_digest(first) == tree_digest(second)
    assert tree_digest(first) != tree_digest(other)
    assert sum(path.stat().st_size for path in first.rglob("*") if path.is_file()) < 20 * 2**20


def test_layout_detection_and_partitions(native: Path, diffusers_root: Path) -> None:
    layout = detect_layout(native)
    assert layout.kind == "native"
    assert layout.tasks == ("t2va", "fl2va", "ref2va")
    assert layout.for_task("t2va").dit == native / "FL2VA" / "transformer"
    assert layout.for_task("ref2va").dit == native / "Ref2VA" / "transformer"
    assert (layout.video_shift, layout.audio_shift) == (12.0, 3.0)

    single = detect_layout(native / "FL2VA")
    assert single.kind == "native" and single.tasks == ("t2va", "fl2va")
    with refused(CheckpointError, says="no ref2va partition"):
        single.for_task("ref2va")

    layout = detect_layout(diffusers_root)
    assert layout.kind == "diffusers"
    assert layout.for_task("fl2va").dit == diffusers_root / "transformer"
    assert layout.for_task("ref2va").dit == diffusers_root / "transformer_ref"
    assert layout.canvas.short_edge == 32 and layout.canvas.max_pixels == 32 * 56


def test_partitions_hold_different_dit_weights(native: Path) -> None:
    fl2va = load_file(native / "FL2VA" / "transformer" / "model-00001-of-00002.safetensors")
    ref2va = load_file(native / "Ref2VA" / "transformer" / "model-00001-of-00002.safetensors")
    key = next(iter(fl2va))
    assert not torch.equal(fl2va[key].float(), ref2va[key].float())


def test_dit_loads_with_released_precision_rules(native: Path) -> None:
    engine = Engine.from_checkpoint(native, device="cpu", dtype=torch.bfloat16)
    dit = engine.store.models_for_partition("fl2va").dit
    fp32 = {name for name, tensor in dit.state_dict().items() if tensor.dtype == torch.float32}
    assert fp32 == set(FP32_PARAMETER_NAMES)
    assert "rope.inv_freq" in fp32 and len(fp32) == 13  # the twelve fp32 tensors and the rope buffer
    assert all(
        tensor.dtype == torch.bfloat16 for name, tensor in dit.state_dict().items() if name not in fp32
    )
    vae = engine.store.models_for_partition("fl2va").video_vae
    assert all(tensor.dtype == torch.float32 for tensor in vae.state_dict().values())


def copy_checkpoint(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _shard(folder: Path) -> Path:
    return folder / "FL2VA" / "transformer" / "model-00002-of-00002.safetensors"


def break_missing_folder(folder: Path) -> str:
    import shutil

    shutil.rmtree(folder / "FL2VA" / "video_vae")
    return "video_vae"


def break_missing_shard(folder: Path) -> str:
    _shard(folder).unlink()
    return "model-00002-of-00002.safetensors"


def break_truncated_file(folder: Path) -> str:
    path = _shard(folder)
    path.write_bytes(path.read_bytes()[:-100])
    return "truncated"


def break_wrong_shape(folder: Path) -> str:
    path = _shard(folder)
    state = load_file(path)
    key = sorted(state)[0]
    state[key] = torch.zeros(*state[key].shape[:-1], state[key].shape[-1] + 1, dtype=state[key].dtype)
    save_file(state, path, metadata={"format": "pt"})
    return key


def break_extra_key(folder: Path) -> str:
    path = _shard(folder)
    state = load_file(path)
    state["blocks.0.attn.surprise.weight"] = torch.zeros(2)
    save_file(state, path, metadata={"format": "pt"})
    index_path = path.parent / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["blocks.0.attn.surprise.weight"] = path.name
    index_path.write_text(json.dumps(index))
    return "blocks.0.attn.surprise.weight"


def break_missing_key(folder: Path) -> str:
    path = folder / "FL2VA" / "audio_vae" / "model.safetensors"
    state = load_file(path)
    key = sorted(state)[-1]
    del state[key]
    save_file(state, path, metadata={"format": "pt"})
    return key


def break_missing_config_field(folder: Path) -> str:
    path = folder / "FL2VA" / "transformer" / "config.json"
    config = json.loads(path.read_text())
    for name in ("num_layers", "num_hidden_layers"):
        config.pop(name, None)
    path.write_text(json.dumps(config))
    return "config.json"


BREAKAGES = [
    break_missing_folder,
    break_missing_shard,
    break_truncated_file,
    break_wrong_shape,
    break_extra_key,
    break_missing_key,
    break_missing_config_field,
]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda function: function.__name__)
def test_broken_checkpoint_fails_at_load_naming_the_problem(native: Path, tmp_path: Path, breakage) -> None:
    folder = copy_checkpoint(native, tmp_path / "ckpt")
    named = breakage(folder)
    with pytest.raises(CheckpointError, match=None) as error:
        Engine.from_checkpoint(folder, device="cpu", dtype=torch.float32)
    assert named in str(error.value)


def test_cli_exit_codes(native: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_checkpoint(native, tmp_path / "ckpt")
    break_missing_shard(folder)
    out = tmp_path / "out.mp4"
    result = run_cli("generate", "--checkpoint", str(folder), "--prompt", "a cat", "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "model-00002-of-00002.safetensors" in result.stderr
    assert not out.exists()

    # The same CLI in this process (the exit code and stderr line come from `main`, as shown above for a process).
    code = cli_main(
        ["generate", "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "a", "--out", str(out)]
    )
    assert code == 2 and "does not exist" in capsys.readouterr().err

    result = run_cli(
        "generate", "--checkpoint", str(native), "--prompt", "a", "--duration", "30", "--out", str(out)
    )
    assert result.returncode == 2 and "duration" in result.stderr
    assert not out.exists() and list(tmp_path.glob("*.mp4")) == []


def test_cli_generates_mp4_sidecar_and_tensors(native: Path, tmp_path: Path) -> None:
    out = tmp_path / "clip.mp4"
    tensors = tmp_path / "clip.safetensors"
    result = run_cli(
        "generate",
        "--checkpoint",
        str(native),
        "--prompt",
        "Waves roll onto a beach.",
        "--steps",
        "2",
        "--seed",
        "9",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--save-tensors",
        str(tensors),
    )
    assert result.returncode == 0, result.stderr
    from h3engine.media.mux import probe_mp4

    probe = probe_mp4(out)
    assert (probe["video_codec"], probe["pix_fmt"], probe["fps"], probe["frame_count"]) == (
        "h264",
        "yuv420p",
        24,
        124,
    )
    assert (probe["audio_codec"], probe["audio_sample_rate"], probe["audio_channels"]) == ("aac", 32000, 2)
    assert probe["moov_before_mdat"]
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["seed"] == 9 and sidecar["recipe"] == "sglang"
    assert sidecar["request"]["prompt"] == "Waves roll onto a beach."
    assert {"text_encode_s", "denoise_s", "video_decode_s", "audio_decode_s", "mux_s"} <= set(
        sidecar["timings_s"]
    )
    saved = load_file(tensors)
    assert saved["video"].shape == (124, 32, 56, 3) and saved["video"].dtype == torch.float32
    assert saved["audio"].shape[0] == 2
    assert saved["video_latents"].shape == (4, 37, 8, 14)
    assert saved["audio_latents"].shape == (2, 4, 207)
    assert 0.0 <= float(saved["video"].min()) and float(saved["video"].max()) <= 1.0


def test_make_tiny_checkpoint_cli_refuses_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("keep me")
    result = run_cli("make-tiny-checkpoint", str(tmp_path / "x"))
    assert result.returncode == 2 and "not empty" in result.stderr
    assert (tmp_path / "x" / "file").read_text() == "keep me"


def test_row_slice_reads_only_the_asked_rows(native: Path) -> None:
    # A tensor-parallel rank reads its rows of a shard without loading the whole tensor.
    from h3engine.checkpoint.safetensors_io import WeightFiles

    files = WeightFiles.open(native / "FL2VA" / "transformer")
    key = "blocks.0.attn.qkv_proj.weight"
    whole = files.tensor(key)
    assert torch.equal(files.row_slice(key, 12, 36), whole[12:36])
    assert files.infos[key].shape == tuple(whole.shape)
