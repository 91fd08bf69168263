"""FP8 DiT linears (h3engine.models.quantization): quantization bounds, the reference path, DiT conversion, `_scaled_mm`.

Error bounds come from e4m3's format: 3 mantissa bits give a relative rounding error of at most 2^-4 in the
normal range (|x / scale| >= 2^-6) and an absolute one of at most 2^-10 * scale below it (subnormal spacing 2^-9).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from torch import nn

import h3engine.models.quantization as fp8
from benchmarks._packed_request import PackedRequest, max_relative_error
from h3engine.checkpoint.dit_format import native_to_module
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.tiny import save_sharded
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.parallel.dit import load_dit_shard
from h3engine.models.parallel.groups import ParallelLayout, create_dit_groups
from h3engine.models.parallel.linear import RowParallelLinear
from h3engine.models.quantization import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize_rows,
    fp8_error_report,
    fp8_matmul_reference,
    fp8_matmul_scaled_mm,
    quantize_dit_linears,
    quantize_rows,
    scaled_mm_supported,
)

SEED = 2468
UNIT_ROUNDOFF = 2.0**-4  # e4m3: 3 mantissa bits, round to nearest
SUBNORMAL_ERROR = 2.0**-10  # half the subnormal spacing 2^-9, in units of the row scale
MIN_NORMAL = 2.0**-6
BF16_UNIT_ROUNDOFF = 2.0**-8
# Quantized vs unquantized tiny DiT, max relative error over each velocity. Measured on CPU (torch 2.14.1):
# fp32 model 4.0e-2 / 2.5e-2 (video / audio), bf16 model 2.6e-2 / 2.4e-2; 1.1e-2 .. 4.9e-2 over three other
# seeds. Each quantized GEMM is off by ~2^-6 RMS (two operands rounded at 2^-4); a wrong row order or scale gives
# O(1) errors (the exact wiring is pinned by test_quantized_dit_computes_the_fp8_rounded_model). The lower bound
# shows the FP8 path ran at all (fp32 noise is ~1e-7).
DIT_ERROR_BOUND = 2.0**-3
DIT_MIN_ERROR = 2.0**-10
needs_fp8_capability = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability >= 8.9 (FP8 GEMMs)",
)


def wide_range_matrix(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """Signed values whose magnitudes span 2^-12 .. 2^2 within a row, rows scaled 10^-3 .. 10^3 apart."""
    magnitudes = torch.exp2(torch.empty(rows, columns).uniform_(-12, 2, generator=generator))
    signs = torch.where(torch.rand(rows, columns, generator=generator) < 0.5, -1.0, 1.0)
    row_scales = torch.logspace(-3, 3, rows)[:, None]
    return magnitudes * signs * row_scales


def elementwise_bound(matrix: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """|dequantize(quantize(matrix)) - matrix| may reach 2^-4 |x| (normal range) or 2^-10 * scale (subnormal)."""
    return UNIT_ROUNDOFF * matrix.abs() + SUBNORMAL_ERROR * scales


def product_bound(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Bound on |Q(x) Q(W)^T - x W^T| from the per-operand bounds (fp32 products, plus fp32 accumulation room)."""
    _, input_scales = quantize_rows(inputs)
    _, weight_scales = quantize_rows(weight)
    input_error = elementwise_bound(inputs, input_scales)
    weight_error = elementwise_bound(weight, weight_scales)
    magnitude = inputs.abs() @ weight.abs().t()
    return (
        input_error @ weight.abs().t()
        + inputs.abs() @ weight_error.t()
        + input_error @ weight_error.t()
        + 1e-5 * magnitude
    )


def relative_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    return fp8_error_report(reference, candidate)["relative_l2"]


# --------------------------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------------------------


