"""Parity of h3engine's video VAE with diffusers' AutoencoderKLMiniMaxH3 (fp32, tiny config), key maps and configs.

Weights: `random_native_state` (native keys) -> our module directly, and -> `native_to_diffusers` -> diffusers with a
strict load. Canvases are small (32x48 and 40x56 px at spatial ratio 4) and tiles are shrunk to 32 px with a 16 px
minimum overlap so that spatial stitching (including the round-robin overlap widening) is exercised.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLMiniMaxH3

from h3engine.checkpoint import video_vae_format, video_vae_keys
from h3engine.errors import CheckpointError
from h3engine.models import ops
from h3engine.models.video_vae import (
    DecodePlan,
    DecodeTile,
    VideoVAE,
    VideoVAEConfig,
    decode_autocast,
    tile_layout,
)

MAX_RELATIVE_ERROR = 1e-5
SMALL_TILE, SMALL_OVERLAP = 32, 16
RELEASED_NATIVE_KEYS = 560
RELEASED_NATIVE_ELEMENTS = 2_603_871_032


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(scope="module")
def tiny_config() -> VideoVAEConfig:
    return VideoVAEConfig.tiny()


def build_pair(
    config: VideoVAEConfig, native: dict[str, torch.Tensor]
) -> tuple[VideoVAE, AutoencoderKLMiniMaxH3]:
    ours = VideoVAE(config).eval()
    ours.load_state_dict(native, strict=True)
    reference = AutoencoderKLMiniMaxH3.from_config(video_vae_format.config_to_diffusers(config)).eval()
    reference.load_state_dict(video_vae_keys.native_to_diffusers(native, config), strict=True)
    return ours, reference


@pytest.fixture(scope="module")
def models(tiny_config: VideoVAEConfig) -> tuple[VideoVAE, AutoencoderKLMiniMaxH3]:
    return build_pair(tiny_config, video_vae_keys.random_native_state(tiny_config, seed=7))


def set_tiling(ours: VideoVAE, reference: AutoencoderKLMiniMaxH3, tiled: bool) -> None:
    if tiled:
        ours.set_tiling(True, SMALL_TILE, SMALL_OVERLAP)
        reference.enable_tiling(SMALL_TILE, SMALL_TILE, SMALL_OVERLAP, SMALL_OVERLAP)
    else:
        ours.set_tiling(False)
        reference.disable_tiling()


def random_pixels(batch: int, frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return VideoVAE.from_unit_range(torch.rand(batch, 3, frames, height, width, generator=generator))


# ---------------------------------------------------------------------------------------------------- tiling layout


def test_tile_layout_matches_diffusers(models: tuple[VideoVAE, AutoencoderKLMiniMaxH3]) -> None:
    _, reference = models
    ratio = reference.spatial_compression_ratio
    for tile, overlap in ((32, 16), (256, 64), (64, 8)):
        for length in range(1, 900):
            expected_starts, expected_lengths, expected_overlaps = reference._split_tiles(
                length, tile, overlap
            )
            starts, size, overlaps = tile_layout(length, tile, overlap, ratio)
            assert (starts, overlaps) == (expected_starts, expected_overlaps)
            assert expected_lengths == [size] * len(starts)
    # The released figures of docs/MODEL.md §5.2.
    assert tile_layout(768, 256, 64, 16)[2] == [96, 80, 80]
    assert tile_layout(1344, 256, 64, 16)[2] == [80, 80, 80, 80, 64, 64]


# ---------------------------------------------------------------------------------------------------- encode


@pytest.mark.parametrize(
    ("batch", "frames", "height", "width", "tiled"),
    [
        (1, 1, 40, 56, False),
        (1, 1, 40, 56, True),  # 2 x 3 tiles, overlaps widened to [24] and [20, 20]
        (
            2,
            22,
            32,
            48,
            False,
        ),  # two 17-frame clips (the second padded by repetition), last 3 latents dropped
        (1, 22, 32, 48, True),
        (1, 39, 32, 48, False),
        (1, 39, 40, 56, True),  # three clips, 2 x 3 tiles each
    ],
)
def test_encode_matches_diffusers(
    models: tuple[VideoVAE, AutoencoderKLMiniMaxH3],
    batch: int,
    frames: int,
    height: int,
    width: int,
    tiled: bool,
) -> None:
    ours, reference = models
    set_tiling(ours, reference, tiled)
    pixels = random_pixels(batch, frames, height, width, seed=frames + height)
    with torch.no_grad():
        mean, logvar = ours.encode(pixels)
        posterior = reference.encode(pixels).latent_dist
    latent_frames = 1 if frames == 1 else 5 * math.ceil(frames / 17) - 3
    assert mean.shape == logvar.shape == (batch, 4, latent_frames, height // 4, width // 4)
    assert relative_error(mean, posterior.mean) <= MAX_RELATIVE_ERROR
    assert relative_error(logvar, posterior.logvar) <= MAX_RELATIVE_ERROR


def test_logvar_clamp_matches_diffusers(tiny_config: VideoVAEConfig) -> None:
    native = video_vae_keys.random_native_state(tiny_config, seed=5)
    # Push half of the logvar channels above 20 and half below -30 so that both clamp bounds are hit.
    logvar_bias = native["quant_conv.bias"][tiny_config.latent_channels :]
    logvar_bias += torch.tensor([60.0, -60.0, 60.0, -60.0])
    ours, reference = build_pair(tiny_config, native)
    pixels = random_pixels(1, 1, 32, 48, seed=5)
    with torch.no_grad():
        _, logvar = ours.encode(pixels)
        expected = reference.encode(pixels).latent_dist.logvar
    assert logvar.max().item() == 20.0 and logvar.min().item() == -30.0
    assert relative_error(logvar, expected) <= MAX_RELATIVE_ERROR


def test_posterior_sample_matches_diffusers(models: tuple[VideoVAE, AutoencoderKLMiniMaxH3]) -> None:
    ours, reference = models
    set_tiling(ours, reference, False)
    pixels = random_pixels(2, 1, 32, 48, seed=3)
    with torch.no_grad():
        mean, logvar = ours.encode(pixels)
        expected = reference.encode(pixels).latent_dist.sample(generator=torch.Generator().manual_seed(42))
    sample = VideoVAE.sample_posterior(mean, logvar, torch.Generator().manual_seed(42))
    assert relative_error(sample, expected) <= MAX_RELATIVE_ERROR
    assert not torch.equal(sample, mean)


# ---------------------------------------------------------------------------------------------------- decode


# 3 and 8 are not 5n+2 (padded, surplus frames cut); 3 and 7 give one window, 8 and 12 two windows.
@pytest.mark.parametrize(("batch", "latent_frames"), [(1, 3), (1, 7), (2, 8), (1, 12)])
def test_decode_matches_diffusers(
    models: tuple[VideoVAE, AutoencoderKLMiniMaxH3], batch: int, latent_frames: int
) -> None:
    ours, reference = models
    latents = torch.randn(
        batch, 4, latent_frames, 10, 14, generator=torch.Generator().manual_seed(latent_frames)
    )
    outputs = {}
    for tiled in (False, True):  # tiled: 2 x 3 tiles of 32 px over the 40 x 56 px canvas
        set_tiling(ours, reference, tiled)
        with torch.no_grad():
            outputs[tiled] = ours.decode(latents)
            expected = reference.decode(latents).sample
        assert outputs[tiled].shape == expected.shape
        assert relative_error(outputs[tiled], expected) <= MAX_RELATIVE_ERROR
        # The same frames piece by piece (one per window, and the last window's tail), final as they come.
        with torch.no_grad():
            pieces = list(ours.decode_pieces(latents))
        windows = ours.plan_decode(latents.shape).window_count
        assert len(pieces) == windows + (ours.config.token_drop > 0) and windows == 1 + (latent_frames > 7)
        assert torch.equal(torch.cat(pieces, dim=2), outputs[tiled])
        assert ours.decoded_video_shape(latents.shape) == tuple(outputs[tiled].shape[2:])
    decoded_frames = {3: 9, 7: 22, 8: 26, 12: 39}[latent_frames]
    assert outputs[True].shape == (batch, 3, decoded_frames, 40, 56)
    # Tiling is part of the function (positions are per tile), so the two must differ.
    assert relative_error(outputs[True], outputs[False]) > 1e-3


def test_decoder_calls_batch_the_tiles_of_one_window(models: tuple[VideoVAE, AutoencoderKLMiniMaxH3]) -> None:
    ours, _ = models
    ours.set_tiling(True, SMALL_TILE, SMALL_OVERLAP)
    plan = ours.plan_decode((1, 4, 12, 10, 14))  # two windows of 2 x 3 tiles
    assert plan.call_batches(16) == (range(0, 6), range(6, 12))
    assert plan.call_batches(4) == (range(0, 3), range(3, 6), range(6, 9), range(9, 12))  # split evenly
    assert plan.call_batches(5) == (range(0, 3), range(3, 6), range(6, 9), range(9, 12))
    assert plan.call_batches(1) == tuple(range(index, index + 1) for index in range(12))
    with pytest.raises(ValueError, match="at least one tile"):
        plan.call_batches(0)
    # Tiles of another extent (a shortened last column) never share a call with the others.
    tile = DecodeTile(frames=(0, 7), rows=(0, 8), columns=(0, 8))
    short = DecodeTile(frames=(0, 7), rows=(0, 8), columns=(8, 12))
    uneven = DecodePlan(1, 0, 1, (1, 5), (), (16,) * 4, (tile, tile, tile, tile, short))
    assert uneven.call_batches(3) == (range(0, 2), range(2, 4), range(4, 5))


def test_batched_decoder_calls_equal_one_tile_per_call(
    models: tuple[VideoVAE, AutoencoderKLMiniMaxH3],
) -> None:
    ours, _ = models
    ours.set_tiling(True, SMALL_TILE, SMALL_OVERLAP)
    latents = torch.randn(2, 4, 8, 10, 14, generator=torch.Generator().manual_seed(3))
    outputs = {}
    try:
        for tiles_per_call in (1, 4, 16):
            ours.decode_batch_tiles = tiles_per_call
            with torch.no_grad():
                outputs[tiles_per_call] = ours.decode(latents)
        plan = ours.plan_decode(latents.shape)
        prepared = ours.prepare_decode_latents(latents, plan)
        with pytest.raises(ValueError, match="not whole decoder calls"):
            ours.decode_tiles(prepared, plan, range(0, 2))  # two of the window's 6 tiles (one call of 6)
    finally:
        ours.decode_batch_tiles = VideoVAE(ours.config).decode_batch_tiles
    # Each sample of a call is its own tile (attention never mixes the batch): equal up to fp32 summation order.
    assert relative_error(outputs[4], outputs[1]) <= 1e-6
    assert relative_error(outputs[16], outputs[1]) <= 1e-6
    with pytest.raises(ValueError, match="tiles of one extent"):
        ours.decode_batch(prepared, [plan.tiles[0], DecodeTile(frames=(0, 7), rows=(0, 4), columns=(0, 8))])


@pytest.mark.cuda
def test_batched_decoder_calls_on_cuda_under_the_fp16_recipe(tiny_config: VideoVAEConfig) -> None:
    ours = VideoVAE(tiny_config).eval()
    ours.load_state_dict(video_vae_keys.random_native_state(tiny_config, seed=7), strict=True)
    ours = ours.cuda()
    ours.set_tiling(True, SMALL_TILE, SMALL_OVERLAP)
    latents = torch.randn(1, 4, 12, 10, 14, generator=torch.Generator().manual_seed(5)).cuda()
    outputs = {}
    for tiles_per_call in (1, 6):  # each window: 6 tiles, one per call or all in one call
        ours.decode_batch_tiles = tiles_per_call
        with torch.no_grad():
            outputs[tiles_per_call] = ours.decode(latents, autocast_dtype=torch.float16)
    # The released recipe computes in fp16: batching may at most move a GEMM's fp16 rounding.
    assert relative_error(outputs[6], outputs[1]) <= 1e-3


def test_decode_matches_diffusers_with_two_rope_frequencies(tiny_config: VideoVAEConfig) -> None:
    # The tiny decoder (docs/MODEL.md §10) rotates 6 channels: one frequency per axis equal to 1, for which 2*pi*pos
    # is blind to a shift of the positions by 1 and to rope_theta. Head size 16 gives frequencies (1, 100^-0.5) per
    # axis.
    config = dataclasses.replace(tiny_config, decoder_attention_head_dim=16)
    ours, reference = build_pair(config, video_vae_keys.random_native_state(config, seed=9))
    set_tiling(ours, reference, True)
    latents = torch.randn(1, 4, 7, 10, 14, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert relative_error(ours.decode(latents), reference.decode(latents).sample) <= MAX_RELATIVE_ERROR


def released_width_vae(
    decoder_layers: int, seed: int
) -> tuple[VideoVAEConfig, dict[str, torch.Tensor], VideoVAE]:
    """The released VAE architecture with a few decoder blocks, random native weights: (config, state, model)."""
    config = dataclasses.replace(VideoVAEConfig.released(), decoder_num_layers=decoder_layers)
    native = video_vae_keys.random_native_state(config, seed=seed)
    with torch.device("meta"):
        ours = VideoVAE(config)
    ours.load_state_dict(native, strict=True, assign=True)
    ours.decoder.rope.reset_computed_buffers(torch.device("cpu"))
    return config, native, ours


@pytest.mark.slow
def test_released_width_matches_diffusers() -> None:
    # The released architecture (6 encoder levels, 32-group norms, 32 heads x 64 with 48 rotated channels = 8
    # frequencies per axis, 4 register tokens, 24 latent channels) with a single decoder block to stay cheap.
    config, native, ours = released_width_vae(decoder_layers=1, seed=4)
    reference = AutoencoderKLMiniMaxH3.from_config(video_vae_format.config_to_diffusers(config)).eval()
    reference.load_state_dict(video_vae_keys.native_to_diffusers(native, config), strict=True)
    ours.set_tiling(True, 32, 16)  # 2 x 2 latent tiles with a 1-latent overlap at spatial ratio 16
    reference.enable_tiling(32, 32, 16, 16)
    pixels = random_pixels(1, 1, 32, 48, seed=4)
    latents = torch.randn(1, 24, 7, 3, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        mean, logvar = ours.encode(pixels)
        posterior = reference.encode(pixels).latent_dist
        decoded = ours.decode(latents)
        expected = reference.decode(latents).sample
    assert relative_error(mean, posterior.mean) <= MAX_RELATIVE_ERROR
    assert relative_error(logvar, posterior.logvar) <= MAX_RELATIVE_ERROR
    assert decoded.shape == (1, 3, 22, 48, 64)
    assert relative_error(decoded, expected) <= MAX_RELATIVE_ERROR


@pytest.mark.cuda
def test_decoder_fused_kernels_on_cuda_equal_the_torch_twins() -> None:
    # The released decoder width (2048 = 32 heads x 64, 48 rotated channels, 8192-wide SwiGLU) with two blocks, so
    # the norm fused into a block's last residual feeds the next block. fp16 recipe, as the engine decodes.
    config, _, ours = released_width_vae(decoder_layers=2, seed=6)
    ours = ours.cuda().eval()
    ours.set_tiling(True, 32, 16)
    latents = torch.randn(1, 24, 7, 3, 4, generator=torch.Generator().manual_seed(6)).cuda()
    stream = torch.randn(8, config.decoder_hidden_size, device="cuda")
    block = ours.decoder.transformer_blocks[0]
    fused_call = (stream, stream.half(), block.scale1, block.norm2.weight, 1e-5, torch.float16)
    with torch.no_grad():
        assert ops.implementation("scaled_residual_rms_norm_to", *fused_call) == "triton"
        fused = ours.decode(latents, autocast_dtype=torch.float16)
        with ops.force_reference():
            twins = ours.decode(latents, autocast_dtype=torch.float16)
    assert torch.isfinite(fused).all()
    # The kernels round like the twins except one-ulp norm differences in rare elements.
    assert relative_error(fused, twins) <= 1e-3


def test_decode_rejects_latent_counts_without_a_window(
    models: tuple[VideoVAE, AutoencoderKLMiniMaxH3],
) -> None:
    # 2 latents (5 frames) give zero decode windows; diffusers fails on an empty torch.cat, we fail with a message.
    ours, reference = models
    latents = torch.randn(1, 4, 2, 10, 14)
    with pytest.raises(ValueError, match="at least 3"):
        ours.decode(latents)
    with pytest.raises((RuntimeError, ValueError)), torch.no_grad():
        reference.decode(latents)


def rotate_leading_channels(tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rope_dim = cos.shape[-1]
    rotated, passthrough = tensor[..., :rope_dim], tensor[..., rope_dim:]
    first_half, second_half = rotated.chunk(2, dim=-1)
    return torch.cat(
        [rotated * cos + torch.cat([-second_half, first_half], dim=-1) * sin, passthrough], dim=-1
    )


def unfused_decoder_block(
    block: torch.nn.Module, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """A decoder block as the module wrote it before the fused ops: hidden [B, T, H] fp32, rotary [T, R]."""

    def rms_norm_fp32(values: torch.Tensor, norm: torch.nn.RMSNorm) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return F.rms_norm(values.float(), norm.normalized_shape, norm.weight.float(), norm.eps)

    attn, batch, tokens = block.attn, hidden.shape[0], hidden.shape[1]
    qkv = attn.to_qkv(rms_norm_fp32(hidden, block.norm1)).view(batch, tokens, attn.heads, 3 * attn.head_dim)
    query, key, value = (part.transpose(1, 2) for part in qkv.split(attn.head_dim, dim=-1))
    with torch.autocast("cpu", enabled=False):
        query = F.rms_norm(query.float(), (attn.head_dim,), eps=attn.eps).to(value.dtype)
        key = F.rms_norm(key.float(), (attn.head_dim,), eps=attn.eps).to(value.dtype)
    cos, sin = (table.to(value.dtype) for table in rotary)
    query, key = rotate_leading_channels(query, cos, sin), rotate_leading_channels(key, cos, sin)
    attended = F.scaled_dot_product_attention(query, key, value).transpose(1, 2).reshape(batch, tokens, -1)
    hidden = hidden + attn.to_out(attended) * block.scale1
    gate, up = block.ff.w1(rms_norm_fp32(hidden, block.norm2)).chunk(2, dim=-1)
    return hidden + block.ff.w2(F.silu(gate) * up) * block.scale2


@pytest.mark.parametrize("autocast_dtype", [None, torch.float16])
def test_decoder_blocks_equal_their_unfused_expressions(
    tiny_config: VideoVAEConfig, autocast_dtype: torch.dtype | None
) -> None:
    # On the CPU the ops run their torch twins: the blocks (norms fused into residuals across blocks included) must
    # give the unfused expressions' bits, in fp32 and under the fp16 recipe. Two blocks, two rotary frequencies.
    config = dataclasses.replace(tiny_config, decoder_num_layers=2, decoder_attention_head_dim=16)
    ours = VideoVAE(config).eval()
    ours.load_state_dict(video_vae_keys.random_native_state(config, seed=9), strict=True)
    blocks = ours.decoder.transformer_blocks
    captured: dict[str, object] = {}

    # Hooks that return None (a returned value would replace the block's arguments or output).
    def keep_input(module: torch.nn.Module, args: tuple) -> None:
        captured.setdefault("input", args)

    def keep_output(module: torch.nn.Module, args: tuple, output: tuple) -> None:
        captured.setdefault("output", output[0])

    hooks = [blocks[0].register_forward_pre_hook(keep_input), blocks[-1].register_forward_hook(keep_output)]
    latents = torch.randn(2, 4, 7, 8, 12, generator=torch.Generator().manual_seed(9))
    try:
        with torch.no_grad():
            ours.decode(latents, autocast_dtype=autocast_dtype)  # the hooks keep the first decoder call
            stream, _, batch, rotary, _ = captured["input"]
            tokens = stream.shape[0] // batch
            expected = stream.view(batch, tokens, -1)
            with decode_autocast(latents.device, autocast_dtype):
                for block in blocks:
                    expected = unfused_decoder_block(
                        block, expected, tuple(table[:tokens] for table in rotary)
                    )
    finally:
        for hook in hooks:
            hook.remove()
    assert batch == 2 and expected.dtype == torch.float32
    assert torch.equal(captured["output"].view(batch, tokens, -1), expected)


def test_fp16_autocast_recipe_keeps_fp32_islands(models: tuple[VideoVAE, AutoencoderKLMiniMaxH3]) -> None:
    ours, _ = models
    ours.set_tiling(False)
    latents = torch.randn(1, 4, 7, 8, 12, generator=torch.Generator().manual_seed(11))
    dtypes: dict[str, torch.dtype] = {}

    def recorder(name: str):
        def record(module: torch.nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            # A decoder block returns (residual stream, next norm's output).
            first = output[0] if isinstance(output, tuple) else output
            dtypes.setdefault(name, first.dtype)

        return record

    block = ours.decoder.transformer_blocks[0]
    hooks = [
        block.attn.to_qkv.register_forward_hook(recorder("qkv")),
        block.register_forward_hook(recorder("residual")),
    ]
    try:
        with torch.no_grad():
            exact = ours.decode(latents)
            dtypes.clear()
            recipe = ours.decode(latents, autocast_dtype=torch.float16)
    finally:
        for hook in hooks:
            hook.remove()
    assert dtypes == {"qkv": torch.float16, "residual": torch.float32}
    assert recipe.dtype == torch.float32
    assert 0 < relative_error(recipe, exact) < 1e-2


# ---------------------------------------------------------------------------------------------------- latents & pixels


def test_latent_and_pixel_normalization(
    tiny_config: VideoVAEConfig, models: tuple[VideoVAE, AutoencoderKLMiniMaxH3]
) -> None:
    ours, _ = models
    latents = torch.randn(1, 4, 3, 2, 2)
    normalized = ours.normalize_latents(latents)
    mean = torch.tensor(tiny_config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(tiny_config.latents_std).view(1, -1, 1, 1, 1)
    assert torch.equal(normalized, (latents - mean) / std)
    assert torch.equal(ours.denormalize_latents(normalized), normalized * std + mean)
    rgb = torch.rand(1, 3, 2, 4, 4)
    pixels = VideoVAE.from_unit_range(rgb)
    assert torch.allclose(pixels[:, 1], (rgb[:, 1] - 0.456) / 0.224)
    assert torch.allclose(VideoVAE.to_unit_range(pixels), rgb, atol=1e-6)
    assert VideoVAE.to_unit_range(torch.full((1, 3, 1, 1, 1), 9.0)).eq(1.0).all()


# ---------------------------------------------------------------------------------------------------- key maps


def test_key_maps_round_trip_and_match_diffusers(
    tiny_config: VideoVAEConfig, models: tuple[VideoVAE, AutoencoderKLMiniMaxH3]
) -> None:
    _, reference = models
    native = video_vae_keys.random_native_state(tiny_config, seed=7)
    assert set(native) == set(VideoVAE(tiny_config).state_dict())
    assert all(tensor.dtype == torch.float32 for tensor in native.values())
    assert not native["decoder.mask_token"].any()
    scales = torch.cat([native[f"decoder.transformer_blocks.0.scale{i}"] for i in (1, 2)])
    assert bool((scales >= 0.1).all() and (scales < 1.0).all())

    diffusers_state = video_vae_keys.native_to_diffusers(native, tiny_config)
    expected = reference.state_dict()
    assert {key: tuple(t.shape) for key, t in diffusers_state.items()} == {
        key: tuple(t.shape) for key, t in expected.items()
    }
    back = video_vae_keys.diffusers_to_native(diffusers_state, tiny_config)
    assert set(back) == set(native)
    assert all(torch.equal(back[key], native[key]) for key in native)

    # Per-head interleave: head 1's query rows are native rows [3d, 4d) (d = 8), weight and bias alike.
    head_dim = tiny_config.decoder_attention_head_dim
    for kind in ("weight", "bias"):
        fused = native[f"decoder.transformer_blocks.0.attn.to_qkv.{kind}"]
        query = diffusers_state[f"decoder.transformer_blocks.0.attn.to_q.{kind}"]
        assert torch.equal(query[head_dim : 2 * head_dim], fused[3 * head_dim : 4 * head_dim])
        gated = native[f"decoder.transformer_blocks.0.ff.w1.{kind}"]
        swapped = diffusers_state[f"decoder.transformer_blocks.0.ff.net.0.proj.{kind}"]
        assert torch.equal(swapped[: gated.shape[0] // 2], gated[gated.shape[0] // 2 :])

    with pytest.raises(CheckpointError, match="unexpected native"):
        video_vae_keys.native_to_diffusers(
            {**native, "decoder.cls_token": native["decoder.mask_token"]}, tiny_config
        )
    incomplete = {k: v for k, v in diffusers_state.items() if not k.endswith("attn.to_k.bias")}
    with pytest.raises(CheckpointError, match="to_k.bias"):
        video_vae_keys.diffusers_to_native(incomplete, tiny_config)


def test_random_native_state_is_deterministic(tiny_config: VideoVAEConfig) -> None:
    first = video_vae_keys.random_native_state(tiny_config, seed=1)
    again = video_vae_keys.random_native_state(tiny_config, seed=1)
    other = video_vae_keys.random_native_state(tiny_config, seed=2)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["decoder.proj_out.weight"], other["decoder.proj_out.weight"])


def test_released_layout_on_meta() -> None:
    config = VideoVAEConfig.released()
    with torch.device("meta"):
        native = VideoVAE(config).state_dict()
        reference = AutoencoderKLMiniMaxH3.from_config(video_vae_format.config_to_diffusers(config))
    assert len(native) == RELEASED_NATIVE_KEYS
    assert sum(tensor.numel() for tensor in native.values()) == RELEASED_NATIVE_ELEMENTS
    converted = video_vae_keys.native_to_diffusers(native, config)
    assert {key: tuple(t.shape) for key, t in converted.items()} == {
        key: tuple(t.shape) for key, t in reference.state_dict().items()
    }
    assert len(converted) == 703
    back = video_vae_keys.diffusers_to_native(converted, config)
    assert {key: tuple(t.shape) for key, t in back.items()} == {
        key: tuple(t.shape) for key, t in native.items()
    }


# ---------------------------------------------------------------------------------------------------- configs


def test_config_round_trips(tiny_config: VideoVAEConfig) -> None:
    for config in (VideoVAEConfig.released(), tiny_config):
        assert video_vae_format.config_from_native(*video_vae_format.config_to_native(config)) == config
        assert video_vae_format.config_from_diffusers(video_vae_format.config_to_diffusers(config)) == config
    released_wrapper, released_source = video_vae_format.config_to_native(VideoVAEConfig.released())
    assert set(released_wrapper) == {
        "_class_name", "_diffusers_version", "mode", "auto_map", "source_path", "source_class_name",
        "source_safetensors_path", "vae_clip_length", "vae_token_drop", "vae_encoder_tiling", "vae_decoder_tiling",
        "vae_parallel_tiling", "vae_tile_size", "vae_tile_overlap_min", "vae_encoder_parallel",
        "vae_decoder_parallel", "vae_chunk_dim", "latent_channels", "latents_mean", "latents_std",
    }  # fmt: skip
    assert released_source["ch_mult"] == [1, 2, 2, 4, 4, 8] and released_source["space_up"] == [
        1,
        2,
        2,
        2,
        2,
        1,
    ]
    assert (
        "norm_num_groups" not in released_source
        and "num_register_tokens" not in released_source["vit_decoder_kwargs"]
    )
    _, tiny_source = video_vae_format.config_to_native(tiny_config)
    assert tiny_source["norm_num_groups"] == 4 and tiny_source["vit_decoder_kwargs"]["ffn_mult"] == 2
    # The config derives the 17n+5 <-> 5n+2 geometry.
    released = VideoVAEConfig.released()
    assert (released.frame_pre_padding, released.latents_per_clip, released.window_overlap_latents) == (
        3,
        5,
        2,
    )
    assert released.window_crossfade_frames == 5 and released.decoder_rope_dim == 48


def test_from_native_rejects_other_architectures() -> None:
    wrapper, source = video_vae_format.config_to_native(VideoVAEConfig.released())
    with pytest.raises(ValueError, match="causal_decoder"):
        video_vae_format.config_from_native(wrapper, {**source, "causal_decoder": True})
    with pytest.raises(ValueError, match="latent_channels"):
        video_vae_format.config_from_native({**wrapper, "latent_channels": 16}, source)
    with pytest.raises(ValueError, match="multiples"):
        dataclasses.replace(VideoVAEConfig.tiny(), tile_size=30)


def test_the_decode_autocast_keeps_no_second_copy_of_the_weights(tiny_config: VideoVAEConfig) -> None:
    """Autocast keeps the casts of weights that require grad for the rest of its context; the decode's context turns
    that cache off (checked here), so even a decoder whose weights require grad holds no fp16 copy of them."""
    from h3engine.models.video_vae import decode_autocast

    with decode_autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
    ours = VideoVAE(tiny_config).eval()
    ours.load_state_dict(video_vae_keys.random_native_state(tiny_config, seed=7), strict=True)
    ours.requires_grad_(True)
    latents = torch.randn(1, 4, 7, 10, 14, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert ours.decode(latents, autocast_dtype=torch.bfloat16).isfinite().all()


@pytest.mark.cuda
def test_the_decode_peak_does_not_grow_with_the_clip(tiny_config: VideoVAEConfig) -> None:
    """Windows decode one after another and leave the GPU as they are done: a clip three times as long peaks the
    same (the latents and the output aside, which this test keeps on the host)."""
    ours = VideoVAE(tiny_config).eval()
    ours.load_state_dict(video_vae_keys.random_native_state(tiny_config, seed=7), strict=True)
    ours = ours.cuda()
    peaks = {}
    for frames in (12, 37):
        latents = torch.randn(1, 4, frames, 10, 14, generator=torch.Generator().manual_seed(3)).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            for pixels in ours.decode_pieces(latents, autocast_dtype=torch.float16):
                pixels.cpu()
        peaks[frames] = torch.cuda.max_memory_allocated() - base
    assert peaks[37] <= peaks[12] * 1.05 + (1 << 20), peaks
