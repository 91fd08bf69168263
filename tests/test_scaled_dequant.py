"""Scaled FP8 / INT8 dequantization: the Triton kernel (kernels/triton/scaled_dequant.py) against its torch twin
(single_file_formats.dequantize_scaled), the dispatch (h3engine.models.scaled_ops), and StoredLinear's use of it.

Values are random bytes of every pattern the dtype has (fp8 NaNs redrawn where a test compares bits, as NaN payloads
may differ), scales random float32 over many magnitudes, one row's scale subnormal (so the products are too: a
kernel that flushed them to zero would fail). Expected agreement is bit-exact: both widen each value exactly, take
one IEEE float32 product and round it once. ConvRot forms rotate the kernel's float32 products with the twin's own
`rotate_groups` on the same device, so they match the twin there too.

Triton (`test_triton_kernel_*`): on a CUDA GPU in fp32, bf16 and fp16 output; on CPU the same tests run in a
subprocess under TRITON_INTERPRET=1 in fp32 only (the interpreter converts to bf16 by truncation, not rounding).
"""

from __future__ import annotations

import os

import pytest
import torch
from _interpreter import assert_kernel_tests_pass_interpreted
from torch import Tensor

from h3engine.checkpoint.single_file_formats import (
    dequantize_scaled,
    quantize_fp8_tensor,
    quantize_int8,
    quantize_int8_convrot,
)
from h3engine.models import ops, scaled_ops
from h3engine.models.stored_linear import StoredLinear, WeightForm

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRETING
DEVICE = "cuda" if HAS_CUDA else "cpu"

VALUE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = ["tensor", "tensor0d", "row"]
BIT_VIEWS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def nan_codes(dtype: torch.dtype) -> Tensor:
    """The byte patterns that are NaN in `dtype` (none for int8)."""
    every = torch.arange(256, dtype=torch.uint8)
    return every[every.view(dtype).to(torch.float32).isnan()] if dtype != torch.int8 else every[:0]


def random_values(dtype: torch.dtype, rows: int, columns: int, seed: int, nan: bool = False) -> Tensor:
    """[rows, columns] of `dtype` from random bytes; without `nan`, NaN patterns become S.1111.100 (e4m3fn: +-384,
    e5m2: +-infinity)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, columns), dtype=torch.uint8, generator=generator)
    if not nan:
        nan_bytes = torch.isin(raw, nan_codes(dtype))
        raw[nan_bytes] = (raw[nan_bytes] & 0x80) | 0x7C
        assert not raw.view(dtype).to(torch.float32).isnan().any()
    return raw.view(dtype)


def random_scale(kind: str, rows: int, seed: int) -> Tensor:
    """float32 scales of magnitude 1e-8 .. 1e2 (row scales: one of them subnormal)."""
    generator = torch.Generator().manual_seed(seed)
    count = rows if kind == "row" else 1
    scale = 10.0 ** (torch.rand(count, generator=generator) * 10 - 8)
    if kind == "row":
        scale[rows // 2] = 3e-39  # subnormal: its row's products are subnormal or zero
        return scale.reshape(rows, 1)
    return scale.reshape(()) if kind == "tensor0d" else scale


def assert_bit_equal(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert actual.device == expected.device
    same = actual.view(BIT_VIEWS[actual.dtype]) == expected.view(BIT_VIEWS[expected.dtype])
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"


# --------------------------------------------------------------------------------------------------------------
# The dispatch on the CPU
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("values_dtype", VALUE_DTYPES, ids=str)
def test_dispatch_on_cpu_is_the_twin(values_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    values = random_values(values_dtype, 6, 64, seed=1)
    for scale, group in [(random_scale("tensor", 6, 2), None), (random_scale("row", 6, 3), None)]:
        assert scaled_ops.implementation(values, scale, group, out_dtype) == "reference"
        expected = dequantize_scaled(values, scale, group, out_dtype)
        assert_bit_equal(scaled_ops.dequantize(values, scale, group, out_dtype), expected)
    values, scale = quantize_int8_convrot(torch.randn(6, 64, generator=torch.Generator().manual_seed(4)), 16)
    assert scaled_ops.implementation(values, scale, 16, out_dtype) == "reference"
    rotated = scaled_ops.dequantize(values, scale, 16, out_dtype)
    assert_bit_equal(rotated, dequantize_scaled(values, scale, 16, out_dtype))
    # The rotation was applied: the plain product differs from the rotated one.
    assert not torch.equal(rotated, dequantize_scaled(values, scale, None, out_dtype))


def test_forced_reference_is_reported_and_restored() -> None:
    values, scale = random_values(torch.int8, 4, 32, seed=5), random_scale("row", 4, 6)
    with ops.force_reference():
        assert ops._reference_forced
        assert scaled_ops.implementation(values, scale, None, torch.bfloat16) == "reference"
        assert_bit_equal(
            scaled_ops.dequantize(values, scale, None, torch.bfloat16),
            dequantize_scaled(values, scale, None, torch.bfloat16),
        )
    assert ops._reference_forced == (os.environ.get(ops.KERNELS_ENVIRONMENT_VARIABLE) == "reference")


def test_stored_linear_dequantizes_through_the_dispatch() -> None:
    """A StoredLinear of each scaled form gives the twin's weight (and the original weight, near enough)."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)) * 0.02
    forms = [
        (WeightForm(values_dtype=torch.float8_e4m3fn), quantize_fp8_tensor(weight), None),
        (WeightForm(values_dtype=torch.int8, scale_per_row=True), quantize_int8(weight, per_row=True), None),
        (
            WeightForm(values_dtype=torch.int8, scale_per_row=True, rotation_group=16),
            quantize_int8_convrot(weight, 16),
            16,
        ),
    ]
    for form, (values, scale), group in forms:
        layer = StoredLinear(64, 8, form, bias=False, dtype=torch.bfloat16)
        layer.quantized.copy_(values.view(torch.uint8))
        layer.scale.copy_(scale.reshape(layer.scale.shape))
        assert_bit_equal(layer.weight, dequantize_scaled(values, scale, group, torch.bfloat16))
        error = (layer.weight.float() - weight).abs().max() / weight.abs().max()
        assert error < 0.07, (form.name, float(error))


