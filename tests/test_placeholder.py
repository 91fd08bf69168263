"""Placeholder checkpoints (h3engine.checkpoint.placeholder): the released layout and shapes with weights drawn at load.

What must hold: the files pass every check the engine makes and cost only their headers on disk; the drawn values
are a function of (seed, key) alone, so slices and ranks agree and a second load gives the same model; they are
scaled so a generation stays finite; and a placeholder says so (warning, sidecar), a real checkpoint does not. A
component written with real bytes holds exactly the values its hole file draws, on disk and read as stored (its
extents known, as a released file's), and the checkpoint is still a placeholder.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import audio_vae_source, dit_source, video_vae_source
from h3engine.checkpoint.placeholder import is_placeholder, make_placeholder_checkpoint
from h3engine.checkpoint.safetensors_io import (
    PLACEHOLDER_KEY,
    PLACEHOLDER_VALUES_KEY,
    WeightFiles,
    placeholder_values,
    read_header,
    row_extents,
)
from h3engine.checkpoint.text_encoder_files import check_text_encoder_files, open_text_encoder_files
from h3engine.cli.main import main as cli_main
from h3engine.engine.engine import Engine
from h3engine.models.dit_config import DiTConfig
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.request.model import GenerationRequest


@pytest.fixture(scope="module")
def tiny_placeholder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_placeholder_checkpoint(
        tmp_path_factory.mktemp("placeholder") / "checkpoint", seed=3, tiny=True
    )


@pytest.fixture(scope="module")
def released_placeholder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_placeholder_checkpoint(tmp_path_factory.mktemp("released") / "checkpoint", seed=0)


def test_a_released_placeholder_passes_every_check_and_holds_headers_only(released_placeholder: Path) -> None:
    layout = detect_layout(released_placeholder)
    assert layout.kind == "native" and set(layout.partitions) == {"fl2va", "ref2va"}
    for paths in layout.partitions.values():
        dit = dit_source(layout, paths, torch.bfloat16)
        for source in (dit, video_vae_source(layout, paths), audio_vae_source(layout, paths)):
            source.check()  # keys and shapes against our modules at the released configs
        assert dit.config == DiTConfig.released() and dit.files.placeholder
        config, files = open_text_encoder_files(paths.text_encoder)
        assert config.text_config.num_hidden_layers == 64  # Qwen3-VL-32B, as released
        with torch.device("meta"):
            encoder = H3TextEncoder(config)
        check_text_encoder_files(encoder, files)
    # The DiT file is as long as the release's tensors say (bf16 with fp32 islands, about 66 GB) ...
    transformer = released_placeholder / "FL2VA" / "transformer" / "model.safetensors"
    infos = read_header(transformer)
    data = sum(math.prod(info.shape) * info.dtype.itemsize for info in infos.values())
    assert data > 60e9 and transformer.stat().st_size > data
    # ... and what was written is its header: the data was never written (a hole, on file systems that have them).
    written = sum(path.stat().st_blocks * 512 for path in released_placeholder.rglob("*") if path.is_file())
    assert written < 64e6 or not hasattr(transformer.stat(), "st_blocks")
    assert is_placeholder(released_placeholder)


def test_drawn_values_depend_on_seed_and_key_only(tiny_placeholder: Path) -> None:
    files = WeightFiles.open(tiny_placeholder / "FL2VA" / "transformer")
    matrix = next(key for key, info in files.infos.items() if len(info.shape) == 2 and info.shape[0] >= 4)
    whole = files.tensor(matrix)
    again = WeightFiles.open(
        tiny_placeholder / "Ref2VA" / "transformer"
    )  # another seed: the other partition's
    assert torch.equal(whole, WeightFiles.open(tiny_placeholder / "FL2VA" / "transformer").tensor(matrix))
    assert not torch.equal(whole, again.tensor(matrix))
    assert torch.equal(files.row_slice(matrix, 1, 3), whole[1:3])
    assert torch.equal(files.column_slice(matrix, 1, 3), whole[:, 1:3])
    assert whole.dtype == files.infos[matrix].dtype and tuple(whole.shape) == files.infos[matrix].shape


def test_drawn_values_are_scaled_per_kind(tmp_path: Path) -> None:
    # One large tensor per rule: the sample statistics of 2^20+ values are within 1 % of the rule's (the standard
    # error of a standard deviation over n draws is about 1/sqrt(2n) = 0.07 %; bf16 rounds each value by <= 0.4 %).
    from h3engine.checkpoint.safetensors_io import TensorInfo

    def info(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> TensorInfo:
        return TensorInfo(tmp_path / "x.safetensors", dtype, shape, placeholder_seed=1)

    matrix = placeholder_values("blocks.0.ffn.w1.weight", info((2048, 1024))).float()
    assert abs(matrix.std().item() * math.sqrt(1024) - 1) < 0.01 and abs(matrix.mean().item()) < 1e-3
    bias = placeholder_values("blocks.0.ffn.w1.bias", info((1_500_000,), torch.float32))
    assert abs(bias.std().item() - 0.1) < 0.001
    gain = placeholder_values("blocks.0.norm1.weight", info((1_500_000,), torch.float32))
    assert abs(gain.mean().item() - 1) < 0.001 and abs(gain.std().item() - 0.1) < 0.001
    counts = placeholder_values("position_ids", info((7,), torch.int64))
    assert counts.dtype == torch.int64 and not counts.any()


def test_a_tiny_placeholder_generates_the_same_finite_output_twice(tiny_placeholder: Path, caplog) -> None:
    request = GenerationRequest(
        task="t2va", prompt="A kite over the sea.", steps=2, duration_seconds=4.0, seed=5
    )
    outputs = []
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="h3engine.engine.model_store"):
            engine = Engine.from_checkpoint(tiny_placeholder, device="cpu", dtype=torch.float32)
        output, _ = engine.generate(request)
        outputs.append(output)
    assert "holds placeholder weights" in caplog.text
    first, second = outputs
    for name in ("video", "audio", "video_latents", "audio_latents"):
        a, b = getattr(first, name), getattr(second, name)
        assert torch.isfinite(a).all() and a.float().std() > 0, name
        assert torch.equal(a, b), name  # the same draws, the same computation
    assert engine.record()["weights"] == "placeholder"


def test_the_cli_writes_one_and_sidecars_say_placeholder(tmp_path: Path, tiny_native: Path) -> None:
    folder = tmp_path / "placeholder"
    assert cli_main(["make-placeholder-checkpoint", str(folder), "--tiny", "--seed", "2"]) == 0
    assert cli_main(["make-placeholder-checkpoint", str(folder), "--tiny"]) == 2  # not empty
    arguments = ["--prompt", "A kite.", "--steps", "1", "--duration", "4", "--device", "cpu", "--quiet"]
    assert (
        cli_main(["generate", "--checkpoint", str(folder), *arguments, "--out", str(tmp_path / "p.mp4")]) == 0
    )
    assert json.loads((tmp_path / "p.json").read_text())["weights"] == "placeholder"
    assert (
        cli_main(["generate", "--checkpoint", str(tiny_native), *arguments, "--out", str(tmp_path / "r.mp4")])
        == 0
    )
    assert "weights" not in json.loads((tmp_path / "r.json").read_text())
    assert not is_placeholder(tiny_native)


def header_metadata(path: Path) -> dict[str, str]:
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        return json.loads(handle.read(length)).get("__metadata__", {})


def test_real_bytes_hold_the_values_the_hole_draws(tmp_path: Path, tiny_placeholder: Path) -> None:
    real = make_placeholder_checkpoint(tmp_path / "real", seed=3, tiny=True, real_bytes=("dit",))
    for partition in ("FL2VA", "Ref2VA"):
        holes = WeightFiles.open(tiny_placeholder / partition / "transformer")
        stored = WeightFiles.open(real / partition / "transformer")
        assert set(stored.infos) == set(holes.infos) and holes.placeholder and stored.placeholder
        for key, info in stored.infos.items():
            assert torch.equal(stored.tensor(key), holes.tensor(key)), key
            # Read as stored: its bytes have extents (the reader threads' path), a hole's have none.
            assert (
                row_extents(info, info.dtype) is not None
                and row_extents(holes.infos[key], info.dtype) is None
            )
        path, hole = (
            real / partition / "transformer" / "model.safetensors",
            next(iter(holes.infos.values())).file,
        )
        assert PLACEHOLDER_KEY not in header_metadata(path) and header_metadata(path)[PLACEHOLDER_VALUES_KEY]
        # On disk: the real-bytes file's blocks cover its length; the hole's cover little more than its header.
        header = 8 + int.from_bytes(hole.read_bytes()[:8], "little")
        assert path.stat().st_blocks * 512 >= path.stat().st_size - 4096
        assert hole.stat().st_blocks * 512 <= header + 8192 < hole.stat().st_size
    # The other components stayed holes.
    assert (
        WeightFiles.open(real / "FL2VA" / "text_encoder").infos["lm_head.weight"].placeholder_seed is not None
    )
    assert is_placeholder(real) and is_placeholder(tiny_placeholder)
    dits = []
    for folder in (tiny_placeholder, real):
        engine = Engine.from_checkpoint(folder, device="cpu", dtype=torch.float32)
        assert engine.store.placeholder and engine.record()["weights"] == "placeholder"
        dits.append(engine.store.models_for_task("t2va").dit.state_dict())
    assert (
        all(torch.equal(dits[0][key], dits[1][key]) for key in dits[0]) and dits[0].keys() == dits[1].keys()
    )


def test_the_cli_writes_real_bytes_and_refuses_an_unknown_component(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "real"
    assert cli_main(["make-placeholder-checkpoint", str(folder), "--tiny", "--real-bytes", "dit,nope"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --real-bytes: unknown component nope (expected some of dit, text_encoder, video_vae, audio_vae)"
    ]
    assert not folder.exists() or not any(folder.iterdir())
    assert cli_main(["make-placeholder-checkpoint", str(folder), "--tiny", "--real-bytes", " video_vae"]) == 0
    vae = WeightFiles.open(folder / "FL2VA" / "video_vae" / "source")
    assert vae.placeholder and all(info.drawn for info in vae.infos.values())
    assert all(
        info.placeholder_seed is not None
        for info in WeightFiles.open(folder / "FL2VA" / "transformer").infos.values()
    )


def test_the_app_on_a_placeholder_says_so_and_serves(tmp_path: Path, tiny_placeholder: Path) -> None:
    import httpx
    from _app_helpers import start_app, stop_app
    from gradio_client import Client

    app = start_app(tmp_path, checkpoint=tiny_placeholder)
    try:
        config = httpx.get(f"{app.url}config").text
        assert "Placeholder weights" in config and "`checkpoint` is a placeholder" in config
        assert str(tiny_placeholder) not in config  # named by its folder, never its path
        status = Client(app.url, verbose=False).predict(
            prompt="A kite.", steps=1, duration_seconds=4, randomize_seed=False, api_name="/t2va"
        )[0]
        assert status.startswith("Done in"), status
    finally:
        assert stop_app(app) == 0
