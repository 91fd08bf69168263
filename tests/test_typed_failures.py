"""A job's failure stays typed from the engine to each door: `JobFailed` carries the error object (its class and
field), `message` is its one public sentence (`h3engine.errors.public_text`: files by base name, no server path),
and the API reports a checkpoint that fails to load as `checkpoint_error`, not as the client's `invalid_request`
(a CheckpointError at a lazy load was reported as an invalid request, with the server's path in the message).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from _api_helpers import InProcessApi
from _app_helpers import ASSETS
from _runtime_helpers import events_until_done

from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.engine.engine import Engine
from h3engine.errors import CheckpointError, RequestError, public_text, without_server_paths
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFailed

EVENT_TIMEOUT_S = 120


def test_the_public_sentence_names_files_by_base_name() -> None:
    error = RequestError(
        "keyframes[0]", "cannot open the image file (No such file)", "/srv/h3/in/job/first.png"
    )
    assert public_text(error) == "keyframes[0]: 'first.png': cannot open the image file (No such file)"
    assert str(error) == "keyframes[0]: '/srv/h3/in/job/first.png': cannot open the image file (No such file)"
    broken = CheckpointError(
        "/srv/models/h3/Ref2VA/transformer/model.safetensors: unreadable safetensors file"
    )
    assert public_text(broken) == "model.safetensors: unreadable safetensors file"
    # Not a path: a URL, a ratio, a lone slash.
    text = "see https://example.com/a/b, 1/4 of 16:9 and /"
    assert without_server_paths(text) == text


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    """A tiny checkpoint of this test's own (its Ref2VA DiT is broken after the engine starts)."""
    return make_tiny_checkpoint(tmp_path / "checkpoint", seed=0)


def _ref2va() -> GenerationRequest:
    picture = Reference(kind="image", path=str(ASSETS / "ref2va" / "picture1.png"))
    return GenerationRequest(task="ref2va", prompt="x", steps=1, duration_seconds=4.0, references=(picture,))


def _break_the_ref2va_dit(checkpoint: Path) -> None:
    """Cut a Ref2VA DiT file in half: its headers were checked at start; it loads with the first Ref2VA job."""
    shard = sorted((checkpoint / "Ref2VA" / "transformer").glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def test_a_failure_carries_its_error_object_from_the_engine(checkpoint, tmp_path) -> None:
    front = EngineFront([Engine.from_checkpoint(checkpoint, device="cpu")], tmp_path / "outputs")
    try:
        # A request error: a keyframe that went away after the request was resolved.
        keyframe = tmp_path / "first.png"
        shutil.copyfile(ASSETS / "fl2va" / "first.png", keyframe)
        request = GenerationRequest(
            task="fl2va",
            prompt="x",
            steps=1,
            duration_seconds=4.0,
            keyframes=(Keyframe(str(keyframe), "first"),),
        )
        resolved = front.resolve(request)
        keyframe.unlink()
        failed = events_until_done(front.submit(resolved), EVENT_TIMEOUT_S)[-1]
        assert isinstance(failed, JobFailed) and failed.kind == "request"
        assert isinstance(failed.error, RequestError) and failed.error.field == "keyframes[0]"
        assert failed.message == public_text(failed.error) and str(tmp_path) not in failed.message
        # A checkpoint file that fails when the job loads it.
        _break_the_ref2va_dit(checkpoint)
        failed = events_until_done(front.submit(_ref2va()), EVENT_TIMEOUT_S)[-1]
        assert isinstance(failed, JobFailed) and failed.kind == "checkpoint"
        assert isinstance(failed.error, CheckpointError) and str(checkpoint) in str(failed.error)
        assert failed.message == public_text(failed.error) and str(checkpoint) not in failed.message
        # What a worker group's rank sends: the same, after pickling.
        again = pickle.loads(pickle.dumps(failed))
        assert (
            again == failed and type(again.error) is CheckpointError and str(again.error) == str(failed.error)
        )
    finally:
        front.shutdown()


def test_the_api_reports_a_checkpoint_that_fails_to_load_as_such(checkpoint, tmp_path) -> None:
    front = EngineFront([Engine.from_checkpoint(checkpoint, device="cpu")], tmp_path / "outputs")
    try:
        with InProcessApi(front, tmp_path) as api:
            _break_the_ref2va_dit(checkpoint)
            picture = (ASSETS / "ref2va" / "picture1.png").read_bytes()
            video = api.create_and_wait(
                data={"prompt": "x", "seconds": "4", "steps": "1", "task": "ref2va"},
                files=[("references", ("picture1.png", picture))],
            )
        assert video["status"] == "failed" and video["error"]["code"] == "checkpoint_error", video
        assert str(tmp_path) not in video["error"]["message"]
        assert video["error"]["message"].startswith("model-0000"), video["error"]
    finally:
        front.shutdown()
