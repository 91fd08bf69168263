"""`generate --lora PATH[:STRENGTH] --lora-target ...` on a tiny checkpoint: a LoRA file that does not fit the DiT is
refused (exit 2, one line naming the file and key) before any model loads; a run with LoRAs lists each in its
sidecar, as the request's `loras` and as the engine's `adapters` (file name, sha256, strength, target)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from _lora_helpers import random_lora, write_lora

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source
from h3engine.cli import main as cli
from h3engine.models.dit_config import DiTConfig


def dit_config(checkpoint: Path) -> DiTConfig:
    layout = detect_layout(checkpoint)
    return dit_source(layout, layout.for_task("t2va"), torch.float32).config


def generate(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--checkpoint", str(checkpoint), "--prompt", "A fox in the snow.", "--device", "cpu"] + [
        "--dtype", "float32", "--steps", "2", "--duration", "4", "--out", str(out), "--progress", "plain", *extra
    ]  # fmt: skip


def test_a_lora_that_does_not_fit_is_refused_before_models_load(
    capsys, tmp_path, tiny_native, monkeypatch
) -> None:
    config = dit_config(tiny_native)
    wider = dataclasses.replace(config, hidden_size=2 * config.hidden_size)
    path = tmp_path / "wide.safetensors"
    write_lora(path, random_lora(wider, 1), "kohya", wider)
    monkeypatch.setattr(cli, "load_engine", lambda *args, **kwargs: pytest.fail("a model loaded"))
    code = cli.main(generate(tiny_native, tmp_path / "clip.mp4", "--lora", f"{path}:0.5"))
    error = capsys.readouterr().err
    assert code == 2, error
    assert error.startswith("error: loras[0]: LoRA file 'wide.safetensors': key 'lora_unet_"), error
    assert "trained on another" in error and error.count("\n") == 1 and str(tmp_path) not in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["wide.safetensors"]


def test_a_run_with_loras_records_them(capsys, tmp_path, tiny_native) -> None:
    config = dit_config(tiny_native)
    first, second = tmp_path / "style.safetensors", tmp_path / "turbo:8.safetensors"
    write_lora(first, random_lora(config, 2), "original", config)
    write_lora(second, random_lora(config, 3), "diffusers", config)
    lora_flags = ["--lora", f"{first}:-0.5", "--lora", str(second), "--lora-target", "transformer"]
    code = cli.main(generate(tiny_native, tmp_path / "clip.mp4", *lora_flags))
    assert code == 0, capsys.readouterr().err
    sidecar = json.loads((tmp_path / "clip.json").read_text())
    assert sidecar["request"]["loras"] == [
        {"path": str(first), "strength": -0.5, "target": "transformer"},
        {"path": str(second), "strength": 1.0, "target": "transformer"},
    ]
    assert sidecar["adapters"] == [
        {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "strength": strength}
        | {"target": "transformer"}
        for path, strength in ((first, -0.5), (second, 1.0))
    ]
