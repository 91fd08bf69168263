"""The MiniMax H3 diffusion transformer ("H3-Omni-Transformer"), one packed request per forward.

`H3DiT.forward` takes one packed request with no batch axis (docs/MODEL.md §2.1, §3): fp32 video rows
[Nv, C*prod(patch)], fp32 audio rows [Na, Ca], text states [Lt, text_dim], the M distinct timesteps (fp32,
t = 1 is clean, unscaled), per-row `timestep_index` and modality `tags` (0 video, 1 text, 2 audio), float64
(t, h, w) `positions`, and the sequence positions of each modality's rows. It returns fp32 velocities for every
video and audio row, in the order of `video_index` / `audio_index` (condition rows included). `state_dict()` keys
are the native checkpoint keys (docs/MODEL.md §1.2), `rope.inv_freq` included; `attn.qkv_proj` rows are held stacked
[q; k; v] where the file interleaves them per head (h3engine.checkpoint.dit_format converts).

Danger: the checkpoint is mixed precision. `FP32_PARAMETER_NAMES` (patch projections, time MLP, output heads,
`rope.inv_freq`) must stay fp32, the rest runs in the constructor's `dtype`: never `.to(torch.bfloat16)` /
`.half()` the whole module (that rounds the fp32 islands), choose the dtype at construction. A module built on
`meta` and materialized with `to_empty()` holds garbage, `rope.inv_freq` included, until a full state is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.models import attention as attention_ops
from h3engine.models import dit_chunks, ops
from h3engine.models.attention import AttentionKernel

# Rows carry one AdaLN entry per (timestep, modality); modality tags are 0 video, 1 text, 2 audio.
NUM_MODALITIES = 3
# Each block's AdaLN projection emits, per modality: shift/scale/gate for attention, then for the FFN.
NUM_BLOCK_MODULATIONS = 6
# The sinusoidal timestep features use the classic 10000 period.
TIMESTEP_MAX_PERIOD = 10000.0

# h3engine.engine.lora.adapters puts a LoRA's update (a callable on the layer's input) on a linear under this name; a forward hook
# adds it where the layer is called, and the paths below that read the weight instead add it themselves.
LOW_RANK_ATTRIBUTE = "low_rank_update"

# State-dict keys that the release stores in fp32 and that must be computed in fp32 whatever the compute dtype.
FP32_PARAMETER_NAMES: frozenset[str] = frozenset(
    {
        "video_patch_proj.weight",
        "video_patch_proj.bias",
        "audio_patch_proj.weight",
        "audio_patch_proj.bias",
        "time_embedder.proj_in.weight",
        "time_embedder.proj_in.bias",
        "time_embedder.proj_out.weight",
        "time_embedder.proj_out.bias",
        "final_layer.video_out.weight",
        "final_layer.video_out.bias",
        "final_layer.audio_out.weight",
        "final_layer.audio_out.bias",
        "rope.inv_freq",
    }
)


# --------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Functional pieces
# --------------------------------------------------------------------------------------------------------------


def attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Full bidirectional attention over one packed document: [S, heads, head_dim] in and out, no mask.

    The single call site of the attention kernel; `h3engine.models.attention` picks the backend (FA4, cuDNN, SDPA).
    Scale is 1/sqrt(head_dim).
    """
    return attention_ops.attention(query, key, value)


def rope_inverse_frequencies(
    rope_freq_dim: int, rope_theta: float, device: torch.device | str | None = None
) -> Tensor:
    """inv_freq[j] = theta^(-2j / (2 * rope_freq_dim)), fp32; one vector shared by the t, h and w axes."""
    exponents = torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32, device=device) / (
        2 * rope_freq_dim
    )
    return 1.0 / (rope_theta**exponents)


def timestep_sinusoid(timesteps: Tensor, dim: int) -> Tensor:
    """[M] t in [0, 1] (not scaled by 1000) -> [M, dim] fp32 features, cos half first, then sin."""
    half = dim // 2
    frequencies = torch.exp(
        -math.log(TIMESTEP_MAX_PERIOD)
        * torch.arange(half, dtype=torch.float32, device=timesteps.device)
        / half
    )
    arguments = timesteps.to(torch.float32)[:, None] * frequencies[None, :]
    return torch.cat((torch.cos(arguments), torch.sin(arguments)), dim=-1)


