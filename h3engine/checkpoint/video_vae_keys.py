"""Video VAE key maps: native `video_vae/source/model.safetensors` <-> diffusers `vae/` (AutoencoderKLMiniMaxH3).

Both functions are pure, work on meta tensors (views, reshapes, concatenations) and are exact inverses. What
changes between the layouts (docs/CHECKPOINT.md §3.2):
* renames: `encoder.down.{L}.block.{j}` -> `encoder.down_blocks.{L}.resnets.{j}`, `nin_shortcut` -> `conv_shortcut`,
  `encoder.down.{L}.downsample` -> `encoder.down_blocks.{L}.downsamplers.0`, `decoder.x_embedder` ->
  `decoder.proj_in`, `attn.to_out` -> `attn.to_out.0`, `ff.w1` -> `ff.net.0.proj`, `ff.w2` -> `ff.net.2`;
* the fused `attn.to_qkv` (weight AND bias) is per-head interleaved, rows = heads x [q(d) k(d) v(d)]; diffusers has
  separate `to_q` / `to_k` / `to_v`;
* `ff.w1` rows are [gate; up] natively and [up; gate] in diffusers (halves swapped, weight and bias);
* `decoder.mask_token` (all zero, never read) exists only natively: dropped one way, restored as zeros the other.

The danger: splitting the interleaved QKV needs the head size, which no tensor shape reveals. A wrong head size
still yields tensors of the right shapes with rows in the wrong heads, so both functions take the config.
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

# Keys that only change name: (native, diffusers) templates whose `{placeholders}` match the alternatives below.
_PLACEHOLDERS = {
    "kind": "weight|bias",
    "level": r"\d+",
    "index": r"\d+",
    "block": r"\d+",
    "layer": "norm1|conv1|norm2|conv2",
    "end": "norm_out|conv_out",
    "quant": "quant_conv|post_quant_conv",
    "norm": "norm1|norm2",
    "scale": "scale1|scale2",
    "head": "norm_out|proj_out",
}
_RENAMES = (
    ("encoder.conv_in.{kind}", "encoder.conv_in.{kind}"),
    (
        "encoder.down.{level}.block.{index}.{layer}.{kind}",
        "encoder.down_blocks.{level}.resnets.{index}.{layer}.{kind}",
    ),
    (
        "encoder.down.{level}.block.{index}.nin_shortcut.{kind}",
        "encoder.down_blocks.{level}.resnets.{index}.conv_shortcut.{kind}",
    ),
    ("encoder.down.{level}.downsample.conv.{kind}", "encoder.down_blocks.{level}.downsamplers.0.conv.{kind}"),
    ("encoder.{end}.{kind}", "encoder.{end}.{kind}"),
    ("{quant}.{kind}", "{quant}.{kind}"),
    ("decoder.x_embedder.{kind}", "decoder.proj_in.{kind}"),
    ("decoder.register_tokens", "decoder.register_tokens"),
    ("decoder.transformer_blocks.{block}.{norm}.weight", "decoder.transformer_blocks.{block}.{norm}.weight"),
    ("decoder.transformer_blocks.{block}.{scale}", "decoder.transformer_blocks.{block}.{scale}"),
    (
        "decoder.transformer_blocks.{block}.attn.to_out.{kind}",
        "decoder.transformer_blocks.{block}.attn.to_out.0.{kind}",
    ),
    ("decoder.transformer_blocks.{block}.ff.w2.{kind}", "decoder.transformer_blocks.{block}.ff.net.2.{kind}"),
    ("decoder.{head}.{kind}", "decoder.{head}.{kind}"),
)


def _template_pattern(template: str) -> re.Pattern[str]:
    """The regex of a key template: literal text, each `{name}` one of its `_PLACEHOLDERS` alternatives."""
    pieces = re.split(r"\{(\w+)\}", template)  # literal, name, literal, ..., literal
    pattern = "".join(
        f"(?P<{piece}>{_PLACEHOLDERS[piece]})" if index % 2 else re.escape(piece)
        for index, piece in enumerate(pieces)
    )
    return re.compile(f"^{pattern}$")


# (pattern of one layout's key, template of the other layout's key), in both directions.
_NATIVE_RENAMES = [(_template_pattern(native), diffusers) for native, diffusers in _RENAMES]
_DIFFUSERS_RENAMES = [(_template_pattern(diffusers), native) for native, diffusers in _RENAMES]
_NATIVE_QKV = re.compile(rf"^({_BLOCK})\.attn\.to_qkv\.(weight|bias)$")
_NATIVE_GATED_UP = re.compile(rf"^({_BLOCK})\.ff\.w1\.(weight|bias)$")
_DIFFUSERS_QKV_PART = re.compile(rf"^({_BLOCK})\.attn\.to_(q|k|v)\.(weight|bias)$")
_DIFFUSERS_GATED_UP = re.compile(rf"^({_BLOCK})\.ff\.net\.0\.proj\.(weight|bias)$")


def _rename(key: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        if match := pattern.match(key):
            return template.format(**match.groupdict())
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
