"""A request's files appear together or not at all; every long phase polls for cancel; a killed run's leftovers go
at the next start (tiny CPU engine).

What is checked: output names are refused before any work (a folder, a missing folder, a tensors file over the
video); a failure writing the tensors leaves no MP4; a full disk fails the job saying so, with the free space; a
commit renames the sidecar last; cancelling at each poll of a request (input files, conditioning encode, text
encode, every step, after the last step, each decoder window) stops it and leaves no file;
`h3engine.media.leftovers` removes exactly the staging files and folders of dead processes and sidecar-less stamped
MP4s, including after a real SIGKILL of the CLI (alone and with a worker group, whose ranks then end by themselves),
and a killed worker group exactly its ranks' staging files; an app started after a SIGKILLed one removes that one's
staging files and its Gradio cache of its own (no GRADIO_TEMP_DIR), and its own such cache, which held its live
previews and served copies, goes at its exit.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _refusals import refused
from _runtime_helpers import events_until_done, still_running

from h3engine.engine import pipeline as pipeline_module
from h3engine.engine.engine import Engine
from h3engine.errors import GenerationCancelled, RequestError
from h3engine.media import outputs
from h3engine.media.leftovers import (
    WORKER_FOLDER_PREFIX,
    remove_dead_temp_folders,
    remove_output_leftovers,
    remove_staging_files_of,
)
from h3engine.media.outputs import OutputFiles, staged
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront, stamped_output_name
from h3engine.runtime.messages import ENGINE_FAILURE_MESSAGE, JobFailed, output_failure_message, size_text

REPOSITORY = Path(__file__).resolve().parents[1]
ASSETS = REPOSITORY / "assets"
STEPS = 2
REQUESTS = {
    "t2va": GenerationRequest(task="t2va", prompt="A kite climbs.", steps=STEPS, duration_seconds=4),
    "fl2va": GenerationRequest(
        task="fl2va",
        prompt="The kite climbs.",
        steps=STEPS,
        duration_seconds=4,
        keyframes=(
            Keyframe(str(ASSETS / "fl2va" / "first.png"), "first"),
            Keyframe(str(ASSETS / "fl2va" / "last.png"), "last"),
        ),
    ),
    "ref2va": GenerationRequest(
        task="ref2va",
        prompt="<Picture 1> speaks in the voice of <Audio 1>.",
        steps=STEPS,
        duration_seconds=4,
        references=(
            Reference("image", str(ASSETS / "ref2va" / "picture1.png")),
            Reference("audio", str(ASSETS / "ref2va" / "audio1.wav")),
        ),
    ),
}
# Polls before the text encode: one per input file, one before the conditioning encode.
POLLS_BEFORE_TEXT_ENCODE = {"t2va": 0, "fl2va": 3, "ref2va": 3}
# The apps' /t2va job (the last test): 2 steps of 5 s at the checkpoint's canvas.
APP_JOB = dict(duration_seconds=5, aspect_ratio="auto", seed=4, randomize_seed=False, steps=2)
GRADIO_SERVER_WAIT_S = 5.0  # how long Gradio's close() waits for its server thread (gradio.http_server)


@pytest.fixture(scope="module")
def checkpoint(tiny_native) -> Path:
    return tiny_native


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)


def counting_cancel(cancel_at: int | None) -> tuple[Callable[[], bool], list[int]]:
    polls: list[int] = []

    def should_cancel() -> bool:
        polls.append(1)
        return cancel_at is not None and len(polls) >= cancel_at

    return should_cancel, polls


# --- output names and staging -------------------------------------------------------------------------------------


def test_output_names_are_refused_before_any_work(engine, tmp_path, monkeypatch) -> None:
    """Each rule of the output names (h3engine.media.outputs), with its wording (the doors' tests check the field)."""
    monkeypatch.setattr(engine, "generate", lambda *args, **kwargs: pytest.fail("work started"))
    (tmp_path / "taken.mp4").mkdir()
    (tmp_path / "side.json").mkdir()
    (tmp_path / "t.safetensors").mkdir()
    (tmp_path / "locked").mkdir()
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "out.json")
    # Root may write anywhere, so the folder's refusal is simulated where the check asks for it.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: Path(path).name != "locked" and real_access(path, mode)
    )
    out, tensors = "out_path", "save_tensors_path"
    cases = [
        (tmp_path / "taken.mp4", None, out, f"'{tmp_path / 'taken.mp4'}' is a folder; give the path of an .mp4 file"),
        (tmp_path / "side.mp4", None, out, f"its sidecar '{tmp_path / 'side.json'}' is a folder; choose another name"),
        (tmp_path / "missing" / "out.mp4", None, out, f"folder '{tmp_path / 'missing'}' does not exist"),
        (tmp_path / "locked" / "out.mp4", None, out, f"folder '{tmp_path / 'locked'}' is not writable"),
        (tmp_path / "out.mp4", tmp_path / "missing" / "t.safetensors", tensors, f"folder '{tmp_path / 'missing'}' does not exist"),
        (tmp_path / "out.mp4", tmp_path / "out.json", tensors, f"must be a .safetensors path, got '{tmp_path / 'out.json'}'"),
        (tmp_path / "out.mp4", tmp_path / "t.safetensors", tensors, f"'{tmp_path / 't.safetensors'}' is a folder; give the path of a file"),
        (tmp_path / "out.mp4", tmp_path / "link.safetensors", tensors, f"'{tmp_path / 'link.safetensors'}' is the video or its sidecar; give a path of its own"),
        (tmp_path / "out.mov", None, out, "must end in '.mp4'"),
    ]  # fmt: skip
    for out_path, tensors_path, field, wording in cases:
        with refused(RequestError, field=field, says=wording):
            engine.generate_to_file(REQUESTS["t2va"], out_path, save_tensors_path=tensors_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "link.safetensors",
        "locked",
        "side.json",
        "t.safetensors",
        "taken.mp4",
    ]


