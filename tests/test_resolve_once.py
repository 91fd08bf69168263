"""One resolve a request: a Generate press, an API create and a CLI run each resolve their request once and probe
each input file once, on the tiny checkpoint, through to the finished MP4.

Counted: calls of the one checker's rules inside `resolve_request` (h3engine.engine.resolved.checked_request, called
once a resolve) and calls of the media probe (h3engine.media.inputs.probe_media) by file. The requests carry two
keyframes (FL2VA) and a video reference beside a picture (Ref2VA); the page copies its inputs into the outputs
folder, and those copies are never probed (their facts travel with the resolved request). The review that filed
issue 48 counted 4 resolves a press, 3 an API create and 3 to 4 a CLI run.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
from _api_helpers import InProcessApi
from _app_helpers import ASSETS

from h3engine.cli.main import main as cli_main
from h3engine.engine import resolved as resolved_module
from h3engine.engine.engine import Engine
from h3engine.media import inputs as media_inputs
from h3engine.runtime.front import EngineFront
from ui.access import AccessPolicy
from ui.handlers import Handlers
from ui.result import RESULT_FIELDS
from ui.tabs import DEFAULT_VALUES
from ui.task_values import parameter_names

FL2VA_FILES = {"first_image": ASSETS / "fl2va" / "first.png", "last_image": ASSETS / "fl2va" / "last.png"}
REF2VA_FILES = (ASSETS / "ref2va" / "video1.mp4", ASSETS / "ref2va" / "picture1.png")
PROMPT = "A kite over the dunes."


class Counted:
    """The resolves and the probes (by file name) made while it was installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.resolves = 0
        self.probes: collections.Counter[str] = collections.Counter()
        checked_request, probe_media = resolved_module.checked_request, media_inputs.probe_media

        def counting_checked_request(*args: Any, **kwargs: Any) -> Any:
            self.resolves += 1
            return checked_request(*args, **kwargs)

        def counting_probe(reference: Any) -> Any:
            self.probes[Path(reference.path).name] += 1
            return probe_media(reference)

        monkeypatch.setattr(resolved_module, "checked_request", counting_checked_request)
        monkeypatch.setattr(media_inputs, "probe_media", counting_probe)

    def assert_once(self, files: list[Path]) -> None:
        assert self.resolves == 1, f"resolved {self.resolves} times"
        assert self.probes == collections.Counter(path.name for path in files), self.probes


@pytest.fixture(scope="module")
def engine(tiny_native: Path) -> Engine:
    return Engine.from_checkpoint(tiny_native, device="cpu")


@pytest.fixture()
def front(engine: Engine, tmp_path: Path):
    front = EngineFront([engine], tmp_path / "outputs")
    yield front
    front.shutdown()


def _uploads(tmp_path: Path, files: list[Path]) -> list[str]:
    """The files as a page's uploads: copies in a folder of their own."""
    folder = tmp_path / "uploads"
    folder.mkdir(exist_ok=True)
    return [str(shutil.copyfile(path, folder / path.name)) for path in files]


def _press(handlers: Handlers, task: str, values: dict[str, Any]) -> tuple[list[tuple], gr.Error | None]:
    """What the page runs on a Generate press: `start`, the validator, then the endpoint to its end."""
    chosen = {**DEFAULT_VALUES, "prompt": PROMPT, "steps": 1, "duration_seconds": 4.0, **values}
    inputs = [chosen[name] for name in parameter_names(task)]
    _, starts = handlers.start(task, inputs)
    assert starts
    assert all(update.get("is_valid", True) for update in handlers.validator(task)(*inputs))

    async def run() -> tuple[list[tuple], gr.Error | None]:
        updates = []
        try:
            async for update in handlers.generator(task)(*inputs, None, lambda *a, **k: None):
                updates.append(update)
        except gr.Error as error:
            return updates, error
        return updates, None

    return asyncio.run(run())


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_a_generate_press_resolves_once(task, front, tmp_path, monkeypatch) -> None:
    files = list(FL2VA_FILES.values()) if task == "fl2va" else list(REF2VA_FILES)
    uploads = _uploads(tmp_path, files)
    values = dict(zip(FL2VA_FILES, uploads, strict=True)) if task == "fl2va" else {"references": uploads}
    handlers = Handlers(front, AccessPolicy(tmp_path / "outputs", serve_dir=tmp_path / "served"))
    counted = Counted(monkeypatch)
    updates, error = _press(handlers, task, values)
    status = updates[-1][RESULT_FIELDS.index("status")]
    assert error is None and status.startswith("Done in "), status
    counted.assert_once(files)
    # The page's job went through the one job service, as an API job does: recorded, followed, completed.
    [record] = handlers.jobs.store.list(handlers.jobs.ui_owner(handlers.access.results_dir(None)))
    assert (record.source, record.status, record.request["steps"]) == ("ui", "completed", 1)


def _api_body(task: str, tmp_path: Path) -> tuple[dict[str, str], list[tuple[str, tuple[str, bytes]]]]:
    fields = {"prompt": PROMPT, "model": "minimax-h3", "seconds": "4", "steps": "1"}
    if task == "fl2va":
        uploads = [("input_reference", FL2VA_FILES["first_image"]), ("last_frame", FL2VA_FILES["last_image"])]
    else:
        uploads = [("input_reference", path) for path in REF2VA_FILES]
    return fields, [(name, (path.name, path.read_bytes())) for name, path in uploads]


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_an_api_create_resolves_once(task, front, tmp_path, monkeypatch) -> None:
    with InProcessApi(front, tmp_path) as api:
        fields, files = _api_body(task, tmp_path)
        counted = Counted(monkeypatch)
        video = api.create_and_wait(data=fields, files=files)
        assert video["status"] == "completed", video
        counted.assert_once(list(FL2VA_FILES.values()) if task == "fl2va" else list(REF2VA_FILES))


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_a_cli_run_resolves_once(task, tiny_native, tmp_path, monkeypatch, capsys) -> None:
    if task == "fl2va":
        files = list(FL2VA_FILES.values())
        media = ["--first-frame", str(files[0]), "--last-frame", str(files[1])]
    else:
        files = list(REF2VA_FILES)
        media = ["--ref", f"video:{files[0]}", "--ref", f"image:{files[1]}"]
    counted = Counted(monkeypatch)
    code = cli_main(
        [
            "generate",
            "--checkpoint",
            str(tiny_native),
            "--device",
            "cpu",
            "--prompt",
            PROMPT,
            "--duration",
            "4",
        ]
        + ["--steps", "1", "--out", str(tmp_path / "clip.mp4"), *media]
    )
    assert code == 0, capsys.readouterr().err
    counted.assert_once(files)
