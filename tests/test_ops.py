"""h3engine.models.ops and its kernels: the torch twins are the model's unfused math; the Triton kernels equal the twins.

CPU: the twins (called through `h3engine.models.ops`, which picks them for CPU tensors) equal the model's unfused
expressions, written out here from its building blocks (RMSNorm, gather_rows, apply_rope, F.silu, the collectives'
permutations), and DiTBlock / Attention / FinalLayer, which now call the ops, still equal those expressions
bit-exactly. Triton (`test_triton_kernel_*`): on a CUDA GPU in bf16, fp16 and fp32; on CPU the same tests run in a
subprocess under TRITON_INTERPRET=1 in fp32 and fp16 only (the interpreter converts to bf16 by truncation, not
rounding, so it cannot check bf16 rounding points).

How the Triton checks separate reduction order from rounding: an RMSNorm op run with scale 1 and shift 0 (or cos 1
and sin 0, or a value half of ones for SwiGLU) returns its own normed (or silu) values. Those must be within one
ulp of torch's in rare elements (bf16/fp16) or within a few fp32 ulps (summation order, rsqrt, exp); the full op
must then equal the reference chain applied to them exactly, which pins every rounding point.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from _interpreter import assert_kernel_tests_pass_interpreted
from torch import Tensor

from h3engine.models import ops
from h3engine.models.dit_config import NUM_BLOCK_MODULATIONS, DiTConfig
from h3engine.models.dit_layers import (
    Attention,
    BlockModulation,
    DiTBlock,
    FinalLayer,
    MultiAxisRope,
    PackedLayout,
    RMSNorm,
    SwiGLU,
    attention,
    run_blocks,
)
from h3engine.models.kernels import reference
from h3engine.models.kernels.reference.rope import rotate_first_channels
from h3engine.models.parallel import collectives
from h3engine.models.parallel.groups import GroupMembership

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRETING
EPS = 1e-5


def gather_rows(table: Tensor, rows: Tensor) -> Tensor:
    """table[rows]: each packed row's AdaLN table row (the model's pre-fusion gather)."""
    return table.index_select(0, rows)


def apply_rope(hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The model's pre-fusion RoPE (rotate-half of the first cos.shape[-1] channels; its semantics are pinned
    against explicit angles in tests/test_dit.py)."""
    return rotate_first_channels(hidden, cos, sin)


# --------------------------------------------------------------------------------------------------------------
# The twins (through the dispatcher, on CPU) are the model's unfused math
# --------------------------------------------------------------------------------------------------------------


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn at random (norm weights included, so a dropped weight shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            offset = 1.0 if parameter.dim() == 1 else 0.0
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 + offset)
    return module.requires_grad_(False)


