"""Deterministic tiny LoRA files in every layout h3engine.checkpoint.lora_format reads, and diffusers' view of them.

`random_lora(config, seed)` draws one adapter in our module's terms (every linear of the DiT, rank 4, rank 2 on the
AdaLN projections as published adapters do, alpha per module); `write_lora(path, lora, layout, config)` writes it in
one of `LAYOUTS` and returns the dense fp32 update per module that the file means. `diffusers_deltas` reads a file
through diffusers' MiniMaxH3LoraLoaderMixin and returns its dense updates under diffusers' module names.
`small_lora` is a `random_lora` that moves a tiny generation by ~10 %; `assert_equal` / `assert_changed` compare
two generations' outputs bit for bit / by more than 1 %; `loras_loaded(pipeline, loras)` loads files into a diffusers
pipeline with `load_lora_weights` for the length of a `with` block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from _parity_helpers import relative_l2
from safetensors.torch import save_file
from torch import Tensor

from h3engine.checkpoint.dit_format import module_to_diffusers, stacked_to_interleaved_qkv
from h3engine.checkpoint.dit_keys import diffusers_keys, native_state_shapes, swap_halves
from h3engine.models.dit_config import DiTConfig

# Layout name -> what the writer does (see write_lora).
LAYOUTS = (
    "diffusers",  # transformer.<diffusers names>.lora_A / lora_B
    "diffusers_ref",  # the same under transformer_ref.
    "peft",  # bare diffusers names with peft's .default. infix
    "original",  # the original checkpoint's module names, bare
    "ai_toolkit",  # the same under diffusion_model.
    "kohya",  # musubi-tuner: lora_unet_<flattened>.lora_down / lora_up / alpha
    "diffsynth",  # original names with .default., fused QKV interleaved per head
    "metadata_alpha",  # original names, alpha in __metadata__
)
METADATA_ALPHA = 3.0


@dataclass(frozen=True)
class RandomLora:
    """Per module: down [r, in], up [out, r] (our row order: stacked QKV, fc1 [gate; value]) and a kohya alpha."""

    down: dict[str, Tensor]
    up: dict[str, Tensor]
    alpha: dict[str, float]


def lora_modules(config: DiTConfig) -> dict[str, tuple[int, int]]:
    """Every linear of the DiT: module name -> (out, in)."""
    return {
        key.removesuffix(".weight"): shape
        for key, shape in native_state_shapes(config).items()
        if key.endswith(".weight") and len(shape) == 2
    }


def random_lora(config: DiTConfig, seed: int = 0) -> RandomLora:
    generator = torch.Generator().manual_seed(seed)
    down, up, alpha = {}, {}, {}
    for module, (out_features, in_features) in lora_modules(config).items():
        rank = 2 if "adaln_proj" in module else 4
        down[module] = torch.randn(rank, in_features, generator=generator)
        up[module] = torch.randn(out_features, rank, generator=generator)
        alpha[module] = float(rank) * (0.5 + len(module) % 3)
    return RandomLora(down, up, alpha)


def small_lora(config: DiTConfig, seed: int, only: str = "", shrink: float = 0.02) -> RandomLora:
    """`random_lora` with its down factors shrunk so the update moves the outputs by ~10 %, not to noise;
    `only`: keep just the modules whose name contains it."""
    lora = random_lora(config, seed)
    keep = [module for module in lora.down if only in module]
    return RandomLora(
        {m: lora.down[m] * shrink for m in keep},
        {m: lora.up[m] for m in keep},
        {m: lora.alpha[m] for m in keep},
    )


def _flattened(module: str) -> str:
    return "lora_unet_" + module.replace(".", "_")


def write_lora(path: Path, lora: RandomLora, layout: str, config: DiTConfig) -> dict[str, Tensor]:
    """Write `lora` in `layout`; returns module -> the dense fp32 update (scale included) the file stands for."""
    tensors: dict[str, Tensor] = {}
    metadata: dict[str, str] = {}
    scales = dict.fromkeys(lora.down, 1.0)
    for module, down in lora.down.items():
        up = lora.up[module]
        if layout in ("diffusers", "diffusers_ref", "peft"):
            prefix = {"diffusers": "transformer.", "diffusers_ref": "transformer_ref.", "peft": ""}[layout]
            infix = ".default" if layout == "peft" else ""
            targets = [key.removesuffix(".weight") for key in diffusers_keys(module + ".weight")]
            ups = (
                up.chunk(3)
                if module.endswith("qkv_proj")
                else (swap_halves(up),)
                if "fc1" in module
                else (up,)
            )
            for target, target_up in zip(targets, ups, strict=True):
                tensors[f"{prefix}{target}.lora_A{infix}.weight"] = down.clone()
                tensors[f"{prefix}{target}.lora_B{infix}.weight"] = target_up.contiguous()
        elif layout == "kohya":
            tensors[_flattened(module) + ".lora_down.weight"] = down
            tensors[_flattened(module) + ".lora_up.weight"] = up
            tensors[_flattened(module) + ".alpha"] = torch.tensor(lora.alpha[module])
            scales[module] = lora.alpha[module] / down.shape[0]
        else:
            prefix = "diffusion_model." if layout == "ai_toolkit" else ""
            infix = ".default" if layout == "diffsynth" else ""
            if layout == "diffsynth" and module.endswith("qkv_proj"):
                up = stacked_to_interleaved_qkv(up, config.num_heads)
            tensors[f"{prefix}{module}.lora_A{infix}.weight"] = down
            tensors[f"{prefix}{module}.lora_B{infix}.weight"] = up.contiguous()
            if layout == "metadata_alpha":
                scales[module] = METADATA_ALPHA / down.shape[0]
    if layout == "metadata_alpha":
        metadata["alpha"] = str(METADATA_ALPHA)
    save_file(tensors, str(path), metadata=metadata or None)
    return {module: lora.up[module] @ lora.down[module] * scales[module] for module in lora.down}


def ours_as_diffusers(deltas: dict[str, Tensor], config: DiTConfig) -> dict[str, Tensor]:
    """Dense updates under our module names -> under diffusers' (QKV split, fc1 halves swapped)."""
    state = {module + ".weight": delta for module, delta in deltas.items()}
    # native_to_diffusers reads each QKV weight's head width off its QK-norm weight.
    norms = {
        key.replace("qkv_proj", "q_norm"): torch.zeros(config.head_dim) for key in state if "qkv_proj" in key
    }
    converted = module_to_diffusers({**state, **norms}, config)
    return {key.removesuffix(".weight"): value for key, value in converted.items() if "norm_q" not in key}


