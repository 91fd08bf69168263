"""Triton twins of `h3engine.checkpoint.gguf_blocks`' decoders: GGUF quantized blocks to fp32, bf16 or fp16.

Contract
--------
`dequantize(raw, ggml_type, shape, out_dtype)` takes a tensor's raw GGUF bytes (contiguous uint8) and returns a
new contiguous tensor of `shape` in `out_dtype`, equal to `gguf_blocks.dequantize(...).to(out_dtype)`: each value
is computed in fp32 with the twin's products and differences in the twin's order (no FMA: `LAUNCH_OPTIONS`), then
rounded once. Quantized types only (Q8_0, Q4_0, Q5_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); F32 / F16 / BF16 data is a
view and a cast, which torch does in one pass already. Type ids are ggml's (the table below repeats gguf_blocks').

One program per tile of whole blocks (2048 values), a 2D [blocks, block_size] tile; each value finds its byte(s)
and scale bytes by index arithmetic (gathers that hit the block's cached bytes). Rows past the last block read the
last block again and store nothing. Offsets are int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import LAUNCH_OPTIONS, SUPPORTED_DTYPES, num_warps_for

# Values per program: 64 blocks of 32 or 8 super-blocks of 256.
TILE = 2048


@triton.jit
def _byte(block, offset):
    """The byte at `offset` (scalar or tensor) of each block, as int32."""
    return tl.load(block + offset).to(tl.int32)


@triton.jit
def _fp16(block, offset: tl.constexpr):
    """The little-endian fp16 at byte `offset` of each block, widened to fp32."""
    bits = tl.load(block + offset).to(tl.uint16) | (tl.load(block + offset + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tile(raw_ptr, n_blocks, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """(rows [B, 1] int64, each row's block pointer [B, 1], value index e [1, BLOCK_SIZE]) of this program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    block = raw_ptr + tl.minimum(rows, n_blocks - 1) * TYPE_SIZE
    return rows, block, tl.arange(0, BLOCK_SIZE)[None, :]


@triton.jit
def _store(out_ptr, rows, n_blocks, e, BLOCK_SIZE: tl.constexpr, values):
    live = (rows < n_blocks) & (e < BLOCK_SIZE)
    tl.store(out_ptr + rows * BLOCK_SIZE + e, values.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _q8_0_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 32, 34)
    q = tl.load(block + 2 + e).to(tl.int8, bitcast=True).to(tl.float32)
    _store(out_ptr, rows, n_blocks, e, 32, _fp16(block, 0) * q)


@triton.jit
def _q4_0_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 32, 18)
    q = (_byte(block, 2 + e % 16) >> (4 * (e // 16))) & 0x0F
    _store(out_ptr, rows, n_blocks, e, 32, _fp16(block, 0) * (q.to(tl.float32) - 8.0))


@triton.jit
def _q5_0_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 32, 22)
    low = (_byte(block, 6 + e % 16) >> (4 * (e // 16))) & 0x0F
    high = (_byte(block, 2 + e // 8) >> (e % 8)) & 0x01
    q = (low | (high << 4)).to(tl.float32)
    _store(out_ptr, rows, n_blocks, e, 32, _fp16(block, 0) * (q - 16.0))


@triton.jit
def _crumb(block, offset: tl.constexpr, e):
    """K-quant 2-bit field of value e: field (e % 128) // 32 of byte offset + 32 * (e // 128) + e % 32."""
    return (_byte(block, offset + 32 * (e // 128) + e % 32) >> (2 * ((e % 128) // 32))) & 0x03


@triton.jit
def _high_bit(block, offset: tl.constexpr, e):
    """Q3_K / Q5_K high bit of value e: bit e // 32 of byte offset + e % 32."""
    return (_byte(block, offset + e % 32) >> (e // 32)) & 0x01


@triton.jit
def _k_nibble(block, offset: tl.constexpr, e):
    """Q4_K / Q5_K nibble of value e: nibble (e // 32) % 2 of byte offset + 32 * (e // 64) + e % 32."""
    return (_byte(block, offset + 32 * (e // 64) + e % 32) >> (4 * ((e // 32) % 2))) & 0x0F


@triton.jit
def _q2_k_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 256, 84)
    scale = _byte(block, e // 16)
    step = _fp16(block, 80) * (scale & 0x0F).to(tl.float32)
    low = _fp16(block, 82) * (scale >> 4).to(tl.float32)
    values = step * _crumb(block, 16, e).to(tl.float32) - low
    _store(out_ptr, rows, n_blocks, e, 256, values)


@triton.jit
def _q3_k_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 256, 110)
    group = e // 16
    scale_low = (_byte(block, 96 + group % 8) >> (4 * (group // 8))) & 0x0F
    scale_high = (_byte(block, 104 + group % 4) >> (2 * (group // 4))) & 0x03
    step = _fp16(block, 108) * ((scale_low | (scale_high << 4)).to(tl.float32) - 32.0)
    high = _high_bit(block, 0, e).to(tl.float32)
    q = _crumb(block, 32, e).to(tl.float32) - 4.0 * (1.0 - high)
    _store(out_ptr, rows, n_blocks, e, 256, step * q)


@triton.jit
def _k_affine(block, e, q):
    """(d * scale) * q - (dmin * min) of Q4_K / Q5_K, the 6-bit scale and min of sub-block e // 32 unpacked from
    bytes 4..15 (see gguf_blocks._k_scales_and_mins)."""
    sub_block = e // 32
    first = _byte(block, 4 + sub_block % 4)
    second = _byte(block, 8 + sub_block % 4)
    third = _byte(block, 12 + sub_block % 4)
    direct = sub_block < 4
    scale = tl.where(direct, first & 0x3F, (third & 0x0F) | ((first >> 6) << 4))
    minimum = tl.where(direct, second & 0x3F, (third >> 4) | ((second >> 6) << 4))
    step = _fp16(block, 0) * scale.to(tl.float32)
    low = _fp16(block, 2) * minimum.to(tl.float32)
    return step * q - low


@triton.jit
def _q4_k_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 256, 144)
    q = _k_nibble(block, 16, e).to(tl.float32)
    _store(out_ptr, rows, n_blocks, e, 256, _k_affine(block, e, q))


@triton.jit
def _q5_k_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 256, 176)
    q = (_k_nibble(block, 48, e) | (_high_bit(block, 16, e) << 4)).to(tl.float32)
    _store(out_ptr, rows, n_blocks, e, 256, _k_affine(block, e, q))


@triton.jit
def _q6_k_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    rows, block, e = _tile(raw_ptr, n_blocks, BLOCKS, 256, 210)
    low = (_byte(block, 64 * (e // 128) + e % 64) >> (4 * ((e % 128) // 64))) & 0x0F
    q = (low | (_crumb(block, 128, e) << 4)).to(tl.float32) - 32.0
    scale = tl.load(block + 192 + e // 16).to(tl.int8, bitcast=True).to(tl.float32)
    _store(out_ptr, rows, n_blocks, e, 256, (_fp16(block, 208) * scale) * q)


# ggml type id -> (kernel, values per block, bytes per block).
KERNELS = {
    8: (_q8_0_kernel, 32, 34),
    2: (_q4_0_kernel, 32, 18),
    6: (_q5_0_kernel, 32, 22),
    10: (_q2_k_kernel, 256, 84),
    11: (_q3_k_kernel, 256, 110),
    12: (_q4_k_kernel, 256, 144),
    13: (_q5_k_kernel, 256, 176),
    14: (_q6_k_kernel, 256, 210),
}


def supports_dequantize(raw: Tensor, ggml_type: int, shape: Sequence[int], out_dtype: torch.dtype) -> bool:
    """True for a quantized type above, contiguous uint8 `raw` of exactly the bytes `shape` takes, a float
    `out_dtype` (bf16, fp16, fp32)."""
    if int(ggml_type) not in KERNELS or out_dtype not in SUPPORTED_DTYPES:
        return False
    _, block_size, type_size = KERNELS[int(ggml_type)]
    elements = 1
    for size in shape:
        elements *= int(size)
    width = int(shape[-1]) if len(shape) else 1
    return (
        raw.dtype == torch.uint8
        and raw.is_contiguous()
        and width % block_size == 0
        and raw.numel() == elements // block_size * type_size
    )


def dequantize(raw: Tensor, ggml_type: int, shape: Sequence[int], out_dtype: torch.dtype) -> Tensor:
    """GGUF bytes `raw` of `ggml_type` -> new contiguous tensor of `shape` in `out_dtype`, on raw's device."""
    kernel, block_size, type_size = KERNELS[int(ggml_type)]
    out = torch.empty(tuple(shape), dtype=out_dtype, device=raw.device)
    n_blocks = raw.numel() // type_size
    if n_blocks == 0:
        return out
    blocks_per_program = TILE // block_size
    kernel[(triton.cdiv(n_blocks, blocks_per_program),)](
        raw, out, n_blocks, BLOCKS=blocks_per_program, num_warps=num_warps_for(TILE), **LAUNCH_OPTIONS
    )
    return out
