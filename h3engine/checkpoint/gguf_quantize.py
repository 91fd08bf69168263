"""Float32 values to GGUF blocks: our torch quantizers of the K-quants (Q6_K .. Q2_K), gguf-py's for the rest.

`quantize(values, type)` turns a float tensor whose rows are whole blocks into uint8 [..., row bytes] in ggml's block
layout (gguf_blocks.BLOCK_FORMATS), which gguf-py's `gguf.quants.dequantize` and gguf_blocks decode. F32/F16/BF16,
Q8_0, Q5_0 and Q4_0 go to gguf-py's numpy quantizers; the K-quants, which gguf-py cannot write, are ours, computed
for every 256-value super-block of the tensor at once (rows in chunks of CHUNK_VALUES), on the values' device.
Per super-block: (1) each sub-block's real scale (and min: Q5_K/Q4_K/Q2_K) is the best of a small grid of candidate
ranges, each refit by least squares on its rounded values (`_SEARCH_STEPS`); (2) the fp16 super-block scale(s) d
(dmin) are the largest sub-scale (min) over the sub-scale range, rounded to fp16 away from zero so that no sub-scale
overflows; (3) each sub-scale is its nearest integer or a neighbour (min: likewise), whichever gives the least squared
error once (4) the values are rounded against the quantized scales. How it differs from llama.cpp (make_qx_quants /
make_qkx2_quants over 19-21 grid points, then a plain rounding of the sub-scales): unweighted squared error (llama.cpp
weights by x^2, |x| or RMS + |x|), 6 grid points, sub-scales chosen by the error of the final values. The bytes
differ; the RMS error measured on Gaussian rows was 1-2% lower (Q6_K, Q4_K) and 11% lower (Q2_K) than a re-statement
of llama.cpp's search gave (tests/test_gguf_quantize.py states the bounds).
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3engine.checkpoint.gguf_blocks import (
    _CRUMBS,
    _HIGH_BITS,
    _K_NIBBLES,
    _Q6_NIBBLES,
    BLOCK_FORMATS,
    SUPER_BLOCK,
    GGMLType,
)

# The K-quants quantized here; the types gguf-py's numpy quantizers write.
K_QUANTS = (GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q4_K, GGMLType.Q3_K, GGMLType.Q2_K)
GGUF_PY_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_0)
QUANTIZABLE = GGUF_PY_TYPES + K_QUANTS
# Values quantized at once (bounds the temporaries: a few times this many floats).
CHUNK_VALUES = 1 << 21
# Offsets (in units of a level) tried around the plain min/max (abs-max) range of each sub-block.
_SEARCH_STEPS = (-0.6, -0.3, 0.0, 0.3, 0.6, 0.9)
_FP16_MAX_BITS = 0x7BFF  # 65504


def ggml_type(kind: int | str) -> GGMLType:
    """A type by id or by name, any case ('q4_k', 'Q4_K', 12); ValueError naming the types written here."""
    try:
        found = GGMLType[kind.upper()] if isinstance(kind, str) else GGMLType(int(kind))
    except (KeyError, ValueError):
        found = None
    if found not in QUANTIZABLE:
        names = ", ".join(kind.name for kind in QUANTIZABLE)
        raise ValueError(f"GGUF type {kind!r} cannot be written; writable: {names}")
    return found


def quantize(values: Tensor, kind: int | str) -> Tensor:
    """`values` (floating point, last dim whole blocks of `kind`) as uint8 [..., row bytes] of `kind`'s blocks, on
    the CPU. The K-quants compute on `values`' device and refuse non-finite values; the other types go through
    gguf-py (numpy), as it writes them."""
    known = ggml_type(kind)
    layout = BLOCK_FORMATS[known]
    shape = tuple(values.shape) or (1,)
    if not values.is_floating_point() or shape[-1] % layout.block_size:
        raise ValueError(
            f"{known.name} quantizes floating-point rows of whole {layout.block_size}-value blocks; got "
            f"{values.dtype} of shape {shape}"
        )
    row_bytes = shape[-1] // layout.block_size * layout.type_size
    if known not in K_QUANTS:
        return _gguf_py(values.reshape(shape), known).reshape(*shape[:-1], row_bytes)
    blocks = values.detach().reshape(-1, SUPER_BLOCK)
    out = torch.empty(blocks.shape[0], layout.type_size, dtype=torch.uint8)
    step = max(1, CHUNK_VALUES // SUPER_BLOCK)
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start : start + step].float()
        if not bool(torch.isfinite(chunk).all()):
            raise ValueError(
                f"{known.name}: the values hold infinities or NaNs, which its blocks cannot store"
            )
        out[start : start + step] = _K_ENCODERS[known](chunk).cpu()
    return out.reshape(*shape[:-1], row_bytes)


def _gguf_py(values: Tensor, kind: GGMLType) -> Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as numpy_quantize

    array = values.detach().to("cpu", torch.float32).contiguous().numpy()
    raw = numpy_quantize(array, GGMLQuantizationType(int(kind)))
    return torch.from_numpy(raw.view("uint8").copy())


# --------------------------------------------------------------------------------------------------------------
# Shared steps
# --------------------------------------------------------------------------------------------------------------


def _fp16_away(value: Tensor) -> Tensor:
    """`value` (float32) as the nearest fp16, moved one step away from zero where that is smaller in magnitude, so
    that no sub-scale divided by it exceeds its range; capped at fp16's largest finite value."""
    half = value.clamp(-65504.0, 65504.0).to(torch.float16)
    short = half.float().abs() < value.abs().clamp(max=65504.0)
    bits = half.view(torch.int16)
    bumped = torch.where(short & ((bits & 0x7FFF) < _FP16_MAX_BITS), bits + 1, bits)
    return bumped.view(torch.float16)