# --------------------------------------------------------------------------------------------------------------
# The Triton kernel against the twin (CUDA, or CPU under the interpreter)
# --------------------------------------------------------------------------------------------------------------

needs_triton_device = pytest.mark.skipif(not (HAS_CUDA or INTERPRETING), reason="needs a CUDA GPU")
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32]
# Shapes that end on partial tiles of both rows and columns (the kernel's tile is 8 x 512).
SHAPES = [(37, 320), (5, 1100)] if HAS_CUDA else [(37, 320)]


def scaled_kernels():
    from h3engine.models.kernels.triton import scaled_dequant

    return scaled_dequant


@needs_triton_device
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize("values_dtype", VALUE_DTYPES, ids=str)
def test_triton_kernel_equals_the_twin(
    values_dtype: torch.dtype, scale_kind: str, out_dtype: torch.dtype
) -> None:
    kernels = scaled_kernels()
    for rows, columns in SHAPES:
        values = random_values(values_dtype, rows, columns, seed=rows + columns)
        scale = random_scale(scale_kind, rows, seed=columns)
        on_device = values.to(DEVICE), scale.to(DEVICE)
        assert kernels.supports_dequantize_scaled(*on_device, out_dtype)
        ours = kernels.dequantize_scaled(*on_device, out_dtype)
        # The twin on the CPU, and on the kernel's device.
        assert_bit_equal(ours.cpu(), dequantize_scaled(values, scale, None, out_dtype))
        assert_bit_equal(ours, dequantize_scaled(*on_device, None, out_dtype))


@needs_triton_device
@pytest.mark.parametrize("values_dtype", VALUE_DTYPES, ids=str)
def test_triton_kernel_without_scale_and_with_nans(values_dtype: torch.dtype) -> None:
    kernels = scaled_kernels()
    values = random_values(values_dtype, 9, 520, seed=8, nan=True)
    scale = random_scale("row", 9, seed=9)
    if values_dtype != torch.int8:
        assert values.to(torch.float32).isnan().any()
    for stored in (scale, None):
        ours = kernels.dequantize_scaled(
            values.to(DEVICE), None if stored is None else stored.to(DEVICE), torch.float32
        )
        expected = dequantize_scaled(values, stored, None, torch.float32)
        torch.testing.assert_close(ours.cpu(), expected, rtol=0, atol=0, equal_nan=True)
        finite = ~expected.isnan()
        assert_bit_equal(ours.cpu()[finite], expected[finite])


