"""What a user asks for: `GenerationRequest`, a frozen, plain-Python description of one generation (no torch,
no numpy), and the bounds its values are judged against (h3engine.request.validate judges them).

Payloads are read into it by h3engine.request.shapes.from_dict, which does not judge values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from h3engine.request.files import Keyframe, Reference
from h3engine.request.geometry import (
    RELEASED_MAX_PIXELS,
    RELEASED_PATCH,
    RELEASED_SHORT_EDGE,
    RELEASED_VAE_SPATIAL_RATIO,
)
from h3engine.request.limits import MAX_SHORT_EDGE
from h3engine.request.remix import Remix

KEYFRAME_POSITIONS = ("first", "last")
REFERENCE_KINDS = ("image", "video", "audio")
RECIPES = ("sglang", "diffusers")
# Step-cache presets (h3engine.engine.sampling.step_cache.PRESETS holds the knobs of each but "off"): "off" runs every
# block of every forward; "high" is the peers' conservative MiniMax-H3 setting, "fast" a more aggressive one.
CACHE_PRESETS = ("off", "high", "fast")
# The two DiTs a LoRA can target (diffusers' component names) and the one each task runs.
LORA_TARGETS = ("transformer", "transformer_ref")
LORA_TARGET_OF_TASK = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}
# peft takes any adapter weight; published adapters are used within about [-2, 2] (negative: the concept taken
# away) and far beyond that a low-rank update swamps the base model, so wider values are a typo, not a choice.
MAX_LORA_STRENGTH = 4.0
MAX_LORAS = 8  # each adds a low-rank product to every adapted linear's forward

# The only configuration MiniMax verified; other short edges run but warn.
VERIFIED_SHORT_EDGE = RELEASED_SHORT_EDGE
# Tiny test checkpoints have a smaller VAE factor and pass their own multiple to `validate`.
RELEASED_CANVAS_MULTIPLE = RELEASED_VAE_SPATIAL_RATIO * RELEASED_PATCH
# Aspect "auto" without a keyframe to follow: references never bind the target geometry.
DEFAULT_ASPECT = (16, 9)

# Qwen vision-block tokens: the engine inserts them around keyframe and reference pixels; typed into a prompt
# they would be tagged as video rows and read as an empty vision block.
RESERVED_PROMPT_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MAX_SEED = 2**63 - 1
# The labels a prompt cites its inputs by (`reference_labels`); only these three forms are checked.
# Not a model limit: a guard so that a mistyped step count or canvas becomes a message, not an hours-long run
# or an allocation failure inside a worker.
MAX_STEPS = 1000
MAX_CANVAS_SIDE = 4096
# The released area cap (768 x 1344) scaled to that short edge the way the canvas rule scales it (2048 x 3584,
# 7,340,032 pixels): no canvas may be larger, explicit width x height included.
MAX_CANVAS_PIXELS = RELEASED_MAX_PIXELS * MAX_SHORT_EDGE**2 // RELEASED_SHORT_EDGE**2
# Sigma shifts (released: 12 video, 3 audio). Within this range every fp32 sigma grid of up to MAX_STEPS steps keeps
# all its points (from ~8,300 on, a 1,000-step grid collapses near sigma 1 and the run fails after loading).
MIN_FLOW_SHIFT = 0.001
MAX_FLOW_SHIFT = 1000.0
# The prompt. The reference pipelines truncate nothing; the official prompts run to ~4,400 characters (~1,000
# tokens). 8,192 tokens keep the text encode short at the released size (Qwen3-VL-32B to layer 50: ~0.4
# PFLOP) and the text rows under a quarter of the 768p / 5 s DiT sequence; 32,768 characters bound the
# tokenizer's own work and, at ~4 characters a token, let English text reach the token bound. The bound counts the
# prompt's own tokens: the labels the engine adds stay under 200 tokens (12 labels, at most 15 s of 2 fps video
# timestamps), and the vision blocks follow from the reference limits (h3engine.request.limits).
MAX_PROMPT_CHARACTERS = 32_768
# Images (keyframes, image references), judged from the probed header before any pixel is decoded. Each side must
# span one 16-pixel patch (the video VAE's spatial factor, Qwen's vision patch); the largest picture the model
# works on is a 4:1 reference normalized to a 2048 short edge, 8192 x 2048, so no side may be longer and no image
# may hold more pixels (16,777,216, also stock Qwen3-VL's image pixel limit). Video frames share the minimum.
MIN_IMAGE_SIDE = 16
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 8192 * 2048


TaskName = Literal["t2va", "fl2va", "ref2va"]
RecipeName = Literal["sglang", "diffusers"]
CacheName = Literal["off", "high", "fast"]


LoraTarget = Literal["transformer", "transformer_ref"]


@dataclass(frozen=True)
class LoraChoice:
    """A LoRA file (.safetensors) applied at `strength` to the DiT `target` ("transformer": T2VA / FL2VA,
    "transformer_ref": Ref2VA); None follows diffusers: the file's own `transformer.` / `transformer_ref.` key
    prefixes, else "transformer"."""

    path: str
    strength: float = 1.0
    target: LoraTarget | None = None


EntryT = TypeVar("EntryT", Keyframe, Reference, LoraChoice)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. Values are checked by `validate`, not on construction."""

    task: TaskName
    prompt: str
    duration_seconds: float | None = 5.0
    aspect_ratio: str = "auto"
    # None: the checkpoint's own canvas rule (768 for the release); a number: that short edge, as given.
    short_edge: int | None = None
    width: int | None = None
    height: int | None = None
    seed: int = 0
    # None: the checkpoint's step-distilled count, else DEFAULT_STEPS (filled in by h3engine.engine.resolved).
    steps: int | None = None
    flow_shift: float = 12.0
    audio_flow_shift: float = 3.0
    recipe: RecipeName = "sglang"
    keyframes: tuple[Keyframe, ...] = ()
    references: tuple[Reference, ...] = ()
    loras: tuple[LoraChoice, ...] = ()
    # Step-distilled rungs (timesteps in (0, 1000], strictly decreasing) run instead of the grid of `steps`, one
    # forward each; empty: a step-distilled checkpoint's own rungs, else the usual grid.
    rungs: tuple[int, ...] = ()
    # Step caching for full-step runs (CACHE_PRESETS): a lossy speed-up, refused with rungs (Turbo, distilled).
    cache: CacheName = "off"
    # Rows held at a source's latents (v2a, a2v, extend, masks: h3engine.request.remix); None: plain generation.
    remix: Remix | None = None

    def to_dict(self) -> dict[str, Any]:
        """Our JSON shape, every field spelled out, so that `from_dict(request.to_dict()) == request`."""
        return {
            "task": self.task,
            "prompt": self.prompt,
            "duration_seconds": self.duration_seconds,
            "aspect_ratio": self.aspect_ratio,
            "short_edge": self.short_edge,
            "width": self.width,
            "height": self.height,
            "seed": self.seed,
            "steps": self.steps,
            "flow_shift": self.flow_shift,
            "audio_flow_shift": self.audio_flow_shift,
            "recipe": self.recipe,
            "keyframes": [
                {"path": keyframe.path, "position": keyframe.position} for keyframe in self.keyframes
            ],
            "references": [
                {"kind": reference.kind, "path": reference.path, "start_seconds": reference.start_seconds}
                for reference in self.references
            ],
            "loras": [
                {"path": lora.path, "strength": lora.strength, "target": lora.target} for lora in self.loras
            ],
            "rungs": list(self.rungs),
            "cache": self.cache,
            "remix": None if self.remix is None else self.remix.to_dict(),
        }