def _divided(x: Tensor, step: Tensor) -> Tensor:
    """x / step, 0 where step is 0 (per-sub-block factors: small tensors)."""
    return torch.where(
        step == 0, torch.zeros_like(x), x / torch.where(step == 0, torch.ones_like(step), step)
    )


def _rounded(x: Tensor, factor: Tensor, low: int, high: int) -> Tensor:
    """round(x * factor) clamped to [low, high], as float (a new tensor, rounded in place)."""
    return (x * factor).round_().clamp_(low, high)


def _squared_error(unit: Tensor, levels: Tensor, target: Tensor) -> Tensor:
    """sum over the last dim of (unit * levels - target)^2."""
    return (levels * unit).sub_(target).square_().sum(-1)


def _keep_better(best: list[Tensor], candidate: list[Tensor]) -> list[Tensor]:
    """Element 0 of each list is an error [n, G]; the others [n, G] are taken where the candidate's error is less."""
    better = candidate[0] < best[0]
    return [torch.where(better, c, b) for b, c in zip(best, candidate, strict=True)]


def _pack(values: Tensor, index_map: tuple[list[int], list[int]], nbytes: int) -> Tensor:
    """[n, 256] small integers -> [n, nbytes] uint8: value e at bits `shift[e]` of byte `byte_index[e]`, the maps
    gguf_blocks reads them through (the fields of a byte do not overlap, so adding them is or-ing them)."""
    byte_index, shift = index_map
    where = torch.tensor(byte_index, device=values.device)
    shifts = torch.tensor(shift, dtype=torch.int32, device=values.device)
    packed = torch.zeros(values.shape[0], nbytes, dtype=torch.int32, device=values.device)
    packed.index_add_(1, where, values.to(torch.int32) << shifts)
    return packed.to(torch.uint8)


def _fp16_bytes(value: Tensor) -> Tensor:
    """[n] fp16 -> [n, 2] uint8 (little-endian, as ggml stores it)."""
    return value.contiguous().reshape(-1, 1).view(torch.uint8)


# --------------------------------------------------------------------------------------------------------------
# Symmetric types (Q6_K, Q3_K): value = d * scale_i * v, v in [-nmax, nmax - 1], scale_i in [-nsc, nsc - 1]
# --------------------------------------------------------------------------------------------------------------


def _symmetric_scales(x: Tensor, nmax: int) -> Tensor:
    """[n, G, S] -> each sub-block's real scale [n, G]: its largest-magnitude value at -(nmax + offset) levels for
    each offset of `_SEARCH_STEPS`, refit by least squares on the rounded values, the one of least error."""
    inverse_peak = _divided(torch.ones(()), x.gather(-1, x.abs().argmax(-1, keepdim=True)))
    energy = x.square().sum(-1)
    best = [energy, torch.zeros_like(energy)]
    for offset in _SEARCH_STEPS:
        levels = _rounded(x, inverse_peak * -(nmax + offset), -nmax, nmax - 1)
        cross, square = (x * levels).sum(-1), levels.square_().sum(-1)
        scale = _divided(cross, square)
        best = _keep_better(best, [energy - scale * cross, scale])
    return best[1]