def test_quantize_rows_bounds_the_error_and_scales_each_row() -> None:
    generator = torch.Generator().manual_seed(SEED)
    matrix = wide_range_matrix(7, 300, generator)
    values, scales = quantize_rows(matrix)
    assert values.dtype == FP8_DTYPE and values.shape == matrix.shape and values.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (7, 1)

    # One scale per row: amax / 448, so every row uses the whole e4m3 range.
    torch.testing.assert_close(scales, matrix.abs().amax(dim=1, keepdim=True) / FP8_MAX, rtol=0, atol=0)
    assert values.float().abs().amax(dim=1).tolist() == [FP8_MAX] * 7

    restored = dequantize_rows(values, scales)
    error = (restored - matrix).abs()
    assert bool((error <= elementwise_bound(matrix, scales)).all())
    # The bound is met with little room: this is 3-mantissa-bit rounding, not a finer format.
    normal = (matrix / scales).abs() >= MIN_NORMAL
    assert (error[normal] / matrix.abs()[normal]).max().item() > UNIT_ROUNDOFF / 2
    # Rows are independent: a row quantized alone comes out the same.
    alone_values, alone_scales = quantize_rows(matrix[3:4])
    assert torch.equal(alone_values.float(), values[3:4].float()) and torch.equal(alone_scales, scales[3:4])


def test_zero_rows_quantize_to_zeros_without_nan() -> None:
    matrix = torch.randn(4, 32, generator=torch.Generator().manual_seed(SEED))
    matrix[1] = 0.0
    values, scales = quantize_rows(matrix)
    assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all())
    assert bool((values[1].float() == 0).all())
    assert bool(torch.isfinite(dequantize_rows(values, scales)).all())

    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(SEED + 1))
    weight[2] = 0.0
    output = Fp8Linear(weight)(matrix)
    assert bool(torch.isfinite(output).all())
    assert bool((output[1] == 0).all()) and bool((output[:, 2] == 0).all())


def test_quantize_rows_needs_a_matrix() -> None:
    with pytest.raises(ValueError, match="2-D matrix"):
        quantize_rows(torch.ones(2, 3, 4))


# --------------------------------------------------------------------------------------------------------------
# Fp8Linear on the reference path
# --------------------------------------------------------------------------------------------------------------


def test_fp8_linear_is_within_the_derived_bound_of_the_exact_product() -> None:
    generator = torch.Generator().manual_seed(SEED)
    # 40 x 48 is not a multiple of 16: the reference path serves every shape (the `_scaled_mm` one would not).
    weight = torch.randn(40, 48, generator=generator) / 48**0.5
    inputs = torch.randn(37, 48, generator=generator)
    layer = Fp8Linear(weight)
    assert not scaled_mm_supported(layer.weight_fp8)
    assert layer.weight_fp8.dtype == FP8_DTYPE and layer.weight_scales.shape == (40, 1)
    assert list(layer.parameters()) == [] and layer.state_dict() == {}

    output = layer(inputs)
    exact = inputs @ weight.t()
    assert output.dtype == torch.float32
    assert bool(((output - exact).abs() <= product_bound(inputs, weight)).all())
    assert relative_l2(output, exact) > BF16_UNIT_ROUNDOFF  # quantized, not merely rounded to bf16
    # Forward is exactly the reference product of the quantized operands.
    input_fp8, input_scales = quantize_rows(inputs)
    expected = fp8_matmul_reference(input_fp8, input_scales, layer.weight_fp8, layer.weight_scales)
    assert torch.equal(output, expected)

    # Leading axes are kept; a bf16 input gives a bf16 output.
    assert layer(inputs.view(37, 1, 48)).shape == (37, 1, 40)
    assert layer(inputs.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="expects 48 input features"):
        layer(torch.ones(3, 47))


