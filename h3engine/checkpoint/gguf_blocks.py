"""GGUF tensor data to float32, in plain torch: the block formats of llama.cpp's ggml that community GGUF files use.

A GGUF tensor of a quantized type is a run of fixed-size blocks along its last dim, each holding `block_size`
values in `type_size` bytes: fp16 scales (and minimums), then packed integers. `BLOCK_FORMATS` lists the types
read here; `dequantize` turns a tensor's raw bytes into float32 values, all blocks at once (no loop over blocks).
Each type's decoder gathers every value's byte(s) through fixed per-type index maps (which byte, which shift),
then applies the scales in float32, product by product, in the order ggml's reference dequantizers use, so the
results are bit-identical to gguf-py's `gguf.quants.dequantize` (tests/test_gguf_blocks.py).

This module is the plain-torch twin of the Triton kernels in `kernels/triton/gguf_dequant.py`; callers go through
`h3engine.models.gguf_ops`, which picks one per call. Shapes are torch's (row-major, last dim fastest), i.e. the
reverse of the `ne` dims a GGUF header stores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from h3engine.errors import CheckpointError

# Values per super-block of the K-quants (ggml's QK_K).
SUPER_BLOCK = 256


class GGMLType(IntEnum):
    """The ggml tensor types read here, by the id a GGUF tensor header stores."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q5_0 = 6
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


@dataclass(frozen=True)
class BlockFormat:
    """`block_size` values stored in `type_size` bytes."""

    block_size: int
    type_size: int


BLOCK_FORMATS: dict[GGMLType, BlockFormat] = {
    GGMLType.F32: BlockFormat(1, 4),
    GGMLType.F16: BlockFormat(1, 2),
    GGMLType.BF16: BlockFormat(1, 2),
    # d (fp16), 32 int8
    GGMLType.Q8_0: BlockFormat(32, 2 + 32),
    # d (fp16), 32 4-bit values, two to a byte
    GGMLType.Q4_0: BlockFormat(32, 2 + 16),
    # d (fp16), the 32 fifth bits (4 bytes), 32 low nibbles
    GGMLType.Q5_0: BlockFormat(32, 2 + 4 + 16),
    # 16 scale/min nibble pairs, 256 2-bit values, d, dmin (fp16)
    GGMLType.Q2_K: BlockFormat(SUPER_BLOCK, 16 + 64 + 2 + 2),
    # 256 high bits, 256 2-bit values, 16 6-bit scales (12 bytes), d
    GGMLType.Q3_K: BlockFormat(SUPER_BLOCK, 32 + 64 + 12 + 2),
    # d, dmin, 8 6-bit scales and 8 6-bit mins (12 bytes), 256 nibbles
    GGMLType.Q4_K: BlockFormat(SUPER_BLOCK, 2 + 2 + 12 + 128),
    # as Q4_K, with 256 fifth bits (32 bytes) before the nibbles
    GGMLType.Q5_K: BlockFormat(SUPER_BLOCK, 2 + 2 + 12 + 32 + 128),
    # 256 low nibbles, 256 2-bit high parts, 16 int8 scales, d
    GGMLType.Q6_K: BlockFormat(SUPER_BLOCK, 128 + 64 + 16 + 2),
}


def supported_type(ggml_type: int) -> GGMLType | None:
    """The GGMLType of a type id read here (an int, ours or gguf-py's GGMLQuantizationType), else None."""
    try:
        return GGMLType(int(ggml_type))
    except ValueError:
        return None


def ggml_type_name(ggml_type: int) -> str:
    """The ggml name of a type id ('Q4_K'), also for the types not read here (gguf-py's list); 'unknown' else."""
    if (known := supported_type(ggml_type)) is not None:
        return known.name
    from gguf import GGMLQuantizationType  # only to name a type we refuse

    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return "unknown"


def block_format(ggml_type: int, name: str = "") -> BlockFormat:
    """The block format of a supported type; a CheckpointError naming the type and the tensor otherwise."""
    known = supported_type(ggml_type)
    if known is None:
        raise CheckpointError(
            f"GGUF tensor {name!r}: ggml type {ggml_type_name(ggml_type)} (id {int(ggml_type)}) is not supported "
            f"(supported: {', '.join(kind.name for kind in BLOCK_FORMATS)})"
        )
    return BLOCK_FORMATS[known]


