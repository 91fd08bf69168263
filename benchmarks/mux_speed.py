"""MP4 mux time of a 768p / 5 s clip (124 frames of 1344x768, 5.2 s of 32 kHz stereo): frame conversion on worker
threads (the engine's default) against one thread, same process and data; the decoded frames of both files must be
identical.

    python -m benchmarks.mux_speed --output-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch

from benchmarks._common import RESULTS_DIR
from h3engine.media import mux

FRAMES, HEIGHT, WIDTH = 124, 768, 1344


def synthetic_clip(seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Moving colour gradients with mild noise (not pure noise, which no encoder meets in practice)."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(FRAMES, dtype=torch.float32)[:, None, None]
    y = torch.linspace(0, 1, HEIGHT)[None, :, None]
    x = torch.linspace(0, 1, WIDTH)[None, None, :]
    channels = [
        0.5 + 0.4 * torch.sin(6.28 * (x * (k + 1) + y * (2 - k) + t / 48 * (k + 1))) for k in range(3)
    ]
    video = torch.stack(channels, dim=-1)
    video = (video + 0.02 * torch.randn(video.shape, generator=generator)).clamp(0, 1)
    audio = (0.1 * np.sin(np.arange(2 * 166_400).reshape(2, -1) / 20.0)).astype(np.float32)
    return video, audio


def decoded_frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def psnr(path: Path, video: torch.Tensor) -> float:
    """PSNR (dB) of the file's decoded frames against the 8-bit source frames."""
    source = (video * 255).round().to(torch.uint8).numpy().astype(np.float64)
    decoded = np.stack(decoded_frames(path)).astype(np.float64)
    return float(10 * np.log10(255.0**2 / np.mean((decoded - source) ** 2)))


def timed_write(
    path: Path, video: torch.Tensor, audio: np.ndarray, threads: int, runs: int, thread_type: str
) -> list[float]:
    mux.FRAME_CONVERSION_THREADS = threads
    mux.ENCODER_THREAD_TYPE = thread_type
    seconds = []
    for _ in range(runs):
        began = time.perf_counter()
        mux.write_mp4(path, video, audio)
        seconds.append(time.perf_counter() - began)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    default_threads, default_thread_type = mux.FRAME_CONVERSION_THREADS, mux.ENCODER_THREAD_TYPE
    video, audio = synthetic_clip()
    encoders = {}
    with tempfile.TemporaryDirectory() as folder:
        serial_path, threaded_path = Path(folder) / "serial.mp4", Path(folder) / "threaded.mp4"
        serial = timed_write(serial_path, video, audio, 1, args.runs, default_thread_type)
        threaded = timed_write(threaded_path, video, audio, default_threads, args.runs, default_thread_type)
        identical = all(
            np.array_equal(a, b)
            for a, b in zip(decoded_frames(serial_path), decoded_frames(threaded_path), strict=True)
        )
        # x264 with frame threads vs slice threads (PyAV's default): time, size and quality of the file.
        for thread_type in ("FRAME", "SLICE"):
            path = Path(folder) / f"{thread_type}.mp4"
            seconds = timed_write(path, video, audio, default_threads, args.runs, thread_type)
            encoders[thread_type.lower()] = {
                "seconds": seconds,
                "median_s": statistics.median(seconds),
                "bytes": path.stat().st_size,
                "psnr_db": psnr(path, video),
            }
            print(f"x264 {thread_type.lower()} threads: {encoders[thread_type.lower()]}")
        mux.ENCODER_THREAD_TYPE = default_thread_type
    result = {
        "benchmark": "mux_speed",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "pyav": av.__version__,
        "shape": [FRAMES, HEIGHT, WIDTH, 3],
        "conversion_threads": default_threads,
        "encoder_thread_type": default_thread_type,
        "x264_thread_types": encoders,
        "serial_s": serial,
        "threaded_s": threaded,
        "serial_median_s": statistics.median(serial),
        "threaded_median_s": statistics.median(threaded),
        "decoded_frames_identical": identical,
    }
    print(json.dumps(result, indent=2))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"mux_speed_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if not identical:
        raise SystemExit("decoded frames differ between serial and threaded conversion")


if __name__ == "__main__":
    main()
