"""Audio VAE config files: native `audio_vae/` (config.json, metadata.json, config.yaml) and diffusers' config.json.

`read_audio_vae_config` reads either layout into an `AudioVAEConfig`; `config_to_native` / `config_to_diffusers`
write a config back the way the release and diffusers store it. The native files repeat the latent width and the
sample rate; they are cross-checked. Malformed files raise CheckpointError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from h3engine.checkpoint.layout import read_json
from h3engine.errors import CheckpointError
from h3engine.models.audio_vae import (
    RELEASED_NUM_ATTENTION_HEADS,
    RELEASED_RESBLOCK_DILATION_SIZES,
    RELEASED_RESBLOCK_KERNEL_SIZES,
    STEREO_CHANNELS,
    AudioVAEConfig,
)

# Native wrapper files (docs/CHECKPOINT.md §4.1).
NATIVE_CLASS_NAME = "MiniMaxH3AudioVAE"
NATIVE_DIFFUSERS_VERSION = "0.32.2"
NATIVE_AUTO_MAP = {"AutoModel": "minimax_h3_audio_vae.MiniMaxH3AudioVAE"}
NATIVE_DECODER_TYPE = "bigvgan"
DIFFUSERS_CLASS_NAME = "AutoencoderKLMiniMaxH3Audio"
DIFFUSERS_VERSION = "0.42.1"


def read_audio_vae_config(folder: Path, native: bool) -> tuple[AudioVAEConfig, Path]:
    """The config of a native or diffusers `audio_vae/` folder, and the path of its weights. An invalid field
    raises CheckpointError, KeyError, TypeError or ValueError."""
    config_json = read_json(folder / "config.json")
    if not native:
        return config_from_diffusers(config_json), folder
    metadata = read_json(folder / config_json.get("source_metadata_path", "metadata.json"))
    yaml_path = folder / config_json.get("source_config_path", "config.yaml")
    config = config_from_native(config_json, metadata, _read_yaml(yaml_path) if yaml_path.is_file() else None)
    return config, folder / config_json.get("source_safetensors_path", "model.safetensors")


def _read_yaml(path: Path) -> dict:
    try:
        value = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise CheckpointError(f"{path}: unreadable YAML ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a YAML mapping")
    return value


def released_decoder_kernel_size(rate: int) -> int:
    """Transposed-conv kernel the release pairs with an upsampling rate: 2u for even u, 2u - 1 for odd u."""
    return 2 * rate - rate % 2


def _require(mapping: dict[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise CheckpointError(f"{where}: missing key '{key}'")
    return mapping[key]


def _require_equal(value: Any, expected: Any, key: str, where: str, against: str) -> None:
    if value != expected:
        raise CheckpointError(f"{where}: '{key}' is {value!r} but {against} says {expected!r}")


def config_from_native(
    config_json: dict[str, Any],
    metadata_json: dict[str, Any],
    config_yaml: dict[str, Any] | None = None,
) -> AudioVAEConfig:
    """Build from the native `audio_vae/` files (config.json, metadata.json and, when given, parsed config.yaml).

    The files duplicate the latent width and the sample rate; they are cross-checked. Fields the release
    hard-codes (heads, BigVGAN kernel sizes, AMP tables) are read from metadata.json kwargs when present (tiny
    checkpoints written by `config_to_native`) and otherwise take the released values.
    """
    kwargs = _require(
        _require(metadata_json, "metadata", "metadata.json"), "kwargs", "metadata.json metadata"
    )
    where = "metadata.json metadata.kwargs"
    if _require(kwargs, "decoder_type", where) != NATIVE_DECODER_TYPE:
        raise CheckpointError(
            f"{where}: decoder_type {kwargs['decoder_type']!r} is not supported (bigvgan only)"
        )
    if _require(kwargs, "attn_proj", where) is not True:
        raise CheckpointError(f"{where}: attn_proj must be true (the causal-attention latent projection)")
    # Malformed values (a string where a number belongs, ...) surface as TypeError / ValueError.
    try:
        latent_channels = int(_require(kwargs, "vae_latent_channels", where))
        sample_rate = int(_require(kwargs, "sample_rate", where))
        decoder_dim = int(_require(kwargs, "decoder_dim", where))
        decoder_rates = tuple(int(rate) for rate in _require(kwargs, "decoder_rates", where))

        for key, native_value in (("latent_channels", latent_channels), ("sample_rate", sample_rate)):
            _require_equal(_require(config_json, key, "config.json"), native_value, key, "config.json", where)
        if config_yaml is not None:
            model_config = _require(config_yaml, "model_config", "config.yaml")
            yaml_where = "config.yaml model_config"
            for key, native_value in (
                ("sr", sample_rate),
                ("decoder_dim", decoder_dim),
                ("vae_latent_channels", latent_channels),
            ):
                _require_equal(_require(model_config, key, yaml_where), native_value, key, yaml_where, where)
            if _require(model_config, "audio_channel", yaml_where) != 1:
                raise CheckpointError(f"{yaml_where}: audio_channel must be 1 (the VAE is mono)")

        return AudioVAEConfig(
            encoder_dim=int(_require(kwargs, "encoder_dim", where)),
            encoder_rates=tuple(_require(kwargs, "encoder_rates", where)),
            latent_dim=int(_require(kwargs, "latent_dim", where)),
            latent_channels=latent_channels,
            num_attention_heads=kwargs.get("num_attention_heads", RELEASED_NUM_ATTENTION_HEADS),
            decoder_dim=decoder_dim,
            decoder_rates=decoder_rates,
            decoder_kernel_sizes=kwargs.get(
                "decoder_kernel_sizes",
                tuple(released_decoder_kernel_size(rate) for rate in decoder_rates),
            ),
            resblock_kernel_sizes=kwargs.get("resblock_kernel_sizes", RELEASED_RESBLOCK_KERNEL_SIZES),
            resblock_dilation_sizes=kwargs.get("resblock_dilation_sizes", RELEASED_RESBLOCK_DILATION_SIZES),
            sampling_rate=sample_rate,
            latents_mean=_require(config_json, "latents_mean", "config.json"),
            latents_std=_require(config_json, "latents_std", "config.json"),
        )
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"audio_vae config.json/metadata.json: {error}") from error


def config_from_diffusers(config: dict[str, Any]) -> AudioVAEConfig:
    """Build from a diffusers `AutoencoderKLMiniMaxH3Audio` config.json dict.

    Missing architecture fields take diffusers' constructor defaults (the released values); the latent
    statistics are required because H3 cannot normalize without them.
    """
    where = "audio_vae/config.json"
    field_names = {field.name for field in dataclasses.fields(AudioVAEConfig)}
    values: dict[str, Any] = {}
    for key, value in config.items():
        if key.startswith("_"):
            continue
        if key not in field_names:
            raise CheckpointError(f"{where}: unexpected key '{key}' for {DIFFUSERS_CLASS_NAME}")
        values[key] = value
    for key in ("latents_mean", "latents_std"):
        if values.get(key) is None:
            raise CheckpointError(f"{where}: missing key '{key}'")
    try:
        return AudioVAEConfig(**values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: {error}") from error


def config_to_native(config: AudioVAEConfig) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The native (config.json, metadata.json, config.yaml text) trio, written like the release.

    Non-released values of the fields the release hard-codes are added to metadata.json kwargs (an h3engine
    extension, absent from released files) so that tiny checkpoints round-trip through `config_from_native`.
    """
    config_json = {
        "_class_name": NATIVE_CLASS_NAME,
        "_diffusers_version": NATIVE_DIFFUSERS_VERSION,
        "auto_map": dict(NATIVE_AUTO_MAP),
        "latent_channels": config.latent_channels,
        "latents_mean": list(config.latents_mean),
        "latents_std": list(config.latents_std),
        "output_channel": STEREO_CHANNELS,
        "sample_rate": config.sampling_rate,
        "source_config_path": "config.yaml",
        "source_metadata_path": "metadata.json",
        "source_safetensors_path": "model.safetensors",
    }
    kwargs: dict[str, Any] = {
        "attn_proj": True,
        "decoder_dim": config.decoder_dim,
        "decoder_rates": list(config.decoder_rates),
        "decoder_type": NATIVE_DECODER_TYPE,
        "encoder_dim": config.encoder_dim,
        "encoder_rates": list(config.encoder_rates),
        "latent_dim": config.latent_dim,
        "sample_rate": config.sampling_rate,
        "vae_latent_channels": config.latent_channels,
    }
    if config.num_attention_heads != RELEASED_NUM_ATTENTION_HEADS:
        kwargs["num_attention_heads"] = config.num_attention_heads
    if config.decoder_kernel_sizes != tuple(
        released_decoder_kernel_size(rate) for rate in config.decoder_rates
    ):
        kwargs["decoder_kernel_sizes"] = list(config.decoder_kernel_sizes)
    if config.resblock_kernel_sizes != RELEASED_RESBLOCK_KERNEL_SIZES:
        kwargs["resblock_kernel_sizes"] = list(config.resblock_kernel_sizes)
    if config.resblock_dilation_sizes != RELEASED_RESBLOCK_DILATION_SIZES:
        kwargs["resblock_dilation_sizes"] = [list(dilations) for dilations in config.resblock_dilation_sizes]
    config_yaml = (
        "model_config:\n"
        f"  sr: {config.sampling_rate}\n"
        f"  decoder_dim: {config.decoder_dim}\n"
        "  audio_channel: 1\n"
        f"  vae_latent_channels: {config.latent_channels}\n"
    )
    return config_json, {"metadata": {"kwargs": kwargs}}, config_yaml


def config_to_diffusers(config: AudioVAEConfig) -> dict[str, Any]:
    """A diffusers config.json dict accepted by `AutoencoderKLMiniMaxH3Audio.from_config`."""
    return {
        "_class_name": DIFFUSERS_CLASS_NAME,
        "_diffusers_version": DIFFUSERS_VERSION,
        "encoder_dim": config.encoder_dim,
        "encoder_rates": list(config.encoder_rates),
        "latent_dim": config.latent_dim,
        "latent_channels": config.latent_channels,
        "num_attention_heads": config.num_attention_heads,
        "decoder_dim": config.decoder_dim,
        "decoder_rates": list(config.decoder_rates),
        "decoder_kernel_sizes": list(config.decoder_kernel_sizes),
        "resblock_kernel_sizes": list(config.resblock_kernel_sizes),
        "resblock_dilation_sizes": [list(dilations) for dilations in config.resblock_dilation_sizes],
        "sampling_rate": config.sampling_rate,
        "latents_mean": list(config.latents_mean),
        "latents_std": list(config.latents_std),
    }
