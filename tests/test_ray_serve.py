"""Engine replicas on a local Ray Serve cluster (h3engine.runtime.ray_serve), on the CPU, addresses on 127.0.0.1.

What is compared:
* Two CPU replicas behind the engine front serve four jobs submitted together (T2VA, FL2VA with a keyframe,
  Ref2VA with an image and an audio reference, T2VA with a LoRA): both replicas work at once, each job's saved
  tensors equal the local fp32 engine's (max |ray - local| / max |local| <= 1e-5), its sidecar records the same
  request, inputs (the app host's paths and hashes) and adapters, and its progress and previews arrive as locally.
* Cancel mid-run stops the job within a few steps and frees its replica; the next job finishes.
* A replica process killed (SIGKILL) mid-job fails that job alone with a message saying so; the other job goes
  on, Ray Serve starts a new replica, and the next jobs finish on both.
* The app (`--ray ADDRESS`): progress with ETA and cancel through the gradio_client API, a playable MP4 in the
  outputs folder; after SIGTERM no actor of its application is left.
* Shutdown of the front cancels the running job and leaves no Ray actor of ours (Serve's controller included)
  and no replica folder; a killed replica's folder is removed by the next job on that node.
Marked `ray`: they need `make ray` (requirements-ray.txt); see README for their time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

# Before Ray is imported: every address of the local cluster is 127.0.0.1, and nothing reports usage.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
from _app_helpers import assert_browser_playable, start_app, stop_app  # noqa: E402
from _lora_helpers import RandomLora, random_lora, write_lora  # noqa: E402
from _runtime_helpers import events_until_done, max_relative_errors, wait_for_step  # noqa: E402

from h3engine.checkpoint.facts import CheckpointFacts  # noqa: E402
from h3engine.checkpoint.layout import detect_layout  # noqa: E402
from h3engine.engine.engine import Engine  # noqa: E402
from h3engine.engine.options import EngineOptions  # noqa: E402
from h3engine.request.files import Keyframe, Reference  # noqa: E402
from h3engine.request.model import GenerationRequest, LoraChoice  # noqa: E402
from h3engine.runtime.front import EngineFront  # noqa: E402
from h3engine.runtime.messages import (  # noqa: E402
    JobFailed,
    JobFinished,
    JobStarted,
    PreviewFrame,
    StepProgress,
)

ray = pytest.importorskip("ray", reason="Ray is not installed (make ray)")
from h3engine.runtime.ray_serve import (  # noqa: E402
    RAY_FOLDER_PREFIX,
    REPLICA_DIED_MESSAGE,
    RayEngine,
    RayReplicaSpec,
    replica_death_cause,
    start_ray_replicas,
)

pytestmark = pytest.mark.ray

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPOSITORY_ROOT / "assets"
SEED = 11
STEPS = 3
PREVIEW_EVERY = 2
TOLERANCE = (
    1e-5  # as the worker groups (tests/test_runtime_workers.py): other thread counts sum in another order
)
EVENT_TIMEOUT_S = 120
REPLACEMENT_TIMEOUT_S = 90
LONG_REQUEST = GenerationRequest(
    task="t2va", prompt="a long one", steps=1000, duration_seconds=15.0, width=112, height=64
)
# The app's /t2va parameters: a job long enough to cancel mid-run (tens of seconds), and a short one.
LONG_API_JOB = dict(
    prompt="A long one.", duration_seconds=15, aspect_ratio="auto", seed=1, randomize_seed=False, steps=1000
)
SHORT_API_JOB = {**LONG_API_JOB, "prompt": "Right after.", "duration_seconds": 5, "seed": 2, "steps": 2}
COMPARED_SIDECAR_KEYS = ("request", "inputs", "adapters", "seed", "geometry", "recipe")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of this process (4 logical CPUs on the 2 cores), ended with the module."""
    context = ray.init(
        address="local", num_cpus=4, include_dashboard=False, namespace="h3engine", logging_level="WARNING"
    )
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=SEED)


@pytest.fixture(scope="module")
def deployment(cluster, checkpoint, tmp_path_factory):
    """Two CPU replicas (fp32) behind a front; the last test shuts it down."""
    spec = RayReplicaSpec(
        str(checkpoint), 1, False, EngineOptions(dtype="float32"), python_path=str(REPOSITORY_ROOT)
    )
    engine = start_ray_replicas(cluster, spec, replicas=2)
    front = EngineFront(engine.slots(), tmp_path_factory.mktemp("ray_outputs"), preview_every=PREVIEW_EVERY)
    yield front, engine
    front.shutdown()