def byte_count(ggml_type: int, shape: Sequence[int], name: str = "") -> int:
    """How many bytes a tensor of this type and torch shape takes; its last dim must be whole blocks."""
    layout = block_format(ggml_type, name)
    width = shape[-1] if len(shape) else 1
    if width % layout.block_size:
        raise CheckpointError(
            f"GGUF tensor {name!r}: last dim {width} of shape {tuple(shape)} is not a multiple of the "
            f"{ggml_type_name(ggml_type)} block size {layout.block_size}"
        )
    elements = 1
    for size in shape:
        elements *= int(size)
    return elements // layout.block_size * layout.type_size


def dequantize(raw: Tensor, ggml_type: int, shape: Sequence[int], name: str = "") -> Tensor:
    """The float32 tensor of `shape` that the GGUF bytes `raw` (uint8, any shape) of `ggml_type`
    hold, on raw's device. `name` (the tensor's GGUF name) is for error messages only."""
    expected = byte_count(ggml_type, shape, name)
    if raw.dtype != torch.uint8 or raw.numel() != expected:
        raise CheckpointError(
            f"GGUF tensor {name!r}: {ggml_type_name(ggml_type)} data of shape {tuple(shape)} takes {expected} "
            f"bytes (uint8); got {raw.numel()} of {raw.dtype}"
        )
    known = GGMLType(int(ggml_type))
    blocks = raw.reshape(-1, BLOCK_FORMATS[known].type_size)
    return DECODERS[known](blocks).reshape(tuple(shape))


# --------------------------------------------------------------------------------------------------------------
# Decoders: [n, type_size] uint8 blocks -> [n, block_size] float32
# --------------------------------------------------------------------------------------------------------------


