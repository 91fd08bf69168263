"""GGUF block dequantization: our torch twin (h3engine.checkpoint.gguf_blocks) against gguf-py's, the Triton kernels
against the twin, the dispatch (h3engine.models.gguf_ops), and the refusal of types we do not read.

Oracle: `gguf.quants.dequantize` (numpy, float32). Blocks come two ways: values quantized by `gguf.quants.quantize`
(the types it can quantize: F32, F16, BF16, Q8_0, Q4_0, Q5_0), and random bytes for every type, the fp16 scale
fields redrawn as finite fp16 bit patterns of any exponent (subnormal to 65504) so that every packed field takes
arbitrary values (K-quants gguf-py can only dequantize). Expected agreement is bit-exact: both compute each value
as the same IEEE float32 products and differences of fp16-widened scales and small integers, in the same order (no
fused multiply-add: the Triton kernels launch with fp fusion off), so they round alike. With non-finite scales
(fully random bytes) only NaN payloads may differ (numpy's and torch's NaNs); those compare as equal NaNs.

Triton (`test_triton_kernel_*`): on a CUDA GPU in fp32, bf16 and fp16 output; on CPU the same tests run in a
subprocess under TRITON_INTERPRET=1 in fp32 only (the interpreter converts to bf16 by truncation, not rounding).
"""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import torch
from _interpreter import assert_kernel_tests_pass_interpreted
from gguf import GGMLQuantizationType, quants
from torch import Tensor

from h3engine.checkpoint import gguf_blocks
from h3engine.checkpoint.gguf_blocks import BLOCK_FORMATS, GGMLType
from h3engine.errors import CheckpointError
from h3engine.models import gguf_ops, ops

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRETING
DEVICE = "cuda" if HAS_CUDA else "cpu"

ALL_TYPES = list(GGMLType)
# Types gguf-py can quantize (the others it only dequantizes).
QUANTIZABLE = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0]
QUANTIZED = [kind for kind in ALL_TYPES if BLOCK_FORMATS[kind].block_size > 1]
# Byte offsets of each block's fp16 scales (d, and dmin where there is one).
FP16_SCALES = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q5_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}
# (bit width, exponent mask) of the float types' elements, for drawing finite bit patterns.
FLOAT_BITS = {GGMLType.F32: (32, 0x7F800000), GGMLType.F16: (16, 0x7C00), GGMLType.BF16: (16, 0x7F80)}


def finite_bits(rng: np.random.Generator, count: int, width: int, exponent: int) -> np.ndarray:
    """`count` random `width`-bit patterns, those with an all-ones exponent (inf, NaN) moved one exponent down."""
    dtype = np.uint32 if width == 32 else np.uint16
    bits = rng.integers(0, 2**width, size=count, dtype=np.uint64).astype(dtype)
    lowest_exponent_bit = exponent & -exponent
    full = (bits & dtype(exponent)) == dtype(exponent)
    bits[full] ^= dtype(lowest_exponent_bit)
    return bits


def random_raw(kind: GGMLType, rows: int, width: int, seed: int, finite: bool = True) -> np.ndarray:
    """[rows, bytes per row] uint8 of random blocks; with `finite`, every scale (and float element) is finite."""
    rng = np.random.default_rng(seed)
    layout = BLOCK_FORMATS[kind]
    blocks = rows * width // layout.block_size
    if finite and kind in FLOAT_BITS:
        return finite_bits(rng, rows * width, *FLOAT_BITS[kind]).view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, size=(blocks, layout.type_size), dtype=np.uint8)
    for offset in FP16_SCALES.get(kind, ()) if finite else ():
        raw[:, offset : offset + 2] = finite_bits(rng, blocks, 16, 0x7C00).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, -1)


