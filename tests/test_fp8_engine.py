"""The engine's optional FP8 linear layers: off by default, quantized blocks when asked, recorded in the sidecar,
and refused on a worker group by the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.models.quantization import Fp8Linear
from h3engine.request.model import GenerationRequest


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("native", seed=11)


def test_fp8_linear_quantizes_the_blocks_and_changes_the_output_a_little(checkpoint, tmp_path) -> None:
    request = GenerationRequest(task="t2va", prompt="a lighthouse at dusk", steps=3, seed=2)
    plain = Engine.from_checkpoint(checkpoint, "cpu", torch.float32)
    quantized = Engine.from_checkpoint(checkpoint, "cpu", torch.float32, fp8_linear=True)
    partition = plain.layout.for_task("t2va").partition
    plain_dit = plain.store.models_for_partition(partition).dit
    quantized_dit = quantized.store.models_for_partition(partition).dit
    assert not isinstance(plain_dit.blocks[0].mlp.fc1, Fp8Linear)
    assert isinstance(quantized_dit.blocks[0].mlp.fc1, Fp8Linear)
    assert isinstance(quantized_dit.blocks[0].attn.qkv_proj, Fp8Linear)
    expected, _ = plain.generate(request)
    actual, _ = quantized.generate(request)
    error = (actual.video_latents - expected.video_latents).norm() / expected.video_latents.norm()
    assert 0 < error < 0.2, error
    written = quantized.generate_to_file(request, tmp_path / "fp8.mp4")
    sidecar = json.loads(written.sidecar.read_text())
    assert sidecar["fp8_linear"] is True
    # What ran is recorded: on the CPU, the plain-torch twins and torch's SDPA.
    assert sidecar["kernels"] == {"attention": "sdpa", "fused_ops": "reference"}


def test_cli_refuses_fp8_on_a_worker_group(capsys, tmp_path) -> None:
    out = tmp_path / "o.mp4"
    code = main(
        ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a fox", "--out", str(out),
         "--fp8-linear", "--world-size", "2", "--device", "cpu"]
    )  # fmt: skip
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.startswith("error: --fp8-linear:") and stderr.count("\n") == 1
    assert not out.exists()
