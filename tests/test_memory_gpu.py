"""Memory budgets on a CUDA GPU (every test here skips, with its reason, without one).

* A scaled-down DiT (bf16, 12 blocks of ~50 MB) streamed through a ring of 2 under a budget enforced with
  `torch.cuda.set_per_process_memory_fraction`: the forward's peak allocation stays under the budget (which the
  resident model alone exceeds) and the velocities equal the resident model's bit for bit; the copies run on their
  own stream (the ring's events order them), so a forward run twice gives the same bits.
* FP8 storage on the GPU dequantizes to exactly what the CPU reference computes.
* The engine under the streamed profile on the GPU (tiny checkpoint, mapped and pinned homes) equals resident.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from _runtime_helpers import parity_requests

from h3engine.checkpoint.safetensors_io import is_parked
from h3engine.engine.engine import Engine
from h3engine.memory.homes import dequantize_into, dequantized
from h3engine.memory.layers import dit_layers
from h3engine.memory.placement import Placement
from h3engine.memory.plan import RESIDENT, ModelPlacement, resident_plan
from h3engine.memory.streaming import LayerStream
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.quantization import quantize_rows

pytestmark = pytest.mark.cuda
MIB = 1 << 20


def scaled_down_dit() -> H3DiT:
    config = dataclasses.replace(
        DiTConfig.tiny(),
        hidden_size=1024,
        num_heads=8,
        head_dim=128,
        ffn_dim=4096,
        num_layers=12,
        time_hidden_dim=1024,
        time_embed_dim=512,
        rope_freq_dim=16,
    )
    torch.manual_seed(0)
    dit = H3DiT(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for parameter in dit.parameters():
            parameter.normal_(0.0, 0.02)
    return dit.eval().requires_grad_(False)


def test_a_streamed_dit_stays_under_a_budget_the_resident_one_exceeds() -> None:
    dit = scaled_down_dit()
    request = tiny_fl2va_request(dit.config, torch.bfloat16, seed=1).to("cuda")
    layer_bytes = sum(
        t.numel() * t.element_size()
        for part in ("attn", "mlp")
        for t in dit.blocks[0].get_submodule(part).parameters()
    )
    resident_bytes = sum(t.numel() * t.element_size() for t in dit.parameters())
    with torch.inference_mode():
        resident = dit.to("cuda")
        expected = resident(*request.as_h3_arguments())
        del resident
    dit = dit.to("cpu")
    torch.cuda.empty_cache()
    streamed = scaled_down_dit()
    LayerStream(dit_layers(streamed), 0, "cuda", 2)
    for tensor in [*streamed.parameters(), *streamed.buffers()]:
        if not is_parked(tensor):  # the rest of the model lives on the GPU
            tensor.data = tensor.data.to("cuda")
    other_bytes = torch.cuda.memory_allocated()
    # Two ring slots, what is not streamed and a generous allowance for this small request's activations.
    budget = other_bytes + 2 * layer_bytes + 64 * MIB
    assert budget < resident_bytes, "the test's budget must be one the resident model does not fit"
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            first = streamed(*request.as_h3_arguments())
            second = streamed(*request.as_h3_arguments())
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert peak <= budget, f"peak {peak / MIB:.0f} MiB over the {budget / MIB:.0f} MiB budget"
    for got in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_fp8_dequantizes_on_the_gpu_to_the_cpu_reference() -> None:
    weight = torch.randn(256, 512, dtype=torch.bfloat16)
    values, scales = quantize_rows(weight)
    on_gpu = dequantize_into(
        torch.empty(256, 512, dtype=torch.bfloat16, device="cuda"), values.cuda(), scales.cuda()
    )
    assert torch.equal(on_gpu.cpu(), dequantized(weight))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=11)


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_the_streamed_engine_on_a_gpu_equals_the_resident_one(checkpoint, task) -> None:
    request = parity_requests(steps=2, seed=3)[task]
    outputs = {}
    for profile in ("resident", "streamed"):
        engine = Engine.from_checkpoint(checkpoint, device="cuda", memory_profile=profile)
        outputs[profile], _ = engine.generate(request)
        del engine
        torch.cuda.empty_cache()
    for name in ("video", "audio", "video_latents", "audio_latents"):
        assert torch.equal(getattr(outputs["streamed"], name), getattr(outputs["resident"], name)), name


class FilesEngine(Engine):
    """Every model's layers streamed straight from the checkpoint files (the DiT's first block resident), in the
    weight format the files give (FP8 for a converted checkpoint)."""

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        from h3engine.memory.sizes import stored_weights

        files = ModelPlacement(layers="streamed", other="resident", home="mapped", ring_depth=2)
        models = {"text_encoder": files, "video_vae": files, "audio_vae": RESIDENT}
        models["dit"] = dataclasses.replace(files, resident_layers=1)
        plan = resident_plan(weights=stored_weights(self.layout))
        return Placement(dataclasses.replace(plan, models=models), device)


@pytest.mark.parametrize("task", ["t2va", "ref2va"])
def test_layers_read_from_the_files_on_a_gpu_equal_the_resident_engine(checkpoint, task) -> None:
    """Every streamed model's layers in the files, read by the reader threads into the page-locked host ring and
    copied to the GPU: the resident engine's outputs, bit for bit; and again once the AdaLN tables and the text
    states come from their caches."""
    request = parity_requests(steps=2, seed=3)[task]
    resident = Engine.from_checkpoint(checkpoint, device="cuda", memory_profile="resident", adaln_cache="off")
    expected, _ = resident.generate(request)
    del resident
    torch.cuda.empty_cache()
    engine = FilesEngine.from_checkpoint(checkpoint, device="cuda")
    for _ in range(2):
        got, _ = engine.generate(request)
        for name in ("video", "audio", "video_latents", "audio_latents"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
    stream = engine.placement.stream_of(engine.store.models_for_task(task).dit)
    assert stream.layer_reads > 0 and stream.host_bytes == 0 and stream.restarts == 0


def test_a_converted_fp8_checkpoint_on_a_gpu_equals_weights_fp8(checkpoint, tmp_path) -> None:
    from h3engine.checkpoint.fp8_files import convert_checkpoint

    converted = tmp_path / "fp8"
    convert_checkpoint(checkpoint, converted)
    request = parity_requests(steps=2, seed=3)["t2va"]
    reference = Engine.from_checkpoint(checkpoint, device="cuda", weights="fp8", memory_profile="streamed")
    expected, _ = reference.generate(request)
    del reference
    torch.cuda.empty_cache()
    engine = FilesEngine.from_checkpoint(converted, device="cuda")
    assert engine.plan.weights == "fp8"
    got, _ = engine.generate(request)
    for name in ("video", "audio", "video_latents", "audio_latents"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    stream = engine.placement.stream_of(engine.store.models_for_task("t2va").dit)
    assert stream.quantize and stream.layer_reads > 0 and stream.read_bytes > 0
