"""Video VAE key maps: native `video_vae/source/model.safetensors` <-> diffusers `vae/` (AutoencoderKLMiniMaxH3).

Both functions are pure, work on meta tensors (only views, reshapes and concatenations) and are exact inverses.
What changes between the layouts (H3_CHECKPOINT_LAYOUT §1.2):
* renames: `encoder.down.{L}.block.{j}` -> `encoder.down_blocks.{L}.resnets.{j}`, `nin_shortcut` -> `conv_shortcut`,
  `encoder.down.{L}.downsample` -> `encoder.down_blocks.{L}.downsamplers.0`, `decoder.x_embedder` ->
  `decoder.proj_in`, `attn.to_out` -> `attn.to_out.0`, `ff.w1` -> `ff.net.0.proj`, `ff.w2` -> `ff.net.2`;
* the fused `attn.to_qkv` (weight AND bias) is per-head interleaved, rows = heads x [q(d) k(d) v(d)]; diffusers has
  separate `to_q` / `to_k` / `to_v`;
* `ff.w1` rows are [gate; up] natively and [up; gate] in diffusers (halves swapped, weight and bias);
* `decoder.mask_token` (all zero, never read) exists only natively: dropped one way, restored as zeros the other.

The danger: splitting the interleaved QKV needs the head size, which no tensor shape reveals (the decoder has no
QK-norm weights and dim == heads * head_dim). A wrong head size still yields tensors of the right shapes, just with
rows in the wrong heads, so both functions take the config and never guess.
"""

from __future__ import annotations

import math
import re

import torch

from h3engine.errors import CheckpointError
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

StateDict = dict[str, torch.Tensor]

MASK_TOKEN_KEY = "decoder.mask_token"
_BLOCK = r"decoder\.transformer_blocks\.\d+"

# (native pattern, diffusers replacement) for the keys that only change name.
_NATIVE_RENAMES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^encoder\.conv_in\.(weight|bias)$"), r"encoder.conv_in.\1"),
    (
        re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\.(norm1|conv1|norm2|conv2)\.(weight|bias)$"),
        r"encoder.down_blocks.\1.resnets.\2.\3.\4",
    ),
    (
        re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\.nin_shortcut\.(weight|bias)$"),
        r"encoder.down_blocks.\1.resnets.\2.conv_shortcut.\3",
    ),
    (
        re.compile(r"^encoder\.down\.(\d+)\.downsample\.conv\.(weight|bias)$"),
        r"encoder.down_blocks.\1.downsamplers.0.conv.\2",
    ),
    (re.compile(r"^encoder\.(norm_out|conv_out)\.(weight|bias)$"), r"encoder.\1.\2"),
    (re.compile(r"^(quant_conv|post_quant_conv)\.(weight|bias)$"), r"\1.\2"),
    (re.compile(r"^decoder\.x_embedder\.(weight|bias)$"), r"decoder.proj_in.\1"),
    (re.compile(r"^decoder\.register_tokens$"), r"decoder.register_tokens"),
    (re.compile(rf"^({_BLOCK})\.(norm1|norm2)\.weight$"), r"\1.\2.weight"),
    (re.compile(rf"^({_BLOCK})\.(scale1|scale2)$"), r"\1.\2"),
    (re.compile(rf"^({_BLOCK})\.attn\.to_out\.(weight|bias)$"), r"\1.attn.to_out.0.\2"),
    (re.compile(rf"^({_BLOCK})\.ff\.w2\.(weight|bias)$"), r"\1.ff.net.2.\2"),
    (re.compile(r"^decoder\.(norm_out|proj_out)\.(weight|bias)$"), r"decoder.\1.\2"),
]
_DIFFUSERS_RENAMES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^encoder\.conv_in\.(weight|bias)$"), r"encoder.conv_in.\1"),
    (
        re.compile(
            r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(norm1|conv1|norm2|conv2)\.(weight|bias)$"
        ),
        r"encoder.down.\1.block.\2.\3.\4",
    ),
    (
        re.compile(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.conv_shortcut\.(weight|bias)$"),
        r"encoder.down.\1.block.\2.nin_shortcut.\3",
    ),
    (
        re.compile(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(weight|bias)$"),
        r"encoder.down.\1.downsample.conv.\2",
    ),
    (re.compile(r"^encoder\.(norm_out|conv_out)\.(weight|bias)$"), r"encoder.\1.\2"),
    (re.compile(r"^(quant_conv|post_quant_conv)\.(weight|bias)$"), r"\1.\2"),
    (re.compile(r"^decoder\.proj_in\.(weight|bias)$"), r"decoder.x_embedder.\1"),
    (re.compile(r"^decoder\.register_tokens$"), r"decoder.register_tokens"),
    (re.compile(rf"^({_BLOCK})\.(norm1|norm2)\.weight$"), r"\1.\2.weight"),
    (re.compile(rf"^({_BLOCK})\.(scale1|scale2)$"), r"\1.\2"),
    (re.compile(rf"^({_BLOCK})\.attn\.to_out\.0\.(weight|bias)$"), r"\1.attn.to_out.\2"),
    (re.compile(rf"^({_BLOCK})\.ff\.net\.2\.(weight|bias)$"), r"\1.ff.w2.\2"),
    (re.compile(r"^decoder\.(norm_out|proj_out)\.(weight|bias)$"), r"decoder.\1.\2"),
]
_NATIVE_QKV = re.compile(rf"^({_BLOCK})\.attn\.to_qkv\.(weight|bias)$")
_NATIVE_GATED_UP = re.compile(rf"^({_BLOCK})\.ff\.w1\.(weight|bias)$")
_DIFFUSERS_QKV_PART = re.compile(rf"^({_BLOCK})\.attn\.to_(q|k|v)\.(weight|bias)$")
_DIFFUSERS_GATED_UP = re.compile(rf"^({_BLOCK})\.ff\.net\.0\.proj\.(weight|bias)$")


def _rename(key: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, replacement in table:
        if pattern.match(key):
            return pattern.sub(replacement, key)
    return None


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """[a; b] -> [b; a] along dim 0 (its own inverse)."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _split_interleaved_qkv(
    tensor: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows heads x [q(d) k(d) v(d)] -> (q, k, v), each with rows heads x d."""
    per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])
    return tuple(per_head[:, part].reshape(-1, *tensor.shape[1:]) for part in range(3))  # type: ignore[return-value]