def quantized_raw(kind: GGMLType, rows: int, width: int, seed: int) -> np.ndarray:
    """gguf-py's quantization of random values whose magnitude varies by row (1e-3 to 1e2), one row all zeros."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, width)) * 10.0 ** rng.uniform(-3, 2, size=(rows, 1))
    values[0] = 0.0
    raw = quants.quantize(values.astype(np.float32), GGMLQuantizationType(kind.value))
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


def oracle(raw: np.ndarray, kind: GGMLType) -> Tensor:
    with np.errstate(invalid="ignore", over="ignore"):
        values = quants.dequantize(raw, GGMLQuantizationType(kind.value))
    return torch.from_numpy(np.ascontiguousarray(values))


BIT_VIEWS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bit_equal(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    same = actual.view(BIT_VIEWS[actual.dtype]) == expected.view(BIT_VIEWS[expected.dtype])
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"


def shape_for(kind: GGMLType) -> tuple[int, int]:
    """Rows of two blocks and a half-ish tile: 13 blocks of 32 per row (65 in all), 3 of 256 (9 in all), so the
    Triton launch ends on a partial tile."""
    return (5, 13 * 32) if BLOCK_FORMATS[kind].block_size == 32 else (3, 3 * 256 if kind in QUANTIZED else 40)


# --------------------------------------------------------------------------------------------------------------
# The twin against gguf-py
# --------------------------------------------------------------------------------------------------------------


def test_block_formats_are_ggmls() -> None:
    for kind, layout in BLOCK_FORMATS.items():
        theirs = GGMLQuantizationType(kind.value)
        assert (layout.block_size, layout.type_size) == gguf.GGML_QUANT_SIZES[theirs]
        assert kind.name == theirs.name


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda kind: kind.name)
def test_twin_equals_gguf_on_quantized_values(kind: GGMLType) -> None:
    rows, width = shape_for(kind)
    raw = quantized_raw(kind, rows, width, seed=kind.value)
    ours = gguf_blocks.dequantize(torch.from_numpy(raw), kind, (rows, width), "blk.0.weight")
    assert_bit_equal(ours, oracle(raw, kind))


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda kind: kind.name)
def test_twin_equals_gguf_on_random_blocks(kind: GGMLType) -> None:
    rows, width = shape_for(kind)
    raw = random_raw(kind, rows, width, seed=100 + kind.value)
    ours = gguf_blocks.dequantize(torch.from_numpy(raw), kind, (rows, width), "blk.0.weight")
    assert_bit_equal(ours, oracle(raw, kind))


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda kind: kind.name)
def test_twin_equals_gguf_with_non_finite_scales(kind: GGMLType) -> None:
    rows, width = shape_for(kind)
    raw = random_raw(kind, rows, width, seed=200 + kind.value, finite=False)
    ours = gguf_blocks.dequantize(torch.from_numpy(raw), kind, (rows, width), "x")
    torch.testing.assert_close(ours, oracle(raw, kind), rtol=0, atol=0, equal_nan=True)


def test_shapes_and_byte_layout_of_the_input() -> None:
    """Any leading dims; raw may come flat or shaped; an empty tensor gives an empty result."""
    raw = random_raw(GGMLType.Q4_K, 6, 512, seed=3)
    expected = oracle(raw, GGMLType.Q4_K).reshape(2, 3, 512)
    flat = torch.from_numpy(raw).reshape(-1)
    assert_bit_equal(gguf_blocks.dequantize(flat, GGMLType.Q4_K, (2, 3, 512)), expected)
    assert_bit_equal(gguf_blocks.dequantize(flat, int(GGMLQuantizationType.Q4_K), [2, 3, 512]), expected)
    empty = gguf_blocks.dequantize(torch.empty(0, dtype=torch.uint8), GGMLType.Q8_0, (0, 64))
    assert empty.shape == (0, 64) and empty.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------------
# Refusals and the dispatch
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ggml_type", "named"),
    [
        (GGMLQuantizationType.IQ2_XXS, "IQ2_XXS (id 16)"),
        (3, "Q4_1 (id 3)"),
        (GGMLQuantizationType.Q8_K, "Q8_K (id 15)"),
        (99, "unknown (id 99)"),
    ],
)
def test_unsupported_types_are_refused_by_name(ggml_type: int, named: str) -> None:
    raw = torch.zeros(1024, dtype=torch.uint8)
    for dequantize in (gguf_blocks.dequantize, gguf_ops.dequantize):
        expected = re.escape(f"'blk.7.attn_qkv.weight': ggml type {named} is not supported")
        with pytest.raises(CheckpointError, match=expected) as caught:
            dequantize(raw, ggml_type, (4, 256), "blk.7.attn_qkv.weight")
        assert "Q4_K" in str(caught.value)  # the supported types are listed


def test_sizes_that_do_not_fit_are_refused() -> None:
    raw = torch.zeros(144, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="'w': last dim 300 .* Q4_K block size 256"):
        gguf_blocks.dequantize(raw, GGMLType.Q4_K, (1, 300), "w")
    too_few = r"'w': Q4_K data of shape \(2, 256\) takes 288 bytes \(uint8\); got 144 of torch.uint8"
    with pytest.raises(CheckpointError, match=too_few):
        gguf_ops.dequantize(raw, GGMLType.Q4_K, (2, 256), "w")
    with pytest.raises(CheckpointError, match="got 36 of torch.int32"):
        gguf_blocks.dequantize(torch.zeros(36, dtype=torch.int32), GGMLType.F32, (36,), "w")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dispatch_on_cpu_is_the_twin_rounded_once(out_dtype: torch.dtype) -> None:
    raw = torch.from_numpy(random_raw(GGMLType.Q6_K, 2, 512, seed=4))
    assert gguf_ops.implementation(raw, GGMLType.Q6_K, (2, 512), out_dtype) == "reference"
    expected = gguf_blocks.dequantize(raw, GGMLType.Q6_K, (2, 512)).to(out_dtype)
    assert torch.equal(gguf_ops.dequantize(raw, GGMLType.Q6_K, (2, 512), "w", out_dtype), expected)


# --------------------------------------------------------------------------------------------------------------
# Triton kernels against the twin (CUDA, or CPU under the interpreter)
# --------------------------------------------------------------------------------------------------------------

needs_triton_device = pytest.mark.skipif(not (HAS_CUDA or INTERPRETING), reason="needs a CUDA GPU")
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32]


def gguf_kernels():
    from h3engine.models.kernels.triton import gguf_dequant

    return gguf_dequant


@needs_triton_device
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda kind: kind.name)
def test_triton_kernel_equals_the_twin(kind: GGMLType, out_dtype: torch.dtype) -> None:
    kernels = gguf_kernels()
    rows, width = shape_for(kind)
    for finite in (True, False):
        raw = torch.from_numpy(random_raw(kind, rows, width, seed=300 + kind.value, finite=finite)).to(DEVICE)
        assert kernels.supports_dequantize(raw, kind, (rows, width), out_dtype)
        ours = kernels.dequantize(raw, kind, (rows, width), out_dtype)
        # The twin on the CPU, the one checked against gguf-py above.
        expected = gguf_blocks.dequantize(raw.cpu(), kind, (rows, width)).to(out_dtype).to(DEVICE)
        if finite:
            assert_bit_equal(ours, expected)
        else:
            torch.testing.assert_close(ours, expected, rtol=0, atol=0, equal_nan=True)


@needs_triton_device
def test_triton_kernel_table_and_support_checks() -> None:
    kernels = gguf_kernels()
    assert {GGMLType(kind) for kind in kernels.KERNELS} == set(QUANTIZED)
    for kind, (_, block_size, type_size) in kernels.KERNELS.items():
        assert BLOCK_FORMATS[GGMLType(kind)] == gguf_blocks.BlockFormat(block_size, type_size)
    raw = torch.zeros(2 * 210, dtype=torch.uint8, device=DEVICE)
    assert kernels.supports_dequantize(raw, GGMLType.Q6_K, (2, 256), torch.bfloat16)
    assert not kernels.supports_dequantize(raw, GGMLType.Q6_K, (2, 256), torch.float64)
    assert not kernels.supports_dequantize(raw, GGMLType.Q6_K, (3, 256), torch.float32)
    assert not kernels.supports_dequantize(raw, GGMLType.F16, (210,), torch.float32)
    assert not kernels.supports_dequantize(raw.view(2, 210)[:, :144], GGMLType.Q4_K, (2, 256), torch.float32)
    assert kernels.dequantize(raw[:0], GGMLType.Q8_0, (0, 32), torch.float32).shape == (0, 32)


@pytest.mark.skipif(INTERPRETING, reason="this test starts the interpreter run itself")
def test_triton_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert_kernel_tests_pass_interpreted(__file__)


# --------------------------------------------------------------------------------------------------------------
# CUDA only: the dispatch picks Triton, a large tensor
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETING, reason="runs compiled kernels on a CUDA GPU, not the interpreter")
def test_dispatch_runs_triton_on_cuda_unless_told_otherwise() -> None:
    rows, width = 3072, 4096
    raw = torch.from_numpy(random_raw(GGMLType.Q4_K, rows, width, seed=5)).cuda()
    assert gguf_ops.implementation(raw, GGMLType.Q4_K, (rows, width), torch.bfloat16) == "triton"
    fast = gguf_ops.dequantize(raw, GGMLType.Q4_K, (rows, width), "w", torch.bfloat16)
    with ops.force_reference():
        assert gguf_ops.implementation(raw, GGMLType.Q4_K, (rows, width)) == "reference"
        assert torch.equal(fast, gguf_ops.dequantize(raw, GGMLType.Q4_K, (rows, width), "w", torch.bfloat16))
    assert gguf_ops.implementation(raw, GGMLType.F16, (raw.numel() // 2,)) == "reference"
