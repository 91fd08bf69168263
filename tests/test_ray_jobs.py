"""The Ray path's parts that need no Ray: app.py's --ray options, a job's inputs and outputs on the wire.

What is checked: `--ray` / `--ray-replicas` (and their environment variables) are read and checked before any
model loads, with one-line errors naming the option, including Ray missing from the environment; with --ray the
local GPU count is not checked (the cluster's GPUs are). A packed job carries its input files' bytes; unpacked on a
replica they keep their own names under a folder per content hash (a LoRA sent twice is one file); the sidecar
written there gets the app host's paths back; a missing input is named by its field and its own file name. The
streamed files appear on the app host all at once on `finish`, or not at all. Importing app.py and the Ray modules
imports no Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _refusals import refused

import app
from h3engine.errors import RequestError
from h3engine.media.outputs import OutputFiles
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest, LoraChoice
from h3engine.runtime.messages import JobFinished
from h3engine.runtime.ray_jobs import (
    CHUNK_BYTES,
    ReceivedFiles,
    file_chunks,
    pack_job,
    restore_sidecar_paths,
    unpack_inputs,
)

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


def forget_after_the_test(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Unset `name`, and have it as it was after the test even when code under test sets it (monkeypatch's
    delenv of an unset name records nothing)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_ray_options_are_read_and_checked() -> None:
    config = app.parse_config(["--ray", "auto", "--ray-replicas", "3", "--world-size", "4"], {})
    assert (config.ray, config.ray_replicas, config.world_size) == ("auto", 3, 4)
    config = app.parse_config([], {"H3_RAY": "10.0.0.5:6379", "H3_RAY_REPLICAS": "2"})
    assert (config.ray, config.ray_replicas) == ("10.0.0.5:6379", 2)
    assert app.parse_config([], {}).ray is None
    with pytest.raises(app.ConfigError, match="^--ray-replicas must be at least 1, got 0$"):
        app.parse_config(["--ray", "auto", "--ray-replicas", "0"], {})
    with pytest.raises(app.ConfigError, match="^--devices: with --ray give cpu .* or leave it out"):
        app.parse_config(["--ray", "auto", "--devices", "cuda:0,cuda:1"], {})
    assert app.parse_config(["--ray", "auto", "--devices", "cpu"], {}).devices == ("cpu",)


def test_without_ray_installed_the_ray_option_is_refused_before_loading(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    forget_after_the_test(monkeypatch, "RAY_AUTH_MODE")  # require_ray may set it
    config = app.parse_config(["--ray", "auto", "--outputs", str(tmp_path)], {})
    with pytest.raises(
        app.ConfigError, match=r"^--ray: Ray is not installed .*\(install it with `make ray`\)$"
    ):
        app.check_before_loading(config)


def test_with_ray_the_local_gpus_are_not_checked(tmp_path, monkeypatch) -> None:
    import h3engine.runtime.ray_serve as ray_serve

    monkeypatch.setattr(ray_serve, "require_ray", lambda: None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    config = app.parse_config(
        ["--ray", "auto", "--world-size", "8", "--port", port, "--outputs", str(tmp_path)], {}
    )
    app.check_before_loading(config)  # this host has no 8 GPUs; the cluster's nodes do
    with pytest.raises(app.ConfigError, match="^--dit-sp 3 does not divide"):
        app.check_before_loading(
            dataclasses.replace(config, engine=dataclasses.replace(config.engine, dit_sp=3))
        )


def test_importing_the_app_and_the_ray_modules_imports_no_ray() -> None:
    code = (
        "import sys, app, h3engine.runtime.ray_serve, h3engine.runtime.ray_jobs; "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPOSITORY_ROOT, check=True, timeout=120)


def _request(folder: Path) -> GenerationRequest:
    (folder / "first.png").write_bytes(b"png bytes")
    (folder / "voice.wav").write_bytes(b"wav bytes")
    (folder / "style.safetensors").write_bytes(b"lora bytes")
    return GenerationRequest(
        task="ref2va",
        prompt="x",
        keyframes=(Keyframe(str(folder / "first.png"), "first"),),
        references=(
            Reference("image", str(folder / "first.png")),
            Reference("audio", str(folder / "voice.wav")),
        ),
        loras=(LoraChoice(str(folder / "style.safetensors"), 0.5),),
    )


def test_inputs_travel_with_the_job_and_keep_their_names(tmp_path) -> None:
    (tmp_path / "host").mkdir()
    request = _request(tmp_path / "host")
    job = pack_job("j1", request, OutputFiles.beside(tmp_path / "out.mp4"), replica_index=1, preview_every=5)
    assert [Path(item.path).name for item in job.inputs] == ["first.png", "voice.wav", "style.safetensors"]
    assert (job.video_name, job.tensors_name, job.replica_index) == ("out.mp4", None, 1)

    replica_inputs = tmp_path / "replica"
    local, app_paths = unpack_inputs(job, replica_inputs)
    assert local.keyframes[0].path == local.references[0].path  # one file for the same input
    for original, unpacked in zip(
        [*request.keyframes, *request.references, *request.loras],
        [*local.keyframes, *local.references, *local.loras],
        strict=True,
    ):
        assert Path(unpacked.path).name == Path(original.path).name
        assert Path(unpacked.path).read_bytes() == Path(original.path).read_bytes()
        assert Path(unpacked.path).is_relative_to(replica_inputs)
        assert app_paths[unpacked.path] == original.path
    again, _ = unpack_inputs(job, replica_inputs)
    assert again.loras == local.loras and len(list(replica_inputs.glob("*/*"))) == 3

    sidecar = {
        "request": local.to_dict(),
        "inputs": [{"path": local.keyframes[0].path, "sha256": "s"}],
        "video": "o",
    }
    restored = json.loads(restore_sidecar_paths(json.dumps(sidecar).encode(), app_paths))
    assert restored["request"] == request.to_dict()
    assert restored["inputs"][0]["path"] == request.keyframes[0].path and restored["video"] == "o"


def test_a_missing_input_is_named_by_its_field_and_own_name(tmp_path) -> None:
    request = GenerationRequest(
        task="fl2va", prompt="x", keyframes=(Keyframe(str(tmp_path / "gone.png"), "first"),)
    )
    with refused(RequestError, field="keyframes[0].path") as caught:
        pack_job("j", request, OutputFiles.beside(tmp_path / "out.mp4"), 0, 5)
    # Its own name, not the server's path (the packer's sentence, made in h3engine.runtime.ray_jobs, once).
    assert caught.value.problem.startswith("cannot read 'gone.png' (No such file"), caught.value


def _written(folder: Path, video: bytes, tensors: bytes | None) -> OutputFiles:
    folder.mkdir()
    files = OutputFiles.beside(folder / "v.mp4", folder / "t.safetensors" if tensors is not None else None)
    files.video.write_bytes(video)
    files.sidecar.write_text('{"seed": 3}')
    if tensors is not None:
        files.tensors.write_bytes(tensors)
    return files


def test_streamed_files_appear_together_on_finish_or_not_at_all(tmp_path) -> None:
    video = bytes(range(256)) * (CHUNK_BYTES // 256 + 7)  # more than one chunk
    remote = _written(tmp_path / "replica", video, b"tensors")
    chunks = list(file_chunks("j", remote))
    assert [chunk.role for chunk in chunks] == ["video", "video", "tensors", "sidecar"]

    (tmp_path / "host").mkdir()
    final = OutputFiles.beside(tmp_path / "host" / "result.mp4", tmp_path / "host" / "result.safetensors")
    received = ReceivedFiles(final)
    for chunk in chunks:
        received.write(chunk)
        assert not final.video.exists() and not final.sidecar.exists()
    done = received.finish(JobFinished("j", str(remote.video), str(remote.sidecar), 3, 1, 1, 1, 24, {}))
    received.discard()  # after finish: nothing to remove
    assert (done.video_path, done.sidecar_path) == (str(final.video), str(final.sidecar))
    assert final.video.read_bytes() == video and final.tensors.read_bytes() == b"tensors"
    assert final.sidecar.read_text() == '{"seed": 3}'
    assert sorted(path.name for path in final.video.parent.iterdir()) == [
        "result.json",
        "result.mp4",
        "result.safetensors",
    ]

    (tmp_path / "broken").mkdir()
    cut = ReceivedFiles(OutputFiles.beside(tmp_path / "broken" / "result.mp4"))
    cut.write(chunks[0])
    cut.discard()  # the stream broke off: no file, no staging leftover
    assert list((tmp_path / "broken").iterdir()) == []


def test_a_token_on_this_machine_turns_token_auth_on_for_any_address(tmp_path, monkeypatch) -> None:
    """Ray does so for --ray auto only; an explicit HOST:PORT of a cluster with a token would be refused."""
    from h3engine.runtime.ray_serve import _token_auth_when_a_token_is_here

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        forget_after_the_test(monkeypatch, name)
    monkeypatch.setenv("HOME", str(tmp_path))
    _token_auth_when_a_token_is_here()
    assert "RAY_AUTH_MODE" not in os.environ  # no token here: Ray's default
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    _token_auth_when_a_token_is_here()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice stays
    _token_auth_when_a_token_is_here()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
