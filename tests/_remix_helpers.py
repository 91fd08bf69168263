"""Helpers of the remix tests (tests/test_remix_tasks.py in one process and on a worker group,
tests/test_remix_split.py on split stage groups,
tests/test_remix_gpu.py on a GPU): the source files, a remix request, an MP4 read back."""

from __future__ import annotations

import wave
from pathlib import Path

import av
import numpy as np
import torch

from h3engine.media.mux import write_mp4
from h3engine.request.model import GenerationRequest
from h3engine.request.remix import Remix

SOURCE_FRAMES = 110  # trimmed to 107 = 17 * 6 + 5
RATE = 32000


def write_sources(folder: Path) -> dict[str, Path]:
    """A 110-frame noise clip at 32x56 with a tone (`video`) and a 2.5 s stereo WAV, shorter than a 4 s clip, so a2v
    generates the rest (`audio`)."""
    generator = torch.Generator().manual_seed(1)
    frames = torch.rand(SOURCE_FRAMES, 32, 56, 3, generator=generator)
    samples = SOURCE_FRAMES * RATE // 24
    tone = 0.3 * torch.sin(torch.arange(samples) * (2 * torch.pi * 440 / RATE))
    write_mp4(folder / "source.mp4", frames, torch.stack([tone, 0.5 * tone]))
    short = (0.4 * np.sin(np.arange(int(2.5 * RATE)) * (2 * np.pi * 220 / RATE))).astype(np.float32)
    with wave.open(str(folder / "voice.wav"), "wb") as file:
        file.setnchannels(2)
        file.setsampwidth(2)
        file.setframerate(RATE)
        file.writeframes((np.stack([short, short], 1) * 32767).astype(np.int16).tobytes())
    return {"video": folder / "source.mp4", "audio": folder / "voice.wav"}


def remix_request(remix: Remix, duration: float = 4.0, steps: int = 2) -> GenerationRequest:
    return GenerationRequest(
        task="t2va", prompt="rain on a tin roof", duration_seconds=duration, steps=steps, remix=remix
    )


def every_mode(sources: dict[str, Path]) -> dict[str, Remix]:
    """One remix of each mode on `sources`: a v2a with an audio mask, an a2v, an extend."""
    return {
        "v2a": Remix(mode="v2a", source_video=str(sources["video"]), audio_mask=((0.5, 1.5),)),
        "a2v": Remix(mode="a2v", source_audio=str(sources["audio"])),
        "extend": Remix(mode="extend", source_video=str(sources["video"])),
    }


def decoded_frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def decoded_audio(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        chunks = [frame.to_ndarray() for frame in container.decode(audio=0)]
    return np.concatenate(chunks, axis=1)