def tiny_layout(
    config: DiTConfig, sequence_length: int, num_timesteps: int, dtype: torch.dtype
) -> PackedLayout:
    generator = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 9, (sequence_length, 3), generator=generator).to(torch.float64)
    timestep_index = torch.randint(0, num_timesteps, (sequence_length,), generator=generator)
    tags = torch.randint(0, 3, (sequence_length,), generator=generator)
    every_row = torch.arange(sequence_length)
    return PackedLayout(
        rope_cos_sin=MultiAxisRope(config, "cpu").cos_sin(positions, dtype),
        adaln_index=timestep_index * 3 + tags,
        timestep_index=timestep_index,
        video_index=every_row[: sequence_length // 2],
        audio_index=every_row[sequence_length // 2 :],
        text_index=every_row[:0],
    )


def unfused_attention(attn: Attention, hidden: Tensor, rope_cos_sin: tuple[Tensor, Tensor] | None) -> Tensor:
    """`Attention.forward` as the model wrote it before the fused ops."""
    sequence_length = hidden.shape[0]
    query_weight, key_weight, value_weight = attn.qkv_proj.weight.chunk(3)
    heads = (sequence_length, attn.num_heads, attn.head_dim)
    query = attn.q_norm(F.linear(hidden, query_weight).view(heads))
    key = attn.k_norm(F.linear(hidden, key_weight).view(heads))
    value = F.linear(hidden, value_weight).view(heads)
    if rope_cos_sin is not None:
        query, key = apply_rope(query, *rope_cos_sin), apply_rope(key, *rope_cos_sin)
    output = attention(query, key, value)
    return attn.out_proj(output.reshape(sequence_length, attn.num_heads * attn.head_dim))


def unfused_swiglu(mlp: SwiGLU, hidden: Tensor) -> Tensor:
    gate, value = mlp.fc1(hidden).chunk(2, dim=-1)
    return mlp.fc2(F.silu(gate) * value)


def unfused_block(block: DiTBlock, hidden: Tensor, tables: BlockModulation, layout: PackedLayout) -> Tensor:
    """`DiTBlock.forward` as the model wrote it before the fused ops."""
    rows = layout.adaln_index
    modulated = block.norm1(hidden) * gather_rows(tables.scale_plus_one_attn, rows) + gather_rows(
        tables.shift_attn, rows
    )
    attended = unfused_attention(block.attn, modulated, layout.rope_cos_sin)
    hidden = hidden + gather_rows(tables.gate_attn, rows) * attended
    modulated = block.norm2(hidden) * gather_rows(tables.scale_plus_one_ffn, rows) + gather_rows(
        tables.shift_ffn, rows
    )
    return hidden + gather_rows(tables.gate_ffn, rows) * unfused_swiglu(block.mlp, modulated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_twins_equal_the_unfused_model_expressions(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(6)

    def draw_cpu(*shape: int, scale: float = 1.0, offset: float = 0.0) -> Tensor:
        return (torch.randn(shape, generator=generator) * scale + offset).to(dtype)

    hidden, update = draw_cpu(9, 16, scale=3.0), draw_cpu(9, 16)
    # AdaLN tables as DiTBlock builds them: unbound (strided) chunks of a [R, 6, H] table, 1 + scale on the table.
    shift, scale, gate = draw_cpu(4, NUM_BLOCK_MODULATIONS, 16).unbind(dim=1)[:3]
    scale_plus_one = 1.0 + scale
    rows = torch.randint(0, 4, (9,), generator=generator)
    norm = randomized(RMSNorm(16, EPS, dtype, "cpu"), seed=8)
    assert ops.implementation(
        "modulated_rms_norm", hidden, norm.weight, EPS, scale_plus_one, shift, rows
    ) == ("reference")

    expected_modulated = norm(hidden) * gather_rows(scale_plus_one, rows) + gather_rows(shift, rows)
    assert torch.equal(
        ops.modulated_rms_norm(hidden, norm.weight, EPS, scale_plus_one, shift, rows), expected_modulated
    )
    expected_hidden = hidden + gather_rows(gate, rows) * update
    assert torch.equal(ops.gated_residual(hidden, gate, rows, update), expected_hidden)
    new_hidden, modulated = ops.gated_residual_rms_norm(
        hidden, gate, rows, update, norm.weight, EPS, scale_plus_one, shift
    )
    assert torch.equal(new_hidden, expected_hidden)
    assert torch.equal(
        modulated, norm(expected_hidden) * gather_rows(scale_plus_one, rows) + gather_rows(shift, rows)
    )

    # query and key as views of one projection output, as Attention makes them.
    query, key = draw_cpu(9, 2 * 2 * 12, scale=2.0).view(9, 2, 2, 12).unbind(dim=1)
    q_norm, k_norm = (
        randomized(RMSNorm(12, EPS, dtype, "cpu"), seed=9),
        randomized(RMSNorm(12, EPS, dtype, "cpu"), seed=10),
    )
    angles = torch.randn(9, 4, generator=generator).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated_query, rotated_key = ops.qk_norm_rope(query, key, q_norm.weight, k_norm.weight, EPS, cos, sin)
    assert torch.equal(rotated_query, apply_rope(q_norm(query), cos, sin))
    assert torch.equal(rotated_key, apply_rope(k_norm(key), cos, sin))
    normed_query, normed_key = ops.qk_norm_rope(query, key, q_norm.weight, k_norm.weight, EPS, None, None)
    assert torch.equal(normed_query, q_norm(query)) and torch.equal(normed_key, k_norm(key))
    with pytest.raises(ValueError, match="both be tensors or both be None"):
        ops.qk_norm_rope(query, key, q_norm.weight, k_norm.weight, EPS, cos, None)

    fused = draw_cpu(9, 2 * 20, scale=4.0)
    gate_half, value_half = fused.chunk(2, dim=-1)
    assert torch.equal(ops.swiglu(fused), F.silu(gate_half) * value_half)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dit_block_attention_and_final_layer_equal_the_unfused_expressions(dtype: torch.dtype) -> None:
    config = DiTConfig.tiny()
    block = randomized(DiTBlock(config, dtype, "cpu"), seed=1)
    final = randomized(FinalLayer(config, dtype, "cpu"), seed=4)
    layout = tiny_layout(config, sequence_length=23, num_timesteps=2, dtype=dtype)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, config.hidden_size, generator=generator).to(dtype)
    temb = torch.randn(2, config.time_embed_dim, generator=generator)
    with torch.no_grad():
        tables = block.modulation(temb)
        assert torch.equal(block(hidden, tables, layout), unfused_block(block, hidden, tables, layout))
        # The text refiner's attention has no RoPE (cos/sin None).
        assert torch.equal(block.attn(hidden, None), unfused_attention(block.attn, hidden, None))

        scale_plus_one, shift = final.modulation(temb)
        rows = layout.timestep_index
        modulated = final.norm(hidden) * gather_rows(scale_plus_one, rows) + gather_rows(shift, rows)
        video_velocity, audio_velocity = final(hidden, (scale_plus_one, shift), layout)
        assert torch.equal(video_velocity, final.video_out(modulated[layout.video_index].to(torch.float32)))
        assert torch.equal(audio_velocity, final.audio_out(modulated[layout.audio_index].to(torch.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_run_blocks_fuses_across_blocks_and_equals_block_after_block(dtype: torch.dtype) -> None:
    config = DiTConfig.tiny()
    blocks = [randomized(DiTBlock(config, dtype, "cpu"), seed=10 + index) for index in range(3)]
    layout = tiny_layout(config, sequence_length=23, num_timesteps=2, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(23, config.hidden_size, generator=generator).to(dtype)
    temb = torch.randn(2, config.time_embed_dim, generator=generator)
    fused_calls = []
    with torch.no_grad():
        tables = [block.modulation(temb) for block in blocks]
        expected = hidden
        for block, block_tables in zip(blocks, tables, strict=True):
            expected = block(expected, block_tables, layout)
        original = ops.gated_residual_rms_norm

        def counting(*arguments):
            fused_calls.append(len(arguments))
            return original(*arguments)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops, "gated_residual_rms_norm", counting)
            result = run_blocks(blocks, tables, hidden, layout)
    # One fused residual + norm inside each block and one across each of the two junctions; on the CPU the ops are
    # the plain-torch twins, whose fused form is the unfused chain itself.
    assert len(fused_calls) == 3 + 2
    assert torch.equal(result, expected)
    assert run_blocks([], [], hidden, layout) is hidden


class _LoopbackExchange:
    """Stands in for dist.all_to_all_single: every rank sends itself its own buffer (keeps what was sent)."""

    def __init__(self) -> None:
        self.sent: list[Tensor] = []

    def __call__(self, received: Tensor, send: Tensor, group=None) -> None:
        self.sent.append(send.clone())
        received.copy_(send)


@pytest.mark.parametrize("lead", [(), (3,)])
def test_relayout_twins_are_the_collectives_permutations(
    monkeypatch: pytest.MonkeyPatch, lead: tuple[int, ...]
) -> None:
    exchange = _LoopbackExchange()
    monkeypatch.setattr(collectives.dist, "all_to_all_single", exchange)
    group = GroupMembership(None, 4, 0)
    generator = torch.Generator().manual_seed(11)
    tensor = torch.randn((5, *lead, 8, 6), generator=generator)

    # sequence_to_heads' send buffer: head block j in slot j.
    expected_send = tensor.unflatten(-2, (4, 2)).movedim(-3, 0).contiguous()
    packed = ops.pack_heads_for_exchange(tensor, 4)
    assert packed.is_contiguous() and torch.equal(packed, expected_send)
    collectives.sequence_to_heads(tensor, group)
    assert torch.equal(exchange.sent[-1], expected_send)

    # heads_to_sequence: with a loopback exchange its receive buffer is its own [size, rows / size, ...] send buffer.
    per_rank = torch.randn((4 * 5, *lead, 2, 6), generator=generator)
    received = per_rank.unflatten(0, (4, 5))
    expected = received.movedim(0, -3).flatten(-3, -2)
    unpacked = ops.unpack_exchanged_heads(received)
    assert unpacked.is_contiguous() and torch.equal(unpacked, expected)
    assert torch.equal(collectives.heads_to_sequence(per_rank, group), expected)
    assert torch.equal(ops.unpack_exchanged_heads(packed), tensor)


def test_dispatcher_on_cpu_tensors_and_unknown_names() -> None:
    fused = torch.randn(3, 8)
    assert ops.implementation("swiglu", fused) == "reference"
    with ops.force_reference():
        assert ops.implementation("swiglu", fused) == "reference"
    with pytest.raises(ValueError, match="no op named 'softmax'"):
        ops.implementation("softmax", fused)


def test_kernels_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("H3_KERNELS", "reference")
    assert ops._reference_forced_by_environment()
    monkeypatch.setenv("H3_KERNELS", "auto")
    assert not ops._reference_forced_by_environment()
    monkeypatch.setenv("H3_KERNELS", "fastest")
    with pytest.raises(ValueError, match="H3_KERNELS='fastest'"):
        ops._reference_forced_by_environment()


# --------------------------------------------------------------------------------------------------------------
# Triton kernels against the twins (CUDA, or CPU under the interpreter)
# --------------------------------------------------------------------------------------------------------------

needs_triton_device = pytest.mark.skipif(not (HAS_CUDA or INTERPRETING), reason="needs a CUDA GPU")
# CUDA tests that Triton's interpreter (set for the whole run) would send to the CPU.
not_interpreted = pytest.mark.skipif(
    INTERPRETING, reason="runs compiled kernels on a CUDA GPU, not the interpreter"
)

DEVICE = "cuda" if HAS_CUDA else "cpu"
KERNEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32] if HAS_CUDA else [torch.float16, torch.float32]
# (rows, hidden, table rows): one row; widths below, at and past a power of two; the released hidden on a GPU.
NORM_SHAPES = [(1, 16, 1), (7, 40, 5)] + ([(5, 64, 3), (301, 5376, 6), (64, 3000, 2)] if HAS_CUDA else [])
# (rows, heads, head_dim, rotary_dim): tiny config (all 12 rotated), partial rotation, odd head count, released.
ROPE_SHAPES = [(3, 2, 12, 12), (4, 3, 12, 8), (2, 2, 128, 96)] + (
    [(2, 5, 16, 2), (257, 56, 128, 96), (33, 7, 80, 48)] if HAS_CUDA else []
)
# (rows, hidden) of the video decoder's fp32-stream norms: tiny widths, past a power of two, the released 2048.
DECODER_NORM_SHAPES = [(1, 16), (7, 40)] + ([(5, 64), (301, 2048), (64, 3000)] if HAS_CUDA else [])
SWIGLU_SHAPES = [(1, 1), (5, 37)] + ([(3, 64), (129, 14336), (77, 3000)] if HAS_CUDA else [])
# (rows, lead, heads, head_dim, size): stacked q/k/v lead axis, no lead, two lead axes with one rank, released.
RELAYOUT_SHAPES = [(5, (3,), 8, 6, 4), (3, (), 6, 12, 3), (4, (2, 3), 4, 5, 1)] + (
    [(2, (3,), 56, 128, 8), (301, (3,), 28, 128, 2)] if HAS_CUDA else []
)


def triton_kernels():
    from h3engine.models.kernels import triton as kernels_triton

    return kernels_triton


def draw(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0, offset: float = 0.0
) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale + offset).to(dtype).to(DEVICE)


def ulp(values: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of `dtype` at each |value| (float64), subnormal spacing at the bottom."""
    info = torch.finfo(dtype)
    smallest_spacing = info.smallest_normal * info.eps
    _, exponent = torch.frexp(values.abs().double())
    spacing = torch.ldexp(
        torch.full(values.shape, info.eps, dtype=torch.float64, device=values.device), exponent - 1
    )
    return torch.where(values == 0, smallest_spacing, spacing.clamp(min=smallest_spacing))


def assert_rounding_level(actual: Tensor, expected: Tensor, fp32_ulps: int) -> None:
    """bf16/fp16: at most 1 ulp apart, in at most 1 % of the elements (+2); fp32: at most `fp32_ulps` ulps."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    spacing = ulp(torch.maximum(actual.abs(), expected.abs()).double(), actual.dtype)
    distance = ((actual.double() - expected.double()).abs() / spacing).max().item() if actual.numel() else 0.0
    if actual.dtype == torch.float32:
        assert distance <= fp32_ulps, f"{distance} fp32 ulps apart"
    else:
        differing = (actual != expected).sum().item()
        assert distance <= 1, f"{distance} ulps apart"
        assert differing <= 2 + actual.numel() // 100, f"{differing} of {actual.numel()} elements differ"


def norm_fp32_ulps(width: int) -> int:
    """fp32 distance two RMSNorms may have: the mean square summed in two orders (log2(width) roundings each,
    halved by the square root), two rsqrt implementations (1-2 ulps) and the two products."""
    return math.ceil(math.log2(max(width, 2))) + 4


def adaln_tables(rows: int, width: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(scale_plus_one, shift, gate) laid out like DiTBlock's: unbound chunks of a [R, 6, H] table (strided)."""
    table = draw((rows, NUM_BLOCK_MODULATIONS, width), dtype, seed)
    shift, scale, gate = table.unbind(dim=1)[:3]
    return 1.0 + scale, shift, gate


@needs_triton_device
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_triton_kernel_modulated_rms_norm(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    sequence_length, width, table_rows = shape
    kernels_triton = triton_kernels()
    hidden = draw((sequence_length, width), dtype, 1, scale=3.0)
    weight = draw((width,), dtype, 2, scale=0.5, offset=1.0)
    scale_plus_one, shift, _ = adaln_tables(table_rows, width, dtype, 3)
    rows = torch.randint(0, table_rows, (sequence_length,), generator=torch.Generator().manual_seed(4)).to(
        DEVICE
    )
    assert kernels_triton.supports_modulated_rms_norm(hidden, weight, EPS, scale_plus_one, shift, rows)

    ones, zeros = torch.ones_like(scale_plus_one), torch.zeros_like(shift)
    normed = kernels_triton.modulated_rms_norm(hidden, weight, EPS, ones, zeros, rows)
    assert_rounding_level(normed, F.rms_norm(hidden, (width,), weight, EPS), norm_fp32_ulps(width))
    modulated = kernels_triton.modulated_rms_norm(hidden, weight, EPS, scale_plus_one, shift, rows)
    assert torch.equal(modulated, normed * scale_plus_one.index_select(0, rows) + shift.index_select(0, rows))


@needs_triton_device
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_triton_kernel_gated_residual_and_fused_norm(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    sequence_length, width, table_rows = shape
    kernels_triton = triton_kernels()
    # hidden as a strided row view (every other row of a buffer) to exercise the row stride.
    hidden = draw((2 * sequence_length, width), dtype, 5, scale=4.0)[::2]
    update = draw((sequence_length, width), dtype, 6, scale=2.0)
    weight = draw((width,), dtype, 7, scale=0.5, offset=1.0)
    scale_plus_one, shift, gate = adaln_tables(table_rows, width, dtype, 8)
    rows = torch.randint(0, table_rows, (sequence_length,), generator=torch.Generator().manual_seed(9)).to(
        DEVICE
    )

    expected_hidden = reference.gated_residual(hidden, gate, rows, update)
    assert torch.equal(kernels_triton.gated_residual(hidden, gate, rows, update), expected_hidden)

    arguments = (hidden, gate, rows, update, weight, EPS)
    new_hidden, normed = kernels_triton.gated_residual_rms_norm(
        *arguments, torch.ones_like(scale_plus_one), torch.zeros_like(shift)
    )
    assert torch.equal(new_hidden, expected_hidden)
    assert_rounding_level(normed, F.rms_norm(expected_hidden, (width,), weight, EPS), norm_fp32_ulps(width))
    new_hidden, modulated = kernels_triton.gated_residual_rms_norm(*arguments, scale_plus_one, shift)
    assert torch.equal(new_hidden, expected_hidden)
    assert torch.equal(modulated, normed * scale_plus_one.index_select(0, rows) + shift.index_select(0, rows))


@needs_triton_device
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_triton_kernel_qk_norm_rope(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    sequence_length, heads, head_dim, rotary_dim = shape
    kernels_triton = triton_kernels()
    # query and key as strided views of one fused [S, 3 * heads * D] projection output.
    fused = draw((sequence_length, 3 * heads * head_dim), dtype, 10, scale=2.0)
    query, key, _ = (part.view(sequence_length, heads, head_dim) for part in fused.chunk(3, dim=-1))
    q_weight = draw((head_dim,), dtype, 11, scale=0.5, offset=1.0)
    k_weight = draw((head_dim,), dtype, 12, scale=0.5, offset=1.0)
    angles = draw((sequence_length, rotary_dim // 2), torch.float32, 13, scale=3.0).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    arguments = (query, key, q_weight, k_weight, EPS)
    assert kernels_triton.supports_qk_norm_rope(*arguments, cos, sin)

    normed_query, normed_key = kernels_triton.qk_norm_rope(
        *arguments, torch.ones_like(cos), torch.zeros_like(sin)
    )
    expected_query, expected_key = reference.qk_norm_rope(*arguments, None, None)
    assert_rounding_level(normed_query, expected_query, norm_fp32_ulps(head_dim))
    assert_rounding_level(normed_key, expected_key, norm_fp32_ulps(head_dim))
    unrotated_query, unrotated_key = kernels_triton.qk_norm_rope(*arguments, None, None)
    assert torch.equal(unrotated_query, normed_query) and torch.equal(unrotated_key, normed_key)

    rotated_query, rotated_key = kernels_triton.qk_norm_rope(*arguments, cos, sin)
    assert rotated_query.is_contiguous() and rotated_key.is_contiguous()
    assert torch.equal(rotated_query, apply_rope(normed_query, cos, sin))
    assert torch.equal(rotated_key, apply_rope(normed_key, cos, sin))


@needs_triton_device
@pytest.mark.parametrize("rows_per_program", [2, 3, 4])
def test_triton_kernel_qk_norm_rope_row_blocks_change_only_the_launch(rows_per_program: int) -> None:
    # 7 rows: the last row block is partial for every block size here.
    sequence_length, heads, head_dim, rotary_dim = 7, 5, 24, 16
    kernels_triton = triton_kernels()
    query = draw((sequence_length, heads, head_dim), torch.float16, 20, scale=2.0)
    key = draw((sequence_length, heads, head_dim), torch.float16, 21, scale=2.0)
    weights = [draw((head_dim,), torch.float16, seed, scale=0.5, offset=1.0) for seed in (22, 23)]
    angles = draw((sequence_length, rotary_dim // 2), torch.float32, 24, scale=3.0).repeat(1, 2)
    cos, sin = angles.cos().to(torch.float16), angles.sin().to(torch.float16)
    single = kernels_triton.qk_norm_rope(query, key, *weights, EPS, cos, sin, rows_per_program=1)
    blocked = kernels_triton.qk_norm_rope(
        query, key, *weights, EPS, cos, sin, rows_per_program=rows_per_program
    )
    assert torch.equal(blocked[0], single[0]) and torch.equal(blocked[1], single[1])
    assert torch.equal(
        single[0], apply_rope(reference.qk_norm_rope(query, key, *weights, EPS, None, None)[0], cos, sin)
    )


@needs_triton_device
@pytest.mark.parametrize("out_dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("update_dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", DECODER_NORM_SHAPES)
def test_triton_kernel_decoder_scaled_residual_and_norm(
    out_dtype: torch.dtype, update_dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    sequence_length, width = shape
    kernels_triton = triton_kernels()
    # The fp32 stream as a strided row view; the update in the GEMM's dtype; fp32 layer scale and norm weight.
    hidden = draw((2 * sequence_length, width), torch.float32, 30, scale=4.0)[::2]
    update = draw((sequence_length, width), update_dtype, 31, scale=2.0)
    scale = draw((width,), torch.float32, 32, scale=0.5)
    weight = draw((width,), torch.float32, 33, scale=0.5, offset=1.0)
    arguments = (hidden, update, scale, weight, EPS, out_dtype)
    assert kernels_triton.supports_scaled_residual_rms_norm_to(*arguments)

    expected_hidden, expected_normed = reference.scaled_residual_rms_norm_to(*arguments)
    new_hidden, normed = kernels_triton.scaled_residual_rms_norm_to(*arguments)
    assert new_hidden.dtype == torch.float32 and torch.equal(new_hidden, expected_hidden)
    assert_rounding_level(normed, expected_normed, norm_fp32_ulps(width))
    # The norm alone, on the new stream (its rounding may differ from the fused kernel's in fp32 ulps).
    assert_rounding_level(
        kernels_triton.rms_norm_to(expected_hidden, weight, EPS, out_dtype),
        expected_normed,
        norm_fp32_ulps(width),
    )
    # A stream stored in the update's dtype is widened exactly before the norm.
    narrow = update.to(update_dtype)
    assert_rounding_level(
        kernels_triton.rms_norm_to(narrow, weight, EPS, out_dtype),
        reference.rms_norm_to(narrow, weight, EPS, out_dtype),
        norm_fp32_ulps(width),
    )


@needs_triton_device
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
def test_triton_kernel_swiglu(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    sequence_length, width = shape
    kernels_triton = triton_kernels()
    # fc1's output as a strided view: the first 2F columns of a wider buffer.
    fused = draw((sequence_length, 2 * width + 3), dtype, 14, scale=4.0)[:, : 2 * width]
    gate = fused[:, :width]
    assert kernels_triton.supports_swiglu(fused)

    activated = kernels_triton.swiglu(torch.cat((gate, torch.ones_like(gate)), dim=-1))
    # fp32: expf implementations differ by an ulp or two (libdevice, torch's vectorized CPU exp, numpy's).
    assert_rounding_level(activated, F.silu(gate), fp32_ulps=4)
    assert torch.equal(kernels_triton.swiglu(fused), activated * fused[:, width:])


@needs_triton_device
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    ("rows", "lead", "heads", "head_dim", "size"),
    RELAYOUT_SHAPES,
)
def test_triton_kernel_relayouts(
    dtype: torch.dtype, rows: int, lead: tuple[int, ...], heads: int, head_dim: int, size: int
) -> None:
    kernels_triton = triton_kernels()
    stacked = draw((rows, *lead, heads, head_dim), dtype, 15)
    assert kernels_triton.supports_pack_heads_for_exchange(stacked, size)
    packed = kernels_triton.pack_heads_for_exchange(stacked, size)
    assert packed.is_contiguous() and torch.equal(packed, reference.pack_heads_for_exchange(stacked, size))

    received = draw((size, rows, *lead, heads // size, head_dim), dtype, 16)
    assert kernels_triton.supports_unpack_exchanged_heads(received)
    unpacked = kernels_triton.unpack_exchanged_heads(received)
    assert unpacked.is_contiguous() and torch.equal(unpacked, reference.unpack_exchanged_heads(received))


@needs_triton_device
def test_triton_kernel_support_checks_reject_what_they_cannot_run() -> None:
    kernels_triton = triton_kernels()
    hidden = draw((4, 16), torch.float32, 17)
    rows = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    table = draw((2, 16), torch.float32, 18)
    assert not kernels_triton.supports_modulated_rms_norm(
        hidden.double(), hidden[0].double(), EPS, table.double(), table.double(), rows
    )
    assert not kernels_triton.supports_modulated_rms_norm(
        hidden.t(), hidden[:, 0], EPS, table, table, rows[:2]
    )
    assert not kernels_triton.supports_gated_residual(hidden, table.half(), rows, hidden)
    assert not kernels_triton.supports_swiglu(draw((4, 7), torch.float32, 19))
    vector = hidden[0]
    assert kernels_triton.supports_scaled_residual_rms_norm_to(
        hidden, hidden, vector, vector, EPS, torch.float16
    )
    # An fp16 stream or scale would round the residual in fp16; a table of scales is not one vector.
    assert not kernels_triton.supports_scaled_residual_rms_norm_to(
        hidden.half(), hidden, vector, vector, EPS, torch.float16
    )
    assert not kernels_triton.supports_scaled_residual_rms_norm_to(
        hidden, hidden, vector.half(), vector, EPS, torch.float16
    )
    assert not kernels_triton.supports_scaled_residual_rms_norm_to(
        hidden, hidden, table, vector, EPS, torch.float16
    )
    assert not kernels_triton.supports_rms_norm_to(hidden, vector, EPS, torch.float64)
    query = draw((3, 2, 12), torch.float32, 20)
    weight = query[0, 0]
    cos = draw((3, 6), torch.float32, 21)
    assert not kernels_triton.supports_qk_norm_rope(query, query, weight, weight, EPS, cos[:, :5], cos[:, :5])
    assert not kernels_triton.supports_qk_norm_rope(query, query, weight, weight, EPS, cos, None)
    assert not kernels_triton.supports_pack_heads_for_exchange(query, 3)
    assert not kernels_triton.supports_pack_heads_for_exchange(query.transpose(1, 2), 2)


@pytest.mark.skipif(INTERPRETING, reason="this test starts the interpreter run itself")
def test_triton_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert_kernel_tests_pass_interpreted(__file__)


# --------------------------------------------------------------------------------------------------------------
# CUDA only: dispatch, bit-exact SwiGLU, int64 offsets
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@not_interpreted
def test_dispatch_runs_triton_on_cuda_unless_told_otherwise() -> None:
    fused = draw((8, 64), torch.bfloat16, 22)
    assert ops.implementation("swiglu", fused) == "triton"
    assert torch.equal(ops.swiglu(fused), triton_kernels().swiglu(fused))
    with ops.force_reference():
        assert ops.implementation("swiglu", fused) == "reference"
        assert torch.equal(ops.swiglu(fused), reference.swiglu(fused))
    assert ops.implementation("swiglu", fused) == "triton"
    assert ops.implementation("swiglu", fused.double()) == "reference"
    assert ops.implementation("swiglu", fused.float().requires_grad_()) == "reference"
    with torch.no_grad():
        assert ops.implementation("swiglu", fused.float().requires_grad_()) == "triton"


@pytest.mark.cuda
@not_interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_swiglu_is_bit_identical_to_torch(dtype: torch.dtype) -> None:
    # libdevice expf and IEEE division are what torch's CUDA silu compiles to.
    fused = draw((513, 2 * 3000), dtype, 23, scale=4.0)
    assert torch.equal(triton_kernels().swiglu(fused), reference.swiglu(fused))


@pytest.mark.cuda
@not_interpreted
def test_cuda_swiglu_addresses_past_two_to_the_31_elements() -> None:
    width = 14336
    sequence_length = 2**31 // (2 * width) + 3
    fused = torch.empty((sequence_length, 2 * width), dtype=torch.bfloat16, device="cuda")
    fused[-4:] = draw((4, 2 * width), torch.bfloat16, 24, scale=4.0)
    out = triton_kernels().swiglu(fused)
    assert fused.numel() > 2**31
    assert torch.equal(out[-4:], reference.swiglu(fused[-4:]))
