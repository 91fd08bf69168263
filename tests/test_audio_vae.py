"""Audio VAE parity against diffusers' AutoencoderKLMiniMaxH3Audio (fp32, tiny config) plus layout/config checks.

Weights flow random_native_state -> ours (strict load) and -> native_to_diffusers -> diffusers (strict load), so a
key, shape or math divergence fails here. Errors are max |ours - reference| / max |reference|.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from diffusers import AutoencoderKLMiniMaxH3Audio
from diffusers.models.autoencoders.autoencoder_kl_minimax_h3_audio import kaiser_sinc_filter1d

from h3engine.checkpoint import audio_vae_format
from h3engine.checkpoint.audio_vae_keys import diffusers_to_native, native_to_diffusers, random_native_state
from h3engine.errors import CheckpointError
from h3engine.models.audio_vae import (
    RELEASED_LATENTS_MEAN,
    RELEASED_LATENTS_STD,
    AudioVAE,
    AudioVAEConfig,
    anti_alias_filter,
)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")

MAX_RELATIVE_ERROR = 1e-5
RELEASED_KEY_COUNT = 1087
RELEASED_ELEMENT_COUNT = 151_326_585


def max_relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def make_waveform(batch: int, samples: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    time = torch.arange(samples, dtype=torch.float32)
    tone = 0.5 * torch.sin(0.07 * time + torch.rand(batch, 1, 1, generator=generator) * 6.28)
    return (tone + 0.2 * torch.randn(batch, 1, samples, generator=generator)).clamp(-1, 1)


def varied_config() -> AudioVAEConfig:
    """Tiny, but with what the tiny config (docs/MODEL.md §10) leaves out: odd strides, two AMP kernels, two
    dilations each."""
    return dataclasses.replace(
        AudioVAEConfig.tiny(),
        encoder_rates=(3, 2),
        decoder_rates=(2, 3),
        decoder_kernel_sizes=(4, 5),
        resblock_kernel_sizes=(3, 5),
        resblock_dilation_sizes=((1, 3), (1, 2)),
    )


def build_pair(config: AudioVAEConfig) -> tuple[AudioVAE, AutoencoderKLMiniMaxH3Audio]:
    """Ours and diffusers' model, both strictly loaded with the same random native state."""
    native_state = random_native_state(config, seed=0)
    ours = AudioVAE(config).eval()
    ours.load_state_dict(native_state, strict=True)
    reference = AutoencoderKLMiniMaxH3Audio.from_config(audio_vae_format.config_to_diffusers(config)).eval()
    reference.load_state_dict(native_to_diffusers(native_state), strict=True)
    return ours, reference


@pytest.fixture(scope="module", params=["tiny", "varied"])
def model_pair(request: pytest.FixtureRequest) -> tuple[AudioVAE, AutoencoderKLMiniMaxH3Audio]:
    return build_pair(AudioVAEConfig.tiny() if request.param == "tiny" else varied_config())


@torch.no_grad()
def test_encode_matches_diffusers(model_pair: tuple[AudioVAE, AutoencoderKLMiniMaxH3Audio]) -> None:
    ours, reference = model_pair
    hop = ours.config.hop_length
    samples = 25 * hop + 3  # not a hop multiple: exercises the right-padding
    waveform = make_waveform(batch=2, samples=samples, seed=1)
    expected = reference.encode(waveform).latent_dist.mode()
    latents = ours.encode(waveform)
    assert latents.shape == (2, 4, 26) and latents.dtype == torch.float32
    error = max_relative_error(latents, expected)
    print(f"encode max relative error (hop {hop}): {error:.3e}")
    assert error <= MAX_RELATIVE_ERROR


@torch.no_grad()
def test_decode_matches_diffusers(model_pair: tuple[AudioVAE, AutoencoderKLMiniMaxH3Audio]) -> None:
    ours, reference = model_pair
    hop = ours.config.hop_length
    latents = torch.randn(2, 4, 24, generator=torch.Generator().manual_seed(2))
    expected = reference.decode(latents).sample
    # The clamp would hide errors in saturated samples: the random weights keep nearly all of them inside.
    assert (expected.abs() >= 1).float().mean() < 0.02 and expected.abs().max() > 0.1
    waveform = ours.decode(latents)
    assert waveform.shape == (2, 1, 24 * hop) and waveform.dtype == torch.float32
    error = max_relative_error(waveform, expected)
    print(f"decode max relative error (hop {hop}): {error:.3e}")
    assert error <= MAX_RELATIVE_ERROR


