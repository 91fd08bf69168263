"""The H3 DiT's architecture, `DiTConfig`: its fields (h3engine.checkpoint.dit_format reads them from a checkpoint's
config), the sizes derived from them, and the released and tiny configurations (docs/MODEL.md §1.1, §10).

The AdaLN form (`adaln_form`): "exact" (the release: every AdaLN projection reads SiLU(temb), time_embed_dim wide),
"table" (the community's pruned files: `adaln_t_table` [adaln_table_rows, adaln_rank] interpolated, no time embedder)
or "basis" (ours, `convert --prune-adaln`: the time embedder kept, c(t) = (SiLU(temb) - mean) @ basis); the two
pruned forms feed adaln_rank-wide projections with no SiLU (h3engine.models.dit_adaln).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Rows carry one AdaLN entry per (timestep, modality); modality tags are 0 video, 1 text, 2 audio.
NUM_MODALITIES = 3
# Each block's AdaLN projection emits, per modality: shift/scale/gate for attention, then for the FFN.
NUM_BLOCK_MODULATIONS = 6


@dataclass(frozen=True)
class DiTConfig:
    """Architecture of the H3 DiT. Field names are ours; h3engine.checkpoint.dit_format reads the files."""

    hidden_size: int
    num_layers: int
    num_refiner_layers: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    video_in_channels: int
    audio_in_channels: int
    patch_size: tuple[int, int, int]
    text_dim: int
    timestep_dim: int
    time_hidden_dim: int
    time_embed_dim: int
    rope_freq_dim: int
    rope_theta: float = 10000.0
    eps: float = 1e-5
    # 0: the exact AdaLN input (SiLU(temb), time_embed_dim wide); > 0: the width of a pruned form's curve c(t).
    adaln_rank: int = 0
    # > 0: the published table form (adaln_t_table rows, no time embedder); 0 with adaln_rank > 0: our basis form.
    adaln_table_rows: int = 0

    def __post_init__(self) -> None:
        # Config files carry patch_size as a JSON list; store the hashable tuple.
        if not isinstance(self.patch_size, tuple | list) or len(self.patch_size) != 3:
            raise ValueError(f"DiTConfig.patch_size must be 3 integers (t, h, w), got {self.patch_size!r}")
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        integer_fields = (
            "hidden_size",
            "num_layers",
            "num_refiner_layers",
            "num_heads",
            "head_dim",
            "ffn_dim",
            "video_in_channels",
            "audio_in_channels",
            "text_dim",
            "timestep_dim",
            "time_hidden_dim",
            "time_embed_dim",
            "rope_freq_dim",
        )
        for name in integer_fields:
            value = getattr(self, name)
            # num_refiner_layers may legitimately be 0; every width must be positive.
            minimum = 0 if name == "num_refiner_layers" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"DiTConfig.{name} must be an integer >= {minimum}, got {value!r}")
        for size in self.patch_size:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"DiTConfig.patch_size must be positive integers, got {self.patch_size!r}")
        if self.head_dim % 2:
            raise ValueError(f"DiTConfig.head_dim must be even, got {self.head_dim}")
        if self.rotary_dim > self.head_dim:
            raise ValueError(
                f"DiTConfig: 6 * rope_freq_dim = {self.rotary_dim} rotated channels exceed head_dim {self.head_dim}"
            )
        if self.timestep_dim % 2:
            raise ValueError(
                f"DiTConfig.timestep_dim must be even (cos and sin halves), got {self.timestep_dim}"
            )
        if not self.rope_theta > 0 or not self.eps > 0:
            raise ValueError(f"DiTConfig.rope_theta and eps must be > 0, got {self.rope_theta}, {self.eps}")
        self._check_adaln_form()

    def _check_adaln_form(self) -> None:
        for name in ("adaln_rank", "adaln_table_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DiTConfig.{name} must be an integer >= 0, got {value!r}")
        if self.adaln_table_rows and not self.adaln_rank:
            raise ValueError(
                f"DiTConfig.adaln_table_rows {self.adaln_table_rows} needs adaln_rank > 0 (the table's width)"
            )
        if self.adaln_table_rows == 1:
            raise ValueError("DiTConfig.adaln_table_rows must be >= 2 (an interpolated table), got 1")
        if self.adaln_form == "basis" and self.adaln_rank > self.time_embed_dim:
            raise ValueError(
                f"DiTConfig.adaln_rank {self.adaln_rank} exceeds time_embed_dim {self.time_embed_dim} (a basis of "
                "the SiLU(temb) curve has at most that many directions)"
            )

    # Derived sizes ------------------------------------------------------------------------------------------

    @property
    def inner_dim(self) -> int:
        """Width of q, k and v (heads x head_dim); larger than hidden_size in the release (7168 vs 5376)."""
        return self.num_heads * self.head_dim

    @property
    def video_patch_dim(self) -> int:
        return self.video_in_channels * math.prod(self.patch_size)

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head: 3 axes x rope_freq_dim angles, each used by a rotate-half pair."""
        return 6 * self.rope_freq_dim

    @property
    def adaln_out_features(self) -> int:
        return NUM_MODALITIES * NUM_BLOCK_MODULATIONS * self.hidden_size

    @property
    def final_adaln_out_features(self) -> int:
        return 2 * self.hidden_size

    @property
    def adaln_form(self) -> str:
        """ "exact" (the release), "table" (published pruned files) or "basis" (ours): see the module docstring."""
        if not self.adaln_rank:
            return "exact"
        return "table" if self.adaln_table_rows else "basis"

    @property
    def adaln_in_features(self) -> int:
        """Width of every AdaLN projection's input: time_embed_dim (exact) or adaln_rank (pruned)."""
        return self.adaln_rank or self.time_embed_dim

    @property
    def has_time_embedder(self) -> bool:
        """Whether the DiT holds the sinusoidal embedder and time MLP (all but the published table form)."""
        return self.adaln_form != "table"

    # Known configurations ------------------------------------------------------------------------------------

    @classmethod
    def released(cls) -> DiTConfig:
        """The released H3-Base DiT (docs/MODEL.md §1.1), 33,122,992,896 parameters."""
        return cls(**{name: released for name, (released, _) in _KNOWN_CONFIGS.items()})

    @classmethod
    def tiny(cls) -> DiTConfig:
        """Test configuration (docs/MODEL.md §10); hidden 16 != heads x head_dim 24 on purpose, all 12 channels
        rotated."""
        return cls(**{name: tiny for name, (_, tiny) in _KNOWN_CONFIGS.items()})


# Field -> (released value, tiny value).
_KNOWN_CONFIGS: dict[str, tuple[Any, Any]] = {
    "hidden_size": (5376, 16),
    "num_layers": (50, 2),
    "num_refiner_layers": (2, 1),
    "num_heads": (56, 2),
    "head_dim": (128, 12),
    "ffn_dim": (14336, 32),
    "video_in_channels": (24, 4),
    "audio_in_channels": (32, 4),
    "patch_size": ((1, 2, 2), (1, 2, 2)),
    "text_dim": (5120, 8),
    "timestep_dim": (256, 8),
    "time_hidden_dim": (5376, 16),
    "time_embed_dim": (2688, 8),
    "rope_freq_dim": (16, 2),
    "rope_theta": (10000.0, 10000.0),
    "eps": (1e-5, 1e-5),
}
