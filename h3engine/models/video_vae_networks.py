"""The video VAE's networks: the causal 3D-CNN encoder and the ViT decoder (`h3engine.models.video_vae` runs them).

Precision (the danger): the weights are fp32 and the encoder always runs in fp32 (`VideoVAE.encode` turns autocast
off). The decoder without autocast is a plain fp32 computation (parity with diffusers). Under fp16 autocast it is
SGLang's released decode recipe with the reference's fp32 islands: `x_embedder` and `proj_out` run with autocast off,
RMSNorms, QK-norm and the final LayerNorm compute in fp32, the residual stream and layer scales stay fp32, the rotary
angles are fp32. Two fp16 roundings of that recipe are reproduced on purpose because they change the output:
`post_quant_conv` runs under autocast, so the embedded tokens are rounded to fp16 before they join the fp32 residual
stream, and the per-axis positions (and cos/sin) are computed in the dtype of that conv's output (diffusers keeps
them in fp32). The decoder blocks' elementwise work goes through `h3engine.models.ops` (RMSNorm fused with the layer-scaled
residual, QK-norm + RoPE, SwiGLU): Triton kernels on CUDA, elsewhere torch twins that give the unfused bits.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from h3engine.models import ops
from h3engine.models.video_vae_config import VideoVAEConfig


def autocast_off(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast switched off for `tensor`'s device type (the reference's fp32 islands)."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


# ==================================================================================================== encoder


class CausalConv3d(nn.Conv3d):
    """3D conv with symmetric spatial padding in `padding_mode` and causal temporal padding (zero frames in front)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: tuple[int, int, int] = (1, 1, 1),
        spatial_padding: int = 0,
        temporal_padding: int = 0,
        padding_mode: str = "reflect",
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        self.spatial_padding = spatial_padding
        self.temporal_padding = temporal_padding
        self.spatial_padding_mode = padding_mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pad = self.spatial_padding
        if pad:
            hidden_states = F.pad(hidden_states, (pad, pad, pad, pad, 0, 0), mode=self.spatial_padding_mode)
        if self.temporal_padding:
            hidden_states = F.pad(hidden_states, (0, 0, 0, 0, self.temporal_padding, 0))
        return F.conv3d(hidden_states, self.weight, self.bias, stride=self.stride)


class FramewiseGroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics never mix frames (`use_t_isolated_gn`): time is folded into the batch."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, channels, frames, height, width = hidden_states.shape
        per_frame = hidden_states.transpose(1, 2).reshape(batch * frames, channels, height, width)
        per_frame = F.group_norm(per_frame, self.num_groups, self.weight, self.bias, self.eps)
        return per_frame.reshape(batch, frames, channels, height, width).transpose(1, 2)


class EncoderResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, config: VideoVAEConfig) -> None:
        super().__init__()
        groups, eps, mode = config.norm_num_groups, config.norm_eps, config.spatial_padding_mode
        self.norm1 = FramewiseGroupNorm(groups, in_channels, eps=eps)
        self.conv1 = CausalConv3d(
            in_channels, out_channels, 3, spatial_padding=1, temporal_padding=2, padding_mode=mode
        )
        self.norm2 = FramewiseGroupNorm(groups, out_channels, eps=eps)
        self.conv2 = CausalConv3d(
            out_channels, out_channels, 3, spatial_padding=1, temporal_padding=2, padding_mode=mode
        )
        # Native name of the 1x1x1 channel-changing shortcut; absent when the channel count is kept.
        self.nin_shortcut = (
            CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states if self.nin_shortcut is None else self.nin_shortcut(hidden_states)
        hidden_states = self.conv1(F.silu(self.norm1(hidden_states)))
        hidden_states = self.conv2(F.silu(self.norm2(hidden_states)))
        return residual + hidden_states


class EncoderDownsample(nn.Module):
    """Stride-(t, s, s) 3x3x3 conv. A spatial stride of 2 first pads one row/column at the bottom/right only (in the
    padding mode), so the output size is ceil(n / 2); temporally it is causal like every encoder conv."""

    def __init__(self, channels: int, temporal_stride: int, spatial_stride: int, padding_mode: str) -> None:
        super().__init__()
        self.spatial_stride = spatial_stride
        self.padding_mode = padding_mode
        self.conv = CausalConv3d(
            channels,
            channels,
            3,
            stride=(temporal_stride, spatial_stride, spatial_stride),
            temporal_padding=2,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.spatial_stride == 2:
            hidden_states = F.pad(hidden_states, (0, 1, 0, 1, 0, 0), mode=self.padding_mode)
        return self.conv(hidden_states)


class EncoderLevel(nn.Module):
    """One resolution level: `layers_per_block` ResBlocks, then a downsampler when the level's factor is > 1."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        spatial_factor: int,
        temporal_factor: int,
        config: VideoVAEConfig,
    ) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            EncoderResnetBlock(in_channels if index == 0 else out_channels, out_channels, config)
            for index in range(config.layers_per_block)
        )
        self.downsample = (
            EncoderDownsample(out_channels, temporal_factor, spatial_factor, config.spatial_padding_mode)
            if spatial_factor * temporal_factor > 1
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for resnet in self.block:
            hidden_states = resnet(hidden_states)
        return hidden_states if self.downsample is None else self.downsample(hidden_states)


class VideoEncoder(nn.Module):
    """Causal 3D CNN: pixels [B, 3, F, H, W] -> 2 * latent_channels moments [B, 2C, T, H/s, W/s]."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        channels = config.block_out_channels
        mode = config.spatial_padding_mode
        self.conv_in = CausalConv3d(
            config.in_channels, channels[0], 3, spatial_padding=1, temporal_padding=2, padding_mode=mode
        )
        level_inputs = (channels[0], *channels[:-1])
        self.down = nn.ModuleList(
            EncoderLevel(level_in, level_out, spatial, temporal, config)
            for level_in, level_out, spatial, temporal in zip(
                level_inputs,
                channels,
                config.spatial_downsample_factors,
                config.temporal_downsample_factors,
                strict=True,
            )
        )
        self.norm_out = FramewiseGroupNorm(config.norm_num_groups, channels[-1], eps=config.norm_eps)
        self.conv_out = CausalConv3d(
            channels[-1],
            2 * config.latent_channels,
            3,
            spatial_padding=1,
            temporal_padding=2,
            padding_mode=mode,
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden_states = self.conv_in(pixels)
        for level in self.down:
            hidden_states = level(hidden_states)
        return self.conv_out(F.silu(self.norm_out(hidden_states)))


# ==================================================================================================== decoder


class DecoderRotaryEmbedding(nn.Module):
    """3-axis rotary table for the ViT decoder: positions in (-1, 1) per axis, angle = 2*pi*pos*inv_freq with
    `inv_freq = theta^-(arange(0, 1, 6/rope_dim))`; the (t, h, w) angles are concatenated then duplicated."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        self.rope_dim = config.decoder_rope_dim
        self.theta = config.decoder_rope_theta
        self.register_buffer("inv_freq", torch.empty(self.rope_dim // 6), persistent=False)
        if not self.inv_freq.is_meta:
            self.reset_computed_buffers(self.inv_freq.device)

    def reset_computed_buffers(self, device: torch.device) -> None:
        # Computed on the CPU in fp32 like the reference, so every device gets the same frequencies.
        exponents = torch.arange(0, 1, 6 / self.rope_dim, dtype=torch.float32)
        self.inv_freq = (1.0 / self.theta**exponents).to(device)

    def forward(
        self, frames: int, height: int, width: int, num_suffix_tokens: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [tokens, rope_dim] in `dtype`; suffix (register + zero) tokens sit at position 0.

        `dtype` is the dtype the positions are computed in (see the module docstring for why it is not always fp32).
        """
        device = self.inv_freq.device
        axes = [
            2.0 * (torch.arange(0.5, size, dtype=dtype, device=device) / size) - 1.0
            for size in (frames, height, width)
        ]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
        positions = torch.cat([grid, grid.new_zeros(num_suffix_tokens, 3)], dim=0)
        with autocast_off(positions):
            # Same association as the reference: (2*pi*pos) first, in the positions' dtype, then times inv_freq.
            angles = (2.0 * math.pi * positions[:, :, None]) * self.inv_freq
            angles = angles.flatten(1).repeat(1, 2)
            return angles.cos().to(dtype), angles.sin().to(dtype)


def _matmul_dtype(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in here: autocast's while it is on for the tensor's device, else the
    weight's."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class DecoderAttention(nn.Module):
    """Full self-attention with a fused QKV projection whose rows are per-head interleaved: head h owns rows
    [h*3*d, (h+1)*3*d) laid out as [q(d) k(d) v(d)]. QK RMSNorm (no affine) in fp32, then RoPE."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        self.heads = config.decoder_num_attention_heads
        self.head_dim = config.decoder_attention_head_dim
        self.eps = config.decoder_norm_eps
        hidden = config.decoder_hidden_size
        self.to_qkv = nn.Linear(hidden, 3 * hidden)
        self.to_out = nn.Linear(hidden, hidden)

    def forward(
        self, normed: torch.Tensor, batch: int, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """`normed` [batch * tokens, hidden] (token rows of `batch` sequences) -> [batch * tokens, hidden];
        `rotary` is (cos, sin) [batch * tokens, rope_dim] in the projection's dtype."""
        rows = normed.shape[0]
        qkv = self.to_qkv(normed).view(rows, self.heads, 3 * self.head_dim)
        query, key, value = qkv.split(self.head_dim, dim=-1)
        # The reference normalizes Q and K in fp32 and rounds back to the compute dtype once, then rotates:
        # qk_norm_rope widens to fp32 inside its norm (a unit weight stands for "no affine").
        unit_weight = torch.ones(self.head_dim, dtype=query.dtype, device=query.device)
        with autocast_off(query):
            query, key = ops.qk_norm_rope(query, key, unit_weight, unit_weight, self.eps, *rotary)
        per_sequence = (batch, rows // batch, self.heads, self.head_dim)
        query, key, value = (part.view(per_sequence).transpose(1, 2) for part in (query, key, value))
        attended = F.scaled_dot_product_attention(query, key, value)
        return self.to_out(attended.transpose(1, 2).reshape(rows, self.heads * self.head_dim))


class DecoderFeedForward(nn.Module):
    """SwiGLU with the native fused layout: `w1` rows are [gate; up] and the output is w2(silu(gate) * up)."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.decoder_hidden_size, 2 * config.decoder_ffn_inner_dim)
        self.w2 = nn.Linear(config.decoder_ffn_inner_dim, config.decoder_hidden_size)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, hidden]."""
        return self.w2(ops.swiglu(self.w1(normed)))


class DecoderBlock(nn.Module):
    """x += scale1 * attn(rms(x)); x += scale2 * ffn(rms(x)). The residual stream, RMSNorms and scales are fp32;
    each RMSNorm rounds once to the dtype of the GEMM it feeds."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        hidden = config.decoder_hidden_size
        self.norm1 = nn.RMSNorm(hidden, eps=config.decoder_norm_eps)
        self.attn = DecoderAttention(config)
        self.scale1 = nn.Parameter(torch.zeros(hidden))
        self.norm2 = nn.RMSNorm(hidden, eps=config.decoder_norm_eps)
        self.ff = DecoderFeedForward(config)
        self.scale2 = nn.Parameter(torch.zeros(hidden))

    def forward(
        self,
        hidden_states: torch.Tensor,
        normed: torch.Tensor,
        batch: int,
        rotary: tuple[torch.Tensor, torch.Tensor],
        next_norm: nn.RMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block on the flat fp32 stream [batch * tokens, hidden], given `normed` = norm1(stream) in the GEMM
        dtype. Returns the new stream and `next_norm`(new stream) in that dtype: the next block's norm1 fused
        into this block's last residual (None after the last block)."""
        attended = self.attn(normed, batch, rotary)
        with autocast_off(hidden_states):
            hidden_states, normed = ops.scaled_residual_rms_norm_to(
                hidden_states, attended, self.scale1, self.norm2.weight, self.norm2.eps, normed.dtype
            )
        fed = self.ff(normed)
        with autocast_off(hidden_states):
            if next_norm is None:
                return hidden_states + fed * self.scale2, None
            return ops.scaled_residual_rms_norm_to(
                hidden_states, fed, self.scale2, next_norm.weight, next_norm.eps, normed.dtype
            )


class ViTDecoder(nn.Module):
    """Latent voxels -> tokens (+ register tokens + one zero token, all at position 0) -> blocks -> LayerNorm ->
    per-token (t_ratio x s_ratio x s_ratio) RGB patch. Positions are relative to the clip/tile being decoded."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        hidden = config.decoder_hidden_size
        self.out_channels = config.out_channels
        self.patch_size = config.spatial_compression_ratio
        self.patch_frames = config.temporal_compression_ratio
        self.norm_eps = config.decoder_norm_eps
        self.rope = DecoderRotaryEmbedding(config)
        self.x_embedder = nn.Linear(config.latent_channels, hidden)
        self.register_tokens = nn.Parameter(torch.zeros(1, config.decoder_num_register_tokens, hidden))
        # All-zero leftover of masked-autoencoder training; the native file carries it, the forward never reads it.
        self.register_buffer("mask_token", torch.zeros(1, 1, hidden))
        self.transformer_blocks = nn.ModuleList(
            DecoderBlock(config) for _ in range(config.decoder_num_layers)
        )
        self.norm_out = nn.LayerNorm(hidden, eps=config.decoder_norm_eps)
        self.proj_out = nn.Linear(hidden, config.out_channels * self.patch_frames * self.patch_size**2)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        batch, channels, frames, height, width = latents.shape
        voxels = latents.permute(0, 2, 3, 4, 1).reshape(batch, frames * height * width, channels)
        with autocast_off(voxels):
            # Embedding in fp32 even under autocast; the result goes back to the input's dtype like the reference.
            patch_tokens = F.linear(voxels.float(), self.x_embedder.weight, self.x_embedder.bias).to(
                voxels.dtype
            )
        num_patches = patch_tokens.shape[1]
        residual_dtype = self.register_tokens.dtype
        hidden_states = torch.cat(
            [
                patch_tokens.to(residual_dtype),
                self.register_tokens.expand(batch, -1, -1),
                patch_tokens.new_zeros(batch, 1, patch_tokens.shape[2], dtype=residual_dtype),
            ],
            dim=1,
        )
        tokens = hidden_states.shape[1]
        rotary = self.rope(frames, height, width, tokens - num_patches, dtype=latents.dtype)
        hidden_states = hidden_states.reshape(batch * tokens, -1)
        blocks = list(self.transformer_blocks)
        gemm_dtype = _matmul_dtype(hidden_states, blocks[0].attn.to_qkv.weight)
        # Every sequence of the batch has the same extent, so the same angles; one row per token row.
        rotary = tuple(table.to(gemm_dtype).repeat(batch, 1) for table in rotary)
        with autocast_off(hidden_states):
            normed = ops.rms_norm_to(hidden_states, blocks[0].norm1.weight, blocks[0].norm1.eps, gemm_dtype)
        for index, block in enumerate(blocks):
            next_norm = blocks[index + 1].norm1 if index + 1 < len(blocks) else None
            hidden_states, normed = block(hidden_states, normed, batch, rotary, next_norm)
        hidden_states = hidden_states.view(batch, tokens, -1)
        with autocast_off(hidden_states):
            hidden_states = F.layer_norm(
                hidden_states[:, :num_patches].float(),
                (hidden_states.shape[-1],),
                self.norm_out.weight,
                self.norm_out.bias,
                self.norm_eps,
            )
            patches = F.linear(hidden_states, self.proj_out.weight, self.proj_out.bias)
        patch, patch_t = self.patch_size, self.patch_frames
        patches = patches.view(batch, frames, height, width, self.out_channels, patch_t, patch, patch)
        patches = patches.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return patches.reshape(batch, self.out_channels, frames * patch_t, height * patch, width * patch)
