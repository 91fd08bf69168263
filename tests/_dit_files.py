"""An engine whose FL2VA DiT is a community file (`--dit fl2va=FILE`), and equality of two generations' outputs.

The DiT-file tests (GGUF, ComfyUI single files, NVFP4) compare a file's engine with its dequantized twin's: every
output tensor equal (`equal_outputs`), as both engines cast each weight once to the module's dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from h3engine.checkpoint.layout import detect_layout, with_dit_files
from h3engine.engine.engine import Engine

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")


def engine(files: dict[str, Path], dit: str, **memory) -> Engine:
    """The engine of `files["checkpoint"]` with `files[dit]` as its FL2VA DiT (`memory`: the engine's memory flags)."""
    layout = with_dit_files(detect_layout(files["checkpoint"]), {"fl2va": files[dit]})
    return Engine.from_checkpoint(layout, device="cpu", adaln_cache="off", **memory)


def equal_outputs(got, expected) -> bool:  # noqa: ANN001 (two GenerationOutputs)
    return all(torch.equal(getattr(got, name), getattr(expected, name)) for name in OUTPUTS)
