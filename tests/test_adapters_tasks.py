"""LoRA adapters on the FL2VA and Ref2VA DiTs: whole fp32 generations equal diffusers 0.42.1's `load_lora_weights`.

FL2VA (first and last keyframe, the `transformer` partition) with files in layouts that name keys differently
(diffusers' `transformer.` names, the original module names under ai-toolkit's `diffusion_model.`, kohya's
flattened names with alphas), one at a strength other than 1; Ref2VA (two image references, `transformer_ref`) with
a `transformer_ref.` file routed by its prefix, and with an unprefixed file sent there by an explicit target
(diffusers: `load_into_transformer_ref=True`). Strength 0 and removal give the base outputs bit for bit, per task.
The tiny checkpoint, 3 steps (2 forwards) and the default 5 s (diffusers takes no shorter clip) keep the file quick;
tests/test_adapters.py does T2VA.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from _lora_helpers import assert_changed, assert_equal, loras_loaded, small_lora, write_lora
from _parity_helpers import reference_objects, reference_pipeline, reference_run, relative_l2, synthetic_image

from h3engine.engine.engine import Engine
from h3engine.engine.lora.adapters import adapted_layers
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest, LoraChoice

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FL2VA_PROMPT = "At 0.00 seconds <Picture 1> is fully referenced. A fox runs through snow; wind hisses softly."
REF2VA_PROMPT = "<Picture 1> walks along the beach in the style of <Picture 2>, humming softly."
STEPS, SEED = 3, 11
# fp32 on both sides, as in tests/test_adapters.py: only summation order differs (peft adds B(A x) after the
# base linear as we do); measured <= 4e-7 here, while the LoRA moves the outputs by ~10 % (`assert_changed`).
PARITY_BOUND = 1e-5
WORKFLOWS = ("fl2va", "ref2va")


@pytest.fixture(scope="module")
def engine(tiny_checkpoints) -> Engine:
    return Engine.from_checkpoint(tiny_checkpoints("diffusers", seed=3), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def pipelines(engine: Engine) -> dict:
    """diffusers' pipelines on the engine's checkpoint folder; each comparison loads its LoRAs and unloads them."""
    return {workflow: reference_pipeline(engine.layout.root, workflow) for workflow in WORKFLOWS}


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> dict[str, GenerationRequest]:
    """One request per task, its pictures written here."""
    folder = tmp_path_factory.mktemp("pictures")
    wide, tall = folder / "wide.png", folder / "tall.png"
    synthetic_image(72, 40, 1).save(wide)
    synthetic_image(40, 64, 2).save(tall)
    common = {"steps": STEPS, "seed": SEED, "recipe": "diffusers"}
    keyframes = (Keyframe(str(wide), "first"), Keyframe(str(tall), "last"))
    references = (Reference("image", str(wide)), Reference("image", str(tall)))
    return {
        "fl2va": GenerationRequest(task="fl2va", prompt=FL2VA_PROMPT, keyframes=keyframes, **common),
        "ref2va": GenerationRequest(task="ref2va", prompt=REF2VA_PROMPT, references=references, **common),
    }


@pytest.fixture(scope="module")
def bases(engine: Engine, requests: dict[str, GenerationRequest]) -> dict:
    return {task: engine.generate(request)[0] for task, request in requests.items()}


def lora_file(folder: Path, engine: Engine, task: str, layout: str, seed: int) -> Path:
    """A small random LoRA for the DiT `task` runs, written in `layout`."""
    path = folder / f"{task}_{layout}_{seed}.safetensors"
    config = engine.store.dit_config(task)
    write_lora(path, small_lora(config, seed), layout, config)
    return path


def generate(engine: Engine, request: GenerationRequest, *choices: LoraChoice):
    return engine.generate(dataclasses.replace(request, loras=choices))[0]


def reference_generation(
    pipeline, request: GenerationRequest, frames: int, loras: list[tuple[Path, float]], into_ref: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' pipeline for the request's task with `loras` loaded, on the same pictures, steps and seed."""
    from diffusers.utils import load_image

    if request.task == "ref2va":
        inputs = {"references": reference_objects(request.references)}
    else:
        inputs = {
            ("image" if k.position == "first" else "last_image"): load_image(k.path)
            for k in request.keyframes
        }
    with loras_loaded(pipeline, loras, into_ref):
        _, video, audio = reference_run(
            pipeline, prompt=request.prompt, num_frames=frames, num_inference_steps=STEPS, seed=SEED, **inputs
        )
    return video, audio


