"""Video VAE config files: native `video_vae/config.json` + `source/config.json` and diffusers' `vae/config.json`.

`read_video_vae_config` reads either layout into a `VideoVAEConfig`; `config_to_native` / `config_to_diffusers`
write a config back the way the release and diffusers store it, so that every config round-trips. The native
files describe an `AutoencoderKLLegacy` with architecture switches; any value but the released one is refused.
diffusers' config has no tiling fields (diffusers hard-codes the released 256/64 px tiling).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from h3engine.checkpoint.layout import read_json
from h3engine.models.video_vae import VideoVAEConfig

DIFFUSERS_CLASS_NAME = "AutoencoderKLMiniMaxH3"
# The config fields diffusers stores under the same names (everything but the tiling settings).
_TILING_FIELDS = ("encoder_tiling", "decoder_tiling", "parallel_tiling", "tile_size", "tile_overlap_min")
_DIFFUSERS_FIELDS = tuple(
    field.name for field in dataclasses.fields(VideoVAEConfig) if field.name not in _TILING_FIELDS
)

# The native source config fixes these architecture switches; any other value is a different model.
_NATIVE_SOURCE_REQUIREMENTS: dict[str, Any] = {
    "use_3d_conv": True,
    "use_vit_decoder": True,
    "causal_encoder": True,
    "causal_decoder": False,
    "use_t_isolated_gn": True,
    "pixel_norm_type": "imagenet",
}
_NATIVE_VIT_REQUIREMENTS: dict[str, Any] = {
    "norm_type": "rms_norm",
    "norm_affine": True,
    "qk_norm_type": "rms_norm",
    "qk_norm_affine": False,
    "ffn_activation_fn": "silu",
    "ffn_use_gated": True,
}
# Values the native code hard-codes (GroupNorm(32, eps 1e-6), FeedForward mult 4, ViT eps 1e-5, 4 register tokens).
# `config_to_native` writes the matching key only when a config differs from them (tiny test models), so the
# released config is written exactly like the release while smaller models still round-trip.
_NATIVE_DEFAULT_NORM_GROUPS = 32
_NATIVE_DEFAULT_NORM_EPS = 1e-6
_NATIVE_DEFAULT_FFN_MULT = 4
_NATIVE_DEFAULT_DECODER_EPS = 1e-5
_NATIVE_DEFAULT_REGISTER_TOKENS = 4


def read_video_vae_config(folder: Path, native: bool) -> tuple[VideoVAEConfig, Path]:
    """The config of a native `video_vae/` or a diffusers `vae/` folder, and the path of its weights. An invalid
    field raises KeyError, TypeError or ValueError."""
    wrapper = read_json(folder / "config.json")
    if not native:
        return config_from_diffusers(wrapper), folder
    source_folder = folder / wrapper.get("source_path", "source")
    config = config_from_native(wrapper, read_json(source_folder / "config.json"))
    return config, source_folder / wrapper.get("source_safetensors_path", "model.safetensors")


def config_from_native(wrapper_config: dict[str, Any], source_config: dict[str, Any]) -> VideoVAEConfig:
    """From `video_vae/config.json` (wrapper) and `video_vae/source/config.json` (AutoencoderKLLegacy)."""
    for key, expected in _NATIVE_SOURCE_REQUIREMENTS.items():
        if source_config.get(key, expected) != expected:
            raise ValueError(
                f"source/config.json '{key}' is {source_config[key]!r}; only {expected!r} is supported"
            )
    vit = source_config["vit_decoder_kwargs"]
    for key, expected in _NATIVE_VIT_REQUIREMENTS.items():
        if vit.get(key, expected) != expected:
            raise ValueError(
                f"source/config.json 'vit_decoder_kwargs.{key}' is {vit[key]!r}; only {expected!r} is supported"
            )
    for key in ("zq_ch_encoder", "padding_mode_t"):
        if source_config.get(key) is not None:
            raise ValueError(f"source/config.json '{key}' must be null")
    if source_config["embed_dim"] != source_config["z_channels"]:
        raise ValueError("source/config.json 'embed_dim' and 'z_channels' differ")
    latent_channels = int(source_config["z_channels"])
    if int(wrapper_config.get("latent_channels", latent_channels)) != latent_channels:
        raise ValueError("config.json 'latent_channels' differs from source/config.json 'z_channels'")
    for key in ("vae_encoder_parallel", "vae_decoder_parallel"):
        if int(wrapper_config.get(key, 0)):
            raise ValueError(
                f"config.json '{key}' asks for spatial sharding, which the release recipe rejects"
            )
    base_channels = int(source_config["ch"])
    config = VideoVAEConfig(
        in_channels=int(source_config.get("in_channels", 3)),
        out_channels=int(source_config.get("out_ch", 3)),
        latent_channels=latent_channels,
        block_out_channels=tuple(base_channels * int(m) for m in source_config["ch_mult"]),
        layers_per_block=int(source_config["num_res_blocks"]),
        spatial_downsample_factors=tuple(int(f) for f in source_config["space_down"]),
        temporal_downsample_factors=tuple(int(f) for f in source_config["time_down"]),
        norm_num_groups=int(source_config.get("norm_num_groups", _NATIVE_DEFAULT_NORM_GROUPS)),
        norm_eps=float(source_config.get("norm_eps", _NATIVE_DEFAULT_NORM_EPS)),
        spatial_padding_mode=str(source_config["padding_mode"]),
        decoder_num_layers=int(vit["num_layers"]),
        decoder_num_attention_heads=int(vit["heads"]),
        decoder_attention_head_dim=int(vit["dim_head"]),
        decoder_num_register_tokens=int(vit.get("num_register_tokens", _NATIVE_DEFAULT_REGISTER_TOKENS)),
        decoder_ffn_mult=int(vit.get("ffn_mult", _NATIVE_DEFAULT_FFN_MULT)),
        decoder_rope_theta=float(vit["rope_theta"]),
        decoder_rope_dim_ratio=float(vit["rope_dim_ratio"]),
        decoder_norm_eps=float(vit.get("eps", _NATIVE_DEFAULT_DECODER_EPS)),
        clip_length=int(wrapper_config["vae_clip_length"]),
        token_drop=int(wrapper_config["vae_token_drop"]),
        encoder_tiling=bool(int(wrapper_config["vae_encoder_tiling"])),
        decoder_tiling=bool(int(wrapper_config["vae_decoder_tiling"])),
        parallel_tiling=bool(int(wrapper_config.get("vae_parallel_tiling", 1))),
        tile_size=int(wrapper_config["vae_tile_size"]),
        tile_overlap_min=int(wrapper_config["vae_tile_overlap_min"]),
        latents_mean=tuple(float(v) for v in wrapper_config["latents_mean"]),
        latents_std=tuple(float(v) for v in wrapper_config["latents_std"]),
    )
    for key, value in (
        ("vae_ratio", config.spatial_compression_ratio),
        ("vae_ratio_t", config.temporal_compression_ratio),
    ):
        if key in source_config and int(source_config[key]) != value:
            raise ValueError(
                f"source/config.json '{key}' is {source_config[key]} but the factors give {value}"
            )
    return config


def config_to_native(config: VideoVAEConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`video_vae/config.json`, `video_vae/source/config.json`) written like the release."""
    base_channels = config.block_out_channels[0]
    if any(channels % base_channels for channels in config.block_out_channels):
        raise ValueError(
            "the native config stores channels as ch * ch_mult; block_out_channels must be multiples"
        )
    return _native_wrapper(config), _native_source(config, base_channels)


