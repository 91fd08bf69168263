"""Shared fixtures and markers.

Tiny checkpoints are made once per session and shared read-only: `tiny_native` and `tiny_diffusers` (seed 0),
and `tiny_checkpoints(layout, seed)` for the other seeds. A test that changes a checkpoint copies one first or
makes its own. Tests marked `cuda` skip, with the reason shown, when torch sees no CUDA GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from h3engine.checkpoint.tiny import make_tiny_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoints(layout="native", seed=0)`: the session's tiny checkpoint of that layout and seed."""
    made: dict[tuple[str, int], Path] = {}

    def tiny_checkpoint(layout: str = "native", seed: int = 0) -> Path:
        if (layout, seed) not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{layout}_{seed}") / "checkpoint"
            made[layout, seed] = make_tiny_checkpoint(folder, seed=seed, layout=layout)
        return made[layout, seed]

    return tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_native(tiny_checkpoints: Callable[..., Path]) -> Path:
    return tiny_checkpoints("native", seed=0)


@pytest.fixture(scope="session")
def tiny_diffusers(tiny_checkpoints: Callable[..., Path]) -> Path:
    return tiny_checkpoints("diffusers", seed=0)
