"""Split against colocated stage layouts in one run: back-to-back requests through the engine's own runtime.

Per layout (`--layouts colocated,split`) it starts the replica the app would (a colocated worker group, or the three
split groups) on `--devices`, runs a warm-up (the request with one step: every kernel built before timing), queues
`--requests` identical T2VA requests (768p / 5 s) of `--timed-steps` steps and waits for all; `extrapolate` scales
them to `--steps`. Recorded: load time, makespan, throughput, each request's latency and sidecar timings (the split
layout's handoff seconds too), the split layout's bytes handed over and when each group took and finished each
request (`SplitReplica.stage_log`), the peak memory of every worker process (GPU: `nvidia-smi` every 0.5 s, and the
whole GPU's; CPU: peak resident size). The JSON in benchmarks/results/ is rewritten after each layout.

    python -m benchmarks.stage_layouts --checkpoint DIR --devices cuda:0             # one H200
    python -m benchmarks.stage_layouts --placeholder --devices cuda:0                 # released shapes, no weights
    python -m benchmarks.stage_layouts --tiny --output-dir /tmp                       # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, package_version
from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.engine.options import EngineOptions, check_engine_options
from h3engine.request.model import GenerationRequest
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFailed, JobFinished
from h3engine.runtime.split import start_replica

PROMPT = (
    "A red fox runs across a snowy field at dawn while the camera slowly pans to the left; "
    "the wind hisses through the grass and a crow calls twice in the distance."
)
MEMORY_SAMPLE_S = 0.5


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--checkpoint", default=None, help="checkpoint folder (the released one for real numbers)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random-weight checkpoint made in a temp folder"
    )
    parser.add_argument(
        "--placeholder",
        action="store_true",
        help="a placeholder checkpoint of the released shapes made in a temp folder (h3engine.checkpoint."
        "placeholder: weights drawn at load); with --tiny, of the tiny shapes",
    )
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument(
        "--devices", default="cuda:0", help="the DiT group's devices, e.g. cuda:0,cuda:1 or cpu"
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="CPU ranks with --devices cpu (default 1)"
    )
    parser.add_argument("--layouts", default="colocated,split")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="the steps the result is extrapolated to")
    parser.add_argument("--timed-steps", type=int, default=3, help="the steps each request runs")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--width", type=int, default=None, help="default: the checkpoint's canvas for 16:9")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--encoder-devices", default=None)
    parser.add_argument("--vae-devices", default=None)
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    return parser.parse_args(argv)


class MemorySampler:
    """The highest memory each process was seen using: GPU memory through nvidia-smi, else peak resident size."""

    def __init__(self, pids: list[int], gpu: bool) -> None:
        self.pids, self.gpu = pids, gpu
        self.peak_mib: dict[int, float] = dict.fromkeys(pids, 0.0)
        self.peak_gpu_used_mib = 0.0  # the whole GPU's (per-process figures need nvidia-smi to see our PIDs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_S):
            if not self.gpu:
                continue
            used = [float(value) for value in nvidia_smi("--query-gpu=memory.used") if _is_number(value)]
            if used:
                self.peak_gpu_used_mib = max(self.peak_gpu_used_mib, sum(used))
            for line in nvidia_smi("--query-compute-apps=pid,used_memory"):
                pid_text, _, used_text = line.partition(",")
                if pid_text.strip().isdigit() and int(pid_text) in self.peak_mib:
                    pid = int(pid_text)
                    self.peak_mib[pid] = max(self.peak_mib[pid], float(used_text))

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        if not self.gpu:
            for pid in self.pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kib = next(
                    (line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), "0"
                )
                self.peak_mib[pid] = int(kib) / 1024
        return self.peak_mib


def nvidia_smi(query: str) -> list[str]:
    """The lines `nvidia-smi QUERY --format=csv,noheader,nounits` prints (none when it cannot run)."""
    try:
        command = ["nvidia-smi", query, "--format=csv,noheader,nounits"]
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def _is_number(text: str) -> bool:
    return text.strip().replace(".", "", 1).isdigit()


def worker_pids(replica: Any) -> dict[str, list[int]]:
    pids = replica.worker_pids
    return pids if isinstance(pids, dict) else {"colocated": list(pids)}


def run_layout(
    name: str, args: argparse.Namespace, checkpoint: str, devices: tuple[str, ...], request: GenerationRequest
) -> dict[str, Any]:
    options = EngineOptions(
        dtype=args.dtype,
        stage_layout=name,
        encoder_devices=args.encoder_devices if name == "split" else None,
        vae_devices=args.vae_devices if name == "split" else None,
    )
    layout = check_engine_options(options, len(devices))
    started = time.perf_counter()
    replica = start_replica(checkpoint, devices, layout, options)
    load_s = time.perf_counter() - started
    pids = worker_pids(replica)
    gpu = devices[0].startswith("cuda")
    sampler = MemorySampler([pid for group in pids.values() for pid in group], gpu)
    with tempfile.TemporaryDirectory() as folder:
        front = EngineFront([replica], folder)
        try:
            warm_up_s = run_warm_up(front, request) if args.warm_up else None
            submitted = time.monotonic()
            handles = [front.submit(request) for _ in range(args.requests)]
            finished = []
            for handle in handles:
                while not isinstance(event := handle.next_event(timeout=3600), JobFinished):
                    if event is None or isinstance(event, JobFailed):
                        raise RuntimeError(f"{name}: a request did not finish: {event}")
                finished.append((time.monotonic(), event))
            peak = sampler.stop()
            log = list(getattr(replica, "stage_log", []))
        finally:
            front.shutdown()
    result = summarize(name, layout.describe(), load_s, submitted, handles, finished, log, pids, peak, args)
    return {**result, "warm_up_s": warm_up_s, "peak_gpu_used_mib": sampler.peak_gpu_used_mib if gpu else None}


def run_warm_up(front: EngineFront, request: GenerationRequest) -> float:
    """The timed request with one step, waited for: the kernels of this shape are built before timing."""
    started = time.monotonic()
    handle = front.submit(dataclasses.replace(request, steps=1))
    while not isinstance(event := handle.next_event(timeout=3600), JobFinished):
        if event is None or isinstance(event, JobFailed):
            raise RuntimeError(f"the warm-up request did not finish: {event}")
    return time.monotonic() - started


def extrapolate(
    latencies: list[float], denoise_s: list[float], timed_steps: int, steps: int
) -> dict[str, Any]:
    """Each request's latency had it run `steps` steps: one DiT runs at a time in either layout, so the steps left of
    every request up to and including this one delay it. A step left costs the uncontended step time, the fastest
    request's denoise per step (in the split layout a denoise overlapping another request's decode shares the GPU,
    which the measured latency keeps once but 50 steps would not repeat)."""
    step_s = min(denoise_s) / timed_steps
    extra = (steps - timed_steps) * step_s
    extrapolated = [latency + extra * (index + 1) for index, latency in enumerate(latencies)]
    return {
        "step_s": step_s,
        "makespan_s": max(extrapolated),
        "throughput_per_min": 60 * len(latencies) / max(extrapolated),
        "latency_s": extrapolated,
    }


def summarize(
    name: str,
    described: str,
    load_s: float,
    submitted: float,
    handles: list[Any],
    finished: list[tuple[float, JobFinished]],
    log: list[Any],
    pids: dict[str, list[int]],
    peak: dict[int, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    latencies = [end - submitted for end, _ in finished]
    makespan = max(latencies)
    denoise = [result.timings_s["denoise_s"] for _, result in finished]
    ids = {handle.job_id: index for index, handle in enumerate(handles)}
    return {
        "layout": name,
        "describe": described,
        "load_s": load_s,
        "measured": {
            "makespan_s": makespan,
            "throughput_per_min": 60 * len(finished) / makespan,
            "latency_s": latencies,
        },
        f"extrapolated_to_{args.steps}_steps": extrapolate(latencies, denoise, args.timed_steps, args.steps),
        "timings_s": [result.timings_s for _, result in finished],
        "handoff": [
            {
                "request": ids.get(record.job_id),
                "step": record.stage,
                "sent_bytes": record.sent_bytes,
                "started_s": record.started_at - submitted,
                "ended_s": record.ended_at - submitted,
            }
            for record in log
            if record.job_id in ids
        ],
        "peak_memory_mib": {
            group: [peak.get(pid, 0.0) for pid in group_pids] for group, group_pids in pids.items()
        },
    }


def main(argv: list[str] | None = None) -> Path:
    args = parse_arguments(argv)
    temporary = None
    checkpoint = args.checkpoint
    if args.placeholder:
        temporary = tempfile.TemporaryDirectory()
        placeholder = make_placeholder_checkpoint(
            Path(temporary.name) / "placeholder", seed=0, tiny=args.tiny
        )
        checkpoint = str(placeholder)
    elif args.tiny or checkpoint is None:
        temporary = tempfile.TemporaryDirectory()
        checkpoint = str(make_tiny_checkpoint(Path(temporary.name) / "tiny", seed=0))
    if args.devices == "cpu":
        devices = ("cpu",) * (args.world_size or 1)
    else:
        devices = tuple(name.strip() for name in args.devices.split(","))
    request = GenerationRequest(
        task="t2va",
        prompt=PROMPT,
        steps=args.timed_steps,
        duration_seconds=args.seconds,
        width=args.width,
        height=args.height,
    )
    gpu = devices[0].startswith("cuda")
    if args.placeholder:
        described = f"placeholder ({'tiny' if args.tiny else 'released'} shapes, weights drawn at load)"
    else:
        described = "tiny (random weights)" if temporary is not None else checkpoint
    record = {
        "benchmark": "stage_layouts",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(torch.device(devices[0]))
        if gpu
        else platform.processor() or "cpu",
        "devices": list(devices),
        "encoder_devices": args.encoder_devices,
        "vae_devices": args.vae_devices,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "transformers": package_version("transformers"),
            "h3engine": package_version("h3engine"),
        },
        "checkpoint": described,
        "request": {**dataclasses.asdict(request), "steps_extrapolated_to": args.steps},
        "warm_up": "the request with one step, before the timed ones" if args.warm_up else None,
        "results": [],
    }
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    label = (record["device"] if gpu else "cpu").replace(" ", "_")
    stamp = datetime.date.today().strftime("%Y%m%d")
    path = output_dir / f"stage_layouts_{label}_x{len(devices)}_{stamp}.json"
    for name in args.layouts.split(","):
        record["results"].append(run_layout(name, args, checkpoint, devices, request))
        path.write_text(
            json.dumps(record, indent=2, default=str) + "\n"
        )  # what finished survives a time limit
    results = record["results"]
    for result in results:
        measured = result[f"extrapolated_to_{args.steps}_steps"]
        print(
            f"{result['layout']:10s} load {result['load_s']:.1f} s, {args.requests} requests: makespan "
            f"{measured['makespan_s']:.1f} s ({measured['throughput_per_min']:.2f}/min at {args.steps} steps), "
            f"latencies {', '.join(f'{value:.1f}' for value in measured['latency_s'])} s"
        )
    print(path)
    if temporary is not None:
        temporary.cleanup()
    return path


if __name__ == "__main__":
    main()