def test_forward_chunks_keep_the_stacked_row_order() -> None:
    generator = torch.Generator().manual_seed(SEED)
    # Three blocks (like q; k; v) of very different magnitudes, so a swapped or mis-scaled block cannot pass.
    blocks = [magnitude * torch.randn(24, 32, generator=generator) for magnitude in (1.0, 100.0, 0.01)]
    weight = torch.cat(blocks)
    inputs = torch.randn(19, 32, generator=generator)
    layer = Fp8Linear(weight)

    chunks = layer.forward_chunks(inputs, 3)
    whole = layer(inputs)
    assert len(chunks) == 3
    for part, (chunk, block) in enumerate(zip(chunks, blocks, strict=True)):
        assert chunk.shape == (19, 24) and chunk.is_contiguous()
        torch.testing.assert_close(chunk, whole[:, 24 * part : 24 * (part + 1)])
        assert bool(((chunk - inputs @ block.t()).abs() <= product_bound(inputs, block)).all())
    with pytest.raises(ValueError, match="into 5 equal parts"):
        layer.forward_chunks(inputs, 5)


def test_fp8_linear_refuses_meta_and_non_matrix_weights() -> None:
    with pytest.raises(ValueError, match="meta"):
        Fp8Linear(torch.empty(16, 16, device="meta"))
    with pytest.raises(ValueError, match="2-D float weight"):
        Fp8Linear(torch.ones(16))


# --------------------------------------------------------------------------------------------------------------
# DiT conversion
# --------------------------------------------------------------------------------------------------------------


def tiny_request(text_dtype: torch.dtype) -> PackedRequest:
    return tiny_fl2va_request(DiTConfig.tiny(), text_dtype, SEED + 1)


