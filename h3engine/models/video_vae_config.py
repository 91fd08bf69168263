"""The video VAE's configuration: its architecture, temporal chunking, tiling and latent statistics
(`VideoVAEConfig`, with the released values and the tiny test checkpoints'), shared by the VAE
(h3engine.models.video_vae) and its networks (h3engine.models.video_vae_networks)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

RELEASED_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075,
    -0.2727581858634949, -1.3675414323806763, -0.2553254961967468, -0.26907554268836975,
    -0.5376840829849243, -0.0464097298681736, 0.6657370328903198, 0.19690127670764923,
    -0.5460608005523682, -0.4035342037677765, -0.23683024942874908, 0.25928452610969543,
    -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)  # fmt: skip
RELEASED_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.68317747116088865, 1.7549455165863037,
    1.5636216402053833, 2.194143533706665, 0.96531379222869875, 1.05698859691619875,
    0.841948926448822, 0.7729952931404114, 1.8955937623977661, 0.946841835975647,
    0.7996809482574463, 0.44988900423049925, 0.7197399735450745, 0.69362932443618775,
    2.961095094680786, 2.7694199085235595, 3.0496184825897215, 2.1088054180145265,
    3.276226282119751, 3.1627357006073, 2.28168129920959475, 2.6127843856811525,
)  # fmt: skip


@dataclass(frozen=True)
class VideoVAEConfig:
    """Architecture, temporal chunking, tiling and latent statistics of the video VAE."""

    in_channels: int
    out_channels: int
    latent_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    spatial_downsample_factors: tuple[int, ...]
    temporal_downsample_factors: tuple[int, ...]
    norm_num_groups: int
    norm_eps: float
    spatial_padding_mode: str
    decoder_num_layers: int
    decoder_num_attention_heads: int
    decoder_attention_head_dim: int
    decoder_num_register_tokens: int
    decoder_ffn_mult: int
    decoder_rope_theta: float
    decoder_rope_dim_ratio: float
    decoder_norm_eps: float
    clip_length: int
    token_drop: int
    encoder_tiling: bool
    decoder_tiling: bool
    parallel_tiling: bool
    tile_size: int
    tile_overlap_min: int
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]

    def __post_init__(self) -> None:
        levels = len(self.block_out_channels)
        if len(self.spatial_downsample_factors) != levels or len(self.temporal_downsample_factors) != levels:
            raise ValueError("block_out_channels and both downsample factor lists must have the same length")
        if any(channels % self.norm_num_groups for channels in self.block_out_channels):
            raise ValueError(
                f"norm_num_groups {self.norm_num_groups} must divide every block_out_channels entry"
            )
        if any(
            factor not in (1, 2)
            for factor in self.spatial_downsample_factors + self.temporal_downsample_factors
        ):
            raise ValueError("downsample factors must be 1 or 2")
        if self.decoder_rope_dim % 6 != 0:
            raise ValueError(
                f"decoder rotary dim {self.decoder_rope_dim} must be a multiple of 6 (3 axes x cos/sin)"
            )
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"latents_mean and latents_std need {self.latent_channels} entries each")
        if (
            self.tile_size % self.spatial_compression_ratio
            or self.tile_overlap_min % self.spatial_compression_ratio
        ):
            raise ValueError(
                "tile_size and tile_overlap_min must be multiples of the spatial compression ratio"
            )
        if not 0 < self.tile_overlap_min < self.tile_size:
            raise ValueError("tile_overlap_min must be positive and smaller than tile_size")

    # ---------------------------------------------------------------------------------------------- derived sizes

    @property
    def spatial_compression_ratio(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_compression_ratio(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def decoder_hidden_size(self) -> int:
        return self.decoder_num_attention_heads * self.decoder_attention_head_dim

    @property
    def decoder_ffn_inner_dim(self) -> int:
        return self.decoder_hidden_size * self.decoder_ffn_mult

    @property
    def decoder_rope_dim(self) -> int:
        return int(self.decoder_attention_head_dim * self.decoder_rope_dim_ratio)

    @property
    def frame_pre_padding(self) -> int:
        """Leading pixel frames of a decoded clip that are not part of the video (17 is not a multiple of 4)."""
        return (-self.clip_length) % self.temporal_compression_ratio

    @property
    def latents_per_clip(self) -> int:
        return math.ceil(self.clip_length / self.temporal_compression_ratio)

    @property
    def window_overlap_latents(self) -> int:
        """Extra latents each decode window reads past its own clip (what `token_drop` removed from the clip)."""
        return (-self.token_drop) % self.latents_per_clip

    @property
    def window_crossfade_frames(self) -> int:
        return max(self.window_overlap_latents * self.temporal_compression_ratio - self.frame_pre_padding, 0)

    # ---------------------------------------------------------------------------------------------- constructors

    @classmethod
    def released(cls) -> VideoVAEConfig:
        return cls(
            in_channels=3,
            out_channels=3,
            latent_channels=24,
            block_out_channels=(128, 256, 256, 512, 512, 1024),
            layers_per_block=2,
            spatial_downsample_factors=(2, 2, 2, 2, 1, 1),
            temporal_downsample_factors=(1, 2, 2, 1, 1, 1),
            norm_num_groups=32,
            norm_eps=1e-6,
            spatial_padding_mode="reflect",
            decoder_num_layers=36,
            decoder_num_attention_heads=32,
            decoder_attention_head_dim=64,
            decoder_num_register_tokens=4,
            decoder_ffn_mult=4,
            decoder_rope_theta=100.0,
            decoder_rope_dim_ratio=0.75,
            decoder_norm_eps=1e-5,
            clip_length=17,
            token_drop=3,
            encoder_tiling=True,
            decoder_tiling=True,
            parallel_tiling=True,
            tile_size=256,
            tile_overlap_min=64,
            latents_mean=RELEASED_LATENTS_MEAN,
            latents_std=RELEASED_LATENTS_STD,
        )

    @classmethod
    def tiny(cls) -> VideoVAEConfig:
        """Tiny VAE (docs/MODEL.md §10): ratio 4 x 4 (spatial x temporal), 4 latent channels, a 1-layer 16-wide
        decoder."""
        return dataclasses.replace(
            cls.released(),
            latent_channels=4,
            block_out_channels=(8, 16, 16),
            layers_per_block=1,
            spatial_downsample_factors=(2, 2, 1),
            temporal_downsample_factors=(2, 2, 1),
            norm_num_groups=4,
            decoder_num_layers=1,
            decoder_num_attention_heads=2,
            decoder_attention_head_dim=8,
            decoder_num_register_tokens=1,
            decoder_ffn_mult=2,
            latents_mean=(0.35, -0.6, 0.15, 0.9),
            latents_std=(1.4, 0.7, 2.1, 0.55),
        )