def assert_equals_diffusers(output, reference: tuple[torch.Tensor, torch.Tensor], base) -> None:
    video, audio = reference
    assert output.video.shape == video.shape and output.audio.shape == audio.shape
    assert relative_l2(output.video, video) <= PARITY_BOUND, relative_l2(output.video, video)
    assert relative_l2(output.audio, audio) <= PARITY_BOUND, relative_l2(output.audio, audio)
    assert_changed(output, base)  # the comparison can fail: without the LoRA the outputs are ~10 % off


@pytest.mark.parametrize(
    ("layout", "strength"),
    [("diffusers", 1.0), ("ai_toolkit", 1.0), ("kohya", 0.6)],
)
def test_fl2va_with_a_lora_equals_diffusers(
    engine, pipelines, requests, bases, tmp_path, layout: str, strength: float
) -> None:
    path = lora_file(tmp_path, engine, "fl2va", layout, seed=31)
    # No target: diffusers' default, the file's `transformer.` prefix or none.
    output = generate(engine, requests["fl2va"], LoraChoice(str(path), strength))
    assert adapted_layers(engine.store.models_for_partition("fl2va").dit) > 0
    reference = reference_generation(
        pipelines["fl2va"], requests["fl2va"], output.video.shape[0], [(path, strength)]
    )
    assert_equals_diffusers(output, reference, bases["fl2va"])


@pytest.mark.parametrize(
    ("layout", "target", "into_ref"),
    [("diffusers_ref", None, False), ("ai_toolkit", "transformer_ref", True)],
    ids=["transformer_ref_prefix", "explicit_target"],
)
def test_ref2va_with_a_lora_equals_diffusers(
    engine, pipelines, requests, bases, tmp_path, layout: str, target: str | None, into_ref: bool
) -> None:
    path = lora_file(tmp_path, engine, "ref2va", layout, seed=32)
    output = generate(engine, requests["ref2va"], LoraChoice(str(path), 0.8, target))
    assert adapted_layers(engine.store.models_for_partition("ref2va").dit) > 0
    reference = reference_generation(
        pipelines["ref2va"], requests["ref2va"], output.video.shape[0], [(path, 0.8)], into_ref
    )
    assert_equals_diffusers(output, reference, bases["ref2va"])


@pytest.mark.parametrize("task", WORKFLOWS)
def test_strength_zero_and_removal_give_the_base_exactly(
    engine, requests, bases, tmp_path, task: str
) -> None:
    request = requests[task]
    path = lora_file(tmp_path, engine, task, "original", seed=33)
    target = "transformer_ref" if task == "ref2va" else "transformer"
    dit = engine.store.models_for_partition(task).dit
    weights = {name: tensor.clone() for name, tensor in dit.state_dict().items()}

    assert_equal(generate(engine, request, LoraChoice(str(path), 0.0, target)), bases[task])
    assert adapted_layers(dit) == 0
    assert_changed(generate(engine, request, LoraChoice(str(path), 1.0, target)), bases[task])
    assert adapted_layers(dit) > 0
    assert_equal(generate(engine, request), bases[task])
    assert adapted_layers(dit) == 0
    for name, tensor in dit.state_dict().items():
        assert torch.equal(tensor, weights[name]), name  # the weights were never written