def _native_wrapper(config: VideoVAEConfig) -> dict[str, Any]:
    """`video_vae/config.json`: the wrapper's tiling and the latent statistics."""
    return {
        "_class_name": "MiniMaxH3VideoVAE",
        "_diffusers_version": "0.32.2",
        "mode": "standalone",
        "auto_map": {"AutoModel": "minimax_h3_video_vae.MiniMaxH3VideoVAE"},
        "source_path": "source",
        "source_class_name": "AutoencoderKLLegacy",
        "source_safetensors_path": "model.safetensors",
        "vae_clip_length": config.clip_length,
        "vae_token_drop": config.token_drop,
        "vae_encoder_tiling": int(config.encoder_tiling),
        "vae_decoder_tiling": int(config.decoder_tiling),
        "vae_parallel_tiling": int(config.parallel_tiling),
        "vae_tile_size": config.tile_size,
        "vae_tile_overlap_min": config.tile_overlap_min,
        "vae_encoder_parallel": 0,
        "vae_decoder_parallel": 0,
        "vae_chunk_dim": -1,
        "latent_channels": config.latent_channels,
        "latents_mean": list(config.latents_mean),
        "latents_std": list(config.latents_std),
    }


def _native_vit_decoder_kwargs(config: VideoVAEConfig) -> dict[str, Any]:
    """The source config's `vit_decoder_kwargs`, leaving out the fields at their native defaults."""
    vit_decoder_kwargs: dict[str, Any] = {
        "dim_head": config.decoder_attention_head_dim,
        "ffn_activation_fn": "silu",
        "ffn_use_gated": True,
        "heads": config.decoder_num_attention_heads,
        "norm_affine": True,
        "norm_type": "rms_norm",
        "num_layers": config.decoder_num_layers,
        "qk_norm_affine": False,
        "qk_norm_type": "rms_norm",
        "rope_dim_ratio": config.decoder_rope_dim_ratio,
        "rope_theta": config.decoder_rope_theta,
    }
    if config.decoder_num_register_tokens != _NATIVE_DEFAULT_REGISTER_TOKENS:
        vit_decoder_kwargs["num_register_tokens"] = config.decoder_num_register_tokens
    if config.decoder_norm_eps != _NATIVE_DEFAULT_DECODER_EPS:
        vit_decoder_kwargs["eps"] = config.decoder_norm_eps
    if config.decoder_ffn_mult != _NATIVE_DEFAULT_FFN_MULT:
        vit_decoder_kwargs["ffn_mult"] = config.decoder_ffn_mult
    return vit_decoder_kwargs


