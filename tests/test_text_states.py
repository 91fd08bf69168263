"""Text-encoder states kept between requests (h3engine.engine.conditioning.text_states): a rerun with another seed skips the
encoder and generates what a fresh encode gives; another prompt, other references or another encoder do not hit.

How it breaks: a key without the pixel tensors would hand a Ref2VA request the states of other references (the
outputs would differ from a fresh engine's); a cache that never hits leaves the encoder's counter moving.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _runtime_helpers import ASSETS, parity_requests

from h3engine.engine.conditioning.text_states import TEXT_STATES, TextStateCache, presentation_key
from h3engine.engine.engine import Engine
from h3engine.request.files import Reference

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("native", seed=13)


def _encoder_calls(engine: Engine, task: str) -> list[int]:
    """Counts the calls of the task's text encoder (its `encode`, which the pipeline calls)."""
    calls = [0]
    encoder = engine.store.models_for_task(task).text_encoder
    encode = encoder.encode

    def counted(*args, **kwargs):
        calls[0] += 1
        return encode(*args, **kwargs)

    encoder.encode = counted
    return calls


def test_a_rerun_skips_the_text_encoder_and_generates_the_same(checkpoint) -> None:
    engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")
    calls = _encoder_calls(engine, "t2va")
    encoder = engine.store.models_for_task("t2va").text_encoder
    first = parity_requests(steps=2, seed=4)["t2va"]
    before = TEXT_STATES.hits
    engine.generate(first)
    assert calls[0] == 1
    rerun = dataclasses.replace(first, seed=9)
    got, _ = engine.generate(rerun)
    assert calls[0] == 1 and TEXT_STATES.hits == before + 1  # the states came back
    fresh = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")
    expected, _ = fresh.generate(rerun)
    for name in OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    engine.generate(dataclasses.replace(first, prompt="a blue kite over the sea"))
    assert calls[0] == 2  # another prompt: encoded
    assert TEXT_STATES.size_bytes(encoder) > 0


def test_other_references_are_encoded_again(checkpoint) -> None:
    engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")
    calls = _encoder_calls(engine, "ref2va")
    request = parity_requests(steps=1, seed=4)["ref2va"]
    other = dataclasses.replace(
        request,
        references=(
            Reference("image", str(ASSETS / "fl2va" / "first.png")),
            Reference("audio", str(ASSETS / "ref2va" / "audio1.wav")),
        ),
    )
    engine.generate(request)
    got, _ = engine.generate(other)
    assert calls[0] == 2
    expected, _ = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off").generate(other)
    assert torch.equal(got.video_latents, expected.video_latents)
    engine.generate(dataclasses.replace(other, seed=77))
    assert calls[0] == 2


def test_the_cache_is_bounded_and_keyed_by_encoder() -> None:
    cache = TextStateCache(capacity_bytes=3 * 4 * 100)
    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    for index in range(5):
        cache.put(first, f"k{index}", torch.full((100,), float(index)))
    assert cache.get(first, "k0") is None and torch.equal(cache.get(first, "k4"), torch.full((100,), 4.0))
    assert cache.size_bytes(first) <= 3 * 4 * 100
    assert cache.get(second, "k4") is None


def test_the_key_reads_every_input_tensor() -> None:
    from h3engine.engine.conditioning.presentation import Presentation

    ids = torch.tensor([[1, 2, 3]])
    base = Presentation(ids, torch.zeros(3, dtype=torch.int64), {"pixel_values": torch.ones(2, 4)})
    keys = {
        presentation_key(base),
        presentation_key(dataclasses.replace(base, input_ids=torch.tensor([[1, 2, 4]]))),
        presentation_key(dataclasses.replace(base, vision_inputs={"pixel_values": torch.ones(2, 4) * 2})),
        presentation_key(dataclasses.replace(base, vision_inputs={})),
    }
    assert len(keys) == 4
    assert presentation_key(dataclasses.replace(base, row_tags=torch.ones(3, dtype=torch.int64))) == (
        presentation_key(base)
    )