@torch.no_grad()
def test_fold_weight_norm_keeps_results_and_is_dropped_on_load() -> None:
    config = AudioVAEConfig.tiny()
    model = AudioVAE(config)
    model.load_state_dict(random_native_state(config, seed=0))
    waveform, latents = make_waveform(2, 64, seed=3), torch.randn(2, 4, 16)
    unfolded = model.encode(waveform), model.decode(latents)
    model.fold_weight_norm()
    assert max_relative_error(model.encode(waveform), unfolded[0]) <= MAX_RELATIVE_ERROR
    assert max_relative_error(model.decode(latents), unfolded[1]) <= MAX_RELATIVE_ERROR

    other_state = random_native_state(config, seed=5)
    model.load_state_dict(other_state)
    fresh = AudioVAE(config)
    fresh.load_state_dict(other_state)
    assert torch.equal(model.decode(latents), fresh.decode(latents))


@torch.no_grad()
def test_stereo_helpers_and_latent_normalization() -> None:
    ours, reference = build_pair(AudioVAEConfig.tiny())
    hop = AudioVAEConfig.tiny().hop_length
    stereo = make_waveform(2, 12 * hop + 50, seed=4)[:, 0]
    latents = ours.encode_stereo(stereo)
    assert latents.shape == (2, 4, 13)  # right-padded to a whole hop
    assert torch.equal(latents, ours.encode(stereo[:, None]))
    decoded = ours.decode_stereo(latents)
    assert decoded.shape == (2, 13 * hop)
    assert torch.equal(decoded, ours.decode(latents)[:, 0])
    with pytest.raises(ValueError):
        ours.encode_stereo(stereo[:1])

    # The reference pipeline normalizes rows [A, C] with fp32 stats built from the config lists.
    mean = torch.tensor(reference.config.latents_mean).view(1, 1, -1)
    std = torch.tensor(reference.config.latents_std).view(1, 1, -1)
    normalized = ours.normalize_latents(latents)
    assert torch.equal(normalized, ((latents.transpose(1, 2) - mean) / std).transpose(1, 2))
    assert torch.equal(
        ours.denormalize_latents(normalized), normalized * std.view(1, -1, 1) + mean.view(1, -1, 1)
    )
    assert max_relative_error(ours.denormalize_latents(normalized), latents) <= 1e-6


def test_released_layout_on_meta_matches_diffusers() -> None:
    config = AudioVAEConfig.released()
    with torch.device("meta"):
        ours = AudioVAE(config).state_dict()
        reference = AutoencoderKLMiniMaxH3Audio.from_config(
            audio_vae_format.config_to_diffusers(config)
        ).state_dict()
    assert len(ours) == RELEASED_KEY_COUNT
    assert sum(tensor.numel() for tensor in ours.values()) == RELEASED_ELEMENT_COUNT
    assert all(tensor.dtype == torch.float32 for tensor in ours.values())
    converted = native_to_diffusers(ours)
    assert set(converted) == set(reference)
    assert all(converted[key].shape == reference[key].shape for key in reference)
    back = diffusers_to_native(converted)
    assert back.keys() == ours.keys() and all(back[key] is ours[key] for key in ours)
    assert ours["decoder.ups.0.0.weight_g"].shape == (1024, 1, 1)  # transposed conv: g over input channels


def test_filters_match_the_reference() -> None:
    assert torch.equal(anti_alias_filter(), kaiser_sinc_filter1d(cutoff=0.25, half_width=0.3, kernel_size=12))
    config = AudioVAEConfig.tiny()
    fresh_reference = AutoencoderKLMiniMaxH3Audio.from_config(
        audio_vae_format.config_to_diffusers(config)
    ).state_dict()
    fresh_ours = AudioVAE(config).state_dict()
    state = random_native_state(config, seed=0)
    filter_keys = [key for key in state if key.endswith(".filter")]
    stages = len(config.decoder_rates)
    assert len(filter_keys) == 2 * (stages * 2 + 1)  # (stages x 2 activations + activation_post) x up/down
    for key in filter_keys:
        assert torch.equal(state[key], fresh_reference[key]) and torch.equal(
            fresh_ours[key], fresh_reference[key]
        )


