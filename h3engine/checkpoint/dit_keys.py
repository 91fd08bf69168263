"""Key maps between the native (MiniMaxAI) and diffusers layouts of the H3 DiT, and random native weights.

`native_to_diffusers` and `diffusers_to_native` are pure, exact inverses (bit-identical values, same dtypes) that
work on `meta` tensors too and map key by key (`diffusers_keys` / `native_key`), so a partial state converts on
its own, except that a diffusers block's to_q / to_k / to_v must arrive together.

Danger
------
* `attn.qkv_proj.weight` rows are interleaved per head, [head, (q, k, v), head_dim]; diffusers keeps separate
  to_q / to_k / to_v. Stacked [q; k; v] files (Comfy-Org single files, GGUF) have the same shape and are NOT
  this layout: their source must be known before calling these functions.
* `mlp.fc1.weight` is [gate; value]; diffusers' SwiGLU wants [value; gate]: the halves are swapped.
* `rope.inv_freq` exists only natively; it is dropped going to diffusers and recomputed in fp32 coming back,
  from the rope settings of the `config` argument (released values when omitted).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from h3engine.errors import CheckpointError
from h3engine.models.dit import FP32_PARAMETER_NAMES, PRUNED_FP32_NAMES, H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import rope_inverse_frequencies

ROPE_KEY = "rope.inv_freq"

# Whole-model renames (native prefix -> diffusers prefix); matched on the full key after the block prefixes.
_GLOBAL_RENAMES: dict[str, str] = {
    "video_patch_proj.": "proj_in.",
    "audio_patch_proj.": "audio_proj_in.",
    "condition_proj.": "context_embedder.",
    "time_embedder.proj_in.": "time_embedder.linear_1.",
    "time_embedder.proj_out.": "time_embedder.linear_2.",
    "token_refiner.final_norm.": "token_refiner.final_norm.",
    "final_layer.norm.": "norm_out.norm.",
    "final_layer.adaln_proj.linear.": "norm_out.linear.",
    "final_layer.video_out.": "proj_out.",
    "final_layer.audio_out.": "audio_proj_out.",
}

# Block-local names (after "token_refiner.blocks.{i}." / "blocks.{i}.") -> diffusers name(s); refiner blocks have
# no AdaLN. The fused QKV weight is three diffusers tensors; fc1 keeps one name but swaps its halves.
QKV_WEIGHT = "attn.qkv_proj.weight"
FC1_WEIGHT = "mlp.fc1.weight"
_DIFFUSERS_QKV = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")
_DIFFUSERS_FC1 = "ff.net.0.proj.weight"
_REFINER_BLOCK_RENAMES: dict[str, tuple[str, ...]] = {
    "norm1.weight": ("norm1.weight",),
    "norm2.weight": ("norm2.weight",),
    "attn.q_norm.weight": ("attn.norm_q.weight",),
    "attn.k_norm.weight": ("attn.norm_k.weight",),
    QKV_WEIGHT: _DIFFUSERS_QKV,
    "attn.out_proj.weight": ("attn.to_out.0.weight",),
    FC1_WEIGHT: (_DIFFUSERS_FC1,),
    "mlp.fc2.weight": ("ff.net.2.weight",),
}
_BLOCK_RENAMES: dict[str, tuple[str, ...]] = {
    **_REFINER_BLOCK_RENAMES,
    "adaln_proj.linear.weight": ("adaln_proj.linear.weight",),
    "adaln_proj.linear.bias": ("adaln_proj.linear.bias",),
}


def _inverse(renames: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    return {target: (source,) for source, targets in renames.items() for target in targets}


@dataclass(frozen=True)
class _Naming:
    """One direction of the key map: block-key pattern, block prefixes, block-local renames, global renames."""

    name: str
    block: re.Pattern[str]
    block_prefixes: dict[str, str]
    block_renames: dict[str, dict[str, tuple[str, ...]]]
    global_renames: dict[str, str]

    def translate(self, key: str) -> tuple[str, ...]:
        block = self.block.match(key)
        if block is None:
            for source_prefix, target_prefix in self.global_renames.items():
                if key.startswith(source_prefix):
                    return (target_prefix + key[len(source_prefix) :],)
            raise CheckpointError(f"unexpected {self.name} DiT key {key!r}")
        prefix, index, local = block.groups()
        targets = self.block_renames[prefix].get(local)
        if targets is None:
            raise CheckpointError(f"unexpected {self.name} DiT key {key!r}")
        return tuple(f"{self.block_prefixes[prefix]}.{index}.{target}" for target in targets)


_FROM_NATIVE = _Naming(
    name="native",
    block=re.compile(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.+)$"),
    block_prefixes={"blocks": "transformer_blocks", "token_refiner.blocks": "token_refiner.refiner_blocks"},
    block_renames={"blocks": _BLOCK_RENAMES, "token_refiner.blocks": _REFINER_BLOCK_RENAMES},
    global_renames=_GLOBAL_RENAMES,
)
_FROM_DIFFUSERS = _Naming(
    name="diffusers",
    block=re.compile(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)$"),
    block_prefixes={"transformer_blocks": "blocks", "token_refiner.refiner_blocks": "token_refiner.blocks"},
    block_renames={
        "transformer_blocks": _inverse(_BLOCK_RENAMES),
        "token_refiner.refiner_blocks": _inverse(_REFINER_BLOCK_RENAMES),
    },
    global_renames={target: source for source, target in _GLOBAL_RENAMES.items()},
)


def diffusers_keys(native_key: str) -> tuple[str, ...]:
    """The diffusers key(s) holding a native tensor: to_q, to_k, to_v for a QKV weight, none for rope.inv_freq."""
    return () if native_key == ROPE_KEY else _FROM_NATIVE.translate(native_key)


def native_key(diffusers_key: str) -> str:
    """The native key a diffusers tensor belongs to (to_q, to_k and to_v all belong to the fused QKV weight)."""
    return _FROM_DIFFUSERS.translate(diffusers_key)[0]


def swap_halves(weight: Tensor) -> Tensor:
    """fc1's [gate; value] rows <-> diffusers' [value; gate] (its own inverse)."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def _head_dim(state: dict[str, Tensor], norm_key: str, weight_key: str) -> int:
    # The per-head QK-norm weight has exactly head_dim entries: the only shape that fixes the interleave.
    if norm_key not in state:
        raise CheckpointError(f"DiT key {weight_key!r} needs {norm_key!r} (its head_dim) in the same state")
    return state[norm_key].shape[0]