def diffusers_deltas(path: Path) -> dict[str, dict[str, Tensor]]:
    """partition -> diffusers module -> B @ A * (alpha / r), as diffusers 0.42.1 would load the file."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    state, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
    deltas: dict[str, dict[str, Tensor]] = {}
    for key, down in state.items():
        if ".lora_A." not in key:
            continue
        partition, _, module = key.partition(".")
        module = module.split(".lora_A.")[0]
        up = state[key.replace(".lora_A.", ".lora_B.")].float()
        alpha = (metadata or {}).get(f"{partition}.lora_alpha")
        rank = down.shape[0]
        scale = 1.0 if alpha is None else alpha / rank
        deltas.setdefault(partition, {})[module] = up @ down.float() * scale
    return deltas


def assert_equal(ours, other) -> None:
    for name in ("video_latents", "audio_latents", "video", "audio"):
        assert torch.equal(getattr(ours, name), getattr(other, name)), name


def assert_changed(ours, other) -> None:
    assert relative_l2(ours.video_latents, other.video_latents) > 1e-2
    assert relative_l2(ours.audio_latents, other.audio_latents) > 1e-2


@contextmanager
def loras_loaded(pipeline, loras: Sequence[tuple[Path, float]], into_ref: bool = False) -> Iterator[None]:
    """diffusers' `pipeline` with `loras` (path, strength) loaded by `load_lora_weights` (`into_ref`: its
    `load_into_transformer_ref`) and set to their strengths; unloaded again on leaving, so the pipeline can serve
    the next comparison bare."""
    names = [f"adapter{index}" for index in range(len(loras))]
    try:
        for name, (path, _) in zip(names, loras, strict=True):
            pipeline.load_lora_weights(str(path), adapter_name=name, load_into_transformer_ref=into_ref)
        pipeline.set_adapters(names, adapter_weights=[strength for _, strength in loras])
        yield
    finally:
        pipeline.unload_lora_weights()