def test_random_native_state_is_deterministic_and_non_trivial() -> None:
    config = AudioVAEConfig.tiny()
    first, again, other = (random_native_state(config, seed) for seed in (0, 0, 1))
    assert first.keys() == AudioVAE(config).state_dict().keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first)
    assert all(tensor.dtype == torch.float32 for tensor in first.values())
    for key, tensor in first.items():
        if key.endswith(("alpha", "beta", "weight_g", "bias")) and not key.endswith("zero_k_bias"):
            assert tensor.abs().min() > 0, key
    assert torch.count_nonzero(first["pre_block.attn.zero_k_bias"]) == 0


def test_config_round_trips() -> None:
    released = AudioVAEConfig.released()
    config_json, metadata_json, config_yaml = audio_vae_format.config_to_native(released)
    assert metadata_json == {
        "metadata": {
            "kwargs": {
                "attn_proj": True,
                "decoder_dim": 1024,
                "decoder_rates": [5, 5, 2, 2, 2, 2, 2],
                "decoder_type": "bigvgan",
                "encoder_dim": 64,
                "encoder_rates": [2, 4, 4, 5, 5],
                "latent_dim": 2048,
                "sample_rate": 32000,
                "vae_latent_channels": 32,
            }
        }
    }
    assert yaml.safe_load(config_yaml) == {
        "model_config": {"sr": 32000, "decoder_dim": 1024, "audio_channel": 1, "vae_latent_channels": 32}
    }
    assert config_json["latents_mean"] == list(RELEASED_LATENTS_MEAN) and len(RELEASED_LATENTS_STD) == 32
    assert (
        audio_vae_format.config_from_native(config_json, metadata_json, yaml.safe_load(config_yaml))
        == released
    )
    assert audio_vae_format.config_from_native(config_json, metadata_json) == released

    diffusers_config = audio_vae_format.config_to_diffusers(released)
    assert diffusers_config["decoder_kernel_sizes"] == [9, 9, 4, 4, 4, 4, 4]
    assert diffusers_config["resblock_dilation_sizes"] == [[1, 3, 5]] * 3
    assert audio_vae_format.config_from_diffusers(diffusers_config) == released

    tiny = AudioVAEConfig.tiny()
    assert audio_vae_format.config_from_native(*audio_vae_format.config_to_native(tiny)[:2]) == tiny
    assert audio_vae_format.config_from_diffusers(audio_vae_format.config_to_diffusers(tiny)) == tiny
    with torch.device("meta"):
        reference_config = AutoencoderKLMiniMaxH3Audio.from_config(
            audio_vae_format.config_to_diffusers(tiny)
        ).config
    assert audio_vae_format.config_from_diffusers(dict(reference_config)) == tiny


def test_bad_checkpoints_raise_checkpoint_error() -> None:
    state = {"encoder.block.0.weight_g": torch.zeros(4, 1, 1, device="meta")}
    assert native_to_diffusers(state).keys() == state.keys()
    with pytest.raises(CheckpointError, match="decoder.mystery"):
        native_to_diffusers({"decoder.mystery.weight": torch.zeros(1, device="meta")})
    with pytest.raises(CheckpointError, match="float32"):
        diffusers_to_native({"mean_proj.bias": torch.zeros(4, dtype=torch.bfloat16)})

    config_json, metadata_json, config_yaml = audio_vae_format.config_to_native(AudioVAEConfig.released())
    with pytest.raises(CheckpointError, match="latent_channels"):
        audio_vae_format.config_from_native({**config_json, "latent_channels": 16}, metadata_json)
    with pytest.raises(CheckpointError, match="latents_std"):
        audio_vae_format.config_from_native({**config_json, "latents_std": [1.0] * 31}, metadata_json)
    wrong_yaml = {"model_config": {**yaml.safe_load(config_yaml)["model_config"], "sr": 16000}}
    with pytest.raises(CheckpointError, match="sr"):
        audio_vae_format.config_from_native(config_json, metadata_json, wrong_yaml)
    with pytest.raises(CheckpointError, match="latents_mean"):
        audio_vae_format.config_from_diffusers({"latent_channels": 32})