@pytest.fixture(scope="module")
def requests(checkpoint, tmp_path_factory) -> list[GenerationRequest]:
    """Four requests whose inputs live in a folder of the app host (not the repository)."""
    folder = tmp_path_factory.mktemp("ray_inputs")
    for name in ("fl2va/first.png", "ref2va/picture1.png", "ref2va/audio1.wav"):
        shutil.copy(ASSETS / name, folder / Path(name).name)
    config = CheckpointFacts.from_layout(detect_layout(checkpoint)).lora_targets["fl2va"][
        1
    ]  # no model loaded
    lora = random_lora(config, 41)
    lora_path = folder / "style.safetensors"
    write_lora(
        lora_path,
        RandomLora({m: d * 0.02 for m, d in lora.down.items()}, lora.up, lora.alpha),
        "original",
        config,
    )
    base = GenerationRequest(task="t2va", prompt="a red kite", steps=STEPS, seed=SEED, duration_seconds=4.0)
    return [
        base,
        dataclasses.replace(
            base,
            task="fl2va",
            prompt="<Picture 1> the kite rises",
            keyframes=(Keyframe(str(folder / "first.png"), "first"),),
        ),
        dataclasses.replace(
            base,
            task="ref2va",
            prompt="<Picture 1> sings <Audio 1>",
            references=(
                Reference("image", str(folder / "picture1.png")),
                Reference("audio", str(folder / "audio1.wav")),
            ),
        ),
        dataclasses.replace(base, seed=SEED + 1, loras=(LoraChoice(str(lora_path), 0.8),)),
    ]


@pytest.fixture(scope="module")
def local_results(checkpoint, requests, tmp_path_factory) -> list[tuple[Path, dict]]:
    """The local fp32 engine's tensors and sidecar of each request."""
    folder = tmp_path_factory.mktemp("ray_local")
    engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    results = []
    for index, request in enumerate(requests):
        files = engine.generate_to_file(
            request, folder / f"{index}.mp4", save_tensors_path=folder / f"{index}.safetensors"
        )
        results.append((files.tensors, json.loads(files.sidecar.read_text())))
    return results


def wait_for_replicas(engine: RayEngine, count: int, other_than: set[str] | None = None) -> set[str]:
    """The names of our live replicas once there are `count` of them (and they are not `other_than`)."""
    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while True:
        names = set(engine.replica_actors())
        if len(names) == count and names != other_than:
            return names
        assert time.monotonic() < deadline, f"replicas now: {names}"
        time.sleep(0.5)


def events_within(handle, seconds: float) -> list:
    """The job's messages up to its terminal one, which must come within `seconds` in all."""
    deadline = time.monotonic() + seconds
    events = []
    while not events or not isinstance(events[-1], (JobFinished, JobFailed)):
        event = handle.next_event(timeout=max(0.0, deadline - time.monotonic()))
        assert event is not None, f"the job did not end within {seconds} s; so far: {events[-3:]}"
        events.append(event)
    return events


def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.2)


def replica_folders(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"{RAY_FOLDER_PREFIX}{pid}-*"))


def our_actors(prefix: str) -> list[str]:
    return [
        actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if prefix in actor["name"]
    ]


# --------------------------------------------------------------------------------------------------------------


def test_a_dead_replica_is_told_by_the_type_of_rays_error() -> None:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    assert replica_death_cause(ActorDiedError()) == "its process exited"
    # The text of the error plays no part: an unavailable actor whose message says "exit" is still unavailable.
    assert replica_death_cause(ActorUnavailableError("worker exit", None)) == "it could not be reached"
    assert replica_death_cause(ReplicaUnavailableError("replica-1")) == "it could not be reached"
    assert replica_death_cause(RayActorError(error_msg="process exited")) == "its actor failed"


def test_two_replicas_serve_four_concurrent_jobs_equal_to_the_local_engine(
    deployment, requests, local_results, tmp_path
) -> None:
    front, _ = deployment
    handles = [
        front.submit(request, tmp_path / f"{index}.mp4", tmp_path / f"{index}.safetensors")
        for index, request in enumerate(requests)
    ]
    busy_at_once = 0
    while not all(handle.done for handle in handles):
        busy_at_once = max(busy_at_once, front.running)
        time.sleep(0.01)
    assert busy_at_once == 2
    for handle, request, (local_tensors, local_sidecar) in zip(handles, requests, local_results, strict=True):
        events = events_until_done(handle, EVENT_TIMEOUT_S)
        finished = events[-1]
        assert isinstance(finished, JobFinished), finished
        assert Path(finished.video_path) == handle.out_path and handle.out_path.is_file()
        errors = max_relative_errors(handle.save_tensors_path, local_tensors)
        assert max(errors.values()) <= TOLERANCE, (request.task, errors)
        sidecar = json.loads(Path(finished.sidecar_path).read_text())
        for key in COMPARED_SIDECAR_KEYS:
            assert sidecar[key] == local_sidecar[key], key
        assert sidecar["video"] == handle.out_path.name
        started = [event for event in events if isinstance(event, JobStarted)]
        assert len(started) == 1 and started[0].replica in (0, 1)
        assert [event.step for event in events if isinstance(event, StepProgress)] == [1, 2, 3]
        assert [event.step for event in events if isinstance(event, PreviewFrame)] == [2, 3]
    assert sum(len(r.loras) for r in requests) == 1 and local_results[3][1]["adapters"][0]["strength"] == 0.8