def native_to_diffusers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Native DiT state dict -> diffusers MiniMaxH3Transformer3DModel state dict (drops rope.inv_freq)."""
    converted: dict[str, Tensor] = {}
    for key, tensor in state.items():
        targets = diffusers_keys(key)
        if key.endswith(QKV_WEIGHT):
            head_dim = _head_dim(state, key.removesuffix(QKV_WEIGHT) + "attn.q_norm.weight", key)
            per_head = tensor.reshape(-1, 3, head_dim, tensor.shape[1])
            for part, target in enumerate(targets):
                converted[target] = per_head[:, part].reshape(-1, tensor.shape[1])
        elif key.endswith(FC1_WEIGHT):
            converted[targets[0]] = swap_halves(tensor)
        else:
            converted.update(dict.fromkeys(targets, tensor))
    return converted


def diffusers_to_native(state: dict[str, Tensor], config: DiTConfig | None = None) -> dict[str, Tensor]:
    """Diffusers DiT state dict -> native state dict; rope.inv_freq recomputed (fp32) from `config`'s rope."""
    rope_config = config if config is not None else DiTConfig.released()
    converted: dict[str, Tensor] = {}
    for key, tensor in state.items():
        target = native_key(key)
        if target.endswith(QKV_WEIGHT):
            prefix = key.removesuffix(next(part for part in _DIFFUSERS_QKV if key.endswith(part)))
            missing = [prefix + part for part in _DIFFUSERS_QKV if prefix + part not in state]
            if missing:
                raise CheckpointError(f"diffusers DiT key(s) {missing} missing next to {key!r}")
            # Merged once, when the query weight is met; the key and value weights are consumed with it.
            if key != prefix + _DIFFUSERS_QKV[0]:
                continue
            parts = [state[prefix + part] for part in _DIFFUSERS_QKV]
            head_dim = _head_dim(state, prefix + "attn.norm_q.weight", key)
            in_features = tensor.shape[1]
            per_head = torch.stack([part.reshape(-1, head_dim, in_features) for part in parts], dim=1)
            converted[target] = per_head.reshape(-1, in_features)
        elif target.endswith(FC1_WEIGHT):
            converted[target] = swap_halves(tensor)
        else:
            converted[target] = tensor
    device = next(iter(state.values())).device if state else None
    converted[ROPE_KEY] = rope_inverse_frequencies(rope_config.rope_freq_dim, rope_config.rope_theta, device)
    return converted


