"""Shared fixtures and markers.

Tiny checkpoints are made once per session and shared read-only: `tiny_native` and `tiny_diffusers` (seed 0),
and `tiny_checkpoints(layout, seed)` for the other seeds. A test that changes a checkpoint copies one first or
makes its own. Tests marked `cuda` skip, with the reason shown, when torch sees no CUDA GPU. The empty folders
gradio_client's downloads leave in the temp folder are removed when the run ends (`pytest_sessionfinish`).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.runtime.rank_process import RANK_MODULES

# The tests' own worker processes (tests/_parallel_*_helpers.py) start like the engine's ranks, from the one fork
# server of this process that has imported torch and the engine: a rank starts in a fraction of a second.
torch.multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_MODULES)


# The longest test files, run first (in this order, each file's own tests in theirs): `make test` runs two test
# processes, each taking a whole file at a time, and the long ones last would leave one process working alone.
LONGEST_FIRST = (
    "test_ray_serve.py",
    "test_memory_budgets_benchmark.py",
    "test_app_browser_jobs.py",
    "test_app_isolation.py",
    "test_app_endings.py",
    "test_outputs_and_cancel.py",
    "test_memory_streaming.py",
    "test_runtime_workers.py",
    "test_split_stages.py",
    "test_stall_watchdog.py",
    "test_serving_api.py",
    "test_conditioning_parity.py",
    "test_app_loras.py",
    "test_app_browser_references.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_gpu)


# gradio_client 2.x downloads each file a call returns into `<temp folder>/<token_hex(20)>/`, moves it into the
# client's `download_files` folder and leaves that folder behind, empty (`Endpoint._download_file`): 11 a job of the
# app (every MP4, sidecar, preview and take). It happens in the process that holds the Client: here, the tests.
_GRADIO_CLIENT_DOWNLOAD_FOLDER = re.compile(r"[0-9a-f]{40}")
_DOWNLOAD_FOLDERS_BEFORE = pytest.StashKey[set[Path]]()


def _gradio_client_download_folders() -> set[Path]:
    return {
        path
        for path in Path(tempfile.gettempdir()).iterdir()
        if _GRADIO_CLIENT_DOWNLOAD_FOLDER.fullmatch(path.name) and path.is_dir()
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the run's own process, not one of its test processes
        session.config.stash[_DOWNLOAD_FOLDERS_BEFORE] = _gradio_client_download_folders()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the empty download folders gradio_client made during the run (only empty ones that were not there
    before: nothing of anyone else's). Done once every test process has ended: while one runs, an empty folder may
    be a download of its own about to be filled."""
    before = session.config.stash.get(_DOWNLOAD_FOLDERS_BEFORE, None)
    if before is None:
        return
    for folder in _gradio_client_download_folders() - before:
        try:
            folder.rmdir()  # only if empty
        except OSError:
            pass


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
