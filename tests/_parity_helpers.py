"""What the whole-generation comparisons with diffusers 0.42.1 share: the reference pipelines and their runs.

`reference_pipeline(folder, workflow)` loads diffusers' ModularPipeline for one workflow at fp32;
`reference_run(pipeline, seed=..., **inputs)` runs it with `recipe="diffusers"`'s generator and returns the inputs
of every DiT forward and the decoded video [F, H, W, 3] and audio; `reference_objects` turns our `Reference`s into
diffusers' own reference loaders. `synthetic_image` draws a deterministic test picture, `relative_l2` compares.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from h3engine.cli.validation.reference import diffusers_references
from h3engine.request.files import Reference

# The keyword inputs of diffusers' DiT forward, in our DiT's positional order.
DIT_INPUT_NAMES = (
    "hidden_states",
    "audio_hidden_states",
    "encoder_hidden_states",
    "timestep",
    "timestep_indices",
    "token_tags",
    "position_ids",
    "video_indices",
    "audio_indices",
    "text_indices",
)


def relative_l2(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth gradient with texture, so that resampling and cropping differences show in the latents."""
    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[0:height, 0:width]
    base = np.stack(
        [columns * 255 / width, rows * 255 / height, (rows + columns) * 127 / (width + height)], -1
    )
    return Image.fromarray(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8))


def reference_pipeline(folder: Path, workflow: str):
    """diffusers' ModularPipeline for `workflow` on the checkpoint `folder`, at fp32, without progress bars."""
    from diffusers import ModularPipeline

    pipeline = ModularPipeline.from_pretrained(str(folder), workflow=workflow)
    pipeline.load_components(dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def reference_run(pipeline, **inputs) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    seed = inputs.pop("seed")
    transformer = pipeline.transformer_ref if "references" in inputs else pipeline.transformer
    calls: list[dict] = []

    def capture(module, args, kwargs) -> None:
        # Cloned: the loop writes the generated rows in place after the forward.
        calls.append({name: kwargs[name].clone() for name in DIT_INPUT_NAMES})

    handle = transformer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        state = pipeline(**inputs, generator=torch.Generator().manual_seed(seed), output_type="pt")
    finally:
        handle.remove()
    video = state.get("videos")[0].permute(0, 2, 3, 1).float()
    return calls, video, state.get("audio")[0].float()


def reference_objects(references: tuple[Reference, ...]) -> list:
    return diffusers_references(references)
