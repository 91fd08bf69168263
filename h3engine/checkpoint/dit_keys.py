"""Key maps between the native (MiniMaxAI) and diffusers layouts of the H3 DiT, and random native weights.

Contract
--------
`native_to_diffusers` and `diffusers_to_native` are pure, exact inverses (bit-identical values, same dtypes) and
work on `meta` tensors, so the loader can derive the expected key/shape set of either layout without data.
They map key by key, so a partial state (e.g. one block) converts on its own, except that a diffusers block's
to_q / to_k / to_v must arrive together.

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

import torch
from torch import Tensor

from h3engine.errors import CheckpointError
from h3engine.models.dit import FP32_PARAMETER_NAMES, DiTConfig, H3DiT, rope_inverse_frequencies

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

# Block-local names (after "token_refiner.blocks.{i}." / "blocks.{i}.") with a one-to-one tensor; refiner
# blocks have no AdaLN.
_REFINER_BLOCK_RENAMES: dict[str, str] = {
    "norm1.weight": "norm1.weight",
    "norm2.weight": "norm2.weight",
    "attn.q_norm.weight": "attn.norm_q.weight",
    "attn.k_norm.weight": "attn.norm_k.weight",
    "attn.out_proj.weight": "attn.to_out.0.weight",
    "mlp.fc2.weight": "ff.net.2.weight",
}
_BLOCK_RENAMES: dict[str, str] = {
    **_REFINER_BLOCK_RENAMES,
    "adaln_proj.linear.weight": "adaln_proj.linear.weight",
    "adaln_proj.linear.bias": "adaln_proj.linear.bias",
}
_NATIVE_QKV = "attn.qkv_proj.weight"
_NATIVE_FC1 = "mlp.fc1.weight"
_DIFFUSERS_QKV = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")
_DIFFUSERS_FC1 = "ff.net.0.proj.weight"

_NATIVE_BLOCK = re.compile(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.+)$")
_DIFFUSERS_BLOCK = re.compile(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)$")
_BLOCK_PREFIX_TO_DIFFUSERS = {
    "blocks": "transformer_blocks",
    "token_refiner.blocks": "token_refiner.refiner_blocks",
}
_BLOCK_PREFIX_TO_NATIVE = {value: key for key, value in _BLOCK_PREFIX_TO_DIFFUSERS.items()}
_NATIVE_RENAMES_BY_PREFIX = {"blocks": _BLOCK_RENAMES, "token_refiner.blocks": _REFINER_BLOCK_RENAMES}
_DIFFUSERS_RENAMES_BY_PREFIX = {
    "transformer_blocks": {target: source for source, target in _BLOCK_RENAMES.items()},
    "token_refiner.refiner_blocks": {target: source for source, target in _REFINER_BLOCK_RENAMES.items()},
}
_DIFFUSERS_GLOBAL_RENAMES = {target: source for source, target in _GLOBAL_RENAMES.items()}


def _rename_global(key: str, renames: dict[str, str]) -> str | None:
    for source_prefix, target_prefix in renames.items():
        if key.startswith(source_prefix):
            return target_prefix + key[len(source_prefix) :]
    return None


def _swap_halves(weight: Tensor) -> Tensor:
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
        if key == ROPE_KEY:
            continue
        block = _NATIVE_BLOCK.match(key)
        if block is None:
            renamed = _rename_global(key, _GLOBAL_RENAMES)
            if renamed is None:
                raise CheckpointError(f"unexpected native DiT key {key!r}")
            converted[renamed] = tensor
            continue
        prefix, index, local = block.groups()
        native_prefix = f"{prefix}.{index}."
        target_prefix = f"{_BLOCK_PREFIX_TO_DIFFUSERS[prefix]}.{index}."
        if local == _NATIVE_QKV:
            head_dim = _head_dim(state, native_prefix + "attn.q_norm.weight", key)
            per_head = tensor.reshape(-1, 3, head_dim, tensor.shape[1])
            for part, diffusers_local in enumerate(_DIFFUSERS_QKV):
                converted[target_prefix + diffusers_local] = per_head[:, part].reshape(-1, tensor.shape[1])
        elif local == _NATIVE_FC1:
            converted[target_prefix + _DIFFUSERS_FC1] = _swap_halves(tensor)
        elif local in _NATIVE_RENAMES_BY_PREFIX[prefix]:
            converted[target_prefix + _NATIVE_RENAMES_BY_PREFIX[prefix][local]] = tensor
        else:
            raise CheckpointError(f"unexpected native DiT key {key!r}")
    return converted


def diffusers_to_native(state: dict[str, Tensor], config: DiTConfig | None = None) -> dict[str, Tensor]:
    """Diffusers DiT state dict -> native state dict; rope.inv_freq recomputed (fp32) from `config`'s rope."""
    rope_config = config if config is not None else DiTConfig.released()
    converted: dict[str, Tensor] = {}
    for key, tensor in state.items():
        block = _DIFFUSERS_BLOCK.match(key)
        if block is None:
            renamed = _rename_global(key, _DIFFUSERS_GLOBAL_RENAMES)
            if renamed is None:
                raise CheckpointError(f"unexpected diffusers DiT key {key!r}")
            converted[renamed] = tensor
            continue
        prefix, index, local = block.groups()
        diffusers_prefix = f"{prefix}.{index}."
        target_prefix = f"{_BLOCK_PREFIX_TO_NATIVE[prefix]}.{index}."
        if local in _DIFFUSERS_QKV:
            missing = [
                diffusers_prefix + part for part in _DIFFUSERS_QKV if diffusers_prefix + part not in state
            ]
            if missing:
                raise CheckpointError(f"diffusers DiT key(s) {missing} missing next to {key!r}")
            # Merged once, when the query weight is met; the key and value weights are consumed with it.
            if local != _DIFFUSERS_QKV[0]:
                continue
            parts = [state[diffusers_prefix + part] for part in _DIFFUSERS_QKV]
            head_dim = _head_dim(state, diffusers_prefix + "attn.norm_q.weight", key)
            in_features = tensor.shape[1]
            per_head = torch.stack([part.reshape(-1, head_dim, in_features) for part in parts], dim=1)
            converted[target_prefix + _NATIVE_QKV] = per_head.reshape(-1, in_features)
        elif local == _DIFFUSERS_FC1:
            converted[target_prefix + _NATIVE_FC1] = _swap_halves(tensor)
        elif local in _DIFFUSERS_RENAMES_BY_PREFIX[prefix]:
            converted[target_prefix + _DIFFUSERS_RENAMES_BY_PREFIX[prefix][local]] = tensor
        else:
            raise CheckpointError(f"unexpected diffusers DiT key {key!r}")
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
    """The dtype the release stores `key` in: fp32 for the twelve islands and rope.inv_freq, else bf16."""
    return torch.float32 if key in FP32_PARAMETER_NAMES else torch.bfloat16


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
