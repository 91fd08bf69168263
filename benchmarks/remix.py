"""Seconds per remix (v2a with an audio mask, a2v, extend) against plain T2VA at the same canvas, one engine.

One process loads the engine once (`--placeholder`, the default: the released shapes; `--tiny`: the CPU smoke test;
`--checkpoint`: a real one), writes a source clip at the T2VA request's canvas (a moving colour gradient with a
stereo tone, `--source-seconds`) and a soundtrack half as long, runs an untimed warm-up, then T2VA and each remix
at `--steps` into an MP4 (prepare, which encodes the sources, + text encode + denoise + decode + write). Each record:
seconds and the ratio to T2VA, the pipeline's timings, peak GPU memory, the packed shape, and whether every held
row of the final latents equals its source latents bit for bit (the remix's promise, at the released shapes).
Placeholder weights say nothing about quality: the timings and the held rows are what this measures.

    python -m benchmarks.remix --placeholder --device cuda:0 --steps 8
    python -m benchmarks.remix --tiny --device cpu --steps 2 --duration 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import (
    RESULTS_DIR,
    add_checkpoint_source,
    device_label,
    package_version,
    prepared_shape,
    synchronize,
)
from benchmarks.step_cache import PROMPT, git_commit, make_checkpoint, write

RATE = 32_000


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_checkpoint_source(parser)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="steps of each timed request")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of each request's clip")
    parser.add_argument(
        "--source-seconds", type=float, default=5.0, help="seconds of the source clip (the soundtrack: half)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default="t2va,v2a,a2v,extend",
        help="which runs, comma-separated (t2va first: the ratios' base)",
    )
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps of the untimed warm-up (0: none)")
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    return parser.parse_args(argv)


def write_sources(folder: Path, height: int, width: int, seconds: float) -> dict[str, Path]:
    """A source MP4 of `seconds` at height x width (a gradient drifting across the frame, a stereo tone) and a WAV
    of half as long."""
    from h3engine.media.mux import write_mp4

    frames = int(round(seconds * 24))
    ys = torch.linspace(0, 1, height)[:, None]
    xs = torch.linspace(0, 1, width)[None, :]
    video = torch.empty(frames, height, width, 3)
    for index in range(frames):
        phase = index / max(frames - 1, 1)
        video[index, :, :, 0] = (xs + phase) % 1.0
        video[index, :, :, 1] = ys.expand(height, width)
        video[index, :, :, 2] = 0.5 + 0.5 * torch.sin(6.28 * (xs + ys + phase))
    samples = frames * RATE // 24
    tone = 0.3 * torch.sin(torch.arange(samples) * (2 * torch.pi * 440 / RATE))
    write_mp4(folder / "source.mp4", video, torch.stack([tone, 0.5 * tone]))
    half = 0.4 * np.sin(np.arange(samples // 2) * (2 * np.pi * 220 / RATE))
    with wave.open(str(folder / "voice.wav"), "wb") as file:
        file.setnchannels(2)
        file.setsampwidth(2)
        file.setframerate(RATE)
        file.writeframes((np.stack([half, half], 1) * 32767).astype(np.int16).tobytes())
    return {"video": folder / "source.mp4", "audio": folder / "voice.wav"}


def remixes(sources: dict[str, Path], seconds: float) -> dict[str, Any]:
    """None (plain T2VA) and one remix of each mode."""
    from h3engine.request.remix import Remix

    return {
        "t2va": None,
        "v2a": Remix(mode="v2a", source_video=str(sources["video"]), audio_mask=((0.5, seconds / 2),)),
        "a2v": Remix(mode="a2v", source_audio=str(sources["audio"])),
        "extend": Remix(mode="extend", source_video=str(sources["video"])),
    }


def held_rows_equal(prepared: Any, output: Any) -> bool | None:
    """Every held row of the final latents equals its source latents bit for bit (None: nothing held)."""
    from h3engine.engine.sampling.packing import audio_latents_to_rows, patchify_video

    held = prepared.held
    if held is None:
        return None
    equal = True
    if held.video_mask is not None:
        rows = patchify_video(output.video_latents[None], prepared.geometry.patch).cpu()
        kept = held.video_mask.cpu() == 0
        equal &= torch.equal(rows[kept], held.video_clean.cpu()[kept].to(rows.dtype))
    if held.audio_mask is not None:
        rows = audio_latents_to_rows(output.audio_latents).cpu()
        kept = held.audio_mask.cpu() == 0
        equal &= torch.equal(rows[kept], held.audio_clean.cpu()[kept].to(rows.dtype))
    return bool(equal)


def run_one(engine: Any, request: Any, mp4: Path, device: torch.device) -> dict[str, Any]:
    """One timed request into `mp4`: its record."""
    from h3engine.engine.pipeline import run_generation

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    started = time.perf_counter()
    prepared = engine.prepare(request)
    prepare_s = time.perf_counter() - started
    with torch.inference_mode():
        output = run_generation(engine.models_for(request), prepared, device, mp4_path=mp4)
    synchronize(device)
    return {
        "request_s": time.perf_counter() - started,
        "prepare_s": prepare_s,
        "timings_s": dict(output.timings),
        "shape": prepared_shape(prepared),
        "output_frames": int(output.video.shape[0]),
        "held_rows_equal_source": held_rows_equal(prepared, output),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> Path:
    args = parse_arguments(argv)
    from h3engine.engine.engine import Engine
    from h3engine.request.model import GenerationRequest

    device = torch.device(args.device)
    base = GenerationRequest(
        task="t2va", prompt=PROMPT, duration_seconds=args.duration, aspect_ratio="16:9", seed=args.seed
    )
    stamp = datetime.datetime.now(datetime.UTC)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or modes[0] != "t2va" or not set(modes) <= {"t2va", "v2a", "a2v", "extend"}:
        raise SystemExit(f"--modes: t2va first, then any of v2a, a2v, extend; got {args.modes!r}")
    suffix = "" if modes == ["t2va", "v2a", "a2v", "extend"] else "_" + "_".join(modes)
    path = Path(args.output_dir) / f"remix_{device_label(device)}_{stamp:%Y%m%d}{suffix}.json"
    result: dict[str, Any] = {
        "benchmark": "remix",
        "date": stamp.isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": package_version("triton"),
            "git_commit": git_commit(),
        },
        "request": {**base.to_dict(), "steps": args.steps},
        "notes": [
            "request_s: Engine.prepare (source probe and VAE encode for a remix) plus run_generation into an MP4 "
            "(text encode, denoise, decode, splice the sources, write), host clock after a device sync",
            "ratio: request_s over T2VA's at the same canvas and steps (extend's window is longer: its overlap "
            "frames come first)",
            "placeholder weights: timings and held rows only, nothing about quality",
        ],
    }
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="remix_bench_") as temporary:
        folder = Path(temporary)
        checkpoint, result["checkpoint"] = make_checkpoint(args, folder)
        started = time.perf_counter()
        engine = Engine.from_checkpoint(checkpoint, device)
        result["load_s"] = time.perf_counter() - started
        geometry = engine.resolve(base).geometry
        sources = write_sources(folder, geometry.height, geometry.width, args.source_seconds)
        if args.warmup_steps > 0:
            warm = dataclasses.replace(base, steps=args.warmup_steps)
            run_one(engine, warm, folder / "warmup.mp4", device)
        for name, remix in remixes(sources, args.source_seconds).items():
            if name not in modes:
                continue
            request = dataclasses.replace(base, steps=args.steps, remix=remix)
            record = run_one(engine, request, folder / f"{name}.mp4", device)
            record["ratio_to_t2va"] = record["request_s"] / runs["t2va"]["request_s"] if runs else 1.0
            runs[name] = record
            result["runs"] = runs
            write(path, result)
            print(
                f"{name}: {record['request_s']:.2f} s ({record['ratio_to_t2va']:.2f}x T2VA), "
                f"held rows equal source: {record['held_rows_equal_source']}",
                flush=True,
            )
        del engine
    result["complete"] = len(runs) == len(modes)
    write(path, result)
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
