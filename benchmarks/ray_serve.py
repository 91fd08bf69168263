"""Ray Serve engine replicas on a local CPU cluster: throughput, per-request overhead, memory (issue 22, point 5).

`python -m benchmarks.ray_serve [--jobs 12] [--sequential 8] [--rounds 2] [--steps 2]` (needs `make ray`). On a fresh
tiny checkpoint, one run measures: the latency of jobs one after another on a local replica (a front and an engine
in a process of its own, like a Ray replica's) and on one Ray replica, both on one torch thread, alternating (the
difference is the Ray path's overhead per request); requests per minute with `--jobs` submitted at once to the
local replica, to one and to two Ray CPU replicas (bursts alternating between them, `--rounds` each; the ratio two
to one); the resident memory of every Ray process with the three replicas up (two applications side by side).
Results: benchmarks/results/ray_serve_cpu_DATE.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every address on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import RESULTS_DIR, package_version  # noqa: E402
from h3engine.checkpoint.tiny import make_tiny_checkpoint  # noqa: E402
from h3engine.engine.engine import Engine  # noqa: E402
from h3engine.engine.options import EngineOptions  # noqa: E402
from h3engine.request.model import GenerationRequest  # noqa: E402
from h3engine.runtime.front import EngineFront, JobHandle  # noqa: E402
from h3engine.runtime.messages import TERMINAL_EVENTS, JobFinished  # noqa: E402

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


def finished(handle: JobHandle) -> JobFinished:
    while True:
        event = handle.next_event(timeout=300)
        if isinstance(event, TERMINAL_EVENTS):
            assert isinstance(event, JobFinished), event
            return event


def sequential_s(front: EngineFront, request: GenerationRequest, count: int) -> list[float]:
    """Seconds from submit to the terminal message, jobs one after another."""
    times = []
    for index in range(count):
        started = time.perf_counter()
        finished(front.submit(GenerationRequest(**{**request.__dict__, "seed": index})))
        times.append(time.perf_counter() - started)
    return times


def requests_per_minute(front: EngineFront, request: GenerationRequest, jobs: int) -> float:
    started = time.perf_counter()
    handles = [front.submit(GenerationRequest(**{**request.__dict__, "seed": n})) for n in range(jobs)]
    for handle in handles:
        finished(handle)
    return jobs / (time.perf_counter() - started) * 60


class LocalPath:
    """The local replica in a child process of its own, as lean as a Ray replica's process (a front of one
    in-process engine on one torch thread, as Ray gives a replica of one CPU): it measures what the parent asks."""

    def __init__(self, checkpoint: Path, request: GenerationRequest, folder: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_local_path, args=(child, checkpoint, request, folder))
        self._process.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def ask(self, what: str, count: int) -> object:
        self._pipe.send((what, count))
        return self._pipe.recv()

    def close(self) -> None:
        self._pipe.send(("stop", 0))
        self._process.join()


def _local_path(pipe: Connection, checkpoint: Path, request: GenerationRequest, folder: Path) -> None:
    torch.set_num_threads(1)
    front = EngineFront([Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)], folder)
    # As Ray Serve does in a replica once it has started (RAY_SERVE_FREEZE_GC_ON_STARTUP): the front's gc.collect()
    # after each job then skips the start-up objects, ~0.3 s on this machine otherwise, more than a tiny job's work.
    gc.collect()
    gc.freeze()
    while (command := pipe.recv())[0] != "stop":
        what, count = command
        pipe.send(
            sequential_s(front, request, count)
            if what == "seq"
            else requests_per_minute(front, request, count)
        )
    front.shutdown()


def ray_memory_mb(other: int) -> dict[str, float]:
    """Resident MB per kind of Ray process started by this driver (its descendants but `other`)."""
    memory: dict[str, float] = {}
    for process in psutil.Process().children(recursive=True):
        if process.pid == other:
            continue
        try:
            name = " ".join(process.cmdline()[:3])
            rss = process.memory_info().rss / 2**20
        except psutil.Error:
            continue
        if "multiprocessing" in name:  # the resource tracker of LocalPath's spawn
            continue
        kind = next(
            (
                k
                for k in (
                    "ServeReplica",
                    "ServeController",
                    "gcs_server",
                    "raylet",
                    "dashboard",
                    "log_monitor",
                )
                if k in name or k in process.name()
            ),
            "other: " + process.name(),
        )
        memory[kind] = memory.get(kind, 0.0) + rss
    return {kind: round(mb, 1) for kind, mb in sorted(memory.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12, help="jobs submitted at once for requests per minute")
    parser.add_argument("--sequential", type=int, default=8, help="jobs one after another for the overhead")
    parser.add_argument(
        "--rounds", type=int, default=2, help="bursts per path, alternating between the paths"
    )
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    import ray

    from h3engine.runtime.ray_serve import RayReplicaSpec, start_ray_replicas

    folder = Path(tempfile.mkdtemp(prefix="h3-ray-bench-"))
    checkpoint = make_tiny_checkpoint(folder / "checkpoint", seed=0)
    request = GenerationRequest(task="t2va", prompt="a kite", steps=args.steps, duration_seconds=4.0)
    results: dict[str, object] = {
        "ray": package_version("ray"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }

    local = LocalPath(checkpoint, request, folder / "local")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    spec = RayReplicaSpec(
        str(checkpoint), 1, False, EngineOptions(dtype="float32"), python_path=str(REPOSITORY_ROOT)
    )
    fronts: dict[str, EngineFront] = {}
    for replicas in (1, 2):  # two applications side by side on the cluster: 3 replicas
        started = time.perf_counter()
        engine = start_ray_replicas("auto", spec, replicas)
        results[f"ray{replicas}_start_s"] = time.perf_counter() - started
        fronts[f"ray{replicas}"] = EngineFront(engine.slots(), folder / f"ray{replicas}")
    results["memory_mb_three_replicas"] = ray_memory_mb(other=local.pid)

    def measure(name: str, what: str, count: int) -> object:
        if name == "local":
            return local.ask(what, count)
        front = fronts[name]
        return (
            sequential_s(front, request, count)
            if what == "seq"
            else requests_per_minute(front, request, count)
        )

    paths = ["local", *fronts]
    for name in paths:  # a first job pays one-time costs on each path
        measure(name, "seq", 1)
    # Interleaved, so that a change in the machine's load falls on every path alike.
    for name in ("local", "ray1"):
        results[f"{name}_s"] = []
    for _ in range(args.sequential):
        for name in ("local", "ray1"):
            results[f"{name}_s"] += measure(name, "seq", 1)  # type: ignore[operator]
    for name in paths:
        results[f"{name}_rpm"] = 0.0
    for _ in range(args.rounds):
        for name in paths:
            results[f"{name}_rpm"] += measure(name, "rpm", args.jobs) / args.rounds  # type: ignore[operator]
    local.close()
    for front in fronts.values():
        front.shutdown()
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)

    local_mean = statistics.mean(results["local_s"])  # type: ignore[arg-type]
    ray_mean = statistics.mean(results["ray1_s"])  # type: ignore[arg-type]
    results["overhead_per_request_s"] = ray_mean - local_mean
    results["rpm_ratio_two_to_one"] = results["ray2_rpm"] / results["ray1_rpm"]  # type: ignore[operator]
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"ray_serve_cpu_{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps({**vars(args), **results}, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
