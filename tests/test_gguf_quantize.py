"""Our GGUF quantizers (h3engine.checkpoint.gguf_quantize): K-quant blocks in ggml's byte layout, of bounded error.

Oracles: gguf-py's `gguf.quants.dequantize` decodes our blocks to exactly what our decoder (gguf_blocks) gives, bit
for bit (a field packed at the wrong place decodes differently, or not within the bound); gguf-py's own quantizers
write the types it knows (Q8_0, Q5_0, Q4_0, F16, BF16, F32), byte for byte as `quantize` hands them on.

Error bounds: the RMS error of a row over its RMS value, on Gaussian rows. A sub-block's values round to a grid of
step D; uniform rounding errs by D / sqrt(12) RMS. With the plain range, D is the sub-block's peak over the value
levels: 16 Gaussians peak near 2.0 sigma, 32 span about 4.1 sigma, so Q6_K (16 values, 32 levels a side) gives
D = 2.0 / 32 -> 1.8%, Q3_K (4 a side) 14.4%, Q5_K (32 values, 31 steps) 3.8%, Q4_K (15 steps) 7.8%, Q2_K (16 values
spanning 3.5 sigma, 3 steps) 34%; the searched ranges do better. Measured (mean / worst row of 2048 values, rows of
RMS 1e-5 to 1e4 alike): Q6_K 1.74 / 1.84%, Q5_K 3.49 / 3.66%, Q4_K 7.06 / 7.38%, Q3_K 14.4 / 15.2%, Q2_K 26.4 /
27.7%; gguf-py's Q8_0 0.54%, Q5_0 4.27%, Q4_0 8.6%. The bounds (BOUNDS) leave about 15% above the worst row. Sanity
anchor: a K-quant's error is within 1.5x of the nearest classic type's (Q5_0, Q4_0), scaled by 2 per bit it has
more or fewer (measured 0.77 to 0.84x: the K-quants' finer sub-blocks and searched ranges).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import Tensor

from h3engine.checkpoint import gguf_blocks, gguf_quantize
from h3engine.checkpoint.gguf_blocks import GGMLType

K_QUANTS = list(gguf_quantize.K_QUANTS)
# RMS error / RMS value, per Gaussian row (see the module doc).
BOUNDS = {
    GGMLType.Q8_0: 0.007,
    GGMLType.Q6_K: 0.021,
    GGMLType.Q5_K: 0.042,
    GGMLType.Q5_0: 0.05,
    GGMLType.Q4_K: 0.085,
    GGMLType.Q4_0: 0.10,
    GGMLType.Q3_K: 0.175,
    GGMLType.Q2_K: 0.32,
}
# The classic type each K-quant is held against, and the value bits of each.
ANCHORS = {
    GGMLType.Q6_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_0,
    GGMLType.Q4_K: GGMLType.Q4_0,
    GGMLType.Q3_K: GGMLType.Q4_0,
    GGMLType.Q2_K: GGMLType.Q4_0,
}
BITS = {GGMLType.Q6_K: 6, GGMLType.Q5_K: 5, GGMLType.Q5_0: 5, GGMLType.Q4_K: 4, GGMLType.Q4_0: 4}
BITS |= {GGMLType.Q3_K: 3, GGMLType.Q2_K: 2}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def gaussian_rows(rows: int, width: int, seed: int) -> Tensor:
    """Gaussian rows of RMS 10^-5 to 10^4, one magnitude each."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.linspace(-5, 4, rows).unsqueeze(1)
    return torch.randn(rows, width, generator=generator) * magnitudes


def special_rows(width: int) -> Tensor:
    """All zeros; zeros and one large outlier; one outlier in small noise; constant rows of either sign."""
    noise = torch.randn(width, generator=torch.Generator().manual_seed(3)) * 1e-2
    rows = torch.zeros(6, width)
    rows[1, width // 3] = -1234.5
    rows[2] = noise
    rows[2, 7] = 80.0
    rows[3], rows[4], rows[5] = 0.7, -3.25, 1e-4
    return rows


def decoded(raw: Tensor, kind: GGMLType, shape: tuple[int, ...]) -> Tensor:
    return gguf_blocks.dequantize(raw.reshape(-1), kind, shape)


def oracle(raw: Tensor, kind: GGMLType) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw.numpy(), GGMLQuantizationType(kind))))


