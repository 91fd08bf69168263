"""The engine front (queue, worker per replica, messages, cancel) and the latent preview, on tiny engines.

What is compared: the exact message sequence of a job (queue position, start with the engine's geometry, one
progress message per step with a consistent ETA, previews every N steps, the finished files); cancel of a
waiting job (immediate) and of a running one (at the next step, replica free afterwards); an engine exception
becomes one fixed sentence without its text or a traceback, and the replica keeps serving; a replica that raises (or
returns something else than a job's end), also at its warm-up, fails only that job and its worker thread runs the
next one; two replicas run two
jobs at once; messages pickle (they must cross a process boundary later); a warm-up runs before the first job
and leaves no files, and a failed one leaves the replica serving. The preview reads only the newest
latent frame, never writes the loop's rows, and equals an independent numpy computation of the documented map.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _app_helpers import ASSETS
from _refusals import refused
from _runtime_helpers import events_until_done

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import CanvasRules
from h3engine.engine.engine import Engine
from h3engine.engine.preview import PREVIEW_SHORT_EDGE, channel_to_rgb_weights, latent_preview_rgb
from h3engine.errors import RequestError
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import WARM_UP_REQUEST, EngineFront, EngineReplica, JobHandle
from h3engine.runtime.messages import (
    ENGINE_FAILURE_MESSAGE,
    TERMINAL_EVENTS,
    JobFailed,
    JobFinished,
    JobQueued,
    JobStarted,
    PreviewFrame,
    StepProgress,
)

EVENT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def checkpoint(tiny_native):
    return tiny_native


@pytest.fixture(scope="module")
def engines(checkpoint):
    return [Engine.from_checkpoint(checkpoint, device="cpu") for _ in range(2)]


@pytest.fixture()
def front(engines, tmp_path):
    front = EngineFront(engines[:1], tmp_path / "outputs", preview_every=3)
    yield front
    front.shutdown()


def _wait_for_step(handle: JobHandle) -> list:
    events = []
    while not any(isinstance(event, StepProgress) for event in events):
        event = handle.next_event(timeout=EVENT_TIMEOUT_S)
        assert event is not None and not isinstance(event, TERMINAL_EVENTS), events + [event]
        events.append(event)
    return events


def _long_request(prompt: str = "long") -> GenerationRequest:
    return GenerationRequest(task="t2va", prompt=prompt, steps=1000, duration_seconds=15.0)


def test_a_job_reports_queue_start_steps_previews_and_files(front) -> None:
    request = GenerationRequest(task="t2va", prompt="a kite", steps=6, seed=5)
    expected_geometry = front.resolve(request).geometry
    events = events_until_done(front.submit(request), EVENT_TIMEOUT_S)

    assert events[0] == JobQueued(events[0].job_id, position=1)
    started = events[1]
    assert isinstance(started, JobStarted)
    assert (started.width, started.height, started.frames, started.fps) == (
        expected_geometry.width,
        expected_geometry.height,
        expected_geometry.frames,
        24,
    )
    steps = [event for event in events if isinstance(event, StepProgress)]
    assert [event.step for event in steps] == [1, 2, 3, 4, 5, 6]
    assert all(event.total == 6 for event in steps)
    for event in steps:
        assert event.eta_s == pytest.approx(event.elapsed_s / event.step * (6 - event.step))
    previews = [event for event in events if isinstance(event, PreviewFrame)]
    assert [event.step for event in previews] == [3, 6]
    assert previews[0].rgb.dtype == np.uint8 and previews[0].rgb.shape[2] == 3
    assert min(previews[0].rgb.shape[:2]) >= PREVIEW_SHORT_EDGE

    finished = events[-1]
    assert isinstance(finished, JobFinished)
    assert finished.seed == 5 and finished.frames == expected_geometry.frames
    assert finished.video_path.endswith(".mp4") and finished.sidecar_path.endswith(".json")
    assert {"text_encode_s", "denoise_s", "mux_s"} <= set(finished.timings_s)
    for event in events:
        assert pickle.loads(pickle.dumps(event)) is not None


def test_cancel_removes_a_waiting_job_and_stops_a_running_one(front) -> None:
    running = front.submit(_long_request("running"))
    _wait_for_step(running)
    waiting = front.submit(_long_request("waiting"))
    assert waiting.next_event(timeout=EVENT_TIMEOUT_S) == JobQueued(waiting.job_id, position=1)

    front.cancel(waiting)
    assert events_until_done(waiting, EVENT_TIMEOUT_S)[-1] == JobFailed(
        waiting.job_id, "cancelled", "Cancelled before it started."
    )
    cancelled_at = time.monotonic()
    front.cancel(running)
    assert events_until_done(running, EVENT_TIMEOUT_S)[-1] == JobFailed(
        running.job_id, "cancelled", "Cancelled."
    )
    assert time.monotonic() - cancelled_at < 10
    assert not list(front.outputs_dir.glob("*.mp4"))

    # The replica is free again.
    after = events_until_done(
        front.submit(GenerationRequest(task="t2va", prompt="after", steps=2)), EVENT_TIMEOUT_S
    )
    assert isinstance(after[-1], JobFinished)


def test_an_engine_failure_is_one_sentence_and_the_replica_survives(front, engines, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise RuntimeError("internal detail that must not reach the user")

    monkeypatch.setattr(engines[0], "generate_to_file", fail)
    failed = events_until_done(
        front.submit(GenerationRequest(task="t2va", prompt="x", steps=2)), EVENT_TIMEOUT_S
    )[-1]
    assert failed == JobFailed(failed.job_id, "engine", ENGINE_FAILURE_MESSAGE)
    monkeypatch.undo()
    assert isinstance(
        events_until_done(front.submit(GenerationRequest(task="t2va", prompt="y", steps=2)), EVENT_TIMEOUT_S)[
            -1
        ],
        JobFinished,
    )


class _FlakyReplica:
    """An engine replica whose runs (the warm-up's too) first do what `faults` say, one per run: raise the exception,
    or return the value instead of a job's end; then they run the engine."""

    def __init__(self, engine: Engine, faults: list[object]) -> None:
        self.inner = EngineReplica(engine)
        self.facts = self.inner.facts
        self.faults = faults

    def run(self, handle: JobHandle, replica_index: int, preview_every: int):
        if self.faults:
            fault = self.faults.pop(0)
            if isinstance(fault, Exception):
                raise fault
            return fault
        return self.inner.run(handle, replica_index, preview_every)

    def close(self) -> None:
        pass


def test_a_replica_that_raises_fails_only_that_job_and_its_thread_serves_the_next(
    engines, tmp_path, caplog
) -> None:
    """What split stage groups once did (a KeyError from a missing timing): the job ends with a sentence, the
    traceback goes to the log, and the same worker thread runs the next job to its end."""
    replica = _FlakyReplica(engines[0], [KeyError("conditioning_s"), "not a job's end"])
    front = EngineFront([replica], tmp_path / "outputs")
    try:
        request = GenerationRequest(task="t2va", prompt="x", steps=2)
        raised, returned, finished = [front.submit(request) for _ in range(3)]
        assert events_until_done(raised, EVENT_TIMEOUT_S)[-1] == JobFailed(
            raised.job_id, "engine", ENGINE_FAILURE_MESSAGE
        )
        assert events_until_done(returned, EVENT_TIMEOUT_S)[-1] == JobFailed(
            returned.job_id, "engine", ENGINE_FAILURE_MESSAGE
        )
        assert isinstance(events_until_done(finished, EVENT_TIMEOUT_S)[-1], JobFinished)
    finally:
        front.shutdown()
    assert (
        f"job {raised.job_id}: replica 0 raised" in caplog.text
        and "KeyError: 'conditioning_s'" in caplog.text
    )


def test_a_warm_up_that_raises_leaves_the_replica_serving(engines, tmp_path) -> None:
    front = EngineFront(
        [_FlakyReplica(engines[0], [RuntimeError("at warm-up")])], tmp_path / "outputs", warm_up=True
    )
    try:
        handle = front.submit(GenerationRequest(task="t2va", prompt="after it", steps=2))
        assert isinstance(events_until_done(handle, EVENT_TIMEOUT_S)[-1], JobFinished)
    finally:
        front.shutdown()


def test_a_request_error_is_refused_at_submit_and_keeps_the_engine_message_at_run_time(
    front, tmp_path
) -> None:
    missing = str(tmp_path / "missing.png")
    request = GenerationRequest(task="fl2va", prompt="x", steps=2, keyframes=(Keyframe(missing, "first"),))
    with refused(RequestError, field="keyframes[0]", path=missing):
        front.submit(request)  # resolved before it takes a place in the queue
    assert front.waiting == 0
    # A file that goes away after the request was resolved: the job fails with the engine's words.
    keyframe = tmp_path / "gone.png"
    shutil.copyfile(ASSETS / "fl2va" / "first.png", keyframe)
    resolved = front.resolve(dataclasses.replace(request, keyframes=(Keyframe(str(keyframe), "first"),)))
    keyframe.unlink()
    failed = events_until_done(front.submit(resolved), EVENT_TIMEOUT_S)[-1]
    assert failed.kind == "request"
    assert "gone.png" in failed.message and "Traceback" not in failed.message


def test_two_replicas_run_two_jobs_at_once(engines, tmp_path) -> None:
    front = EngineFront(engines, tmp_path / "outputs")
    try:
        handles = [front.submit(_long_request(f"job {index}")) for index in range(2)]
        for handle in handles:
            _wait_for_step(handle)
        assert front.running == 2 and front.waiting == 0
    finally:
        front.shutdown()
    for handle in handles:
        assert events_until_done(handle, EVENT_TIMEOUT_S)[-1].kind == "cancelled"


def test_preview_reads_only_the_newest_latent_frame() -> None:
    latent_frames, latent_h, latent_w, patch, channels = 3, 8, 14, 2, 4
    rows_per_frame = (latent_h // patch) * (latent_w // patch)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(latent_frames * rows_per_frame, channels * patch * patch, generator=generator)
    rows_before = rows.clone()
    image = latent_preview_rgb(rows, latent_frames, latent_h, latent_w, patch)
    assert torch.equal(rows, rows_before)

    # Independent numpy version of the documented map: newest frame, hue-wheel weights, +-2.5 std, repeat.
    last = (
        rows[-rows_per_frame:].numpy().reshape(latent_h // patch, latent_w // patch, channels, patch, patch)
    )
    latent = last.transpose(2, 0, 3, 1, 4).reshape(channels, latent_h, latent_w)
    angles = 2 * np.pi * np.arange(channels) / channels
    weights = np.cos(angles[None, :] - 2 * np.pi * np.arange(3)[:, None] / 3) / np.sqrt(channels)
    rgb = np.einsum("kc,chw->hwk", weights, latent)
    rgb -= rgb.mean(axis=(0, 1))
    expected = np.round(np.clip(0.5 + 0.5 * rgb / (2.5 * rgb.std()), 0, 1) * 255).astype(np.uint8)
    scale = -(-PREVIEW_SHORT_EDGE // latent_h)
    expected = expected.repeat(scale, axis=0).repeat(scale, axis=1)
    assert image.shape == expected.shape == (latent_h * scale, latent_w * scale, 3)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    np.testing.assert_allclose(channel_to_rgb_weights(channels), weights, rtol=1e-6)

    older = rows.clone()
    older[:-rows_per_frame] = 0
    assert np.array_equal(latent_preview_rgb(older, latent_frames, latent_h, latent_w, patch), image)
    with pytest.raises(ValueError, match="expected 84 video rows"):
        latent_preview_rgb(rows[:-1], latent_frames, latent_h, latent_w, patch)


def test_a_warm_up_runs_before_the_first_job_and_leaves_no_files(engines, tmp_path, monkeypatch) -> None:
    calls, wrote_video = [], []
    generate_to_file = engines[0].generate_to_file

    def recording(request, out_path, **keywords):
        calls.append((request, out_path))
        written = generate_to_file(request, out_path, **keywords)
        wrote_video.append(out_path.is_file())
        return written

    monkeypatch.setattr(engines[0], "generate_to_file", recording)
    outputs = tmp_path / "outputs"
    front = EngineFront(engines[:1], outputs, warm_up=True)
    try:
        request = GenerationRequest(task="t2va", prompt="after the warm-up", steps=2)
        events = events_until_done(front.submit(request), EVENT_TIMEOUT_S)
    finally:
        front.shutdown()
    assert isinstance(events[-1], JobFinished)
    # The job waited for the warm-up, which ran like a job into a folder of its own, now gone.
    # Each ran as resolved (the job by the front when submitted, the warm-up by its engine), steps as given.
    assert [call[0].request for call in calls] == [WARM_UP_REQUEST, request]
    warm_up_folder = calls[0][1].parent
    assert wrote_video == [True, True] and warm_up_folder != outputs and not warm_up_folder.exists()
    assert sorted(path.name for path in outputs.iterdir()) == sorted(
        Path(path).name for path in (events[-1].video_path, events[-1].sidecar_path)
    )


def test_a_failed_warm_up_leaves_the_replica_serving(engines, tmp_path, monkeypatch, caplog) -> None:
    generate_to_file = engines[0].generate_to_file

    def fail_the_warm_up(request, out_path, **keywords):
        if request.request == WARM_UP_REQUEST:
            raise RuntimeError("a kernel that does not compile")
        return generate_to_file(request, out_path, **keywords)

    monkeypatch.setattr(engines[0], "generate_to_file", fail_the_warm_up)
    front = EngineFront(engines[:1], tmp_path / "outputs", warm_up=True)
    try:
        events = events_until_done(
            front.submit(GenerationRequest(task="t2va", prompt="x", steps=2)), EVENT_TIMEOUT_S
        )
    finally:
        front.shutdown()
    assert isinstance(events[-1], JobFinished)
    assert "the warm-up run did not finish" in caplog.text


class _WaitingReplica:
    """A replica whose runs last until they are cancelled (what a long warm-up looks like to the front)."""

    def __init__(self, tasks: tuple[str, ...] = ("t2va", "fl2va", "ref2va")) -> None:
        # An undistilled checkpoint: the warm-up keeps its one step.
        # The facts of a small undistilled checkpoint: the front resolves each job on them before queueing it.
        self.facts = CheckpointFacts(
            tasks=tasks, canvas=CanvasRules(32, 32 * 56), vae_spatial_ratio=4, patch=2
        )
        self.requests = []

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFailed:
        self.requests.append(handle.request)
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not handle.cancel_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        return JobFailed(handle.job_id, "cancelled", "Cancelled.")

    def close(self) -> None:
        pass


def test_shutdown_cancels_a_warm_up_that_is_still_running(tmp_path) -> None:
    replica = _WaitingReplica()
    front = EngineFront([replica], tmp_path / "outputs", warm_up=True)
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not replica.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = front.submit(GenerationRequest(task="t2va", prompt="queued behind the warm-up", steps=2))
    assert replica.requests == [WARM_UP_REQUEST] and front.waiting == 1
    started = time.monotonic()
    front.shutdown(timeout=EVENT_TIMEOUT_S)
    assert time.monotonic() - started < 10
    assert replica.requests == [WARM_UP_REQUEST]  # the queued job never ran
    assert events_until_done(waiting, EVENT_TIMEOUT_S)[-1].kind == "cancelled"


def test_no_warm_up_where_the_checkpoint_does_not_serve_its_task(tmp_path) -> None:
    replica = _WaitingReplica(tasks=("ref2va",))
    front = EngineFront([replica], tmp_path / "outputs", warm_up=True)
    try:
        picture = Reference(kind="image", path=str(ASSETS / "ref2va" / "picture1.png"))
        handle = front.submit(
            GenerationRequest(task="ref2va", prompt="first", steps=2, references=(picture,))
        )
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not replica.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert replica.requests == [handle.request]  # the job ran first: no warm-up before it
    finally:
        front.shutdown(timeout=EVENT_TIMEOUT_S)


def test_settle_heap_collects_start_up_garbage_and_later_cycles_are_still_collected() -> None:
    import gc
    import weakref

    from h3engine.runtime.front import release_memory, settle_heap

    class Node:
        pass

    def cycle() -> weakref.ref:
        node = Node()
        node.self = node  # only the cyclic collector frees it
        return weakref.ref(node)

    gc.disable()  # nothing but these calls may collect
    try:
        before = cycle()
        frozen_before = gc.get_freeze_count()
        settle_heap()
        assert before() is None  # start-up's cyclic garbage is collected, not frozen forever
        assert gc.get_freeze_count() > frozen_before  # what start-up made is now out of later collections
        after = cycle()
        assert after() is not None
        release_memory(torch.device("cpu"))
        assert after() is None  # a job's cycles are still found
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_lora_that_does_not_fit_is_refused_before_the_job_is_queued(front, tmp_path) -> None:
    from _app_helpers import ASSETS
    from _lora_helpers import random_lora, write_lora
    from safetensors.torch import save_file

    from h3engine.errors import RequestError
    from h3engine.models.dit_config import DiTConfig
    from h3engine.request.files import Reference
    from h3engine.request.model import LoraChoice

    config = DiTConfig.tiny()
    fits = tmp_path / "fits.safetensors"
    write_lora(fits, random_lora(config, seed=1), "diffusers", config)
    pruned = tmp_path / "pruned.safetensors"  # fc2's input narrower than this DiT's
    save_file(
        {
            "blocks.1.mlp.fc2.lora_A.weight": torch.ones(4, config.ffn_dim - 8),
            "blocks.1.mlp.fc2.lora_B.weight": torch.ones(config.hidden_size, 4),
        },
        str(pruned),
    )
    ref_only = tmp_path / "ref_only.safetensors"
    write_lora(ref_only, random_lora(config, seed=2), "diffusers_ref", config)

    def request(path: Path, task: str = "t2va") -> GenerationRequest:
        picture = (Reference("image", str(ASSETS / "ref2va" / "picture1.png")),) if task == "ref2va" else ()
        return GenerationRequest(
            task=task,
            prompt="<Picture 1> waves." if picture else "Waves.",
            steps=2,
            references=picture,
            loras=(LoraChoice(str(path), 0.5),),
        )

    assert front.resolve(request(fits)).warnings == ()
    # The file and its first offending key (the file's own wording: tests/test_lora_format.py).
    names = ("'pruned.safetensors'", "'blocks.1.mlp.fc2.lora_A.weight'")
    with refused(RequestError, field="loras[0]", names=names) as caught:
        front.resolve(request(pruned))
    assert str(tmp_path) not in str(caught.value)  # the user's file name, never the server's path
    with refused(RequestError, field="loras[0].target", names=("'ref_only.safetensors'",)):
        front.resolve(request(ref_only))
    assert front.resolve(request(ref_only, "ref2va")).warnings == ()  # the Ref2VA DiT is what it names