def _native_source(config: VideoVAEConfig, base_channels: int) -> dict[str, Any]:
    """`video_vae/source/config.json`: the legacy autoencoder's fields, channels as `base_channels` * ch_mult."""
    source: dict[str, Any] = {
        "_class_name": "AutoencoderKLLegacy",
        "in_channels": config.in_channels,
        "out_ch": config.out_channels,
        "ch": base_channels,
        "ch_mult": [channels // base_channels for channels in config.block_out_channels],
        "embed_dim": config.latent_channels,
        "z_channels": config.latent_channels,
        "num_res_blocks": config.layers_per_block,
        "num_res_blocks_decoder": None,
        "padding_mode": config.spatial_padding_mode,
        "padding_mode_t": None,
        "pixel_norm_type": "imagenet",
        "scaling_factor": 1.0,
        "shift_factor": 0.0,
        "space_down": list(config.spatial_downsample_factors),
        # Legacy CNN-decoder field, unused by the ViT decoder; the release stores the down factors shifted by one.
        "space_up": [1, *config.spatial_downsample_factors[:-1]],
        "time_down": list(config.temporal_downsample_factors),
        "time_up": None,
        "causal_encoder": True,
        "causal_decoder": False,
        "use_3d_conv": True,
        "use_t_isolated_gn": True,
        "use_vit_decoder": True,
        "vae_ratio": config.spatial_compression_ratio,
        "vae_ratio_t": config.temporal_compression_ratio,
        "vit_decoder_kwargs": _native_vit_decoder_kwargs(config),
        "zq_ch_decoder": None,
        "zq_ch_encoder": None,
    }
    if config.norm_num_groups != _NATIVE_DEFAULT_NORM_GROUPS:
        source["norm_num_groups"] = config.norm_num_groups
    if config.norm_eps != _NATIVE_DEFAULT_NORM_EPS:
        source["norm_eps"] = config.norm_eps
    return source


def config_from_diffusers(config: dict[str, Any]) -> VideoVAEConfig:
    """From diffusers' `vae/config.json` (AutoencoderKLMiniMaxH3), with the released tiling. A missing field takes
    diffusers' default: the released value, identity statistics for the latents."""
    released = VideoVAEConfig.released()
    latent_channels = int(config.get("latent_channels", released.latent_channels))
    defaults = {
        **{name: getattr(released, name) for name in _DIFFUSERS_FIELDS},
        "latents_mean": (0.0,) * latent_channels,
        "latents_std": (1.0,) * latent_channels,
    }
    values: dict[str, Any] = {}
    for name, default in defaults.items():
        value = config.get(name, default)
        # Each value is converted to the type of the released one (JSON gives lists and maybe ints for floats).
        if isinstance(default, tuple):
            values[name] = tuple(type(default[0])(item) for item in value)
        else:
            values[name] = type(default)(value)
    return dataclasses.replace(released, **values)


def config_to_diffusers(config: VideoVAEConfig) -> dict[str, Any]:
    """Constructor arguments of diffusers' AutoencoderKLMiniMaxH3 (the tiling settings have no place there)."""
    values = {name: getattr(config, name) for name in _DIFFUSERS_FIELDS}
    return {
        "_class_name": DIFFUSERS_CLASS_NAME,
        **{name: list(value) if isinstance(value, tuple) else value for name, value in values.items()},
    }
