"""Audio VAE state-dict layouts: native `audio_vae/model.safetensors` <-> diffusers `AutoencoderKLMiniMaxH3Audio`.

The two layouts are the same (docs/CHECKPOINT.md §4.3: the diffusers converter passes every tensor through
unchanged), so both directions are identities that only *validate*: every key must belong to the audio VAE's native
key grammar and every tensor must be fp32 (the converter rejects anything else). Shapes and the complete key set
depend on the config and are checked by the strict `load_state_dict` of `AudioVAE`.

Both functions read only names and dtypes, never data, so they work on `meta` tensors.

`random_native_state` draws a deterministic, non-identity test state in the released storage dtype (all fp32).
"""

from __future__ import annotations

import math
import re

import torch

from h3engine.errors import CheckpointError
from h3engine.models.audio_vae import AudioVAE, AudioVAEConfig, anti_alias_filter

_WEIGHT_NORMED = r"(weight_g|weight_v|bias)"
_ANTI_ALIASED = r"(act\.(alpha|beta)|upsample\.filter|downsample\.lowpass\.filter)"
NATIVE_KEY_PATTERN = re.compile(
    "|".join(
        (
            rf"encoder\.block\.\d+\.{_WEIGHT_NORMED}",
            r"encoder\.block\.\d+\.alpha",
            rf"encoder\.block\.\d+\.block\.\d+\.({_WEIGHT_NORMED}|alpha)",
            rf"encoder\.block\.\d+\.block\.\d+\.block\.\d+\.({_WEIGHT_NORMED}|alpha)",
            r"pre_block\.(norm1|norm2|norm3|proj|mlp\.norm|mlp\.w0|mlp\.w1|mlp\.w2|attn\.proj)\.(weight|bias)",
            r"pre_block\.attn\.(qkv\.weight|q_bias|v_bias|zero_k_bias)",
            r"(mean_proj|logs_proj|dec_in_proj)\.(weight|bias)",
            rf"decoder\.conv_pre\.{_WEIGHT_NORMED}",
            rf"decoder\.ups\.\d+\.0\.{_WEIGHT_NORMED}",
            rf"decoder\.resblocks\.\d+\.(convs1|convs2)\.\d+\.{_WEIGHT_NORMED}",
            rf"decoder\.resblocks\.\d+\.activations\.\d+\.{_ANTI_ALIASED}",
            rf"decoder\.activation_post\.{_ANTI_ALIASED}",
            r"decoder\.conv_post\.(weight_g|weight_v)",
        )
    )
)


def _validated_copy(state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    for key, tensor in state.items():
        if NATIVE_KEY_PATTERN.fullmatch(key) is None:
            raise CheckpointError(f"{source}: unexpected audio VAE key '{key}'")
        if tensor.dtype != torch.float32:
            raise CheckpointError(f"{source}: '{key}' is {tensor.dtype}, the audio VAE is stored in float32")
    return dict(state)


def native_to_diffusers(
    state: dict[str, torch.Tensor], *, source: str = "audio VAE state dict"
) -> dict[str, torch.Tensor]:
    """Native -> diffusers: same keys and tensors (validated); `source` names the file in error messages."""
    return _validated_copy(state, source)


def diffusers_to_native(
    state: dict[str, torch.Tensor], *, source: str = "audio VAE state dict"
) -> dict[str, torch.Tensor]:
    """diffusers -> native: same keys and tensors (validated); `source` names the file in error messages."""
    return _validated_copy(state, source)


def random_native_state(config: AudioVAEConfig, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic fp32 native state for `config` in which no block is an identity.

    Scales keep activations O(1): each weight-normed output row gets a norm in [0.6, 1.0) (so a conv roughly preserves
    variance), Snake alphas are positive and away from 0 (the Snake divides by alpha), LayerNorm gains sit near 1,
    plain Linear / Conv weights are scaled by 1 / sqrt(fan_in), and biases are small but non-zero. The final
    `conv_post` gain is small so decodes mostly stay inside the [-1, 1] clamp, which would otherwise hide errors.
    Filter buffers are the real Kaiser-sinc kernels and `zero_k_bias` is zero, as in the release.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device("meta"):
        shapes = {key: tensor.shape for key, tensor in AudioVAE(config).state_dict().items()}

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float32)

    def normal(shape: torch.Size, scale: float) -> torch.Tensor:
        return scale * torch.randn(shape, generator=generator, dtype=torch.float32)

    state: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if key.endswith(".filter"):
            state[key] = anti_alias_filter()
        elif key.endswith("zero_k_bias"):
            state[key] = torch.zeros(shape, dtype=torch.float32)
        elif key == "decoder.conv_post.weight_g":
            state[key] = uniform(shape, 0.15, 0.3)
        elif upsampler := re.match(r"decoder\.ups\.(\d+)\.0\.weight_g$", key):
            # A transposed conv of stride s feeds each output sample from 2 of its 2s taps, which shrinks the
            # signal by ~sqrt(s); the gain makes up for it so long hops (the released 5, 5, ...) stay O(1).
            stride = config.decoder_rates[int(upsampler.group(1))]
            state[key] = uniform(shape, 0.6, 1.0) * stride**0.5
        elif key.endswith("weight_g"):
            state[key] = uniform(shape, 0.6, 1.0)
        elif key.endswith("weight_v"):
            state[key] = normal(shape, 1.0)
        elif key.endswith(".alpha") and len(shape) == 3:
            # Encoder Snake alpha is raw (not log-scale).
            state[key] = uniform(shape, 0.5, 1.5)
        elif key.endswith((".act.alpha", ".act.beta")):
            state[key] = normal(shape, 0.3)
        elif re.search(r"norm\d?\.weight$", key):
            state[key] = 1.0 + normal(shape, 0.1)
        elif key.endswith("weight"):
            state[key] = normal(shape, 1.0 / math.sqrt(math.prod(shape[1:])))
        else:
            state[key] = normal(shape, 0.1)
    return state