def _symmetric_fit(x: Tensor, scales: Tensor, nmax: int, nsc: int) -> tuple[Tensor, Tensor, Tensor]:
    """Quantized: the fp16 d [n], the integer sub-scales [n, G] and values [n, G, S] (int32) for real `scales`."""
    peak = scales.gather(-1, scales.abs().argmax(-1, keepdim=True))
    d = _fp16_away(peak / -nsc)
    step = d.float()
    nearest = _divided(scales, step).round()
    best: list[Tensor] = []
    for move in (-1, 0, 1):
        sub = (nearest + move).clamp(-nsc, nsc - 1)
        unit = (step * sub).unsqueeze(-1)
        error = _squared_error(unit, _rounded(x, _divided(torch.ones(()), unit), -nmax, nmax - 1), x)
        best = _keep_better(best, [error, sub]) if best else [error, sub]
    unit = (step * best[1]).unsqueeze(-1)
    levels = _rounded(x, _divided(torch.ones(()), unit), -nmax, nmax - 1)
    return d.squeeze(-1), best[1].to(torch.int32), levels.to(torch.int32)


def _q6_k(x: Tensor) -> Tensor:
    groups = x.reshape(-1, 16, 16)
    d, sub, levels = _symmetric_fit(groups, _symmetric_scales(groups, 32), 32, 128)
    values = (levels + 32).reshape(-1, SUPER_BLOCK)
    return torch.cat(
        [
            _pack(values & 0x0F, _Q6_NIBBLES, 128),
            _pack(values >> 4, _CRUMBS, 64),
            sub.to(torch.int8).view(torch.uint8),
            _fp16_bytes(d),
        ],
        dim=1,
    )


def _q3_k(x: Tensor) -> Tensor:
    groups = x.reshape(-1, 16, 16)
    d, sub, levels = _symmetric_fit(groups, _symmetric_scales(groups, 4), 4, 32)
    values = (levels + 4).reshape(-1, SUPER_BLOCK)  # bit 2 set: the value as is; clear: 4 less
    stored = sub + 32
    low = stored & 0x0F  # scale i's low bits: nibble i // 8 of byte i % 8
    high = stored >> 4  # its top 2 bits: field i // 4 of byte 8 + i % 4
    scale_bytes = torch.cat(
        [
            low[:, :8] | (low[:, 8:] << 4),
            high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:] << 6),
        ],
        dim=1,
    )
    return torch.cat(
        [
            _pack(values >> 2, _HIGH_BITS, 32),
            _pack(values & 0x03, _CRUMBS, 64),
            scale_bytes.to(torch.uint8),
            _fp16_bytes(d),
        ],
        dim=1,
    )


# --------------------------------------------------------------------------------------------------------------
# Affine types (Q5_K, Q4_K, Q2_K): value = (d * scale_i) * q - (dmin * min_i), q in [0, nmax], scale, min in [0, nsc]
# --------------------------------------------------------------------------------------------------------------


