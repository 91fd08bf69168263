"""Remix on a CUDA GPU (every test here skips, with its reason, without one), tiny checkpoint, bf16 (the released
precision), one remix of each mode (v2a with an audio mask, a2v, extend):

* Held rows through the fused Triton ops: after every step the kept video rows are the source's latents, and the
  kept audio rows are fed to the DiT clean, exactly (holding copies, it computes nothing); the steps after the
  first never make the host wait for the device (torch's sync debug mode raises on any synchronizing call), so the
  per-row timesteps and masks stay on the device; the result agrees with the CPU's fp32 run within bf16's bound.
* The streamed memory profile on the GPU gives the resident engine's result bit for bit.
tests/test_remix_hold.py and tests/test_remix_tasks.py check the same modes on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _remix_helpers import every_mode, remix_request, write_sources

from h3engine.engine.engine import Engine
from h3engine.engine.pipeline import StepEvent, denoise_request

pytestmark = pytest.mark.cuda
STEPS = 3
# max |gpu - cpu| / max |cpu| over each latent tensor: the GPU runs bf16 against the CPU's fp32, a sanity bound as in
# tests/test_runtime_gpu.py (bf16 keeps 8 bits: ~4e-3 a rounding, compounded over the DiT's layers and the steps).
BF16_TOLERANCE = 1e-1


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_sources(tmp_path_factory.mktemp("remix_gpu_sources"))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=5)


def watched_run(engine: Engine, request):  # noqa: ANN001, ANN201
    """Denoise `request` with the sync debug mode armed after step 1; returns the prepared request, the latents,
    each step's video rows and each forward's audio input rows (clones, on the device)."""
    prepared = engine.prepare(request)
    models = engine.models_for(request)
    video_steps: list[torch.Tensor] = []
    audio_inputs: list[torch.Tensor] = []

    def on_step(event: StepEvent) -> None:
        video_steps.append(event.video_rows.clone())
        torch.cuda.set_sync_debug_mode(0 if event.step == event.total else "error")

    hook = models.dit.register_forward_hook(lambda module, args, output: audio_inputs.append(args[1].clone()))
    try:
        with torch.inference_mode():
            latents = denoise_request(models, prepared, engine.device, on_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        hook.remove()
    return prepared, latents, video_steps, audio_inputs


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float().cpu()
    return float((got.float().cpu() - expected).abs().max() / expected.abs().max())


def test_held_rows_stay_the_source_through_the_triton_ops_without_synchronizing(
    checkpoint: Path, sources
) -> None:
    gpu = Engine.from_checkpoint(checkpoint, device="cuda", dtype=torch.bfloat16)
    cpu = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    for mode, remix in every_mode(sources).items():
        request = remix_request(remix, steps=STEPS)
        prepared, latents, video_steps, audio_inputs = watched_run(gpu, request)
        held = prepared.held
        assert len(video_steps) == len(audio_inputs) == STEPS, mode
        if held.video_mask is not None:
            kept = (held.video_mask == 0).to(video_steps[0].device)
            clean = held.video_clean.to(video_steps[0].device)
            assert bool(kept.any()), mode
            for step, rows in enumerate(video_steps):
                assert torch.equal(rows[kept], clean[kept].to(rows.dtype)), (mode, step)
        if held.audio_mask is not None:
            kept = (held.audio_mask == 0).to(audio_inputs[0].device)
            clean = held.audio_clean.to(audio_inputs[0].device)
            assert bool(kept.any()), mode
            for forward, rows in enumerate(audio_inputs):
                assert torch.equal(rows[kept], clean[kept].to(rows.dtype)), (mode, forward)
        expected = cpu.prepare(request)
        with torch.inference_mode():
            reference = denoise_request(cpu.models_for(request), expected, cpu.device)
        for name in ("video_latents", "audio_latents"):
            error = relative_error(getattr(latents, name), getattr(reference, name))
            assert error < BF16_TOLERANCE, (mode, name, error)
    # The fused Triton ops ran (the tiny heads of 12 channels take SDPA: tests/test_step_loop_gpu.py says why, and
    # shows that the sync debug mode really raises on a synchronizing call).
    assert gpu.store.kernel_report() == {"attention": "sdpa", "fused_ops": "triton"}


def test_the_streamed_engine_on_a_gpu_remixes_as_the_resident_one(checkpoint: Path, sources) -> None:
    outputs = {}
    for profile in ("resident", "streamed"):
        engine = Engine.from_checkpoint(checkpoint, device="cuda", memory_profile=profile)
        outputs[profile] = {
            mode: engine.generate(remix_request(remix, steps=2))[0]
            for mode, remix in every_mode(sources).items()
        }
        del engine
        torch.cuda.empty_cache()
    for mode, resident in outputs["resident"].items():
        streamed = outputs["streamed"][mode]
        for name in ("video", "audio", "video_latents", "audio_latents"):
            assert torch.equal(getattr(streamed, name), getattr(resident, name)), (mode, name)