def test_the_front_refuses_output_names_before_queueing(engine, tmp_path) -> None:
    front = EngineFront([engine], tmp_path)
    try:
        with refused(RequestError, field="save_tensors_path"):
            front.submit(REQUESTS["t2va"], tmp_path / "a.mp4", tmp_path / "missing" / "a.safetensors")
    finally:
        front.shutdown()


def test_a_failed_tensors_write_leaves_no_video_and_no_staging_file(engine, tmp_path, monkeypatch) -> None:
    def failing_save(path, tensors):
        raise OSError("disk full")

    monkeypatch.setattr(pipeline_module, "save_tensors", failing_save)
    with pytest.raises(OSError, match="disk full"):
        engine.generate_to_file(
            REQUESTS["t2va"], tmp_path / "out.mp4", save_tensors_path=tmp_path / "t.safetensors"
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("writer", ["write_mp4", "save_tensors"])
def test_a_full_disk_fails_the_job_saying_so_with_the_free_space(
    engine, tmp_path, monkeypatch, writer
) -> None:
    """ENOSPC from the MP4 writer (under the decode's Mp4WriteError) or from the tensors' writer, after it wrote a
    little: the job's sentence says the disk is full and how much is free; no file is left."""

    def full_disk(path, *contents):
        Path(path).write_bytes(b"the first bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(pipeline_module, writer, full_disk)
    free = 123 * 1024**2
    real_disk_usage = shutil.disk_usage

    def disk_usage(folder):  # the outputs folder's disk has 123 MB free
        usage = real_disk_usage(folder)
        return usage._replace(free=free) if Path(folder) == outputs_dir else usage

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    outputs_dir = tmp_path / "outputs"
    front = EngineFront([engine], outputs_dir)
    try:
        handle = front.submit(REQUESTS["t2va"], save_tensors_path=outputs_dir / "t.safetensors")
        failed = events_until_done(handle, 120)[-1]
    finally:
        front.shutdown()
    assert failed == JobFailed(
        handle.job_id,
        "engine",
        "The disk of the outputs folder is full (123.0 MB free); free some space, then try again.",
    )
    assert list(outputs_dir.iterdir()) == []


def test_only_a_full_disk_anywhere_in_the_chain_reads_as_a_full_disk(tmp_path) -> None:
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    try:
        try:
            raise quota
        except OSError:
            raise RuntimeError("the muxer gave up")  # noqa: B904 (the context is what is read)
    except RuntimeError as error:
        assert output_failure_message(error, tmp_path).startswith("The disk of the outputs folder is full (")
    assert output_failure_message(OSError(errno.EACCES, "denied"), tmp_path) == ENGINE_FAILURE_MESSAGE
    assert size_text(0) == "0 bytes" and size_text(1536) == "1.5 KB" and size_text(5 * 1024**4) == "5.0 TB"


def test_a_whole_request_commits_its_three_files_sidecar_last(engine, tmp_path, monkeypatch) -> None:
    renamed: list[str] = []
    replace = os.replace

    def recording_replace(source, target):
        renamed.append(Path(target).name)
        replace(source, target)

    monkeypatch.setattr(outputs.os, "replace", recording_replace)
    written = engine.generate_to_file(REQUESTS["t2va"], tmp_path / "out.mp4", tmp_path / "out.safetensors")
    assert written == OutputFiles(tmp_path / "out.mp4", tmp_path / "out.json", tmp_path / "out.safetensors")
    # Each writer first fills its staging file (atomically, through its own hidden partial), then the commit.
    assert renamed[-3:] == ["out.mp4", "out.safetensors", "out.json"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.json", "out.mp4", "out.safetensors"]


def test_leaving_a_staged_block_without_commit_removes_every_staging_file(tmp_path) -> None:
    files = OutputFiles.beside(tmp_path / "a.mp4", tmp_path / "a.safetensors")
    with staged(files) as staging:
        for path in staging.files.in_commit_order():
            assert path.exists() and path.name.startswith(".") and path.name.endswith(".partial")
            path.write_bytes(b"data")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="boom"), staged(files) as staging:
        raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


# --- cancellation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(REQUESTS))
def test_every_poll_of_a_request_can_cancel_it_and_leaves_no_file(engine, task, tmp_path) -> None:
    request = REQUESTS[task]
    should_cancel, polls = counting_cancel(None)
    engine.generate_to_file(request, tmp_path / "full.mp4", should_cancel=should_cancel)
    geometry = engine.geometry_for(request)
    video_vae = engine.store.models_for_partition(engine.layout.for_task(task).partition).video_vae
    plan = video_vae.plan_decode((1, 1, geometry.latent_frames, geometry.latent_h, geometry.latent_w))
    # The decoder yields a piece per window, and the carried tail last when windows overlap (token_drop).
    pieces = plan.window_count + (1 if video_vae.config.token_drop > 0 else 0)
    # Inputs and conditioning, text encode, every step, after the last step, every decoded piece.
    expected = POLLS_BEFORE_TEXT_ENCODE[task] + 1 + STEPS + 1 + pieces
    assert len(polls) == expected
    # The first polls (inputs, conditioning, text encode), the step loop's first, and the last three (after the
    # loop and the decoder windows): every phase, without running every step count twice.
    positions = sorted(
        set(range(1, POLLS_BEFORE_TEXT_ENCODE[task] + 3)) | set(range(expected - 2, expected + 1))
    )
    for position in positions:
        folder = tmp_path / f"cancel-at-{position}"
        folder.mkdir()
        should_cancel, polls = counting_cancel(position)
        with pytest.raises(GenerationCancelled):
            engine.generate_to_file(
                request,
                folder / "out.mp4",
                save_tensors_path=folder / "out.safetensors",
                should_cancel=should_cancel,
            )
        assert len(polls) == position
        assert list(folder.iterdir()) == [], f"cancel at poll {position} left {list(folder.iterdir())}"


# --- leftovers --------------------------------------------------------------------------------------------------------


def dead_pid() -> int:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(finished.stdout)


def test_only_dead_writers_staging_files_and_unpaired_stamped_videos_are_removed(tmp_path) -> None:
    dead, alive = dead_pid(), os.getpid()
    nested = tmp_path / "user"
    nested.mkdir()
    stamped = stamped_output_name("t2va", "0123abcd")
    paired = stamped_output_name("fl2va", "89abcdef")
    doomed = [
        tmp_path / f".out.mp4.{dead}-0123456789ab.partial",
        tmp_path / f"..out.mp4.{dead}-0123456789ab.partial.{dead}-ba9876543210.partial",
        nested / f".x.json.{dead}-00000000ffff.partial",
        tmp_path / stamped,
    ]
    kept = [
        tmp_path / f".out.mp4.{alive}-0123456789ab.partial",  # a live writer's
        tmp_path / ".notes.partial",  # not our naming
        tmp_path / "holiday.mp4",  # not our naming, no sidecar
        tmp_path / paired,
        tmp_path / paired.replace(".mp4", ".json"),
    ]
    for path in doomed + kept:
        path.write_bytes(b"x")
    assert sorted(remove_output_leftovers(tmp_path)) == sorted(doomed)
    assert all(path.exists() for path in kept) and not any(path.exists() for path in doomed)


def test_a_killed_groups_staging_files_are_removed_and_nothing_else(tmp_path) -> None:
    """What a worker group removes when it is killed: its ranks' staging files, in the folders it wrote into."""
    killed, other = 4_000_001, 4_000_002  # ids of the killed ranks and of another writer (dead too, or alive)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    doomed = [
        tmp_path / f".out.mp4.{killed}-0123456789ab.partial",
        tmp_path / f".out.json.{killed}-0123456789ab.partial",
    ]
    kept = [
        tmp_path / f".out.mp4.{other}-0123456789ab.partial",  # another process's
        elsewhere / f".out.mp4.{killed}-0123456789ab.partial",  # a folder the group did not write into
        tmp_path / f"out.mp4.{killed}-0123456789ab.partial",  # not our naming
    ]
    for path in doomed + kept:
        path.write_bytes(b"x")
    assert sorted(remove_staging_files_of([killed, 4_000_003], [tmp_path, tmp_path / "gone"])) == sorted(
        doomed
    )
    assert all(path.exists() for path in kept) and not any(path.exists() for path in doomed)


def test_only_dead_processes_temp_folders_are_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{WORKER_FOLDER_PREFIX}{dead_pid()}-abc"
    live = tmp_path / f"{WORKER_FOLDER_PREFIX}{os.getpid()}-abc"
    other = tmp_path / f"{WORKER_FOLDER_PREFIX}old-style"
    for folder in (dead, live, other):
        (folder / "store").mkdir(parents=True)
    assert remove_dead_temp_folders(WORKER_FOLDER_PREFIX) == [dead]
    assert live.is_dir() and other.is_dir() and not dead.exists()


def start_cli(
    checkpoint: Path, out: Path, temp: Path, *extra: str, stdout: int = subprocess.DEVNULL
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "h3engine", "generate", "--checkpoint", str(checkpoint), "--prompt", "long"]
        + ["--steps", "1000", "--duration", "15", "--device", "cpu", "--out", str(out), *extra],
        cwd=REPOSITORY,
        env={**os.environ, "TMPDIR": str(temp)},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the CLI ended early: {process.stderr.read()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_sigkilled_cli_leaves_staging_files_that_the_next_start_removes(checkpoint, tmp_path) -> None:
    folder, temp = tmp_path / "out", tmp_path / "tmp"
    folder.mkdir()
    temp.mkdir()
    process = start_cli(
        checkpoint, folder / "clip.mp4", temp, "--save-tensors", str(folder / "clip.safetensors")
    )
    wait_for(lambda: len(list(folder.iterdir())) == 3, process)  # the staging files exist from the start
    process.send_signal(signal.SIGKILL)
    process.wait()
    left = sorted(path.name for path in folder.iterdir())
    assert len(left) == 3 and all(name.startswith(".") and name.endswith(".partial") for name in left)
    assert len(remove_output_leftovers(folder)) == 3
    assert list(folder.iterdir()) == []


@pytest.mark.slow
def test_a_sigkilled_cli_s_ranks_end_by_themselves_and_the_next_start_removes_its_rendezvous_folder(
    checkpoint, tmp_path, monkeypatch
) -> None:
    from _app_helpers import rank_processes_of

    folder = tmp_path / "out"
    folder.mkdir()
    # A short TMPDIR (in the run's own temp folder, removed with it): under tmp_path the fork server's socket path
    # would pass 107 bytes, and the CLI would spawn its ranks instead of forking them from its server.
    temp = Path(tempfile.mkdtemp(prefix="rdv-"))
    process = start_cli(
        checkpoint,
        folder / "clip.mp4",
        temp,
        "--world-size",
        "2",
        "--progress",
        "json",
        stdout=subprocess.PIPE,
    )
    try:
        for line in process.stdout:  # until the group denoises
            if json.loads(line)["event"] == "step":
                break
        ranks = rank_processes_of(process.pid)
        assert len(ranks) == 2, ranks
        assert len(list(temp.glob(f"{WORKER_FOLDER_PREFIX}{process.pid}-*"))) == 1
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    # No one tells the ranks: each sees its parent gone and exits.
    assert still_running(ranks) == []
    assert len(list(temp.glob(f"{WORKER_FOLDER_PREFIX}{process.pid}-*"))) == 1
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    from h3engine.runtime.workers import ProcessReplica

    replica = ProcessReplica(checkpoint, ["cpu"])
    try:
        assert not list(temp.glob(f"{WORKER_FOLDER_PREFIX}{process.pid}-*"))
    finally:
        replica.close()


@pytest.mark.slow
def test_an_app_removes_what_a_sigkilled_one_left_and_its_own_gradio_cache_goes_at_exit(tmp_path) -> None:
    """Without GRADIO_TEMP_DIR each app keeps a Gradio cache of its own in the temp folder. A SIGKILLed app leaves its
    staging files in the outputs folder and that cache; the next app removes both as it starts. That app's own cache
    holds its live previews and served copies, and goes when it exits: SIGTERM with a client still connected, whose
    heartbeat stream ends with the server (Gradio would otherwise wait 5 s for it)."""
    from _app_helpers import start_app, stop_app
    from gradio_client import Client

    app = start_app(tmp_path, embedded_default=True, gradio_temp_dir=False)
    try:
        client = Client(app.url, verbose=False)
        long_job = {**APP_JOB, "duration_seconds": 15, "steps": 1000}
        client.submit(prompt="A long one.", **long_job, api_name="/t2va")
        deadline = time.monotonic() + 120
        while not list(app.outputs_dir.rglob("*.partial")):
            assert time.monotonic() < deadline and app.process.poll() is None, app.log_tail()
            time.sleep(0.2)
    finally:
        app.process.send_signal(signal.SIGKILL)
        app.process.wait()
    left = list(app.outputs_dir.rglob("*.partial"))
    assert left
    (cache,) = (tmp_path / "tmp").glob(f"h3-gradio-{app.process.pid}-*")
    again = start_app(
        tmp_path, embedded_default=True, gradio_temp_dir=False, extra_arguments=["--preview-every", "1"]
    )
    try:
        assert not list(again.outputs_dir.rglob("*.partial"))
        assert f"removed {len(left)} leftover(s) of a stopped run" in again.log_tail()
        assert not cache.exists()
        (own_cache,) = (tmp_path / "tmp").glob(f"h3-gradio-{again.process.pid}-*")
        client = Client(again.url, verbose=False, download_files=str(tmp_path / "downloads"))
        result = client.predict(prompt="Previewed.", **APP_JOB, api_name="/t2va")
        assert result[0].startswith("Done"), result[0]
        files = [path for path in own_cache.rglob("*") if path.is_file()]
        assert any(path.suffix in (".webp", ".png") for path in files), files  # a live preview image
        assert any(path.suffix == ".mp4" for path in files), files  # the served copy
    finally:
        terminated_at = time.monotonic()
        assert stop_app(again) == 0, again.log_tail()
    assert time.monotonic() - terminated_at < GRADIO_SERVER_WAIT_S - 0.5
    assert not own_cache.exists()
