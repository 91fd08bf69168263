"""Whole T2VA generations against diffusers 0.42.1 on tiny random-weight checkpoints (fp32, CPU).

`--recipe diffusers` reproduces diffusers' sampler (N grid points, N-1 forwards, one sequential CPU generator), so
the decoded video and audio must match the reference pipeline run from the same checkpoint folder. The same seed's
checkpoint written in the native layout must give exactly the same result as the diffusers layout.
"""

from __future__ import annotations

import os

import pytest
import torch

from h3engine.engine.engine import Engine
from h3engine.request.model import GenerationRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "A red fox runs through fresh snow at dawn. <d>[English] Look at that!</d> Wind hisses softly."


def relative_l2(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints) -> dict[str, object]:
    return {layout: tiny_checkpoints(layout, seed=3) for layout in ("native", "diffusers")}


def reference_generation(folder, prompt: str, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder), workflow="t2va")
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    state = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    )
    video = state.get("videos")[0].permute(0, 2, 3, 1)  # [F, 3, H, W] -> [F, H, W, 3]
    return video.float(), state.get("audio")[0].float()


def our_generation(folder, prompt: str, steps: int, seed: int, recipe: str = "diffusers"):
    engine = Engine.from_checkpoint(folder, device="cpu", dtype=torch.float32)
    request = GenerationRequest(task="t2va", prompt=prompt, steps=steps, seed=seed, recipe=recipe)
    output, geometry = engine.generate(request)
    return output, geometry


@pytest.mark.parametrize("layout", ["diffusers", "native"])
def test_t2va_matches_diffusers_pipeline(checkpoints, layout: str) -> None:
    steps, seed = 4, 11
    reference_video, reference_audio = reference_generation(checkpoints["diffusers"], PROMPT, steps, seed)
    output, geometry = our_generation(checkpoints[layout], PROMPT, steps, seed)

    assert (geometry.height, geometry.width, geometry.frames) == (32, 56, 124)
    assert output.video.shape == reference_video.shape == (124, 32, 56, 3)
    assert output.audio.shape == reference_audio.shape
    video_error = relative_l2(output.video, reference_video)
    audio_error = relative_l2(output.audio, reference_audio)
    assert video_error <= 1e-4, video_error
    assert audio_error <= 1e-4, audio_error
    # The comparison can fail: a different seed moves both outputs far beyond the tolerance.
    other_video, other_audio = reference_generation(checkpoints["diffusers"], PROMPT, steps, seed + 1)
    assert relative_l2(output.video, other_video) > 1e-2
    assert relative_l2(output.audio, other_audio) > 1e-2


def test_native_and_diffusers_layouts_generate_the_same(checkpoints) -> None:
    for recipe in ("sglang", "diffusers"):
        native, _ = our_generation(checkpoints["native"], PROMPT, 3, 5, recipe)
        diffusers, _ = our_generation(checkpoints["diffusers"], PROMPT, 3, 5, recipe)
        assert torch.equal(native.video_latents, diffusers.video_latents)
        assert torch.equal(native.audio_latents, diffusers.audio_latents)
        assert torch.equal(native.video, diffusers.video)
        assert torch.equal(native.audio, diffusers.audio)


def test_sglang_recipe_runs_one_forward_per_step(checkpoints) -> None:
    engine = Engine.from_checkpoint(checkpoints["native"], device="cpu", dtype=torch.float32)
    forwards = []
    engine.store.models_for_partition("fl2va").dit.register_forward_hook(lambda *args: forwards.append(1))
    for recipe, expected in (("sglang", 3), ("diffusers", 2)):
        forwards.clear()
        engine.generate(GenerationRequest(task="t2va", prompt=PROMPT, steps=3, seed=0, recipe=recipe))
        assert len(forwards) == expected