def tiny_dit(state: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu") -> H3DiT:
    model = H3DiT(DiTConfig.tiny(), dtype=dtype)
    model.load_state_dict(native_to_module(state, DiTConfig.tiny()), strict=True)
    return model.to(device).eval()


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return random_native_state(DiTConfig.tiny(), SEED)


def test_quantize_dit_linears_converts_only_the_block_gemms(tiny_state) -> None:
    model = tiny_dit(tiny_state, torch.bfloat16)
    before = dict(model.named_parameters())
    converted = quantize_dit_linears(model)

    config = DiTConfig.tiny()
    layer_names = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    quantized = {f"blocks.{i}.{name}" for i in range(config.num_layers) for name in layer_names}
    assert converted == len(quantized) == 4 * config.num_layers
    modules = dict(model.named_modules())
    assert {name for name, module in modules.items() if isinstance(module, Fp8Linear)} == quantized
    # The refiner keeps its bf16 linears; AdaLN, the fp32 islands and everything else keep their very tensors.
    assert isinstance(modules["token_refiner.blocks.0.attn.qkv_proj"], nn.Linear)
    after = dict(model.named_parameters())
    assert set(after) == set(before) - {f"{name}.weight" for name in quantized}
    assert all(after[name] is before[name] for name in after)
    assert after["final_layer.video_out.weight"].dtype == torch.float32
    assert after["blocks.0.adaln_proj.linear.weight"].dtype == torch.bfloat16

    # The stacked [q; k; v] rows are quantized in place, in order.
    qkv = modules["blocks.1.attn.qkv_proj"]
    original = before["blocks.1.attn.qkv_proj.weight"].float()
    restored = dequantize_rows(qkv.weight_fp8, qkv.weight_scales)
    assert bool(((restored - original).abs() <= elementwise_bound(original, qkv.weight_scales)).all())

    with pytest.raises(ValueError, match="ran twice"):
        quantize_dit_linears(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_dit_stays_close_to_the_unquantized_one(tiny_state, dtype: torch.dtype) -> None:
    request = tiny_request(dtype)
    model = tiny_dit(tiny_state, dtype)
    quantized = copy.deepcopy(model)
    quantize_dit_linears(quantized)
    with torch.no_grad():
        reference = model(*request.as_h3_arguments())
        candidate = quantized(*request.as_h3_arguments())
    for reference_velocity, candidate_velocity in zip(reference, candidate, strict=True):
        assert candidate_velocity.dtype == torch.float32
        error = max_relative_error(candidate_velocity, reference_velocity)
        assert DIT_MIN_ERROR < error < DIT_ERROR_BOUND


def round_trip_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the module's first input replaced by its FP8 round trip (per row), in its own dtype."""
    hidden = args[0]
    restored = dequantize_rows(*quantize_rows(hidden.reshape(-1, hidden.shape[-1])))
    return (restored.to(hidden.dtype).view(hidden.shape), *args[1:])


def fake_quantized(model: H3DiT) -> H3DiT:
    """A copy that runs the converted GEMMs unquantized on FP8-rounded weights and inputs (no Fp8Linear)."""
    fake = copy.deepcopy(model)
    for block in fake.blocks:
        for layer in (block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1, block.mlp.fc2):
            layer.weight.data = dequantize_rows(*quantize_rows(layer.weight.data)).to(layer.weight.dtype)
        # q, k and v are projected from the attention module's input.
        for consumer in (block.attn, block.attn.out_proj, block.mlp.fc1, block.mlp.fc2):
            consumer.register_forward_pre_hook(round_trip_input)
    return fake


def test_quantized_dit_computes_the_fp8_rounded_model(tiny_state) -> None:
    # In fp32 the reference path is exactly "round both GEMM operands to FP8, multiply in fp32": the converted
    # DiT must match a plain DiT run on those rounded operands to fp32 rounding noise. A swapped q/k/v block, a
    # misplaced scale or a quantized layer that should not be would show up at the 1e-2 level.
    request = tiny_request(torch.float32)
    model = tiny_dit(tiny_state, torch.float32)
    expected_model = fake_quantized(model)
    quantize_dit_linears(model)
    with torch.no_grad():
        expected = expected_model(*request.as_h3_arguments())
        actual = model(*request.as_h3_arguments())
    for expected_velocity, actual_velocity in zip(expected, actual, strict=True):
        torch.testing.assert_close(actual_velocity, expected_velocity)


def test_row_parallel_layers_keep_their_group_sum(tiny_state, tmp_path: Path, monkeypatch) -> None:
    config = DiTConfig.tiny()
    save_sharded(tiny_state, tmp_path, "model", 1, "model.safetensors.index.json")
    groups = create_dit_groups(ParallelLayout.for_dit(config, 1))
    model = load_dit_shard(WeightFiles.open(tmp_path), config, groups, torch.float32, "cpu")
    row_parallel = {
        name: module.group for name, module in model.named_modules() if isinstance(module, RowParallelLinear)
    }
    assert quantize_dit_linears(model) == 4 * config.num_layers
    block_row_parallel = {name for name in row_parallel if name.startswith("blocks.")}
    assert block_row_parallel == {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.out_proj", "mlp.fc2")}
    modules = dict(model.named_modules())
    for name in block_row_parallel:
        assert modules[name].sum_group is row_parallel[name]

    summed_groups = []

    def recording_sum(tensor: torch.Tensor, group) -> torch.Tensor:
        summed_groups.append(group)
        return tensor

    monkeypatch.setattr(fp8, "all_reduce_sum", recording_sum)
    layer = modules["blocks.0.mlp.fc2"]
    layer(torch.ones(3, layer.in_features))
    assert summed_groups == [row_parallel["blocks.0.mlp.fc2"]]


# --------------------------------------------------------------------------------------------------------------
# Error report
# --------------------------------------------------------------------------------------------------------------


def test_fp8_error_report() -> None:
    reference = torch.tensor([[3.0, 4.0]])
    report = fp8_error_report(reference, torch.tensor([[3.0, 5.0]]))
    assert report == pytest.approx({"relative_l2": 1 / 5, "max_abs": 1.0, "max_relative": 1 / 4})
    with pytest.raises(ValueError, match="differ"):
        fp8_error_report(reference, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="all zeros"):
        fp8_error_report(torch.zeros(2), torch.ones(2))


# --------------------------------------------------------------------------------------------------------------
# `_scaled_mm` against the reference
# --------------------------------------------------------------------------------------------------------------


def check_scaled_mm_matches_reference(device: str) -> None:
    """Same quantized operands through both paths: they differ only by the bf16 output rounding (and fp32 sums)."""
    generator = torch.Generator().manual_seed(SEED)
    # 200 rows is not a multiple of 16: token counts are arbitrary. Weight rows stacked [q; k; v].
    weight = (torch.randn(3 * 128, 256, generator=generator) / 16).to(device, torch.bfloat16)
    inputs = torch.randn(200, 256, generator=generator).to(device, torch.bfloat16)
    layer = Fp8Linear(weight)
    input_fp8, input_scales = quantize_rows(inputs)
    fast = fp8_matmul_scaled_mm(input_fp8, input_scales, layer.weight_fp8, layer.weight_scales)
    reference = fp8_matmul_reference(input_fp8, input_scales, layer.weight_fp8, layer.weight_scales)
    assert fast.dtype == torch.bfloat16 and fast.shape == (200, 384)
    assert relative_l2(fast, reference) <= BF16_UNIT_ROUNDOFF
    for part in range(3):
        rows = slice(128 * part, 128 * (part + 1))
        fast_part = fp8_matmul_scaled_mm(
            input_fp8, input_scales, layer.weight_fp8[rows], layer.weight_scales[rows]
        )
        assert relative_l2(fast_part, reference[:, rows]) <= BF16_UNIT_ROUNDOFF


def _cpu_has_rowwise_scaled_mm() -> bool:
    ones = torch.ones(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(ones, ones.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_has_rowwise_scaled_mm(), reason="this torch build has no CPU rowwise _scaled_mm")
def test_scaled_mm_call_matches_reference_on_cpu() -> None:
    # The CPU kernel checks the call's operand layout and scale semantics where no GPU is present.
    check_scaled_mm_matches_reference("cpu")


@pytest.mark.cuda
@needs_fp8_capability
def test_scaled_mm_matches_reference_on_gpu() -> None:
    check_scaled_mm_matches_reference("cuda")


@pytest.mark.cuda
@needs_fp8_capability
def test_fp8_linear_dispatches_by_shape_on_gpu() -> None:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(200, 256, generator=generator).to("cuda", torch.bfloat16)
    input_fp8, input_scales = quantize_rows(inputs)

    aligned = Fp8Linear(torch.randn(3 * 128, 256, generator=generator).to("cuda", torch.bfloat16))
    assert scaled_mm_supported(aligned.weight_fp8)
    fast = fp8_matmul_scaled_mm(input_fp8, input_scales, aligned.weight_fp8, aligned.weight_scales)
    assert torch.equal(aligned(inputs), fast)
    for part, chunk in enumerate(aligned.forward_chunks(inputs, 3)):
        rows = slice(128 * part, 128 * (part + 1))
        expected = fp8_matmul_scaled_mm(
            input_fp8, input_scales, aligned.weight_fp8[rows], aligned.weight_scales[rows]
        )
        assert torch.equal(chunk, expected)

    # 24 output rows break `_scaled_mm`'s multiple-of-16 rule: the layer falls back to the reference path.
    unaligned = Fp8Linear(torch.randn(24, 256, generator=generator).to("cuda", torch.bfloat16))
    assert not scaled_mm_supported(unaligned.weight_fp8)
    reference = fp8_matmul_reference(
        input_fp8, input_scales, unaligned.weight_fp8, unaligned.weight_scales, torch.bfloat16
    )
    assert torch.equal(unaligned(inputs), reference)


@pytest.mark.cuda
def test_quantized_dit_stays_close_on_gpu(tiny_state) -> None:
    # On an FP8-capable GPU fc1 / fc2 of the tiny DiT take `_scaled_mm`; qkv and out_proj (24 wide) fall back.
    request = tiny_request(torch.bfloat16).to("cuda")
    model = tiny_dit(tiny_state, torch.bfloat16, "cuda")
    quantized = copy.deepcopy(model)
    quantize_dit_linears(quantized)
    with torch.no_grad():
        reference = model(*request.as_h3_arguments())
        candidate = quantized(*request.as_h3_arguments())
    for reference_velocity, candidate_velocity in zip(reference, candidate, strict=True):
        error = max_relative_error(candidate_velocity, reference_velocity)
        assert DIT_MIN_ERROR < error < DIT_ERROR_BOUND
