"""Ray Serve engine replicas on a local CPU cluster: throughput, per-request overhead, memory (issue 22, point 5).

`python -m benchmarks.ray_serve [--jobs 12] [--sequential 8] [--steps 2]` (needs `make ray`). On a fresh tiny
checkpoint, one run measures: the latency of jobs one after another on a local in-process replica and on one Ray
replica, both on one torch thread (the difference is the Ray path's overhead per request); requests per minute with `--jobs` submitted at
once to one and then to two Ray CPU replicas (and their ratio); the resident memory of every Ray process while two
replicas are up. Results: benchmarks/results/ray_serve_cpu_DATE.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every address on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import RESULTS_DIR, package_version  # noqa: E402
from h3engine.checkpoint.tiny import make_tiny_checkpoint  # noqa: E402
from h3engine.engine import Engine  # noqa: E402
from h3engine.engine_options import EngineOptions  # noqa: E402
from h3engine.request import GenerationRequest  # noqa: E402
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
    """Seconds from submit to the terminal message, jobs one after another (the first one, a warm-up, dropped)."""
    times = []
    for index in range(count + 1):
        started = time.perf_counter()
        finished(front.submit(GenerationRequest(**{**request.__dict__, "seed": index})))
        times.append(time.perf_counter() - started)
    return times[1:]


def requests_per_minute(front: EngineFront, request: GenerationRequest, jobs: int) -> float:
    started = time.perf_counter()
    handles = [front.submit(GenerationRequest(**{**request.__dict__, "seed": n})) for n in range(jobs)]
    for handle in handles:
        finished(handle)
    return jobs / (time.perf_counter() - started) * 60


def ray_memory_mb() -> dict[str, float]:
    """Resident MB per kind of Ray process started by this driver (its descendants)."""
    memory: dict[str, float] = {}
    for process in psutil.Process().children(recursive=True):
        try:
            name = " ".join(process.cmdline()[:3])
            rss = process.memory_info().rss / 2**20
        except psutil.Error:
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

    torch.set_num_threads(1)  # as a Ray CPU replica of one CPU runs (Ray sets OMP_NUM_THREADS=1 in it)
    local = EngineFront(
        [Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)], folder / "local"
    )
    results["local_s"] = sequential_s(local, request, args.sequential)
    results["local_rpm"] = requests_per_minute(local, request, args.jobs)
    local.shutdown()

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    spec = RayReplicaSpec(
        str(checkpoint), 1, False, EngineOptions(dtype="float32"), python_path=str(REPOSITORY_ROOT)
    )
    for replicas in (1, 2):
        started = time.perf_counter()
        engine = start_ray_replicas("auto", spec, replicas)
        results[f"ray{replicas}_start_s"] = time.perf_counter() - started
        front = EngineFront(engine.slots(), folder / f"ray{replicas}")
        if replicas == 1:
            results["ray1_s"] = sequential_s(front, request, args.sequential)
        results[f"ray{replicas}_rpm"] = requests_per_minute(front, request, args.jobs)
        if replicas == 2:
            results["memory_mb_two_replicas"] = ray_memory_mb()
        front.shutdown()
    ray.shutdown()

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
