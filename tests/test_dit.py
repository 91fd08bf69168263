"""H3 DiT: parity with diffusers 0.42.1 (fp32 and the released bf16 recipe), config files, key maps, full size.

Errors are max |ours - reference| / max |reference| over each velocity (benchmarks/_packed_request.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from diffusers import MiniMaxH3Transformer3DModel

from benchmarks._packed_request import PackedRequest, max_relative_error
from h3engine.checkpoint.dit_format import (
    config_from_diffusers,
    config_from_native,
    config_to_diffusers,
    config_to_native,
    module_to_native,
    native_to_module,
)
from h3engine.checkpoint.dit_keys import (
    diffusers_to_native,
    native_state_shapes,
    native_to_diffusers,
    random_native_state,
)
from h3engine.engine.sampling import modulation as modulation_module
from h3engine.engine.sampling.modulation import clear_modulation_cache, offload_adaln, schedule_modulation
from h3engine.errors import CheckpointError
from h3engine.models.dit import FP32_PARAMETER_NAMES, H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import MultiAxisRope
from h3engine.models.kernels.reference.rope import rotate_first_channels

SEED = 1234
FP32_TOLERANCE = 1e-5
# One bf16 rounding done differently anywhere shows up at the bf16 recipe's own distance from fp32, far above this:
# the tolerance demands the same op sequence at every bf16 boundary and only leaves room for fp32-level noise
# (e.g. selecting rows before vs after the fp32 heads).
BF16_TOLERANCE = 1e-4


RELEASED_GLOBAL_SHAPES = {
    "video_patch_proj.weight": (5376, 96),
    "video_patch_proj.bias": (5376,),
    "audio_patch_proj.weight": (5376, 32),
    "audio_patch_proj.bias": (5376,),
    "condition_proj.weight": (5376, 5120),
    "condition_proj.bias": (5376,),
    "time_embedder.proj_in.weight": (5376, 256),
    "time_embedder.proj_in.bias": (5376,),
    "time_embedder.proj_out.weight": (2688, 5376),
    "time_embedder.proj_out.bias": (2688,),
    "rope.inv_freq": (16,),
    "token_refiner.final_norm.weight": (5376,),
    "final_layer.norm.weight": (5376,),
    "final_layer.adaln_proj.linear.weight": (10752, 2688),
    "final_layer.adaln_proj.linear.bias": (10752,),
    "final_layer.video_out.weight": (96, 5376),
    "final_layer.video_out.bias": (96,),
    "final_layer.audio_out.weight": (32, 5376),
    "final_layer.audio_out.bias": (32,),
}
RELEASED_REFINER_BLOCK_SHAPES = {
    "norm1.weight": (5376,),
    "attn.qkv_proj.weight": (21504, 5376),
    "attn.q_norm.weight": (128,),
    "attn.k_norm.weight": (128,),
    "attn.out_proj.weight": (5376, 7168),
    "norm2.weight": (5376,),
    "mlp.fc1.weight": (28672, 5376),
    "mlp.fc2.weight": (5376, 14336),
}
RELEASED_BLOCK_SHAPES = {
    **RELEASED_REFINER_BLOCK_SHAPES,
    "adaln_proj.linear.weight": (96768, 2688),
    "adaln_proj.linear.bias": (96768,),
}


def released_native_shapes() -> dict[str, tuple[int, ...]]:
    """docs/MODEL.md §1.2, written out independently of the model code."""
    shapes = dict(RELEASED_GLOBAL_SHAPES)
    for index in range(2):
        shapes.update(
            {f"token_refiner.blocks.{index}.{k}": v for k, v in RELEASED_REFINER_BLOCK_SHAPES.items()}
        )
    for index in range(50):
        shapes.update({f"blocks.{index}.{k}": v for k, v in RELEASED_BLOCK_SHAPES.items()})
    return shapes


def tiny_request(text_dtype: torch.dtype) -> PackedRequest:
    return tiny_fl2va_request(DiTConfig.tiny(), text_dtype, SEED + 1)


def our_model(state: dict[str, torch.Tensor], dtype: torch.dtype) -> H3DiT:
    model = H3DiT(DiTConfig.tiny(), dtype=dtype)
    model.load_state_dict(native_to_module(state, DiTConfig.tiny()), strict=True)
    return model.eval()


def diffusers_fp32_model(state: dict[str, torch.Tensor]) -> MiniMaxH3Transformer3DModel:
    model = MiniMaxH3Transformer3DModel.from_config(config_to_diffusers(DiTConfig.tiny()))
    model.load_state_dict(native_to_diffusers(state), strict=True)
    return model.eval()


def run_ours(model: H3DiT, request: PackedRequest) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(*request.as_h3_arguments())


def run_diffusers(
    model: MiniMaxH3Transformer3DModel, request: PackedRequest
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        video, audio = model(**request.as_diffusers_kwargs(), return_dict=False)
    return video[0], audio[0]


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return random_native_state(DiTConfig.tiny(), SEED)


# --------------------------------------------------------------------------------------------------------------
# Parity with diffusers
# --------------------------------------------------------------------------------------------------------------


def test_request_layout_is_realistic() -> None:
    request = tiny_request(torch.float32)
    assert request.timesteps.tolist() == pytest.approx([0.42, 0.67, 0.999])
    assert sorted(torch.cat((request.text_index, request.video_index, request.audio_index)).tolist()) == list(
        range(request.tags.numel())
    )
    # Every (timestep, modality) row kind of a real FL2VA request is present.
    pairs = set(zip(request.timestep_index.tolist(), request.tags.tolist(), strict=True))
    assert pairs == {(0, 1), (0, 0), (1, 2), (2, 0)}


def test_fp32_parity_with_diffusers(tiny_state: dict[str, torch.Tensor]) -> None:
    request = tiny_request(torch.float32)
    ours_video, ours_audio = run_ours(our_model(tiny_state, torch.float32), request)
    reference_video, reference_audio = run_diffusers(diffusers_fp32_model(tiny_state), request)
    assert ours_video.dtype == ours_audio.dtype == torch.float32
    assert ours_video.shape == reference_video.shape == request.video_rows.shape
    assert ours_audio.shape == reference_audio.shape == request.audio_rows.shape
    # Velocities are O(1): a vanishing output would make the relative error meaningless.
    assert 0.3 < reference_video.std().item() < 10 and 0.3 < reference_audio.std().item() < 10
    assert max_relative_error(ours_video, reference_video) <= FP32_TOLERANCE
    assert max_relative_error(ours_audio, reference_audio) <= FP32_TOLERANCE


def test_bf16_parity_with_diffusers_pipeline_cast(tiny_state: dict[str, torch.Tensor], tmp_path) -> None:
    # diffusers' pipeline loads with from_pretrained(torch_dtype=bfloat16), which keeps _keep_in_fp32_modules fp32.
    diffusers_fp32 = diffusers_fp32_model(tiny_state)
    diffusers_fp32.save_pretrained(tmp_path)
    diffusers_bf16 = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    fp32_in_diffusers = {name for name, p in diffusers_bf16.named_parameters() if p.dtype == torch.float32}
    fp32_native = {key: tiny_state[key] for key in FP32_PARAMETER_NAMES}
    assert fp32_in_diffusers == set(native_to_diffusers(fp32_native))
    assert diffusers_bf16.rope.inv_freq.dtype == torch.float32

    ours = our_model(tiny_state, torch.bfloat16)
    request = tiny_request(torch.bfloat16)
    ours_video, ours_audio = run_ours(ours, request)
    reference_video, reference_audio = run_diffusers(diffusers_bf16, request)
    assert ours_video.dtype == ours_audio.dtype == torch.float32
    video_error = max_relative_error(ours_video, reference_video)
    audio_error = max_relative_error(ours_audio, reference_audio)
    assert video_error <= BF16_TOLERANCE and audio_error <= BF16_TOLERANCE

    # The tolerance is meaningful only if it is far below the bf16 recipe's own distance from fp32.
    fp32_video, fp32_audio = run_diffusers(diffusers_fp32, tiny_request(torch.float32))
    assert max_relative_error(reference_video, fp32_video) > 10 * BF16_TOLERANCE
    assert max_relative_error(reference_audio, fp32_audio) > 10 * BF16_TOLERANCE


def test_no_block_is_an_identity(tiny_state: dict[str, torch.Tensor]) -> None:
    request = tiny_request(torch.float32)
    full_video, full_audio = run_ours(our_model(tiny_state, torch.float32), request)
    block_prefixes = [f"blocks.{i}." for i in range(DiTConfig.tiny().num_layers)] + [
        "token_refiner.blocks.0."
    ]
    for prefix in block_prefixes:
        for branch in ("attn.out_proj.weight", "mlp.fc2.weight"):
            state = dict(tiny_state)
            state[prefix + branch] = torch.zeros_like(state[prefix + branch])
            video, audio = run_ours(our_model(state, torch.float32), request)
            changed = max(max_relative_error(video, full_video), max_relative_error(audio, full_audio))
            assert changed > 1e-2, f"{prefix}{branch} barely matters ({changed:.2e})"


# --------------------------------------------------------------------------------------------------------------
# Layout conventions pinned independently of the model (parity alone cannot tell a consistently wrong pair)
# --------------------------------------------------------------------------------------------------------------


def test_qkv_rows_are_interleaved_per_head_and_fc1_is_gate_then_value() -> None:
    heads, head_dim, hidden, ffn = 3, 4, 5, 6
    row_labels = torch.arange(heads * 3 * head_dim, dtype=torch.float32)[:, None].expand(-1, hidden)
    fc1_labels = torch.arange(2 * ffn, dtype=torch.float32)[:, None].expand(-1, hidden)
    native = {
        "blocks.0.attn.qkv_proj.weight": row_labels,
        "blocks.0.attn.q_norm.weight": torch.ones(head_dim),
        "blocks.0.mlp.fc1.weight": fc1_labels,
    }
    converted = native_to_diffusers(native)
    for part, name in enumerate(("to_q", "to_k", "to_v")):
        expected = [h * 3 * head_dim + part * head_dim + d for h in range(heads) for d in range(head_dim)]
        assert converted[f"transformer_blocks.0.attn.{name}.weight"][:, 0].tolist() == expected
    # diffusers' SwiGLU multiplies silu(second half): the native gate (first half) must land there.
    assert converted["transformer_blocks.0.ff.net.0.proj.weight"][:, 0].tolist() == list(
        range(ffn, 2 * ffn)
    ) + list(range(ffn))


def test_rope_inverse_frequencies_follow_the_spec(tiny_state: dict[str, torch.Tensor]) -> None:
    # inv_freq[j] = 10000^(-2j/32), j = 0..15 (docs/MODEL.md §2.5), fp32.
    expected = torch.tensor([10000.0 ** (-(2 * j) / 32) for j in range(16)], dtype=torch.float64)
    released = MultiAxisRope(DiTConfig.released(), device="cpu").inv_freq
    assert released.dtype == torch.float32
    torch.testing.assert_close(released.double(), expected, rtol=1e-6, atol=0)
    tiny_expected = MultiAxisRope(DiTConfig.tiny(), device="cpu").inv_freq
    assert tiny_state["rope.inv_freq"].dtype == torch.float32
    assert torch.equal(tiny_state["rope.inv_freq"], tiny_expected)


def test_rope_rotates_pairs_c_and_c_plus_half_and_passes_the_tail() -> None:
    # Released: 96 of 128 channels rotated; channel c < 48 pairs with c + 48 (rotate-half, not interleaved).
    rope = MultiAxisRope(DiTConfig.released(), device="cpu")
    positions = torch.tensor([[3.0, 5.0, 7.0]], dtype=torch.float64)
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert cos.shape == (1, 96)
    hidden = torch.randn(1, 1, 128)
    rotated = rotate_first_channels(hidden, cos, sin)
    assert torch.equal(rotated[..., 96:], hidden[..., 96:])
    for channel, axis, frequency in ((0, 0, 0), (17, 1, 1), (47, 2, 15)):
        angle = positions[0, axis].item() * rope.inv_freq[frequency].item()
        c, s = torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))
        x1, x2 = hidden[0, 0, channel], hidden[0, 0, channel + 48]
        torch.testing.assert_close(rotated[0, 0, channel], x1 * c - x2 * s)
        torch.testing.assert_close(rotated[0, 0, channel + 48], x2 * c + x1 * s)


# --------------------------------------------------------------------------------------------------------------
# Key maps
# --------------------------------------------------------------------------------------------------------------


def test_key_map_round_trip_is_exact(tiny_state: dict[str, torch.Tensor]) -> None:
    converted = native_to_diffusers(tiny_state)
    reference_state = MiniMaxH3Transformer3DModel.from_config(
        config_to_diffusers(DiTConfig.tiny())
    ).state_dict()
    assert set(converted) == set(reference_state)
    assert all(converted[key].shape == reference_state[key].shape for key in converted)
    back = diffusers_to_native(converted, DiTConfig.tiny())
    assert set(back) == set(tiny_state)
    for key, tensor in tiny_state.items():
        assert back[key].dtype == tensor.dtype, key
        assert torch.equal(back[key], tensor), key


def test_key_maps_reject_unknown_and_incomplete_keys(tiny_state: dict[str, torch.Tensor]) -> None:
    with pytest.raises(CheckpointError, match="blocks.0.attn.bogus"):
        native_to_diffusers({"blocks.0.attn.bogus": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="token_refiner.blocks.0.adaln_proj"):
        native_to_diffusers({"token_refiner.blocks.0.adaln_proj.linear.bias": torch.zeros(1)})
    converted = native_to_diffusers(tiny_state)
    del converted["transformer_blocks.1.attn.to_k.weight"]
    with pytest.raises(CheckpointError, match="to_k"):
        diffusers_to_native(converted, DiTConfig.tiny())


def test_random_native_state_is_deterministic_in_released_dtypes(tiny_state: dict[str, torch.Tensor]) -> None:
    again = random_native_state(DiTConfig.tiny(), SEED)
    other = random_native_state(DiTConfig.tiny(), SEED + 1)
    assert list(again) == list(tiny_state) == list(native_state_shapes(DiTConfig.tiny()))
    assert all(torch.equal(again[key], tiny_state[key]) for key in tiny_state)
    assert not torch.equal(
        other["blocks.0.attn.qkv_proj.weight"], tiny_state["blocks.0.attn.qkv_proj.weight"]
    )
    for key, tensor in tiny_state.items():
        assert tensor.dtype == (torch.float32 if key in FP32_PARAMETER_NAMES else torch.bfloat16), key
    for key in ("blocks.0.norm1.weight", "blocks.1.attn.q_norm.weight", "final_layer.norm.weight"):
        weight = tiny_state[key].float()
        assert (weight - 1).abs().max() > 0.01 and (weight - 1).abs().max() < 0.5, key
    assert tiny_state["blocks.0.adaln_proj.linear.bias"].float().abs().min() > 0


# --------------------------------------------------------------------------------------------------------------
# Config files
# --------------------------------------------------------------------------------------------------------------


def test_config_round_trips_and_diffusers_accepts_it() -> None:
    for config in (DiTConfig.tiny(), DiTConfig.released()):
        assert config_from_native(config_to_native(config)) == config
        assert config_from_diffusers(config_to_diffusers(config)) == config
    model = MiniMaxH3Transformer3DModel.from_config(config_to_diffusers(DiTConfig.tiny()))
    assert config_from_diffusers(dict(model.config)) == DiTConfig.tiny()


def test_native_config_matches_the_release() -> None:
    native = config_to_native(DiTConfig.released())
    release = {
        "_class_name": "MiniMaxH3DiTModel",
        "hidden_size": 5376,
        "num_layers": 50,
        "token_refiner_num_layers": 2,
        "num_refiner_layers": 2,
        "num_attention_heads": 56,
        "attention_head_dim": 128,
        "ffn_hidden_size": 14336,
        "ffn_dim": 14336,
        "latents_dim": 24,
        "in_channels": 24,
        "audio_latents_dim": 32,
        "audio_in_channels": 32,
        "patch_size": [1, 2, 2],
        "text_dim": 5120,
        "timestep_input_dim": 256,
        "freq_dim": 256,
        "time_embed_hidden_size": 5376,
        "time_embed_hidden_dim": 5376,
        "time_embed_dim": 2688,
        "adaln_out_features": 96768,
        "final_adaln_out_features": 10752,
        "rope_inv_freq_len": 16,
        "rope_freq_dim": 16,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "qk_norm_eps": 1e-5,
        "final_norm_eps": 1e-5,
    }
    assert native == release
    # Only one alias of each field is enough.
    only_native_names = {
        k: v for k, v in release.items() if k not in ("num_refiner_layers", "ffn_dim", "freq_dim")
    }
    assert config_from_native(only_native_names) == DiTConfig.released()


def test_config_errors_name_the_field() -> None:
    native = config_to_native(DiTConfig.released())
    missing = {k: v for k, v in native.items() if k not in ("latents_dim", "in_channels")}
    with pytest.raises(CheckpointError, match="latents_dim.*in_channels"):
        config_from_native(missing, source="FL2VA/transformer/config.json")
    with pytest.raises(
        CheckpointError, match="FL2VA/transformer/config.json.*ffn_hidden_size=1.*ffn_dim=14336"
    ):
        config_from_native({**native, "ffn_hidden_size": 1}, source="FL2VA/transformer/config.json")
    with pytest.raises(CheckpointError, match="adaln_out_features"):
        config_from_native({**native, "adaln_out_features": 5})
    with pytest.raises(CheckpointError, match="_class_name"):
        config_from_native(config_to_diffusers(DiTConfig.released()))
    diffusers = config_to_diffusers(DiTConfig.released())
    with pytest.raises(CheckpointError, match="qk_norm_eps"):
        config_from_diffusers({k: v for k, v in diffusers.items() if k != "qk_norm_eps"})
    with pytest.raises(CheckpointError, match="rotated channels"):
        config_from_diffusers({**diffusers, "rope_freq_dim": 32})
    with pytest.raises(ValueError, match="head_dim must be even"):
        dataclasses.replace(DiTConfig.tiny(), head_dim=13)
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(DiTConfig.tiny(), num_layers=0)


# --------------------------------------------------------------------------------------------------------------
# Released size, on the meta device
# --------------------------------------------------------------------------------------------------------------


def test_released_model_on_meta_matches_the_native_checkpoint() -> None:
    model = H3DiT(DiTConfig.released(), device="meta")
    state = model.state_dict()
    expected_shapes = released_native_shapes()
    assert set(state) == set(expected_shapes)
    assert {key: tuple(tensor.shape) for key, tensor in state.items()} == expected_shapes
    assert sum(parameter.numel() for parameter in model.parameters()) == 33_122_992_896

    fp32_keys = {key for key, tensor in state.items() if tensor.dtype == torch.float32}
    assert fp32_keys == FP32_PARAMETER_NAMES
    assert len(FP32_PARAMETER_NAMES - {"rope.inv_freq"}) == 12
    assert {tensor.dtype for key, tensor in state.items() if key not in fp32_keys} == {torch.bfloat16}
    fp32_parameters = sum(state[key].numel() for key in FP32_PARAMETER_NAMES - {"rope.inv_freq"})
    assert fp32_parameters == 17_222_144
    stored_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    assert stored_bytes == 66_280_430_144

    with torch.device("meta"):
        reference = MiniMaxH3Transformer3DModel.from_config(config_to_diffusers(DiTConfig.released()))
    reference_shapes = {key: tuple(tensor.shape) for key, tensor in reference.state_dict().items()}
    converted = native_to_diffusers(state)
    assert {key: tuple(tensor.shape) for key, tensor in converted.items()} == reference_shapes
    back = diffusers_to_native(converted)
    assert {key: (tuple(t.shape), t.dtype) for key, t in back.items()} == {
        key: (tuple(t.shape), t.dtype) for key, t in state.items()
    }


def test_state_dict_round_trips_the_checkpoint_qkv_order(tiny_state: dict[str, torch.Tensor]) -> None:
    # QKV rows are stacked in memory; the converters speak the checkpoint's per-head interleaved order.
    model = H3DiT(DiTConfig.tiny(), dtype=torch.float32)
    model.load_state_dict(native_to_module(tiny_state, DiTConfig.tiny()), strict=True)
    saved = module_to_native(model.state_dict(), DiTConfig.tiny())
    for key, tensor in tiny_state.items():
        assert torch.equal(saved[key].to(tensor.dtype), tensor), key
    stacked = model.blocks[0].attn.qkv_proj.weight
    interleaved = tiny_state["blocks.0.attn.qkv_proj.weight"].float()
    assert not torch.equal(stacked, interleaved)
    heads, head_dim = DiTConfig.tiny().num_heads, DiTConfig.tiny().head_dim
    # head 1's key rows sit at [1, k] in the file and at [k, 1] in memory
    assert torch.equal(
        stacked[(heads + 1) * head_dim : (heads + 2) * head_dim],
        interleaved[(3 + 1) * head_dim : (3 + 2) * head_dim],
    )


# --------------------------------------------------------------------------------------------------------------
# AdaLN modulation cache
# --------------------------------------------------------------------------------------------------------------


def _step_timesteps() -> list[torch.Tensor]:
    return [
        torch.tensor([0.999, 0.42, 0.67]),
        torch.tensor([0.999, 0.5, 0.7]),
        torch.tensor([0.999, 0.61, 0.8]),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_schedule_modulation_gives_the_per_forward_tables_and_outputs(tiny_state, dtype) -> None:
    model = our_model(tiny_state, dtype)
    request = tiny_request(dtype)
    steps = _step_timesteps()
    with torch.no_grad():
        tables = schedule_modulation(model, steps, torch.device("cpu"))
        for timesteps, step_tables in zip(steps, tables, strict=True):
            direct = model.modulation(timesteps)
            for cached, computed in zip(step_tables.blocks, direct.blocks, strict=True):
                for name in (
                    "shift_attn",
                    "scale_plus_one_attn",
                    "gate_attn",
                    "shift_ffn",
                    "scale_plus_one_ffn",
                ):
                    assert torch.equal(getattr(cached, name), getattr(computed, name))
                assert torch.equal(cached.gate_ffn, computed.gate_ffn)
            assert all(torch.equal(a, b) for a, b in zip(step_tables.final, direct.final, strict=True))
        # A forward fed the cached tables equals the plain forward at the same timesteps ...
        arguments = request.as_h3_arguments()
        timesteps = arguments[3]
        plain = model(*arguments)
        cached = model(*arguments, modulation=schedule_modulation(model, [timesteps], torch.device("cpu"))[0])
        assert torch.equal(plain[0], cached[0]) and torch.equal(plain[1], cached[1])
        # ... and tables of other timesteps give another output (the tables are really used).
        other = model(*arguments, modulation=tables[1])
        assert not torch.equal(other[0], plain[0])


def test_modulation_cache_hits_and_is_cleared_by_loading(tiny_state) -> None:
    model = our_model(tiny_state, torch.float32)
    steps = _step_timesteps()
    with torch.no_grad():
        first = schedule_modulation(model, steps, torch.device("cpu"))
        again = schedule_modulation(model, [t.clone() for t in steps], torch.device("cpu"))
        assert again.source == "memory" and all(a is b for a, b in zip(again, first, strict=True))
        model.load_state_dict(native_to_module(tiny_state, DiTConfig.tiny()))
        reloaded = schedule_modulation(model, steps, torch.device("cpu"))
        assert reloaded.source == "computed" and reloaded[0] is not first[0]
        # Old schedules are evicted beyond the cache size.
        for shift in range(4):
            schedule_modulation(model, [t * (0.5 + 0.1 * shift) for t in steps], torch.device("cpu"))
        assert len(modulation_module._caches[model]) == 2


def test_offloaded_adaln_gives_the_same_tables(tiny_state) -> None:
    model = our_model(tiny_state, torch.float32)
    steps = _step_timesteps()
    with torch.no_grad():
        resident = schedule_modulation(model, steps, torch.device("cpu"))
        offload_adaln(model)
        offloaded = schedule_modulation(model, steps, torch.device("cpu"))
    assert offloaded is not resident
    for a, b in zip(resident, offloaded, strict=True):
        assert all(torch.equal(x.gate_attn, y.gate_attn) for x, y in zip(a.blocks, b.blocks, strict=True))
        assert torch.equal(a.final[0], b.final[0])


@pytest.mark.cuda
def test_offloaded_adaln_on_the_gpu_matches_the_resident_model(tiny_state) -> None:
    device = torch.device("cuda")
    model = our_model(tiny_state, torch.bfloat16).to(device)
    request = tiny_request(torch.bfloat16)
    arguments = [t.to(device) for t in request.as_h3_arguments()]
    with torch.no_grad():
        expected = model(*arguments)
        offload_adaln(model)
        assert all(p.device.type == "cpu" for p in model.blocks[0].adaln_proj.parameters())
        assert model.blocks[0].attn.qkv_proj.weight.device.type == "cuda"
        tables = schedule_modulation(model, [request.timesteps], device)[0]
        actual = model(*arguments, modulation=tables)
    assert torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])


@pytest.mark.cuda
def test_tables_built_on_their_own_stream_are_waited_for(tiny_state, monkeypatch) -> None:
    # A schedule's tables are built on a stream of their own while the forward is queued on the current one. Here
    # each projection's streaming starts with a GPU sleep on the building stream, so a forward that did not
    # wait for its tables would read them before they exist.
    device = torch.device("cuda")
    model = our_model(tiny_state, torch.bfloat16).to(device)
    offload_adaln(model)
    request = tiny_request(torch.bfloat16)
    arguments = [t.to(device) for t in request.as_h3_arguments()]
    timesteps = [request.timesteps]
    with torch.no_grad():
        settled = schedule_modulation(model, timesteps, device)[0]
        torch.cuda.synchronize()
        expected = model(*arguments, modulation=settled)
        torch.cuda.synchronize()
        clear_modulation_cache(model)  # `settled` stays referenced: the new tables get other memory

        streamed = modulation_module._on_device

        def slow_on_device(linear: torch.nn.Linear, to: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            torch.cuda._sleep(50_000_000)
            return streamed(linear, to)

        monkeypatch.setattr(modulation_module, "_on_device", slow_on_device)
        tables = schedule_modulation(model, timesteps, device)[0]
        assert tables is not settled and tables.blocks[-1].ready is not None
        assert not tables.final_ready.query()  # still being built when the forward is queued
        actual = model(*arguments, modulation=tables)
    assert torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])