# --------------------------------------------------------------------------------------------------------------
# Random weights for tests and benchmarks
# --------------------------------------------------------------------------------------------------------------

# Norm weights are drawn around 1 (not exactly 1) so a dropped weight multiply is caught.
_NORM_WEIGHT_SPREAD = 0.1
# AdaLN weights move the modulation by ~0.2 between (timestep, modality) rows and the biases keep shift, scale and
# gate clearly non-zero: a wrong table row or a gate forced to 0 or 1 changes the output.
_ADALN_WEIGHT_GAIN = 0.5
_ADALN_BIAS_STD = 0.2
_OTHER_BIAS_STD = 0.1


def native_state_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Native key -> shape, in module order, without allocating (the model is built on meta)."""
    model = H3DiT(config, device="meta")
    return {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}


def native_storage_dtype(key: str) -> torch.dtype:
    """The dtype the release stores `key` in: fp32 for the twelve islands and rope.inv_freq (and a pruned form's table,
    mean and basis), else bf16."""
    return torch.float32 if key in FP32_PARAMETER_NAMES | PRUNED_FP32_NAMES else torch.bfloat16


def random_native_tensor(
    key: str, shape: tuple[int, ...], config: DiTConfig, generator: torch.Generator
) -> Tensor:
    """One deterministic random native tensor on `generator`'s device, in its released storage dtype.

    Linear weights are N(0, gain^2 / fan_in) so every projection keeps O(1) activations through all blocks.
    """
    device = generator.device
    if key == ROPE_KEY:
        return rope_inverse_frequencies(config.rope_freq_dim, config.rope_theta, device)
    if key.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        values = 1.0 + _NORM_WEIGHT_SPREAD * torch.randn(shape, generator=generator, device=device)
    elif key in PRUNED_FP32_NAMES:
        values = torch.randn(shape, generator=generator, device=device)
    elif key.endswith(".bias"):
        std = _ADALN_BIAS_STD if "adaln_proj" in key else _OTHER_BIAS_STD
        values = std * torch.randn(shape, generator=generator, device=device)
    elif key.endswith(".weight") and len(shape) == 2:
        gain = _ADALN_WEIGHT_GAIN if "adaln_proj" in key else 1.0
        values = (gain / math.sqrt(shape[1])) * torch.randn(shape, generator=generator, device=device)
    else:
        raise CheckpointError(f"no random recipe for native DiT key {key!r} of shape {shape}")
    return values.to(native_storage_dtype(key))


def random_native_state(config: DiTConfig, seed: int) -> dict[str, Tensor]:
    """Deterministic random native state dict (CPU generator seeded with `seed`), released storage dtypes."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return {
        key: random_native_tensor(key, shape, config, generator)
        for key, shape in native_state_shapes(config).items()
    }