# --------------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight; F.rms_norm reduces and applies the weight in fp32, output in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, hidden: Tensor) -> Tensor:
        return F.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.eps)


class TimestepEmbedder(nn.Module):
    """Sinusoid -> Linear -> SiLU -> Linear, entirely fp32: temb feeds every AdaLN table and must not be rounded."""

    def __init__(self, config: DiTConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.timestep_dim = config.timestep_dim
        self.proj_in = nn.Linear(
            config.timestep_dim, config.time_hidden_dim, dtype=torch.float32, device=device
        )
        self.proj_out = nn.Linear(
            config.time_hidden_dim, config.time_embed_dim, dtype=torch.float32, device=device
        )

    def forward(self, timesteps: Tensor) -> Tensor:
        features = timestep_sinusoid(timesteps, self.timestep_dim)
        return self.proj_out(F.silu(self.proj_in(features)))


class MultiAxisRope(nn.Module):
    """3-axis (t, h, w) RoPE tables. `inv_freq` is a persistent fp32 buffer because the native file ships it."""

    def __init__(self, config: DiTConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq",
            rope_inverse_frequencies(config.rope_freq_dim, config.rope_theta, device),
            persistent=True,
        )

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [S, 3] (fp64) -> cos, sin [S, 6 * rope_freq_dim] in `dtype`.

        Angles are formed in fp32 from the fp64 grid (the released precision), laid out [t | h | w] and repeated
        for the two rotate-half halves; only cos/sin are rounded to the activation dtype.
        """
        angles = positions.to(torch.float32)[:, :, None] * self.inv_freq[None, None, :]
        angles = angles.flatten(1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    """Self-attention with a fused QKV weight, per-head RMS QK-norm (before RoPE), no biases.

    The checkpoint interleaves the QKV rows per head; the weight holds them stacked [q; k; v] (the checkpoint
    loaders convert). Stacked rows let q, k and v come from three GEMMs with contiguous weight slices and
    contiguous outputs: slicing one fused output per head hands strided tensors to the QK-norm and the attention
    kernel, which then copy them. By head groups with `activation_chunks` > 1 (h3engine.models.dit_chunks).
    """

    def __init__(self, config: DiTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.activation_chunks = 1  # head groups (h3engine.models.dit_chunks): set_activation_chunks sets it
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, 3 * config.inner_dim, bias=False, dtype=dtype, device=device
        )
        self.q_norm = RMSNorm(config.head_dim, config.eps, dtype, device)
        self.k_norm = RMSNorm(config.head_dim, config.eps, dtype, device)
        self.out_proj = nn.Linear(
            config.inner_dim, config.hidden_size, bias=False, dtype=dtype, device=device
        )

    def _project_qkv(self, hidden: Tensor) -> tuple[Tensor, ...]:
        """q, k and v as three GEMMs on the stacked weight's row blocks (contiguous outputs).

        An FP8 layer (`h3engine.models.quantization.Fp8Linear`, which holds no bf16 weight) provides `forward_chunks`, which
        quantizes `hidden` once for the three GEMMs (duck-typed: fp8 imports this module, not the other way round).
        """
        forward_chunks = getattr(self.qkv_proj, "forward_chunks", None)
        if forward_chunks is not None:
            projections = forward_chunks(hidden, 3)
        else:
            projections = tuple(F.linear(hidden, weight) for weight in self.qkv_proj.weight.chunk(3))
        update = getattr(self.qkv_proj, LOW_RANK_ATTRIBUTE, None)
        if update is None:
            return projections
        return tuple(p + u for p, u in zip(projections, update.chunks(hidden, 3), strict=True))

    def forward(
        self,
        hidden: Tensor,
        rope_cos_sin: tuple[Tensor, Tensor] | None,
        attend: AttentionKernel = attention,
    ) -> Tensor:
        if self.activation_chunks > 1 and attend is attention and dit_chunks.plain_linears(self.qkv_proj):
            update = getattr(self.qkv_proj, LOW_RANK_ATTRIBUTE, None)
            return dit_chunks.attention_by_head_groups(self, hidden, rope_cos_sin, attend, update)
        sequence_length = hidden.shape[0]
        heads = (sequence_length, self.num_heads, self.head_dim)
        query, key, value = (projection.view(heads) for projection in self._project_qkv(hidden))
        # Per-head RMS norm (rounded), then the partial rotate-half RoPE (`apply_rope`'s rounding), fused.
        cos, sin = rope_cos_sin if rope_cos_sin is not None else (None, None)
        query, key = ops.qk_norm_rope(
            query, key, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin
        )
        output = attend(query, key, value)
        return self.out_proj(output.reshape(sequence_length, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """fc2(silu(gate) * value) with fc1 rows stored [gate; value] (the gate is the FIRST half)."""

    def __init__(self, config: DiTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.activation_chunks = 1  # row chunks (h3engine.models.dit_chunks): set_activation_chunks sets it
        self.fc1 = nn.Linear(config.hidden_size, 2 * config.ffn_dim, bias=False, dtype=dtype, device=device)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, hidden: Tensor) -> Tensor:
        chunks = self.activation_chunks if dit_chunks.plain_linears(self.fc1, self.fc2) else 1
        return dit_chunks.map_rows(lambda rows: self.fc2(ops.swiglu(self.fc1(rows))), hidden, chunks)


class AdaLNProjection(nn.Module):
    """SiLU(temb) -> Linear. SiLU runs on the fp32 temb; only its result is cast to the (bf16) linear's dtype."""

    def __init__(
        self, config: DiTConfig, out_features: int, dtype: torch.dtype, device: torch.device | str | None
    ):
        super().__init__()
        self.linear = nn.Linear(config.time_embed_dim, out_features, dtype=dtype, device=device)

    def forward(self, temb: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """`weight` / `bias` stand in for the module's own (the same values on another device)."""
        weight = self.linear.weight if weight is None else weight
        bias = self.linear.bias if bias is None else bias
        activated = F.silu(temb).to(weight.dtype)
        update = getattr(self.linear, LOW_RANK_ATTRIBUTE, None)
        table = F.linear(activated, weight, bias)
        return table if update is None else table + update(activated)


class RefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows only: no AdaLN, no RoPE."""

    def __init__(self, config: DiTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.eps, dtype, device)
        self.attn = Attention(config, dtype, device)
        self.norm2 = RMSNorm(config.hidden_size, config.eps, dtype, device)
        self.mlp = SwiGLU(config, dtype, device)

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), None)
        return hidden + self.mlp(self.norm2(hidden))


class TokenRefiner(nn.Module):
    def __init__(self, config: DiTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            RefinerBlock(config, dtype, device) for _ in range(config.num_refiner_layers)
        )
        self.final_norm = RMSNorm(config.hidden_size, config.eps, dtype, device)

    def forward(self, text: Tensor) -> Tensor:
        for block in self.blocks:
            text = block(text)
        return self.final_norm(text)


class DiTBlock(nn.Module):
    """Pre-norm attention + SwiGLU, each modulated by the (timestep, modality) AdaLN row of every packed row."""

    def __init__(self, config: DiTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norm1 = RMSNorm(config.hidden_size, config.eps, dtype, device)
        self.attn = Attention(config, dtype, device)
        self.norm2 = RMSNorm(config.hidden_size, config.eps, dtype, device)
        self.mlp = SwiGLU(config, dtype, device)
        self.adaln_proj = AdaLNProjection(config, config.adaln_out_features, dtype, device)

    def modulation(
        self, temb: Tensor, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> BlockModulation:
        """This block's AdaLN tables for the M timesteps of `temb` (optionally with the projection's weights given,
        e.g. streamed from CPU memory)."""
        # Output features are [modality][6 chunks][hidden], so a [M*3, 6, hidden] view puts the AdaLN table
        # row (timestep_index * 3 + tag) first.
        table = self.adaln_proj(temb, weight, bias).view(-1, NUM_BLOCK_MODULATIONS, self.hidden_size)
        shift_attn, scale_attn, gate_attn, shift_ffn, scale_ffn, gate_ffn = table.unbind(dim=1)
        # `1 + scale` is taken on the [M*3, hidden] table before the per-row gather: the same bf16 additions as
        # after it, but on a dozen rows instead of the whole sequence.
        return BlockModulation(
            shift_attn=shift_attn.contiguous(),
            scale_plus_one_attn=1.0 + scale_attn,
            gate_attn=gate_attn.contiguous(),
            shift_ffn=shift_ffn.contiguous(),
            scale_plus_one_ffn=1.0 + scale_ffn,
            gate_ffn=gate_ffn.contiguous(),
        )

    def attention_input(self, hidden: Tensor, modulation: BlockModulation, layout: PackedLayout) -> Tensor:
        """The first modulated norm: norm1(hidden) * (1 + scale_attn) + shift_attn, per packed row."""
        return ops.modulated_rms_norm(
            hidden,
            self.norm1.weight,
            self.norm1.eps,
            modulation.scale_plus_one_attn,
            modulation.shift_attn,
            layout.adaln_index,
        )

    def forward(self, hidden: Tensor, modulation: BlockModulation, layout: PackedLayout) -> Tensor:
        hidden, _ = self.forward_from(
            hidden, self.attention_input(hidden, modulation, layout), modulation, layout
        )
        return hidden

    def forward_from(
        self,
        hidden: Tensor,
        modulated: Tensor,
        modulation: BlockModulation,
        layout: PackedLayout,
        following: tuple[DiTBlock, BlockModulation] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The block from its attention input `modulated` (`attention_input(hidden, ...)`) on: (new hidden, the
        `following` block's attention input of it, or None without a following block). The last gated residual and
        the next block's first norm then run as one op, one pass over the sequence instead of two."""
        # Each op gathers its table rows per packed row: table[adaln_index] (see `h3engine.models.ops` for the rounding).
        rows, tables = layout.adaln_index, modulation
        attended = self.attn(modulated, layout.rope_cos_sin, layout.attend)
        # hidden + gate_attn * attended, and the FFN's modulated norm of that sum, in one pass.
        hidden, modulated = ops.gated_residual_rms_norm(
            hidden,
            tables.gate_attn,
            rows,
            attended,
            self.norm2.weight,
            self.norm2.eps,
            tables.scale_plus_one_ffn,
            tables.shift_ffn,
        )
        del attended  # what is dropped here and below is not held through the FFN and the last fused op
        update = self.mlp(modulated)
        del modulated
        if following is None:
            return ops.gated_residual(hidden, tables.gate_ffn, rows, update), None
        block, next_tables = following
        return ops.gated_residual_rms_norm(
            hidden,
            tables.gate_ffn,
            rows,
            update,
            block.norm1.weight,
            block.norm1.eps,
            next_tables.scale_plus_one_attn,
            next_tables.shift_attn,
        )


def run_blocks(
    blocks: Sequence[DiTBlock], modulations: Sequence[BlockModulation], hidden: Tensor, layout: PackedLayout
) -> Tensor:
    """The DiT blocks in order on the packed rows. Each block's last gated residual is fused with the next block's
    first modulated norm (`DiTBlock.forward_from`): the same ops as block after block, one pass fewer each."""
    chain = list(zip(blocks, modulations, strict=True))
    if not chain:
        return hidden
    # Tables may still be in flight on the stream that builds a schedule's (h3engine.engine.sampling.modulation): each block waits
    # for its own and, for the fused next norm, the following block's.
    modulated = chain[0][0].attention_input(hidden, chain[0][1].wait(), layout)
    for index, (block, modulation) in enumerate(chain):
        following = chain[index + 1] if index + 1 < len(chain) else None
        if following is not None:
            following[1].wait()
        hidden, modulated = block.forward_from(hidden, modulated, modulation, layout, following)
    return hidden


# (blocks, their modulations, hidden, layout) -> hidden: how a forward runs its block chain (`run_blocks`'s signature).
BlocksRunner = Callable[[Sequence["DiTBlock"], Sequence["BlockModulation"], Tensor, "PackedLayout"], Tensor]


class FinalLayer(nn.Module):
    """RMSNorm + shift/scale indexed by timestep only (not modality), then the fp32 video and audio heads."""

    def __init__(self, config: DiTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.activation_chunks = 1  # row chunks of the heads (h3engine.models.dit_chunks): as above
        self.norm = RMSNorm(config.hidden_size, config.eps, dtype, device)
        self.adaln_proj = AdaLNProjection(config, config.final_adaln_out_features, dtype, device)
        self.video_out = nn.Linear(
            config.hidden_size, config.video_patch_dim, dtype=torch.float32, device=device
        )
        self.audio_out = nn.Linear(
            config.hidden_size, config.audio_in_channels, dtype=torch.float32, device=device
        )

    def modulation(
        self, temb: Tensor, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(1 + scale, shift) tables [M, hidden] for the M timesteps of `temb`."""
        shift, scale = self.adaln_proj(temb, weight, bias).chunk(2, dim=-1)
        return 1.0 + scale, shift.contiguous()

    def forward(
        self, hidden: Tensor, modulation: tuple[Tensor, Tensor], layout: PackedLayout
    ) -> tuple[Tensor, Tensor]:
        scale_plus_one, shift = modulation
        modulated = ops.modulated_rms_norm(
            hidden, self.norm.weight, self.norm.eps, scale_plus_one, shift, layout.timestep_index
        )
        # The modulation runs in the compute dtype; the heads are fp32 islands and produce fp32 velocities.
        return dit_chunks.fp32_velocities(self, modulated, layout)


@dataclass(frozen=True)
class BlockModulation:
    """One block's AdaLN tables for one forward: [M*3, hidden] each, row timestep_index * 3 + modality tag."""

    shift_attn: Tensor
    scale_plus_one_attn: Tensor
    gate_attn: Tensor
    shift_ffn: Tensor
    scale_plus_one_ffn: Tensor
    gate_ffn: Tensor

    def wait(self) -> BlockModulation:
        """These tables, ready to be read; tables built on another CUDA stream (h3engine.engine.sampling.modulation) first make the
        reading stream wait for them."""
        return self


@dataclass(frozen=True)
class StepModulation:
    """Every AdaLN table of one forward: one `BlockModulation` per block and the final layer's (1 + scale, shift).

    It depends only on the forward's M distinct timesteps, so a request can build the tables of every step of its
    schedule once (h3engine.engine.sampling.modulation) and pass each forward its step's.
    """

    blocks: tuple[BlockModulation, ...]
    final: tuple[Tensor, Tensor]

    def final_tables(self) -> tuple[Tensor, Tensor]:
        """The final layer's tables, ready to be read (see `BlockModulation.wait`)."""
        return self.final


@dataclass(frozen=True)
class PackedLayout:
    """Tensors derived from the packed layout alone, computed once per forward by `H3DiT.prepare_layout`.

    RoPE tables depend only on the request's positions. The index tensors depend on which rows share a timestep,
    which is fixed for a request except at steps where two modalities' timesteps coincide (e.g. t_v == t_a == 0
    at the first step collapses M), so a per-request cache must key on `timestep_index` too.
    """

    rope_cos_sin: tuple[Tensor, Tensor]
    adaln_index: Tensor
    timestep_index: Tensor
    video_index: Tensor
    audio_index: Tensor
    text_index: Tensor
    # One process holding every row attends locally; a sequence-parallel shard (h3engine.models.parallel) passes a kernel
    # that exchanges rows with the other shards around the attention call.
    attend: AttentionKernel = attention

    @property
    def sequence_length(self) -> int:
        return self.adaln_index.shape[0]

    @property
    def local(self) -> PackedLayout:
        """The layout of the rows this process holds: all of them (a sequence-parallel shard holds a block)."""
        return self


def packed_rows(sequence_length: int, *parts: tuple[Tensor, Tensor]) -> Tensor:
    """[sequence_length, width] zeros in the first part's dtype, with each (rows, index) part's rows at its index."""
    first = parts[0][0]
    hidden = first.new_zeros(sequence_length, first.shape[1])
    for rows, index in parts:
        hidden.index_copy_(0, index, rows.to(hidden.dtype))
    return hidden


class H3DiT(nn.Module):
    """The H3 DiT over one packed request (see the module docstring for the contract and the fp32 islands)."""

    def __init__(
        self, config: DiTConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.video_patch_proj = nn.Linear(
            config.video_patch_dim, config.hidden_size, dtype=torch.float32, device=device
        )
        self.audio_patch_proj = nn.Linear(
            config.audio_in_channels, config.hidden_size, dtype=torch.float32, device=device
        )
        self.condition_proj = nn.Linear(config.text_dim, config.hidden_size, dtype=dtype, device=device)
        self.time_embedder = TimestepEmbedder(config, device)
        self.rope = MultiAxisRope(config, device)
        self.token_refiner = TokenRefiner(config, dtype, device)
        self.blocks = nn.ModuleList(DiTBlock(config, dtype, device) for _ in range(config.num_layers))
        self.final_layer = FinalLayer(config, dtype, device)

    @property
    def activation_chunks(self) -> int:
        """Row chunks and head groups of the forward (1: off); change it with `set_activation_chunks`."""
        return self.final_layer.activation_chunks

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the packed sequence: that of the (bf16 in the release) non-island weights."""
        return self.condition_proj.weight.dtype

    def prepare_layout(
        self,
        timestep_index: Tensor,
        tags: Tensor,
        positions: Tensor,
        video_index: Tensor,
        audio_index: Tensor,
        text_index: Tensor,
    ) -> PackedLayout:
        """Request-static work: RoPE cos/sin from the fp64 positions and each row's AdaLN table row."""
        sequence_length = positions.shape[0]
        if positions.shape != (sequence_length, 3):
            raise ValueError(f"positions must be [S, 3], got {list(positions.shape)}")
        if tags.shape != (sequence_length,) or timestep_index.shape != (sequence_length,):
            raise ValueError(
                f"tags {list(tags.shape)} and timestep_index {list(timestep_index.shape)} must both be "
                f"[S] with S = {sequence_length}"
            )
        if video_index.numel() + audio_index.numel() + text_index.numel() != sequence_length:
            raise ValueError(
                f"video/audio/text index lengths {video_index.numel()}+{audio_index.numel()}+"
                f"{text_index.numel()} must add up to S = {sequence_length}"
            )
        return PackedLayout(
            rope_cos_sin=self.rope.cos_sin(positions, self.compute_dtype),
            adaln_index=timestep_index * NUM_MODALITIES + tags,
            timestep_index=timestep_index,
            video_index=video_index,
            audio_index=audio_index,
            text_index=text_index,
        )

    def forward(
        self,
        video_rows: Tensor,
        audio_rows: Tensor,
        text_states: Tensor,
        timesteps: Tensor,
        timestep_index: Tensor,
        tags: Tensor,
        positions: Tensor,
        video_index: Tensor,
        audio_index: Tensor,
        text_index: Tensor,
        layout: PackedLayout | None = None,
        modulation: StepModulation | None = None,
        blocks_runner: BlocksRunner | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One packed request -> (video velocity [Nv, C*prod(patch)] fp32, audio velocity [Na, Ca] fp32).

        A denoising loop passes the request-static `layout` (from `prepare_layout` on the same index tensors) and
        this step's `modulation` (h3engine.engine.sampling.modulation.schedule_modulation) so that neither is rebuilt every step.
        `blocks_runner` runs the block chain instead of `run_blocks` (the step cache, h3engine.engine.sampling.step_cache).
        """
        if layout is None:
            layout = self.prepare_layout(
                timestep_index, tags, positions, video_index, audio_index, text_index
            )
        return self.forward_with_layout(
            video_rows, audio_rows, text_states, timesteps, layout, modulation, blocks_runner
        )

    def check_packed_inputs(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor, layout: PackedLayout
    ) -> None:
        """Raise ValueError unless the row tensors have the layout's row counts and the config's widths."""
        expected = {
            "video_rows": (video_rows, layout.video_index.numel(), self.config.video_patch_dim, "Nv"),
            "audio_rows": (audio_rows, layout.audio_index.numel(), self.config.audio_in_channels, "Na"),
            "text_states": (text_states, layout.text_index.numel(), self.config.text_dim, "Lt"),
        }
        for name, (rows, count, width, symbol) in expected.items():
            if rows.shape != (count, width):
                raise ValueError(f"{name} must be [{symbol}, {width}], got {list(rows.shape)}")

    def forward_with_layout(
        self,
        video_rows: Tensor,
        audio_rows: Tensor,
        text_states: Tensor,
        timesteps: Tensor,
        layout: PackedLayout,
        modulation: StepModulation | None = None,
        blocks_runner: BlocksRunner | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`forward` with the request-static tensors (and optionally this step's AdaLN tables) already prepared:
        the rows are embedded into the packed sequence, run through the blocks (`run_blocks`, or `blocks_runner`
        when given), and the head reads them out."""
        self.check_packed_inputs(video_rows, audio_rows, text_states, layout)
        if modulation is None:
            modulation = self.modulation(timesteps)
        # The embedded rows go straight in: no name here keeps them alive while the blocks run.
        embedded = [self.embed(video_rows, audio_rows, text_states, layout)]
        runner = run_blocks if blocks_runner is None else blocks_runner
        hidden = runner(self.blocks, modulation.blocks, embedded.pop(), layout.local)
        return self.head(hidden, modulation.final_tables(), layout)

    def project_inputs(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(video, audio, text) rows of width hidden_size: video and audio through their fp32 patch projections in
        fp32, text through the condition projection and the token refiner (its dtype sets the packed sequence's)."""
        video = self.video_patch_proj(video_rows.to(torch.float32))
        audio = self.audio_patch_proj(audio_rows.to(torch.float32))
        text = self.token_refiner(self.condition_proj(text_states.to(self.compute_dtype)))
        return video, audio, text

    def embed(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor, layout: PackedLayout
    ) -> Tensor:
        """The packed sequence [S, hidden] the blocks run on: each modality's projected rows at its positions."""
        if self.activation_chunks > 1:
            return dit_chunks.embed_by_rows(self, video_rows, audio_rows, text_states, layout)
        video, audio, text = self.project_inputs(video_rows, audio_rows, text_states)
        return packed_rows(
            layout.sequence_length,
            (text, layout.text_index),
            (video, layout.video_index),
            (audio, layout.audio_index),
        )

    def head(
        self, hidden: Tensor, final_tables: tuple[Tensor, Tensor], layout: PackedLayout
    ) -> tuple[Tensor, Tensor]:
        """The blocks' output -> fp32 (video, audio) velocities in the order of the layout's row indices."""
        return self.final_layer(hidden, final_tables, layout)

    def modulation(self, timesteps: Tensor) -> StepModulation:
        """Every AdaLN table of one forward with these M timesteps (fp32 [M], on the compute device)."""
        # temb stays fp32 ([M, time_embed_dim]); each AdaLN projection casts only after its SiLU.
        temb = self.time_embedder(timesteps)
        return StepModulation(
            blocks=tuple(block.modulation(temb) for block in self.blocks),
            final=self.final_layer.modulation(temb),
        )


def set_activation_chunks(dit: H3DiT, chunks: int) -> None:
    """Chunk `dit`'s activations from its next forward on (h3engine.models.dit_chunks; 1: off, ValueError below)."""
    dit_chunks.set_chunks(dit, chunks)