def relative_errors(approximation: Tensor, values: Tensor) -> Tensor:
    """RMS error over RMS value, per row."""
    return ((approximation - values).square().mean(-1) / values.square().mean(-1)).sqrt()


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda kind: kind.name)
def test_our_k_quant_blocks_decode_alike_in_gguf_py_and_ours(kind: GGMLType) -> None:
    values = torch.cat([gaussian_rows(10, 512, seed=int(kind)), special_rows(512)])
    raw = gguf_quantize.quantize(values, kind)
    layout = gguf_blocks.BLOCK_FORMATS[kind]
    assert raw.dtype == torch.uint8 and raw.shape == (16, 2 * layout.type_size)
    ours = decoded(raw, kind, values.shape)
    assert torch.equal(ours.view(torch.int32), oracle(raw, kind).view(torch.int32))
    assert torch.equal(ours[10], torch.zeros(512))  # the all-zero row stays zero


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("device", DEVICES)
def test_k_quant_error_is_within_the_formats_bound(kind: GGMLType, device: str) -> None:
    values = gaussian_rows(32, 2048, seed=10 + int(kind))
    errors = relative_errors(
        decoded(gguf_quantize.quantize(values.to(device), kind), kind, values.shape), values
    )
    assert float(errors.max()) < BOUNDS[kind], f"worst row {float(errors.max()):.4f}"
    specials = special_rows(2048)
    approximation = decoded(gguf_quantize.quantize(specials.to(device), kind), kind, specials.shape)
    assert torch.equal(approximation[0], specials[0])
    assert float(relative_errors(approximation[1:], specials[1:]).max()) < BOUNDS[kind]
    # The outliers themselves come back within the bound of their own size.
    assert abs(float(approximation[1, 2048 // 3]) + 1234.5) < BOUNDS[kind] * 1234.5
    assert abs(float(approximation[2, 7]) - 80.0) < BOUNDS[kind] * 80.0


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda kind: kind.name)
def test_k_quant_error_is_near_the_classic_types(kind: GGMLType) -> None:
    values = gaussian_rows(16, 4096, seed=40)
    mine = relative_errors(decoded(gguf_quantize.quantize(values, kind), kind, values.shape), values)
    anchor = ANCHORS[kind]
    theirs = relative_errors(decoded(gguf_quantize.quantize(values, anchor), anchor, values.shape), values)
    # A row of RMS 1e-5 loses gguf-py's classic types to fp16's subnormal scales: compare from 1e-4 on.
    kept = slice(2, None)
    scaled = float(theirs[kept].mean()) * 2.0 ** (BITS[anchor] - BITS[kind])
    assert float(mine[kept].mean()) < 1.5 * scaled


@pytest.mark.parametrize("kind", gguf_quantize.GGUF_PY_TYPES, ids=lambda kind: kind.name)
def test_the_other_types_are_gguf_pys_bytes(kind: GGMLType) -> None:
    values = torch.cat([gaussian_rows(6, 256, seed=5), special_rows(256)])
    raw = gguf_quantize.quantize(values.to(torch.bfloat16), kind.name.lower())
    expected = quants.quantize(values.to(torch.bfloat16).float().numpy(), GGMLQuantizationType(kind))
    assert np.array_equal(raw.numpy(), np.ascontiguousarray(expected).view(np.uint8).reshape(raw.shape))
    if kind == GGMLType.Q8_0:
        errors = relative_errors(decoded(raw, kind, values.shape), values.to(torch.bfloat16).float())
        assert float(errors[1:6].max()) < BOUNDS[kind]  # rows of RMS 6e-4 and up


def test_shapes_and_refusals() -> None:
    values = gaussian_rows(6, 512, seed=8).reshape(2, 3, 512)
    raw = gguf_quantize.quantize(values, "q4_k")
    assert raw.shape == (2, 3, 2 * 144)
    assert torch.equal(raw.reshape(6, -1), gguf_quantize.quantize(values.reshape(6, 512), GGMLType.Q4_K))
    # Chunks of rows give the blocks a whole tensor gives.
    chunked = gguf_quantize.CHUNK_VALUES
    try:
        gguf_quantize.CHUNK_VALUES = 512
        assert torch.equal(gguf_quantize.quantize(values, 12), raw)
    finally:
        gguf_quantize.CHUNK_VALUES = chunked
    with pytest.raises(ValueError, match="whole 256-value blocks"):
        gguf_quantize.quantize(torch.zeros(4, 96), "Q6_K")
    with pytest.raises(ValueError, match="floating-point"):
        gguf_quantize.quantize(torch.zeros(4, 256, dtype=torch.int32), "Q6_K")
    with pytest.raises(ValueError, match="IQ2_XXS.*writable: F32"):
        gguf_quantize.quantize(torch.zeros(4, 256), "IQ2_XXS")
    with pytest.raises(ValueError, match="NaN"):
        gguf_quantize.quantize(torch.full((1, 256), float("nan")), "Q2_K")
