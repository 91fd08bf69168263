"""The reference runner: one request through diffusers' MiniMax H3 pipeline, its boundaries captured by hooks.

diffusers is an optional extra, imported inside the runner's functions only (`ReferenceUnavailable` when absent).
The boundaries carry our capture's names (h3engine.engine.trace): the text encoder's input ids, the DiT's inputs
and outputs of each forward, each scheduler step's output, the VAE decoders' inputs, the decoded video and audio.
Step conventions: the forward index is the step of both sides. `recipe="diffusers"` runs diffusers as it is (N grid
points, N - 1 forwards, its own generator); `recipe="sglang"` asks it for N + 1 grid points (the sglang grid, N
forwards), hands it the sglang recipe's noise as its starting latents (which skips its own video and audio draws)
and serves its conditions' draws (FL2VA, Ref2VA) the sglang recipe's condition noise (`_sglang_condition_draws`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import detect_layout
from h3engine.engine.resolved import resolve_request
from h3engine.engine.sampling.noise import draw_initial_noise, sglang_condition_noise
from h3engine.engine.sampling.packing import unpatchify_video
from h3engine.engine.trace import Capture
from h3engine.errors import RequestError
from h3engine.request.geometry import Geometry
from h3engine.request.model import GenerationRequest

# The layout fields of diffusers' DiT forward, in our capture's names.
LAYOUT_FIELDS = {
    "token_tags": "tags",
    "position_ids": "positions",
    "video_indices": "video_index",
    "audio_indices": "audio_index",
    "text_indices": "text_index",
}


class ReferenceUnavailable(Exception):
    """diffusers (the optional extra) is not installed, or cannot run this checkpoint."""


@dataclass
class _Hooks:
    """What the hooks saw so far: the forward count, the condition row counts, the pending scheduler halves."""

    capture: Capture
    geometry: Geometry
    total: int
    forwards: int = 0
    condition: tuple[int, int] = (0, 0)
    pending_video: torch.Tensor | None = None
    pending_latents: dict[str, torch.Tensor] | None = None

    def text_encoder(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not any(entry["name"] == "processor_tokens" for entry in self.capture.entries):
            vision = {
                name: value
                for name, value in kwargs.items()
                if name.startswith("pixel_") or name.endswith("_thw")
            }
            self.capture.record("processor_tokens", {"input_ids": kwargs["input_ids"].reshape(-1), **vision})

    def before_dit(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.forwards == 0:
            video, audio = kwargs["hidden_states"][0], kwargs["audio_hidden_states"][0]
            self.condition = (
                video.shape[0] - self.geometry.video_rows,
                audio.shape[0] - self.geometry.audio_rows,
            )
            states = kwargs["encoder_hidden_states"]
            self.capture.record("text_states", {"states": states.reshape(-1, states.shape[-1])})
            if self.condition != (0, 0):
                conditions = {"video": video[: self.condition[0]], "audio": audio[: self.condition[1]]}
                self.capture.record("condition_rows", conditions)
            noise = {"video": video[self.condition[0] :], "audio": audio[self.condition[1] :]}
            self.capture.record("initial_noise", noise)
            fields = {ours: kwargs[theirs] for theirs, ours in LAYOUT_FIELDS.items() if theirs in kwargs}
            self.capture.record("packed_layout", fields)

    def after_dit(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        video, audio = output[0][0], output[1][0]
        if self.capture.wants(self.forwards, self.total):
            predictions = {"video": video[self.condition[0] :], "audio": audio[self.condition[1] :]}
            self.capture.record("dit_prediction", predictions, self.forwards)

    def scheduler_step(self, step: Any, modality: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            if modality == "video":
                self.pending_video = result[0]
            else:
                if self.capture.wants(self.forwards, self.total):
                    outputs = {"video": self.pending_video, "audio": result[0]}
                    self.capture.record("scheduler_output", outputs, self.forwards)
                self.forwards += 1
            return result

        return wrapped

    def decoder(self, decode: Any, modality: str) -> Any:
        """`decode` recording its first input: `final_latents` once both decoders have been called."""

        def wrapped(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            pending = self.pending_latents = self.pending_latents or {}
            if modality not in pending:
                pending[modality] = latents
                if len(pending) == 2:
                    self.capture.record(
                        "final_latents", {"video": pending["video"], "audio": pending["audio"]}
                    )
            return decode(latents, *args, **kwargs)

        return wrapped


def reference_geometry(checkpoint: Path, request: GenerationRequest) -> Geometry:
    """The request's geometry on the checkpoint, as our engine resolves it (RequestError naming a field)."""
    facts = CheckpointFacts.from_layout(detect_layout(checkpoint))
    return resolve_request(request, facts).geometry


