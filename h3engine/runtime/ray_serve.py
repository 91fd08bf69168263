"""Engine replicas on a Ray Serve cluster behind the engine front (`python app.py --ray ADDRESS`).

`start_ray_replicas(address, spec, replicas)` deploys `EngineDeployment` (one Serve replica = one engine
replica: an in-process `Engine`, or with `world_size` > 1 a resident worker group, h3engine.runtime.workers; a
replica's GPUs are one placement-group bundle's, so on one node) and returns a `RayEngine` whose `slots()` are
the front's replicas: one worker thread each, so the front's queue, positions, progress, previews, cancel and
History stay as they are. A job streams its messages back (`DeploymentHandle.options(stream=True)`); its files
come back as bytes (h3engine.runtime.ray_jobs). Cancel cancels the Serve request: the replica stops the job at
its next step. A replica that dies fails its job with `JobFailed(kind="engine")` saying so (no retry: a job
that killed its replica, say out of memory, would kill the next one too); Ray Serve replaces it.
`RayEngine.close()` deletes our application (and Serve, when it was the last), so no actor of ours outlives
the app. Ray is imported here only, and only when used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.engine.options import EngineOptions
from h3engine.errors import RequestError
from h3engine.media.leftovers import owned_temp_folder, remove_dead_temp_folders
from h3engine.media.outputs import OutputFiles
from h3engine.runtime.front import (
    CANCELLED_BEFORE_START_MESSAGE,
    JobHandle,
    Replica,
    output_failure_message,
    settle_heap,
    warm_up_request,
)
from h3engine.runtime.messages import CANCELLED_MESSAGE, JobFailed, JobFinished, JobStarted
from h3engine.runtime.ray_jobs import (
    FileChunk,
    RayJob,
    ReceivedFiles,
    file_chunks,
    pack_job,
    restore_sidecar_paths,
    unpack_inputs,
)

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "H3EngineReplica"
APP_NAME_PREFIX = "h3engine-"
SERVE_NAMESPACE = "serve"
POLL_INTERVAL_S = 0.05
# A replica's folder for its jobs' inputs and outputs (h3engine.media.leftovers: `PREFIX-PID-*`).
RAY_FOLDER_PREFIX = "h3-ray-"
# Serve checks each replica this often; a dead replica's actor is noticed sooner, through Ray's own heartbeat.
HEALTH_CHECK_PERIOD_S = 2.0
GRACEFUL_SHUTDOWN_S = 20.0
REPLICA_DIED_MESSAGE = "The Ray replica running this job died ({cause}); Ray Serve is starting a new one."
RAY_MISSING_PROBLEM = "Ray is not installed in this environment (install it with `make ray`)"


@dataclass(frozen=True)
class RayReplicaSpec:
    """One Serve replica: `world_size` ranks on GPUs (`gpus`) or on the CPU, over the checkpoint at the same path
    on every node."""

    checkpoint: str
    world_size: int
    gpus: bool
    engine: EngineOptions
    warm_up: bool = True
    cpus: float = 1.0  # Ray CPUs each replica reserves
    python_path: str | None = None  # where the nodes' workers import h3engine from (the app's checkout)
    stall_timeout_s: float | None = None  # --stall-timeout, for a replica's worker group (None: derived)


def require_ray() -> None:
    """RequestError naming --ray when Ray cannot be imported."""
    _token_auth_when_a_token_is_here()  # before Ray is imported: it reads the setting then
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise RequestError("--ray", RAY_MISSING_PROBLEM) from None


# --- inside a Serve replica -------------------------------------------------------------------------------------


def _local_replica(spec: RayReplicaSpec) -> Replica:
    import torch

    from h3engine.engine.options import check_engine_options, load_engine
    from h3engine.runtime.front import EngineReplica
    from h3engine.runtime.supervision import StallPolicy
    from h3engine.runtime.workers import ProcessReplica

    layout = check_engine_options(spec.engine, spec.world_size)
    # Ray gives the actor its GPUs as CUDA_VISIBLE_DEVICES: they are cuda:0..N-1 here.
    devices = [f"cuda:{index}" if spec.gpus else "cpu" for index in range(spec.world_size)]
    if spec.world_size == 1:
        return EngineReplica(load_engine(spec.checkpoint, torch.device(devices[0]), spec.engine))
    return ProcessReplica(spec.checkpoint, devices, layout, spec.engine, StallPolicy(spec.stall_timeout_s))


class EngineDeployment:
    """The class of the Serve deployment: one engine replica, one job at a time (`max_ongoing_requests=1`)."""

    def __init__(self, spec: RayReplicaSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        self._folder = owned_temp_folder(RAY_FOLDER_PREFIX)
        self._replica = _local_replica(spec)
        self._busy = threading.Lock()
        if spec.warm_up and spec.gpus:
            self._warm_up()
        settle_heap()  # each job's collection then walks only what jobs made

    def _warm_up(self) -> None:
        if "t2va" not in self._replica.facts.tasks:
            return
        handle = JobHandle("warm-up", warm_up_request(self._replica.facts), self._folder / "warm-up.mp4")
        started = time.perf_counter()
        result = self._replica.run(handle, 0, 1 << 30)
        logger.info("warm-up: %s in %.1f s", type(result).__name__, time.perf_counter() - started)

    def facts(self) -> CheckpointFacts:
        return self._replica.facts

    def _run_job(self, handle: JobHandle, job: RayJob) -> JobFinished | JobFailed:
        with self._busy:
            return self._replica.run(handle, job.replica_index, job.preview_every)

    async def run(self, job: RayJob) -> Any:
        """Run one job, yielding its messages, then its files' chunks and its terminal message."""
        # Those of replicas on this node that were killed (here, not only at start: a killed process may linger
        # unreaped for a moment, and counts as alive until then).
        remove_dead_temp_folders(RAY_FOLDER_PREFIX)
        folder = self._folder / f"job-{job.job_id}"
        folder.mkdir()
        inputs_folder = self._folder / "inputs"
        request, app_paths = unpack_inputs(job, inputs_folder)
        tensors = folder / job.tensors_name if job.tensors_name is not None else None
        handle = JobHandle(job.job_id, request, folder / job.video_name, tensors)
        running = asyncio.get_running_loop().run_in_executor(None, self._run_job, handle, job)
        try:
            while not running.done():
                for event in handle.drain():
                    yield event
                await asyncio.sleep(POLL_INTERVAL_S)
            for event in handle.drain():
                yield event
            result = running.result()
            if isinstance(result, JobFinished):
                sidecar = Path(result.sidecar_path)
                sidecar.write_bytes(restore_sidecar_paths(sidecar.read_bytes(), app_paths))
                for chunk in file_chunks(job.job_id, OutputFiles(handle.out_path, sidecar, tensors)):
                    yield chunk
            yield result
        finally:
            # Cancelled by the caller (the app's Cancel, or the app went away): stop the job, and hold this replica
            # until it has stopped, so that the next job finds it free.
            handle._cancel_requested.set()
            await asyncio.shield(running)
            shutil.rmtree(folder, ignore_errors=True)
            for path in [p for p in inputs_folder.glob("*/*") if p.suffix != ".safetensors"]:
                shutil.rmtree(path.parent, ignore_errors=True)  # LoRAs stay for the next job; the rest goes

    def __del__(self) -> None:
        replica = getattr(self, "_replica", None)
        if replica is not None:
            replica.close()
        shutil.rmtree(getattr(self, "_folder", ""), ignore_errors=True)


