"""Seconds per request and DiT forwards computed / skipped for each step-cache preset, and the error against "off".

One process loads the engine once (`--placeholder`, the default: the released shapes, 768p / 5 s T2VA; `--tiny`: the
CPU smoke test; `--checkpoint`: a real one), runs an untimed warm-up request, then the request once per preset in
the order off, the presets, off again (the second "off" must give the first one's latents bit for bit, and brackets
the timings). Each record: the request's seconds (prepare + text encode + denoise + decode), the pipeline's timings,
forwards computed / skipped, peak GPU memory, and the relative L2 error of the final latents and of the decoded video
and audio against the first "off", with the video's PSNR. Random or placeholder weights say nothing about picture
quality: the errors show only that the cache changes what it should; quality needs the released weights. `--custom
NAME=Fn,Bn,THRESHOLD,WARMUP,MAX_CONSECUTIVE` adds a preset of one's own (a sweep). JSON: benchmarks/results/.

    python -m benchmarks.step_cache --placeholder --device cuda:0 --steps 50
    python -m benchmarks.step_cache --tiny --device cpu --steps 8 --custom eager=1,0,10,1,-1
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    RESULTS_DIR,
    add_checkpoint_source,
    device_label,
    enforce_budget,
    package_version,
    prepared_shape,
    synchronize,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = (
    "A red fox runs across a snowy field at dawn while the camera slowly pans to the left; "
    "the wind hisses through the grass and a crow calls twice in the distance."
)
QUALITY_NOTE = (
    "errors are relative L2 (and PSNR) against the first 'off' run of the same request and seed; with random or "
    "placeholder weights they say nothing about picture quality (that needs the released weights), only that "
    "the cache changes the output where it skipped and nowhere else"
)
NOTES = [
    "request_s: Engine.prepare plus run_generation (text encode, denoise, decode), host clock after a device sync",
    "forwards: DiT forwards of the request (one per step, sglang recipe); computed ran every block, skipped ran the "
    "first / last blocks and reused the middle blocks' residual of the last computed forward",
    "speedup: the first 'off' run's request_s over the preset's",
    QUALITY_NOTE,
]
# What the peers published for their MiniMax-H3 presets (their hardware, released weights, against no cache).
PEERS = {
    "vllm-omni quality=high (Cache-DiT, PR #5853)": "85.5 s -> 63.4 s on 4x H200 (1.35x), SSIM 0.971 / PSNR 35.0 dB",
    "sglang quality=high (4, 0.04, 1)": "SSIM 0.931 / PSNR 28.16 dB against lossless, 4x H200 T2VA",
    "sglang (4, 0.08, 3) on 1x B200 T2VA 768p 8.7 s (issue #33828)": "29 of 49 forwards skipped, 2.23x, SSIM 0.865",
    "TeleFuser velocity cache": "78.5 s -> 53.4 s on 4x H100",
}


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_checkpoint_source(parser)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", default="high,fast", help="the presets besides off, comma-separated")
    parser.add_argument(
        "--custom",
        action="append",
        default=[],
        help="NAME=Fn,Bn,THRESHOLD,WARMUP,MAX_CONSECUTIVE: a preset of one's own (may repeat)",
    )
    parser.add_argument("--steps", type=int, default=50, help="steps of each timed request")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of video")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="steps of the untimed warm-up request (0: none)"
    )
    parser.add_argument("--memory-profile", default="auto", help="the engine's --memory-profile")
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        help="GiB: the engine's --gpu-memory, and this process's CUDA allocator capped there (a smaller card)",
    )
    parser.add_argument(
        "--repeat-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end with 'off' again (its latents must equal the first's, and it brackets the timings)",
    )
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    return parser.parse_args(argv)


def parse_custom(text: str) -> Any:
    """`NAME=Fn,Bn,THRESHOLD,WARMUP,MAX_CONSECUTIVE` -> a CachePreset (ValueError naming the flag otherwise)."""
    from h3engine.engine.sampling.step_cache import CachePreset

    name, _, knobs = text.partition("=")
    parts = knobs.split(",")
    if not name or len(parts) != 5:
        raise ValueError(f"--custom: expected NAME=Fn,Bn,THRESHOLD,WARMUP,MAX_CONSECUTIVE, got {text!r}")
    first, last, threshold, warmup, consecutive = parts
    return CachePreset(name, int(first), int(last), float(threshold), int(warmup), int(consecutive))


def presets(args: argparse.Namespace) -> list[Any]:
    """The runs' presets in order: "off", the named ones, the custom ones, "off" again (unless --no-repeat-off)."""
    from h3engine.engine.sampling.step_cache import cache_preset

    named = [name.strip() for name in args.presets.split(",") if name.strip()]
    for name in named:
        cache_preset(name)  # ValueError for an unknown name, before anything loads
    repeat = ["off"] if args.repeat_off else []
    return ["off", *named, *(parse_custom(text) for text in args.custom), *repeat]