def test_cancel_mid_run_stops_the_job_and_frees_its_replica(deployment, requests, tmp_path) -> None:
    front, _ = deployment
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    front.cancel(handle)
    after_cancel = events_within(handle, 30)
    assert after_cancel[-1] == JobFailed(handle.job_id, "cancelled", "Cancelled.")
    assert len([event for event in after_cancel if isinstance(event, StepProgress)]) <= 5
    # Both replicas are free again: two jobs run side by side and finish.
    following = [front.submit(requests[0], tmp_path / f"after-{n}.mp4") for n in range(2)]
    for next_handle in following:
        assert isinstance(events_until_done(next_handle, EVENT_TIMEOUT_S)[-1], JobFinished)


def test_a_killed_replica_fails_its_job_alone_and_comes_back(deployment, requests, tmp_path) -> None:
    front, engine = deployment
    old_names = wait_for_replicas(engine, 2)
    handles = [front.submit(LONG_REQUEST) for _ in range(2)]
    for handle in handles:
        wait_for_step(handle, 2, EVENT_TIMEOUT_S)
    victim = engine.replica_pids()[0]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    while not any(handle.done for handle in handles):
        assert time.monotonic() - killed_at < 30, "no job failed after the kill"
        time.sleep(0.05)
    failed = [events_until_done(handle, 5)[-1] for handle in handles if handle.done]
    assert len(failed) == 1 and failed[0].kind == "engine", failed
    # Told by the error's type (Ray's ActorDiedError), not by its text.
    assert failed[0].message == REPLICA_DIED_MESSAGE.format(cause="its process exited"), failed[0].message
    survivor = next(handle for handle in handles if not handle.done)
    wait_for_step(survivor, 4, EVENT_TIMEOUT_S)  # the other replica keeps denoising
    front.cancel(survivor)
    assert events_within(survivor, 30)[-1].kind == "cancelled"

    new_names = wait_for_replicas(engine, 2, other_than=old_names)
    assert len(new_names - old_names) == 1 and victim not in engine.replica_pids()
    following = [front.submit(requests[0], tmp_path / f"after-{n}.mp4") for n in range(2)]
    assert all(isinstance(events_until_done(h, EVENT_TIMEOUT_S)[-1], JobFinished) for h in following)
    assert replica_folders(victim) == []  # a replica removed the killed one's folder


def test_the_app_serves_progress_and_cancel_through_ray(cluster, checkpoint, tmp_path) -> None:
    from gradio_client import Client

    app = start_app(
        tmp_path, extra_arguments=["--ray", cluster, "--ray-replicas", "1"], checkpoint=checkpoint
    )
    try:
        client = Client(app.url, verbose=False, download_files=str(tmp_path / "downloads"))
        job = client.submit(**LONG_API_JOB, api_name="/t2va")
        wait_until(lambda: any("s left" in str(update[0]) for update in job.outputs()) or job.done(), 60)
        assert not job.done(), f"no progress arrived before the end:\n{app.log_tail()}"
        job.cancel()
        wait_until(job.done, 20)
        result = client.predict(**SHORT_API_JOB, api_name="/t2va")
        assert result[0].startswith("Done"), result[0]
        assert_browser_playable(result[2], 124)
        assert "Ray Serve application h3engine-" in app.log_tail(20000)
        assert our_actors(f"h3engine-{app.process.pid}-"), "the app's replica is not a Ray actor"
    finally:
        assert stop_app(app) == 0, app.log_tail()
    assert our_actors(f"h3engine-{app.process.pid}-") == []


def test_shutdown_cancels_the_running_job_and_leaves_no_actor_of_ours(deployment) -> None:
    front, engine = deployment
    pids = engine.replica_pids()
    assert all(replica_folders(pid) for pid in pids)
    handle = front.submit(LONG_REQUEST)
    wait_for_step(handle, 1, EVENT_TIMEOUT_S)
    front.shutdown()
    assert events_within(handle, 30)[-1] == JobFailed(handle.job_id, "cancelled", "Cancelled.")
    assert our_actors(engine.app_name) == []
    assert [folder for pid in pids for folder in replica_folders(pid)] == []
    # No application was left, so Serve itself (its controller) went too.
    assert [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"] == []
