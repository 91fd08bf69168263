"""The engine's model store builds every component through the loader it is given (what a worker rank relies on)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import ComponentSource
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.engine.engine import Engine
from h3engine.engine.model_store import ModelLoader


class RecordingLoader(ModelLoader):
    """Whole components, every call recorded; no audio VAE (as on a rank that does not decode audio)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def text_encoder(
        self, folder: Path, device: torch.device, dtype: torch.dtype, deferred=None, weights=None
    ):
        self.calls.append("text_encoder")
        return super().text_encoder(folder, device, dtype, deferred, weights)

    def dit(self, source: ComponentSource, device: torch.device, dtype: torch.dtype, deferred=None):
        self.calls.append("dit")
        return super().dit(source, device, dtype, deferred)

    def video_vae(self, source: ComponentSource, device: torch.device, deferred=None):
        self.calls.append("video_vae")
        return super().video_vae(source, device, deferred)

    def audio_vae(self, source: ComponentSource, device: torch.device, deferred=None):
        self.calls.append("audio_vae")
        return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("store") / "tiny", seed=2)


def test_the_engine_loads_its_first_partition_through_the_given_loader(checkpoint) -> None:
    loader = RecordingLoader()
    engine = Engine(detect_layout(checkpoint), torch.device("cpu"), torch.float32, loader=loader)
    assert sorted(loader.calls) == ["audio_vae", "dit", "text_encoder", "video_vae"]
    models = engine.store.models_for_partition(engine.store.first_partition)
    assert models.audio_vae is None
    assert models.dit.config.patch_size[-1] == models.spatial_factors[1]
    # Loaded once: asking again reuses the modules.
    engine.store.models_for_partition(engine.store.first_partition)
    assert len(loader.calls) == 4


def test_the_sidecar_names_the_engine_that_made_the_video(checkpoint) -> None:
    engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    record = engine.store.record()
    assert record["checkpoint"] == f"native:{Path(checkpoint).resolve()}"
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert record["memory_profile"] == "auto" and record["fp8_linear"] is False
    # On the CPU there is no budget: `auto` keeps every model resident, in the released bf16.
    assert set(record["memory_plan"].values()) == {"resident"} and record["weight_format"] == "bf16"
    assert record["kernels"]["attention"] == "sdpa"
