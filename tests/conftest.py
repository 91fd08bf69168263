"""Shared fixtures and markers.

Tiny checkpoints are made once per session and shared read-only: `tiny_native` and `tiny_diffusers` (seed 0),
and `tiny_checkpoints(layout, seed)` for the other seeds. A test that changes a checkpoint copies one first or
makes its own. Tests marked `cuda` skip, with the reason shown, when torch sees no CUDA GPU. A run's temp folder is
its own, removed when it ends (`pytest_configure`).
"""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# One compute thread per process (unless OMP_NUM_THREADS says otherwise), set before torch is imported, for this
# process, its test processes and everything they start (apps, ranks, CLIs): on a 2-core machine running two test
# processes and their children, OpenMP threads that spin waiting for work fight over the cores. Measured on one such
# machine, four multi-process files with two test processes: 146 s -> 100 s, 154 s -> 61 s of user CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# No cyclic collection while the test files are imported (torch, transformers, diffusers, gradio: millions of
# long-lived objects, next to no garbage); after it, what they made is frozen, so that the collections during the tests
# walk only what the tests make (`pytest_collection_finish`). Measured on four in-process files: 46.3 -> 43.0 s of CPU.
gc.disable()


def runs_tests(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller (`-n N`), which hands the tests to its test processes and runs none: it
    needs neither torch nor the engine, and importing them there would delay every test process's start."""
    return hasattr(config, "workerinput") or not config.getoption("numprocesses", None)


def prepare_test_process() -> None:
    """The tests' own worker processes (tests/_parallel_*_helpers.py) start like the engine's ranks, from the one fork
    server of this process that has imported torch and the engine: a rank starts in a fraction of a second."""
    import torch

    from h3engine.runtime.rank_process import RANK_MODULES

    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_MODULES)


# The files' order is pytest-xdist's (`make test` runs two test processes, each taking a whole file at a time): by
# their number of tests, which puts the multi-process files (apps, ranks, chromium) beside in-process ones. Handing
# out the longest files first (--no-loadscope-reorder and a sort here) ran them side by side instead: a fresh clone's
# tests then took 558 s.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_gpu)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
    gc.enable()


# Everything a run writes to "the temp folder" goes to one folder of its own, removed when the run ends: pytest's
# own folders, gradio_client's downloads (an empty <token_hex(20)> folder each), Gradio's cache of in-process UIs,
# multiprocessing's socket folders (pymp-*, which a process ended by os._exit never removes), and whatever the apps,
# ranks and CLIs the tests start leave there. Set by the run's own process before its test processes start (they
# inherit it); a short path, so that the fork server's Unix socket under it stays bindable (107 bytes).
RUN_TEMP_VARIABLE = "H3_TEST_RUN_TEMP"


def pytest_configure(config: pytest.Config) -> None:
    # The run's temp folder first: importing the engine (prepare_test_process) may already make folders in the
    # temp folder (torch's inductor cache), which must be the run's.
    if not hasattr(config, "workerinput") and not os.environ.get(RUN_TEMP_VARIABLE):
        use_run_temp_folder()
    if runs_tests(config):
        prepare_test_process()
    else:
        gc.enable()  # pytest-xdist's controller collects nothing (`pytest_collection_finish` never runs there)


def use_run_temp_folder() -> None:
    """A temp folder of the run's own for this process and every process it starts, removed at its exit."""
    folder = tempfile.mkdtemp(prefix="h3-tests-")
    os.environ[RUN_TEMP_VARIABLE] = folder
    for variable in ("TMPDIR", "TEMP", "TMP"):
        os.environ[variable] = folder
    # The engine's cache folder (AdaLN tables) too, unless a test names one: never the user's ~/.cache.
    os.environ["XDG_CACHE_HOME"] = os.path.join(folder, "cache")
    tempfile.tempdir = None  # read TMPDIR again
    # Removed at this process's exit after multiprocessing's own exit cleanup (which removes its socket folder and
    # would fail on one already gone): its finalizers run by priority, its temp folder's at -100.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-200)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoints(layout="native", seed=0)`: the session's tiny checkpoint of that layout and seed."""
    made: dict[tuple[str, int], Path] = {}

    from h3engine.checkpoint.tiny import make_tiny_checkpoint

    def tiny_checkpoint(layout: str = "native", seed: int = 0) -> Path:
        if (layout, seed) not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{layout}_{seed}") / "checkpoint"
            made[layout, seed] = make_tiny_checkpoint(folder, seed=seed, layout=layout)
        return made[layout, seed]

    return tiny_checkpoint


@pytest.fixture(scope="session")
def shared_app(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One `python app.py` on its embedded tiny default per test process, for the test files whose app takes no
    option of its own (each counts only its own results, and History is a browser context's): an app's start costs
    about 6 s of CPU on two cores. It must exit with 0 at the end of the run, leaving none of its files in Gradio's
    temp folder."""
    from _app_helpers import start_app, stop_app

    running = start_app(tmp_path_factory.mktemp("shared_app"), embedded_default=True)
    yield running
    assert stop_app(running) == 0, running.log_tail()
    # Gradio's temp folder (GRADIO_TEMP_DIR) keeps none of the app's files: the first frames uploaded
    # (test_app_isolation) and our served copies. (Gradio keeps the live preview images it made from arrays.)
    left = [path for path in (running.outputs_dir.parent / "gradio").rglob("*") if path.is_file()]
    assert [path for path in left if path.name == "first.png" or path.parent.name.startswith("h3-")] == []


@pytest.fixture(scope="session")
def tiny_native(tiny_checkpoints: Callable[..., Path]) -> Path:
    return tiny_checkpoints("native", seed=0)


@pytest.fixture(scope="session")
def tiny_diffusers(tiny_checkpoints: Callable[..., Path]) -> Path:
    return tiny_checkpoints("diffusers", seed=0)


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down (a page fixture closes its context)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test file's last test, park the browser its browser tests shared (tests/_browser_helpers.py), if one
    started, for the next browser test file of this process: Playwright's sync API keeps an event loop marked running
    on this thread, which the next file's asyncio.run() and Ray's sync calls refuse."""
    helpers = sys.modules.get("_browser_helpers")
    if helpers is not None and nextitem is not None and nextitem.path != item.path:
        helpers.park_shared_browser()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close this process's browser and its Playwright driver, if one started."""
    helpers = sys.modules.get("_browser_helpers")
    if helpers is not None:
        helpers.close_shared_browser()