# --- on the app host -------------------------------------------------------------------------------------------


class RaySlot:
    """One place in the front's queue: sends a job to the deployment and relays its stream (a `Replica`)."""

    def __init__(self, engine: RayEngine) -> None:
        self._engine = engine
        self.facts = engine.facts

    def partition_on_device(self) -> str | None:
        """Unknown: Serve routes each job to whichever replica is free, so a slot has no device of its own and the
        front takes its jobs in submission order."""
        return None

    def run(self, handle: JobHandle, replica_index: int, preview_every: int) -> JobFinished | JobFailed:
        if handle.cancel_requested:
            return JobFailed(handle.job_id, "cancelled", CANCELLED_BEFORE_START_MESSAGE)
        files = OutputFiles.beside(handle.out_path, handle.save_tensors_path)
        try:
            job = pack_job(handle.job_id, handle.request, files, replica_index, preview_every)
        except RequestError as error:
            return JobFailed(handle.job_id, "request", str(error))
        received = ReceivedFiles(files)
        try:
            return self._relay(handle, job, received)
        finally:
            received.discard()

    def _relay(self, handle: JobHandle, job: RayJob, received: ReceivedFiles) -> JobFinished | JobFailed:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError, RequestCancelledError

        stream = self._engine.handle.options(stream=True).run.remote(job)
        finished = threading.Event()
        watcher = threading.Thread(
            target=self._cancel_on_request, args=(handle, stream, finished), daemon=True
        )
        watcher.start()
        try:
            for event in stream:
                if isinstance(event, FileChunk):
                    received.write(event)
                elif isinstance(event, JobFinished):
                    return received.finish(event)
                elif isinstance(event, JobFailed):
                    return event
                elif isinstance(event, JobStarted):
                    wait = time.monotonic() - handle.submitted_at  # the replica's clock is not ours
                    handle.publish(dataclasses.replace(event, replica=job.replica_index, queue_wait_s=wait))
                else:
                    handle.publish(event)
            raise RuntimeError("the replica's stream ended without a terminal message")
        except RequestCancelledError:
            return JobFailed(handle.job_id, "cancelled", CANCELLED_MESSAGE)
        except (RayActorError, ReplicaUnavailableError) as error:
            logger.error("job %s: the Ray replica died: %s", handle.job_id, error)
            cause = replica_death_cause(error)
            return JobFailed(handle.job_id, "engine", REPLICA_DIED_MESSAGE.format(cause=cause))
        except Exception as error:
            if handle.cancel_requested:
                return JobFailed(handle.job_id, "cancelled", CANCELLED_MESSAGE)
            logger.exception("job %s failed on the Ray deployment", handle.job_id)
            return JobFailed(handle.job_id, "engine", output_failure_message(error, handle.out_path.parent))
        finally:
            finished.set()
            watcher.join()

    @staticmethod
    def _cancel_on_request(handle: JobHandle, stream: Any, finished: threading.Event) -> None:
        while not finished.wait(POLL_INTERVAL_S):
            if handle.cancel_requested:
                stream.cancel()
                return

    def close(self) -> None:
        self._engine.close()