def _affine_scales(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """[n, G, S] -> each sub-block's real scale and min (>= 0, subtracted) [n, G]: its range [min(x, 0), max(x)] at
    nmax + offset levels for each offset of `_SEARCH_STEPS`, refit by least squares (min kept >= 0), least error."""
    low = x.amin(-1, keepdim=True).clamp(max=0.0)
    width = x.amax(-1, keepdim=True) - low
    above = x - low
    count, total, energy = x.shape[-1], x.sum(-1), x.square().sum(-1)
    plain = width / nmax
    best = [_squared_error(plain, _rounded(above, _divided(torch.ones(()), plain), 0, nmax), above)]
    best += [plain.squeeze(-1), -low.squeeze(-1)]
    for offset in _SEARCH_STEPS:
        levels = _rounded(above, _divided(torch.ones(()), width) * (nmax + offset), 0, nmax)
        ones, cross, square = levels.sum(-1), (x * levels).sum(-1), levels.square_().sum(-1)
        determinant = count * square - ones * ones
        scale = _divided(count * cross - ones * total, determinant)
        shift = _divided(square * total - ones * cross, determinant)
        # A positive offset cannot be stored (nor one fit to equal levels): refit through zero.
        through_zero = (shift > 0) | (determinant == 0)
        scale = torch.where(through_zero, _divided(cross, square), scale)
        shift = torch.where(through_zero, torch.zeros_like(shift), shift)
        # sum((scale * levels + shift - x)^2), from the sums
        error = (
            scale * (scale * square + 2 * shift * ones - 2 * cross)
            + shift * (count * shift - 2 * total)
            + energy
        )
        best = _keep_better(best, [error, scale, -shift])
    return best[1].clamp(min=0.0), best[2]


def _affine_fit(x: Tensor, nmax: int, nsc: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quantized: fp16 d and dmin [n], integer sub-scales and mins [n, G], values [n, G, S] (int32)."""
    scales, mins = _affine_scales(x, nmax)
    d = _fp16_away(scales.amax(-1, keepdim=True) / nsc)
    dmin = _fp16_away(mins.amax(-1, keepdim=True) / nsc)
    step, min_step = d.float(), dmin.float()
    nearest, nearest_min = _divided(scales, step).round(), _divided(mins, min_step).round()
    best: list[Tensor] = []
    for min_move in (-1, 0, 1):
        low = (nearest_min + min_move).clamp(0, nsc)
        target = x + (min_step * low).unsqueeze(-1)
        for move in (-1, 0, 1):
            sub = (nearest + move).clamp(0, nsc)
            unit = (step * sub).unsqueeze(-1)
            error = _squared_error(unit, _rounded(target, _divided(torch.ones(()), unit), 0, nmax), target)
            best = _keep_better(best, [error, sub, low]) if best else [error, sub, low]
    _, sub, low = best
    unit, target = (step * sub).unsqueeze(-1), x + (min_step * low).unsqueeze(-1)
    levels = _rounded(target, _divided(torch.ones(()), unit), 0, nmax)
    return d.squeeze(-1), dmin.squeeze(-1), sub.to(torch.int32), low.to(torch.int32), levels.to(torch.int32)


def _k_scale_bytes(sub: Tensor, low: Tensor) -> Tensor:
    """Q4_K / Q5_K: 8 6-bit scales and mins -> 12 bytes (the layout gguf_blocks._k_scales_and_mins reads)."""
    first = sub[:, :4] | ((sub[:, 4:] >> 4) << 6)
    second = low[:, :4] | ((low[:, 4:] >> 4) << 6)
    third = (sub[:, 4:] & 0x0F) | ((low[:, 4:] & 0x0F) << 4)
    return torch.cat([first, second, third], dim=1).to(torch.uint8)


def _q4_k(x: Tensor) -> Tensor:
    d, dmin, sub, low, levels = _affine_fit(x.reshape(-1, 8, 32), 15, 63)
    values = levels.reshape(-1, SUPER_BLOCK)
    return torch.cat(
        [_fp16_bytes(d), _fp16_bytes(dmin), _k_scale_bytes(sub, low), _pack(values, _K_NIBBLES, 128)], dim=1
    )


def _q5_k(x: Tensor) -> Tensor:
    d, dmin, sub, low, levels = _affine_fit(x.reshape(-1, 8, 32), 31, 63)
    values = levels.reshape(-1, SUPER_BLOCK)
    return torch.cat(
        [
            _fp16_bytes(d),
            _fp16_bytes(dmin),
            _k_scale_bytes(sub, low),
            _pack(values >> 4, _HIGH_BITS, 32),
            _pack(values & 0x0F, _K_NIBBLES, 128),
        ],
        dim=1,
    )


def _q2_k(x: Tensor) -> Tensor:
    d, dmin, sub, low, levels = _affine_fit(x.reshape(-1, 16, 16), 3, 15)
    values = levels.reshape(-1, SUPER_BLOCK)
    return torch.cat(
        [(sub | (low << 4)).to(torch.uint8), _pack(values, _CRUMBS, 64), _fp16_bytes(d), _fp16_bytes(dmin)],
        dim=1,
    )


_K_ENCODERS = {
    GGMLType.Q6_K: _q6_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q2_K: _q2_k,
}
