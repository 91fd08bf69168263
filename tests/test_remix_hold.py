"""Held target rows (h3engine.engine.sampling.hold) on the tiny checkpoint: kept rows stay the source, masks 0 and 1."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from h3engine.engine.engine import Engine
from h3engine.engine.pipeline import PreparedRequest, StepEvent, denoise_request
from h3engine.engine.sampling.hold import HeldRows, audio_range_mask, pool_spatial_mask, video_range_mask
from h3engine.engine.sampling.packing import audio_latents_to_rows, patchify_video
from h3engine.request.geometry import Geometry
from h3engine.request.model import GenerationRequest

STEPS = 2


@pytest.fixture(scope="module")
def engine(tiny_native: Path) -> Engine:
    return Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)


def request(seed: int) -> GenerationRequest:
    return GenerationRequest(
        task="t2va", prompt="waves on rocks", duration_seconds=4.0, steps=STEPS, seed=seed
    )


@pytest.fixture(scope="module")
def source(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """A 'source' clip's latents: a plain generation with another seed, as packed rows."""
    latents = run(engine, engine.prepare(request(seed=11)))
    return patchify_video(latents.video_latents, 2), audio_latents_to_rows(latents.audio_latents)


def run(engine: Engine, prepared: PreparedRequest, on_step=None):  # noqa: ANN001, ANN201
    models = engine.models_for(request(0))
    with torch.inference_mode():
        return denoise_request(models, prepared, engine.device, on_step)


def held(geometry: Geometry, source, video: float | None, audio: float | None) -> HeldRows:  # noqa: ANN001
    video_rows, audio_rows = source
    fields = {}
    if video is not None:
        fields |= {"video_mask": torch.full((geometry.video_rows,), video), "video_clean": video_rows}
    if audio is not None:
        fields |= {"audio_mask": torch.full((geometry.audio_rows,), audio), "audio_clean": audio_rows}
    return HeldRows(**fields)


def test_held_video_rows_equal_the_source_after_every_step_and_audio_is_generated(
    engine: Engine, source
) -> None:
    plain = engine.prepare(request(seed=3))
    steps: list[torch.Tensor] = []

    def on_step(event: StepEvent) -> None:
        steps.append(event.video_rows.clone())

    latents = run(engine, replace(plain, held=held(plain.geometry, source, video=0.0, audio=None)), on_step)
    assert len(steps) == STEPS
    for rows in steps:
        assert torch.equal(rows, source[0])
    generated = audio_latents_to_rows(latents.audio_latents)
    assert not torch.allclose(generated, source[1], atol=1e-3)
    # The audio was generated under the held video: it differs from plain generation with the same seed too.
    assert not torch.equal(latents.audio_latents, run(engine, plain).audio_latents)


def test_held_audio_rows_are_fed_clean_every_step_and_video_is_generated(engine: Engine, source) -> None:
    plain = engine.prepare(request(seed=3))
    dit = engine.models_for(request(0)).dit
    fed: list[torch.Tensor] = []
    hook = dit.register_forward_hook(lambda module, args, output: fed.append(args[1].clone()))
    try:
        latents = run(engine, replace(plain, held=held(plain.geometry, source, video=None, audio=0.0)))
    finally:
        hook.remove()
    assert len(fed) == STEPS
    for audio_rows in fed:
        assert torch.equal(audio_rows, source[1])
    assert torch.equal(audio_latents_to_rows(latents.audio_latents), source[1])
    assert not torch.allclose(patchify_video(latents.video_latents, 2), source[0], atol=1e-3)


def test_an_all_zero_mask_reproduces_the_source(engine: Engine, source) -> None:
    plain = engine.prepare(request(seed=5))
    latents = run(engine, replace(plain, held=held(plain.geometry, source, video=0.0, audio=0.0)))
    assert torch.equal(patchify_video(latents.video_latents, 2), source[0])
    assert torch.equal(audio_latents_to_rows(latents.audio_latents), source[1])


def test_an_all_one_mask_equals_plain_generation_bit_for_bit(engine: Engine, source) -> None:
    plain = engine.prepare(request(seed=5))
    expected = run(engine, plain)
    latents = run(engine, replace(plain, held=held(plain.geometry, source, video=1.0, audio=1.0)))
    assert torch.equal(latents.video_latents, expected.video_latents)
    assert torch.equal(latents.audio_latents, expected.audio_latents)
    # A mask of all 1 built from a range over the whole clip is the same mask.
    geometry = plain.geometry
    assert bool((video_range_mask(geometry, [(0.0, geometry.duration)]) == 1).all())
    assert bool((audio_range_mask(geometry, [(0.0, geometry.duration)]) == 1).all())


def test_a_range_mask_keeps_the_rows_outside_it(engine: Engine, source) -> None:
    plain = engine.prepare(request(seed=5))
    geometry = plain.geometry
    video_mask = video_range_mask(geometry, [(1.0, 2.0)])
    audio_mask = audio_range_mask(geometry, [(1.0, 2.0)])
    assert 0 < int(video_mask.sum()) < geometry.video_rows and 0 < int(audio_mask.sum()) < geometry.audio_rows
    hold = HeldRows(video_mask, source[0], audio_mask, source[1])
    latents = run(engine, replace(plain, held=hold))
    video_rows, audio_rows = (
        patchify_video(latents.video_latents, 2),
        audio_latents_to_rows(latents.audio_latents),
    )
    assert torch.equal(video_rows[video_mask == 0], source[0][video_mask == 0])
    assert torch.equal(audio_rows[audio_mask == 0], source[1][audio_mask == 0])
    assert not torch.allclose(video_rows[video_mask == 1], source[0][video_mask == 1], atol=1e-3)
    assert not torch.allclose(audio_rows[audio_mask == 1], source[1][audio_mask == 1], atol=1e-3)


def test_a_mask_image_is_pooled_to_the_patch_grid_and_limits_the_regenerated_rows() -> None:
    geometry = Geometry(
        height=32, width=56, frames=107, latent_frames=32, latent_h=8, latent_w=14, audio_latents=178
    )
    image = torch.zeros(32, 56)
    image[:9, :13] = 1.0  # white: regenerate (a corner, a little past one 8x8 cell each way)
    grid = pool_spatial_mask(image, 4, 7)
    assert grid.shape == (4, 7)
    assert grid[:2, :2].eq(1).all() and grid.sum() == 4  # max pooling: a touched cell is regenerated
    mask = video_range_mask(geometry, [(1.0, 2.0)], grid).reshape(32, 28)
    frames = video_range_mask(geometry, [(1.0, 2.0)]).reshape(32, 28)[:, 0]
    assert torch.equal(mask[frames == 1], grid.reshape(1, -1).expand(int(frames.sum()), -1))
    assert mask[frames == 0].eq(0).all()
    # Latent frames follow the VAE's spans (1, 4, 4, 4, 4): 1.0-2.0 s is pixel frames 24-47.
    assert frames.nonzero().flatten().tolist() == list(range(7, 15))
