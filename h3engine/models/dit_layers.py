"""The layers of the H3 DiT (h3engine.models.dit.H3DiT is built from them) and the tables one forward reads.

RMSNorm, the fp32 timestep embedder, the 3-axis RoPE, attention with a fused QKV weight and per-head QK-norm, SwiGLU,
the AdaLN projections, the text token refiner, the DiT block (`run_blocks` fuses each block's last gated residual
with the next block's first modulated norm) and the final layer with its fp32 heads. `BlockModulation` and
`StepModulation` hold one forward's AdaLN tables, `PackedLayout` its request-static tensors. A LoRA's update rides
on a linear under `LOW_RANK_ATTRIBUTE`. Each layer takes the compute dtype at construction; the fp32 islands
(h3engine.models.dit.FP32_PARAMETER_NAMES) are built in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.models import attention as attention_ops
from h3engine.models import dit_chunks, ops
from h3engine.models.attention import AttentionKernel
from h3engine.models.dit_config import NUM_BLOCK_MODULATIONS, DiTConfig

# The sinusoidal timestep features use the classic 10000 period.
TIMESTEP_MAX_PERIOD = 10000.0

# h3engine.engine.lora.adapters puts a LoRA's update (a callable on the layer's input) on a linear under this name; a forward hook
# adds it where the layer is called, and the paths below that read the weight instead add it themselves.
LOW_RANK_ATTRIBUTE = "low_rank_update"


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
    """The AdaLN input (`H3DiT.adaln_input`) -> Linear.

    Exact form: SiLU runs on the fp32 temb; only its result is cast to the (bf16) linear's dtype. Pruned forms
    (h3engine.models.dit_adaln): no SiLU, the adaln_rank-wide linear is held and computed in fp32 (as ComfyUI runs
    the published files) and its tables are cast to the compute dtype.
    """

    def __init__(
        self, config: DiTConfig, out_features: int, dtype: torch.dtype, device: torch.device | str | None
    ):
        super().__init__()
        self.pruned = config.adaln_form != "exact"
        self.output_dtype = dtype
        linear_dtype = torch.float32 if self.pruned else dtype
        self.linear = nn.Linear(config.adaln_in_features, out_features, dtype=linear_dtype, device=device)

    def forward(
        self, adaln_input: Tensor, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> Tensor:
        """`weight` / `bias` stand in for the module's own (the same values on another device)."""
        weight = self.linear.weight if weight is None else weight
        bias = self.linear.bias if bias is None else bias
        update = getattr(self.linear, LOW_RANK_ATTRIBUTE, None)
        if self.pruned:
            activated = adaln_input.to(torch.float32)
            table = F.linear(activated, weight.to(torch.float32), bias.to(torch.float32))
            table = table if update is None else table + update(activated).to(torch.float32)
            return table.to(self.output_dtype)
        activated = F.silu(adaln_input).to(weight.dtype)
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
        self, adaln_input: Tensor, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> BlockModulation:
        """This block's AdaLN tables for the M timesteps of `adaln_input` (`H3DiT.adaln_input`; optionally with the
        projection's weights given, e.g. streamed from CPU memory)."""
        # Output features are [modality][6 chunks][hidden], so a [M*3, 6, hidden] view puts the AdaLN table
        # row (timestep_index * 3 + tag) first.
        table = self.adaln_proj(adaln_input, weight, bias).view(-1, NUM_BLOCK_MODULATIONS, self.hidden_size)
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
        self, adaln_input: Tensor, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(1 + scale, shift) tables [M, hidden] for the M timesteps of `adaln_input` (`H3DiT.adaln_input`)."""
        shift, scale = self.adaln_proj(adaln_input, weight, bias).chunk(2, dim=-1)
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
