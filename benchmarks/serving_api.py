"""The /v1/videos API of `python app.py` on the tiny random-weight checkpoint, on this machine's CPU.

Measures, with the app in a subprocess on loopback (no keys): generation throughput (N one-step 4 s jobs at the
smallest canvas queued at once: jobs per minute, submit-to-completed latency p50 / p99), API latency (GET
/v1/videos/{id} from 10 threads, and POSTs refused with 429 while the queue is full: requests per minute, p50 /
p99), and restart recovery (a SIGKILL with one job running and four queued: from the new process's start to it
answering, and to every recovered job completed). Everything goes into a temp folder, removed at the end.

    python -m benchmarks.serving_api --jobs 20 --gets 1000    # JSON to benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._common import RESULTS_DIR

REPOSITORY = Path(__file__).resolve().parents[1]
FAST = {"steps": 1, "aspect_ratio": "1:1", "seconds": "4"}


def _call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _start(folder: Path, checkpoint: Path, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        str(REPOSITORY / "app.py"),
        "--outputs",
        str(folder / "outputs"),
        "--port",
        str(port),
    ]
    command += [
        "--devices",
        "cpu",
        "--checkpoint",
        str(checkpoint),
        "--max-queue",
        "64",
        "--max-jobs-per-owner",
        "64",
    ]
    environment = {
        **os.environ,
        "GRADIO_TEMP_DIR": str(folder / "gradio"),
        "H3_CACHE_DIR": str(folder / "cache"),
    }
    log = open(folder / "app.log", "ab")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=folder)


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError("the app exited during start-up")
        try:
            if _call(f"{url}readyz")[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the app did not answer")


def _wait_done(url: str, ids: list[str]) -> dict[str, float]:
    done: dict[str, float] = {}
    while len(done) < len(ids):
        for video_id in ids:
            if video_id not in done and _call(f"{url}v1/videos/{video_id}")[1].get("status") in (
                "completed",
                "failed",
            ):
                done[video_id] = time.monotonic()
        time.sleep(0.05)
    return done


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    args = parser.parse_args()
    from h3engine.checkpoint.tiny import make_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="h3-bench-serving-"))
    process = None
    try:
        checkpoint = make_tiny_checkpoint(folder / "checkpoint", seed=0)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        url = f"http://127.0.0.1:{port}/"
        process = _start(folder, checkpoint, port)
        start_s = _wait_ready(url, process)
        _wait_done(url, [_call(f"{url}v1/videos", "POST", {"prompt": "Warm.", **FAST})[1]["id"]])
        # Throughput.
        submitted, started = {}, time.monotonic()
        for index in range(args.jobs):
            submitted[_call(f"{url}v1/videos", "POST", {"prompt": f"Job {index}.", **FAST})[1]["id"]] = (
                time.monotonic()
            )
        done = _wait_done(url, list(submitted))
        wall = max(done.values()) - started
        throughput = {
            "jobs": args.jobs,
            "wall_s": round(wall, 2),
            "jobs_per_min": round(args.jobs / wall * 60, 1),
            **_percentiles([done[i] - submitted[i] for i in submitted]),
        }
        # API latency: retrieves, then refusals while the queue is full.
        some_id = next(iter(submitted))

        def timed(call) -> float:
            begun = time.monotonic()
            call()
            return time.monotonic() - begun

        begun = time.monotonic()
        with ThreadPoolExecutor(10) as pool:
            gets = list(
                pool.map(lambda _: timed(lambda: _call(f"{url}v1/videos/{some_id}")), range(args.gets))
            )
        gets_wall = time.monotonic() - begun
        retrieve = {"requests": args.gets, "per_min": round(args.gets / gets_wall * 60), **_percentiles(gets)}
        # Restart recovery: one running, four queued, SIGKILL.
        ids = [_call(f"{url}v1/videos", "POST", {"prompt": "Long.", **FAST, "steps": 30})[1]["id"]]
        ids += [_call(f"{url}v1/videos", "POST", {"prompt": f"Q{n}.", **FAST})[1]["id"] for n in range(4)]
        while _call(f"{url}v1/videos/{ids[0]}")[1]["status"] != "in_progress":
            time.sleep(0.02)
        process.kill()
        process.wait()
        begun = time.monotonic()
        process = _start(folder, checkpoint, port)
        answering = _wait_ready(url, process)
        _wait_done(url, ids)
        statuses = [_call(f"{url}v1/videos/{i}")[1]["status"] for i in ids]
        recovery = {
            "jobs": len(ids),
            "to_answering_s": round(answering, 2),
            "to_all_done_s": round(time.monotonic() - begun, 2),
            "statuses": statuses,
        }
        result = {
            "benchmark": "serving_api",
            "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPU cores",
            "start_to_ready_s": round(start_s, 2),
            "throughput": throughput,
            "retrieve": retrieve,
            "recovery": recovery,
        }
        print(json.dumps(result, indent=2))
        out = Path(args.output_dir) / f"serving_api_cpu_{datetime.date.today():%Y%m%d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