def _fp16(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 at byte `offset` of every block, widened to float32: [n, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _bits(blocks: Tensor, offset: int, byte_index: list[int], shift: list[int], mask: int) -> Tensor:
    """Value e of every block: (blocks[:, offset + byte_index[e]] >> shift[e]) & mask, as uint8 [n, len(byte_index)]."""
    where = torch.tensor(byte_index, device=blocks.device) + offset
    shifts = torch.tensor(shift, dtype=torch.uint8, device=blocks.device)
    return (blocks.index_select(1, where) >> shifts) & mask


def _groups(values: Tensor, scales: Tensor) -> Tensor:
    """[n, G * size] values and [n, G] per-group factors -> [n, G, size] values, [n, G, 1] factors."""
    return values.reshape(values.shape[0], scales.shape[1], -1), scales.unsqueeze(-1)


def _float32(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float32)


def _float16(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bfloat16(blocks: Tensor) -> Tensor:
    # The bits moved up by 16, so NaN payloads survive as they are.
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q8_0(blocks: Tensor) -> Tensor:
    return _fp16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


# Q4_0 / Q5_0: value j < 16 is the low nibble of byte j, value j + 16 its high nibble.
_NIBBLE_PAIRS = ([j % 16 for j in range(32)], [4 * (j // 16) for j in range(32)])


def _q4_0(blocks: Tensor) -> Tensor:
    low = _bits(blocks, 2, *_NIBBLE_PAIRS, 0x0F)
    return _fp16(blocks, 0) * (low.float() - 8.0)


def _q5_0(blocks: Tensor) -> Tensor:
    low = _bits(blocks, 6, *_NIBBLE_PAIRS, 0x0F)
    # The fifth bit of value j is bit j of the little-endian uint32 at byte 2.
    high = _bits(blocks, 2, [j // 8 for j in range(32)], [j % 8 for j in range(32)], 0x01)
    return _fp16(blocks, 0) * ((low | (high << 4)).float() - 16.0)


# K-quants: in each 128-value half, 2-bit field s of byte j (shift 2s) is value 32s + j; the byte is 32 * half + j.
_CRUMBS = (
    [32 * (e // 128) + e % 32 for e in range(SUPER_BLOCK)],
    [2 * ((e % 128) // 32) for e in range(SUPER_BLOCK)],
)
# Q3_K / Q5_K high bits: bit b of byte j is value 32b + j.
_HIGH_BITS = ([e % 32 for e in range(SUPER_BLOCK)], [e // 32 for e in range(SUPER_BLOCK)])
# Q4_K / Q5_K nibbles: in each 64-value chunk c, byte 32c + j holds value 64c + j (low) and 64c + 32 + j (high).
_K_NIBBLES = (
    [32 * (e // 64) + e % 32 for e in range(SUPER_BLOCK)],
    [4 * ((e // 32) % 2) for e in range(SUPER_BLOCK)],
)
# Q6_K low nibbles: in each 128-value half, byte 64 * half + k holds value k (low) and 64 + k (high), k < 64.
_Q6_NIBBLES = (
    [64 * (e // 128) + e % 64 for e in range(SUPER_BLOCK)],
    [4 * ((e % 128) // 64) for e in range(SUPER_BLOCK)],
)


def _q2_k(blocks: Tensor) -> Tensor:
    scales = blocks[:, :16]
    step = _fp16(blocks, 80) * (scales & 0x0F).float()
    low = _fp16(blocks, 82) * (scales >> 4).float()
    values, step = _groups(_bits(blocks, 16, *_CRUMBS, 0x03).float(), step)
    return (step * values - low.unsqueeze(-1)).reshape(blocks.shape[0], -1)


def _q3_k_scales(packed: Tensor) -> Tensor:
    """12 bytes -> 16 signed 6-bit scales: scale i has its low 4 bits in nibble i // 8 of byte i % 8 and its top 2
    bits in field i // 4 (shift 2 * (i // 4)) of byte 8 + i % 4; stored with a bias of 32."""
    low = _bits(packed, 0, [i % 8 for i in range(16)], [4 * (i // 8) for i in range(16)], 0x0F)
    high = _bits(packed, 8, [i % 4 for i in range(16)], [2 * (i // 4) for i in range(16)], 0x03)
    return (low | (high << 4)).float() - 32.0


def _q3_k(blocks: Tensor) -> Tensor:
    step = _fp16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])
    low = _bits(blocks, 32, *_CRUMBS, 0x03).float()
    # A clear high bit subtracts 4.
    high = _bits(blocks, 0, *_HIGH_BITS, 0x01).float()
    values, step = _groups(low - 4.0 * (1.0 - high), step)
    return (step * values).reshape(blocks.shape[0], -1)


def _k_scales_and_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins (float32 [n, 8] each). Sub-block i < 4: scale
    and min are the low 6 bits of bytes i and 4 + i; i >= 4: their low 4 bits are the low and high nibble of byte
    4 + i, their top 2 bits the top 2 bits of bytes i - 4 and i."""
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)], dim=1)
    mins = torch.cat([second & 0x3F, (third >> 4) | ((second >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k_affine(blocks: Tensor, values: Tensor) -> Tensor:
    """(d * scale) * value - (dmin * min) per 32-value sub-block, the factors read from bytes 0..15."""
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    values, step = _groups(values, _fp16(blocks, 0) * scales)
    low = (_fp16(blocks, 2) * mins).unsqueeze(-1)
    return (step * values - low).reshape(blocks.shape[0], -1)


def _q4_k(blocks: Tensor) -> Tensor:
    return _k_affine(blocks, _bits(blocks, 16, *_K_NIBBLES, 0x0F).float())


def _q5_k(blocks: Tensor) -> Tensor:
    low = _bits(blocks, 48, *_K_NIBBLES, 0x0F)
    high = _bits(blocks, 16, *_HIGH_BITS, 0x01)
    return _k_affine(blocks, (low | (high << 4)).float())


def _q6_k(blocks: Tensor) -> Tensor:
    low = _bits(blocks, 0, *_Q6_NIBBLES, 0x0F)
    high = _bits(blocks, 128, *_CRUMBS, 0x03)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    values, step = _groups((low | (high << 4)).float() - 32.0, _fp16(blocks, 208) * scales)
    return (step * values).reshape(blocks.shape[0], -1)


DECODERS: dict[GGMLType, Callable[[Tensor], Tensor]] = {
    GGMLType.F32: _float32,
    GGMLType.F16: _float16,
    GGMLType.BF16: _bfloat16,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