@needs_triton_device
def test_triton_kernel_support_checks() -> None:
    kernels = scaled_kernels()
    values = random_values(torch.int8, 4, 64, seed=10).to(DEVICE)
    row, tensor = random_scale("row", 4, 11).to(DEVICE), random_scale("tensor", 4, 12).to(DEVICE)
    assert kernels.supports_dequantize_scaled(values, row, torch.bfloat16)
    assert kernels.supports_dequantize_scaled(values, None, torch.float16)
    assert not kernels.supports_dequantize_scaled(values, row, torch.float64)
    assert not kernels.supports_dequantize_scaled(values.view(torch.uint8), row, torch.float32)
    assert not kernels.supports_dequantize_scaled(values[:, ::2], tensor, torch.float32)
    assert not kernels.supports_dequantize_scaled(values.reshape(2, 2, 64), tensor, torch.float32)
    assert not kernels.supports_dequantize_scaled(values, row[:3], torch.float32)
    assert not kernels.supports_dequantize_scaled(values, row.double(), torch.float32)
    assert kernels.dequantize_scaled(values[:0], tensor, torch.float32).shape == (0, 64)


@pytest.mark.skipif(INTERPRETING, reason="this test starts the interpreter run itself")
def test_triton_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert_kernel_tests_pass_interpreted(__file__)


# --------------------------------------------------------------------------------------------------------------
# CUDA only: ConvRot through the dispatch, StoredLinear on the Triton path
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETING, reason="runs compiled kernels on a CUDA GPU, not the interpreter")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [16, 256])
def test_convrot_dispatch_on_cuda_equals_the_twin(group: int, out_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(group)
    matrix = torch.randn(37, 3 * 256, generator=generator) * 10.0 ** torch.randint(
        -4, 2, (37, 1), generator=generator
    )
    values, scale = (tensor.cuda() for tensor in quantize_int8_convrot(matrix, group))
    assert scaled_ops.implementation(values, scale, group, out_dtype) == "triton"
    fast = scaled_ops.dequantize(values, scale, group, out_dtype)
    assert_bit_equal(fast, dequantize_scaled(values, scale, group, out_dtype))
    with ops.force_reference():
        assert scaled_ops.implementation(values, scale, group, out_dtype) == "reference"
        assert_bit_equal(fast, scaled_ops.dequantize(values, scale, group, out_dtype))
    torch.testing.assert_close(fast.float().cpu(), matrix, rtol=0, atol=float(matrix.abs().max()) / 20)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETING, reason="runs compiled kernels on a CUDA GPU, not the interpreter")
def test_stored_linear_runs_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = scaled_kernels()
    weight = torch.randn(300, 512, generator=torch.Generator().manual_seed(13)) * 0.02
    values, scale = quantize_fp8_tensor(weight)
    layer = StoredLinear(512, 300, WeightForm(values_dtype=torch.float8_e4m3fn), bias=True, device="cuda")
    layer.quantized.copy_(values.view(torch.uint8))
    layer.scale.copy_(scale.reshape(1))
    layer.bias.data.normal_()
    calls = []
    launch = kernels.dequantize_scaled
    monkeypatch.setattr(kernels, "dequantize_scaled", lambda *args: calls.append(args) or launch(*args))
    hidden = torch.randn(7, 512, device="cuda", dtype=torch.bfloat16)
    output = layer(hidden)
    stored_values = layer.quantized.view(torch.float8_e4m3fn)
    assert (
        len(calls) == 1
        and scaled_ops.implementation(stored_values, layer.scale, None, torch.bfloat16) == "triton"
    )
    with ops.force_reference():
        reference_weight = layer.weight
        assert torch.equal(layer(hidden), output)
    assert len(calls) == 1
    assert_bit_equal(reference_weight, dequantize_scaled(values, scale, None, torch.bfloat16).cuda())