def _merge_interleaved_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int
) -> torch.Tensor:
    parts = [part.reshape(heads, -1, *part.shape[1:]) for part in (query, key, value)]
    return torch.stack(parts, dim=1).reshape(-1, *query.shape[1:])


def native_to_diffusers(state: StateDict, config: VideoVAEConfig) -> StateDict:
    """Native keys -> diffusers keys (drops `decoder.mask_token`). Raises CheckpointError on an unknown key."""
    heads = config.decoder_num_attention_heads
    converted: StateDict = {}
    for key, tensor in state.items():
        if key == MASK_TOKEN_KEY:
            continue
        if match := _NATIVE_QKV.match(key):
            block, kind = match.groups()
            for name, part in zip("qkv", _split_interleaved_qkv(tensor, heads), strict=True):
                converted[f"{block}.attn.to_{name}.{kind}"] = part
        elif match := _NATIVE_GATED_UP.match(key):
            block, kind = match.groups()
            converted[f"{block}.ff.net.0.proj.{kind}"] = _swap_halves(tensor)
        elif (renamed := _rename(key, _NATIVE_RENAMES)) is not None:
            converted[renamed] = tensor
        else:
            raise CheckpointError(f"unexpected native video VAE key '{key}'")
    return converted


def diffusers_to_native(state: StateDict, config: VideoVAEConfig) -> StateDict:
    """diffusers keys -> native keys (re-fuses QKV, restores the all-zero `decoder.mask_token`).

    Raises CheckpointError on an unknown key or an incomplete q/k/v triple.
    """
    heads = config.decoder_num_attention_heads
    converted: StateDict = {}
    qkv_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if match := _DIFFUSERS_QKV_PART.match(key):
            block, name, kind = match.groups()
            qkv_parts.setdefault((block, kind), {})[name] = tensor
        elif match := _DIFFUSERS_GATED_UP.match(key):
            block, kind = match.groups()
            converted[f"{block}.ff.w1.{kind}"] = _swap_halves(tensor)
        elif (renamed := _rename(key, _DIFFUSERS_RENAMES)) is not None:
            converted[renamed] = tensor
        else:
            raise CheckpointError(f"unexpected diffusers video VAE key '{key}'")
    for (block, kind), parts in qkv_parts.items():
        missing = [name for name in "qkv" if name not in parts]
        if missing:
            raise CheckpointError(
                f"'{block}.attn.to_{missing[0]}.{kind}' is missing (needed to rebuild to_qkv)"
            )
        converted[f"{block}.attn.to_qkv.{kind}"] = _merge_interleaved_qkv(
            parts["q"], parts["k"], parts["v"], heads
        )
    if "decoder.register_tokens" not in converted:
        raise CheckpointError("'decoder.register_tokens' is missing")
    register_tokens = converted["decoder.register_tokens"]
    converted[MASK_TOKEN_KEY] = torch.zeros(
        1, 1, register_tokens.shape[-1], dtype=register_tokens.dtype, device=register_tokens.device
    )
    return converted


def random_native_state(config: VideoVAEConfig, seed: int) -> StateDict:
    """Deterministic random fp32 weights under the native keys, drawn so that no block is an identity and
    activations stay O(1): convs/linears ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2), norm gains 1 + N(0, 0.1^2),
    norm shifts ~ N(0, 0.1^2), layer scales uniform in [0.1, 1), register tokens ~ N(0, 1), mask token zero."""
    with torch.device("meta"):
        shapes = {key: tensor.shape for key, tensor in VideoVAE(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    state: StateDict = {}
    for key, shape in shapes.items():
        module_name = key.split(".")[-2]
        if key == MASK_TOKEN_KEY:
            tensor = torch.zeros(shape)
        elif key.endswith((".scale1", ".scale2")):
            tensor = 0.1 + 0.9 * torch.rand(shape, generator=generator)
        elif key == "decoder.register_tokens":
            tensor = torch.randn(shape, generator=generator)
        elif module_name.startswith("norm") and key.endswith(".weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif key.endswith(".bias"):
            tensor = 0.1 * torch.randn(shape, generator=generator)
        else:
            fan_in = math.prod(shape[1:])
            tensor = torch.randn(shape, generator=generator) / math.sqrt(fan_in)
        state[key] = tensor.to(torch.float32)
    return state