def check_reference(checkpoint: Path, request: GenerationRequest) -> None:
    """What the reference runner needs before it starts: a T2VA, FL2VA or Ref2VA request, a diffusers-layout
    checkpoint, diffusers itself (RequestError naming the field / ReferenceUnavailable)."""
    if request.task not in ("t2va", "fl2va", "ref2va"):
        raise RequestError("task", f"the reference runner runs t2va, fl2va and ref2va, got '{request.task}'")
    if any(reference.start_seconds for reference in request.references):
        raise RequestError("references", "the reference runner takes a video reference from its start only")
    if detect_layout(checkpoint).kind != "diffusers":
        raise RequestError("--checkpoint", f"{checkpoint}: the reference runner needs the diffusers layout")
    try:
        import diffusers  # noqa: F401 - the optional extra, only here
    except ImportError:
        raise ReferenceUnavailable(
            "the reference runner needs diffusers (pip install 'diffusers==0.42.1')"
        ) from None


def run_reference(checkpoint: Path, request: GenerationRequest, capture: Capture) -> dict[str, Any]:
    """Run `request` (T2VA, FL2VA or Ref2VA, in either step convention) through diffusers on a diffusers-layout
    `checkpoint` at fp32 on the CPU and capture its boundaries; returns what the index records about the run."""
    check_reference(checkpoint, request)
    from diffusers import ModularPipeline

    geometry = reference_geometry(checkpoint, request)
    pipeline = ModularPipeline.from_pretrained(str(checkpoint), workflow=request.task)
    pipeline.load_components(dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    sglang = request.recipe == "sglang"
    points = request.steps + 1 if sglang else request.steps
    inputs: dict[str, Any] = {
        "prompt": request.prompt,
        "num_inference_steps": points,
        "num_frames": geometry.frames,
        "generator": torch.Generator().manual_seed(request.seed),
        "output_type": "pt",
    }
    if request.task == "ref2va":  # the canvas follows from the references, as ours does
        inputs["references"] = diffusers_references(request.references)
    else:
        inputs.update(height=geometry.height, width=geometry.width)
    transformer = pipeline.transformer_ref if request.task == "ref2va" else pipeline.transformer
    draws: Any = contextlib.nullcontext()
    if sglang:
        inputs.update(_sglang_latents(transformer.config, request.seed, geometry))
        draws = _sglang_condition_draws(request, geometry, transformer.config.in_channels)
    inputs.update(_keyframes(request))
    for scheduler, shift in (
        (pipeline.scheduler, request.flow_shift),
        (pipeline.audio_scheduler, request.audio_flow_shift),
    ):
        if shift is not None:
            scheduler.set_shift(shift)
    hooks = _Hooks(capture, geometry, total=points - 1)
    handles = [
        pipeline.text_encoder.model.register_forward_pre_hook(hooks.text_encoder, with_kwargs=True),
        transformer.register_forward_pre_hook(hooks.before_dit, with_kwargs=True),
        transformer.register_forward_hook(hooks.after_dit, with_kwargs=True),
    ]
    pipeline.scheduler.step = hooks.scheduler_step(pipeline.scheduler.step, "video")
    pipeline.audio_scheduler.step = hooks.scheduler_step(pipeline.audio_scheduler.step, "audio")
    pipeline.vae.decode = hooks.decoder(pipeline.vae.decode, "video")
    pipeline.audio_vae.decode = hooks.decoder(pipeline.audio_vae.decode, "audio")
    try:
        with torch.inference_mode(), draws:
            state = pipeline(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    capture.record("decoded_frames", {"frames": state.get("videos")[0].permute(0, 2, 3, 1).float()})
    capture.record("waveform", {"audio": state.get("audio")[0].float()})
    return {"runner": "diffusers", "forwards": hooks.forwards, "grid_points": points}


def _keyframes(request: GenerationRequest) -> dict[str, Any]:
    """An fl2va request's keyframes as diffusers' `image` / `last_image` (RGB pictures read by Pillow)."""
    from PIL import Image

    names = {"first": "image", "last": "last_image"}
    return {
        names[keyframe.position]: Image.open(keyframe.path).convert("RGB") for keyframe in request.keyframes
    }


def diffusers_references(references: Any) -> list[Any]:
    """Our `Reference`s as diffusers' reference objects, in order (each read from its file)."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    classes = {
        "image": MiniMaxH3ImageReference,
        "audio": MiniMaxH3AudioReference,
        "video": MiniMaxH3VideoReference,
    }
    return [classes[reference.kind].from_file(reference.path) for reference in references]


def _sglang_latents(config: Any, seed: int, geometry: Geometry) -> dict[str, torch.Tensor]:
    """The sglang recipe's noise as diffusers' starting `latents` [1, C, T, h, w] and `audio_latents` [2, C, A]
    (`config`: the task's DiT's, which names the channels)."""
    noise = draw_initial_noise(
        seed,
        geometry,
        recipe="sglang",
        video_channels=config.in_channels,
        audio_channels=config.audio_in_channels,
    )
    latents = unpatchify_video(
        noise.video_rows, geometry.latent_frames, geometry.latent_h, geometry.latent_w, geometry.patch
    )
    audio = noise.audio_rows.reshape(2, geometry.audio_latents, -1).permute(0, 2, 1)
    return {"latents": latents, "audio_latents": audio}


def _visual_condition_count(request: GenerationRequest) -> int:
    """How many visual conditions (keyframes, image and video references) a request packs: its noise draws."""
    if request.task == "fl2va":
        return len(request.keyframes)
    return sum(reference.kind in ("image", "video") for reference in request.references)


@contextlib.contextmanager
def _sglang_condition_draws(request: GenerationRequest, geometry: Geometry, channels: int) -> Iterator[None]:
    """For the block, diffusers' noise draws before its denoising (`randn_tensor` of its before-denoise module) are
    served the sglang recipe's condition noise, one condition at a time in packed order; a draw that is not a
    condition's (its shape, or one too many: the video and audio noise, which the given latents skip) or a
    condition left undrawn raises. The module's own function is back after the block, whatever happened."""
    module = importlib.import_module("diffusers.modular_pipelines.minimax_h3.before_denoise")
    count, served = _visual_condition_count(request), []

    def serve(shape: Any, generator: Any = None, device: Any = None, dtype: Any = None, **_: Any) -> Any:
        shape = tuple(shape)
        limit = geometry.latent_frames + count
        if len(served) == count or len(shape) != 5 or shape[:2] != (1, channels) or shape[2] > limit:
            raise RuntimeError(
                f"the reference runner serves {count} condition noise draw(s) [1, {channels}, T <= {limit}, h, w]; "
                f"diffusers asked for draw {len(served) + 1} of shape {list(shape)}"
            )
        served.append(shape)
        noise = sglang_condition_noise(
            request.seed, shape[2:], count=count, target_frames=geometry.latent_frames, channels=channels
        )
        return noise.to(device=device, dtype=dtype)

    original, module.randn_tensor = module.randn_tensor, serve
    try:
        yield
    finally:
        module.randn_tensor = original
    if len(served) != count:
        raise RuntimeError(f"diffusers drew {len(served)} of the request's {count} condition noise draws")