def replica_death_cause(error: BaseException) -> str:
    """Why Ray says a replica is gone, in a few words, by the error's type: its actor's process died (ActorDiedError),
    it could not be reached (ActorUnavailableError, Serve's ReplicaUnavailableError), or its actor failed."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import ReplicaUnavailableError

    if isinstance(error, ActorDiedError):
        return "its process exited"
    if isinstance(error, (ActorUnavailableError, ReplicaUnavailableError)):
        return "it could not be reached"
    return "its actor failed"


@dataclass
class RayEngine:
    """Our Serve application on a Ray cluster: its handle, the checkpoint facts, its slots for the front.

    `disconnect`: whether `close` also ends this process's connection to the cluster (it made it).
    """

    app_name: str
    handle: Any
    replicas: int
    facts: CheckpointFacts | None
    disconnect: bool = True
    _closed: bool = dataclasses.field(default=False, init=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    def slots(self) -> list[RaySlot]:
        """One front replica per Serve replica: the front's queue runs as many jobs at once as there are replicas."""
        return [RaySlot(self) for _ in range(self.replicas)]

    def replica_actors(self) -> list[str]:
        """The actor names of our live Serve replicas (in Serve's namespace)."""
        import ray

        return [
            actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith(f"SERVE_REPLICA::{self.app_name}#")
        ]

    def replica_pids(self) -> list[int]:
        """The process of every live replica of ours (tests and diagnostics)."""
        import ray

        pids = []
        for name in self.replica_actors():
            actor = ray.get_actor(name, namespace=SERVE_NAMESPACE)
            pids.append(ray.get(actor.__ray_call__.remote(lambda replica: os.getpid()), timeout=30))
        return pids

    def close(self) -> None:
        """Delete our application; shut Serve down when no other application is left (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        import ray
        from ray import serve

        try:
            serve.delete(self.app_name)
            if not serve.status().applications:
                serve.shutdown()
        finally:
            if self.disconnect:
                ray.shutdown()


def start_ray_replicas(address: str, spec: RayReplicaSpec, replicas: int) -> RayEngine:
    """Connect to the cluster at `address` ("auto": the one this node belongs to), deploy `replicas` engine
    replicas and wait until every one has loaded its models."""
    require_ray()
    import ray
    from ray import serve

    if replicas < 1:
        raise RequestError("--ray-replicas", f"must be at least 1, got {replicas}")
    connected = not ray.is_initialized()  # a caller that is already connected keeps its connection
    try:
        if connected:
            ray.init(address=address, namespace="h3engine", logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as error:
        raise RequestError(
            "--ray", f"cannot join the Ray cluster at {address!r} ({_first_line(error)})"
        ) from None
    app_name = f"{APP_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    gpus = spec.world_size if spec.gpus else 0
    actor_options: dict[str, Any] = {"num_cpus": spec.cpus, "num_gpus": gpus}
    # One bundle holds the whole replica (its ranks are the actor's child processes), so all of its GPUs are on one
    # node; STRICT_PACK says so should a bundle ever be added.
    bundle = {"CPU": spec.cpus, **({"GPU": gpus} if gpus else {})}
    if spec.python_path is not None:
        actor_options["runtime_env"] = {"env_vars": {"PYTHONPATH": spec.python_path}}
    engine = RayEngine(app_name, None, replicas, None, disconnect=connected)
    try:
        serve.start(proxy_location="Disabled")
        deployment = serve.deployment(EngineDeployment, name=DEPLOYMENT_NAME).options(
            num_replicas=replicas,
            max_ongoing_requests=1,
            ray_actor_options=actor_options,
            placement_group_bundles=[bundle],
            placement_group_strategy="STRICT_PACK",
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        )
        engine.handle = serve.run(deployment.bind(spec), name=app_name, route_prefix=None)
        engine.facts = engine.handle.facts.remote().result()
    except RuntimeError as error:
        engine.close()
        raise RequestError("--ray", f"the engine replicas did not start ({_first_line(error)})") from None
    except BaseException:
        engine.close()
        raise
    logger.info("Ray Serve application %s: %d engine replicas ready", app_name, replicas)
    return engine


def _token_auth_when_a_token_is_here() -> None:
    """Ray turns token authentication on by itself for address "auto" when this machine has a token, but not for
    an explicit address; do the same for both (RAY_AUTH_MODE set by the user wins)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