def make_checkpoint(args: argparse.Namespace, folder: Path) -> tuple[str, str]:
    """(the checkpoint folder, what it is)."""
    if args.checkpoint is not None:
        return str(Path(args.checkpoint).resolve()), args.checkpoint
    if args.tiny:
        from h3engine.checkpoint.tiny import make_tiny_checkpoint

        return str(
            make_tiny_checkpoint(folder / "tiny", seed=0)
        ), "tiny (random weights, h3engine.checkpoint.tiny)"
    from h3engine.checkpoint.placeholder import make_placeholder_checkpoint

    placeholder = make_placeholder_checkpoint(folder / "placeholder", seed=0)
    return str(
        placeholder
    ), "placeholder (released shapes, weights drawn at load: h3engine.checkpoint.placeholder)"


def relative_l2(ours: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    norm = float(reference.norm())
    return float((ours.double() - reference).norm()) / norm if norm > 0 else math.inf


def psnr(ours: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Of video frames in [0, 1]; None for identical frames (infinite)."""
    mse = float((ours.double() - reference.double()).pow(2).mean())
    return None if mse == 0 else 10.0 * math.log10(1.0 / mse)


def errors(output: Any, reference: Any) -> dict[str, float]:
    return {
        "video_latents_rel_l2": relative_l2(output.video_latents, reference.video_latents),
        "audio_latents_rel_l2": relative_l2(output.audio_latents, reference.audio_latents),
        "video_rel_l2": relative_l2(output.video, reference.video),
        "audio_rel_l2": relative_l2(output.audio, reference.audio),
        "video_psnr_db": psnr(output.video, reference.video),
    }


def run_preset(
    engine: Any, request: Any, preset: Any, device: torch.device
) -> tuple[Any, Any, dict[str, Any]]:
    """One timed request with `preset` ("off", a preset's name or a CachePreset): (output, prepared, record)."""
    from h3engine.engine.pipeline import run_generation

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    started = time.perf_counter()
    if isinstance(preset, str):  # a named preset is the request's own (the memory plan counts its residuals)
        prepared = engine.prepare(dataclasses.replace(request, cache=preset))
    else:
        prepared = dataclasses.replace(engine.prepare(request), cache=preset)
    prepared_s = time.perf_counter() - started
    models = engine.models_for(request)
    with torch.inference_mode():
        output = run_generation(models, prepared, device)
    synchronize(device)
    request_s = time.perf_counter() - started
    name = preset if isinstance(preset, str) else preset.name
    forwards = prepared.schedule.num_steps
    cache = output.step_cache or {"preset": "off", "forwards": forwards, "computed": forwards, "skipped": 0}
    record = {
        "preset": name,
        "knobs": None if isinstance(preset, str) and preset == "off" else knobs_of(preset),
        "request_s": request_s,
        "prepare_s": prepared_s,
        "timings_s": dict(output.timings),
        "forwards": cache["forwards"],
        "computed": cache["computed"],
        "skipped": cache["skipped"],
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    return output, prepared, record


def knobs_of(preset: Any) -> dict[str, Any]:
    from h3engine.engine.sampling.step_cache import cache_preset

    return dataclasses.asdict(cache_preset(preset))


def git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per preset: seconds, speedup over the first "off", forwards, errors (the last run of each name)."""
    baseline = runs[0]["request_s"]
    summary = {}
    for run in runs:
        key = run["preset"] if run["preset"] not in summary else f"{run['preset']} (repeat)"
        summary[key] = {
            "request_s": run["request_s"],
            "speedup": baseline / run["request_s"] if run["request_s"] > 0 else None,
            "computed_of": f"{run['computed']} of {run['forwards']}",
            "video_latents_rel_l2": run["errors"]["video_latents_rel_l2"],
            "audio_latents_rel_l2": run["errors"]["audio_latents_rel_l2"],
        }
    return summary


def result_path(args: argparse.Namespace, device: torch.device) -> Path:
    """benchmarks/results/step_cache_<gpu>_<date>[_<profile>][_<budget>gib].json"""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    profile = "" if args.memory_profile == "auto" else f"_{args.memory_profile}"
    budget = "" if args.gpu_memory is None else f"_{args.gpu_memory:g}gib"
    return Path(args.output_dir) / f"step_cache_{device_label(device)}_{stamp}{profile}{budget}.json"


def header(
    args: argparse.Namespace, device: torch.device, request: Any, limit: dict[str, Any]
) -> dict[str, Any]:
    """What the JSON says before any run: the machine, versions, the request and its memory settings."""
    return {
        "benchmark": "step_cache",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "git_commit": git_commit(),
            "triton": package_version("triton"),
            "flash_attn_4": package_version("flash-attn-4"),
            "cache_dit": package_version("cache-dit"),
        },
        "request": {
            **request.to_dict(),
            "memory_profile": args.memory_profile,
            "gpu_memory_gib": args.gpu_memory,
        },
        "allocator_limit": limit,
        "notes": NOTES,
        "peers_published": PEERS,
    }


def write(path: Path, result: dict[str, Any]) -> None:
    """The JSON as it stands (written after every run, so that a run cut short keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> Path:
    args = parse_arguments(argv)
    from h3engine.engine.engine import Engine
    from h3engine.request.model import GenerationRequest

    device = torch.device(args.device)
    order = presets(args)
    request = GenerationRequest(
        task="t2va",
        prompt=PROMPT,
        duration_seconds=args.duration,
        aspect_ratio="16:9",
        seed=args.seed,
        steps=args.steps,
    )
    limit = enforce_budget(device, args.gpu_memory)
    path = result_path(args, device)
    result = header(args, device, request, limit)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="step_cache_") as temporary:
        checkpoint, result["checkpoint"] = make_checkpoint(args, Path(temporary))
        started = time.perf_counter()
        engine = Engine.from_checkpoint(
            checkpoint, device, memory_profile=args.memory_profile, gpu_memory=args.gpu_memory
        )
        result["load_s"] = time.perf_counter() - started
        from h3engine.memory.report import summary_lines

        result["memory_plan"] = summary_lines(engine.plan)
        if args.warmup_steps > 0:
            run_preset(engine, dataclasses.replace(request, steps=args.warmup_steps), "off", device)
        reference = None
        for preset in order:
            output, prepared, record = run_preset(engine, request, preset, device)
            reference = reference or output
            result.setdefault("shape", prepared_shape(prepared))
            record["errors"] = errors(output, reference)
            runs.append(record)
            result.update(runs=runs, summary=summarize(runs), complete=len(runs) == len(order))
            write(path, result)
            print(
                f"{record['preset']}: {record['request_s']:.2f} s, computed {record['computed']} of "
                f"{record['forwards']}, video latents rel L2 {record['errors']['video_latents_rel_l2']:.3g}",
                flush=True,
            )
        del engine
    if args.repeat_off:
        result["off_repeat_equal"] = bool(runs[-1]["errors"]["video_latents_rel_l2"] == 0.0)
    write(path, result)
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
