"""NVFP4 (ComfyUI comfy_quant format "nvfp4", as Comfy-Org's comfy-kitchen writes it): its layout and math in plain
torch: `dequantize_nvfp4` (the twin every other path must equal), the block-scale swizzle and its inverse, the
nibble packing, and the quantizer our writer uses. The layout, as read from public code, is in the comment below.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Read from comfy-kitchen (Comfy-Org/comfy-kitchen: comfy_kitchen/float_utils.py `pack_uint4` / `unpack_uint4`
# hi_first=True, `to_blocked` / `from_blocked`; backends/eager/quantization.py `quantize_nvfp4` / `dequantize_nvfp4`;
# tensor/nvfp4.py `TensorCoreNVFP4Layout.state_dict_tensors`, `get_padded_shape`; commit ea7a339 "Nibble Swizzle",
# whose default hi_first=True is the order every earlier version wrote) and ComfyUI's loader (comfy/ops.py, comfy/
# quant_ops.py: `weight_scale` read as float8_e4m3fn, a uint8 one viewed so). A layer L of R rows and K columns:
# * `L.weight`: uint8 [R, K/2]; byte j of a row holds columns 2j (HIGH nibble, bits 4-7) and 2j+1 (low nibble).
#   Each nibble is an e2m1 code: bit 3 the sign, codes 0-7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 (8-15 their negatives).
# * `L.weight_scale`: float8_e4m3fn, one per 16 consecutive columns of a row (S[r, c], c < K/16), stored swizzled
#   (cuBLAS' 128x4 block-scaling layout): S zero-padded to [roundup(R, 128), roundup(K/16, 4)], S[r, c] at flat index
#   ((r//128 * (padded K/16)/4 + c//4) * 32 + r%32) * 16 + (r%128)//32 * 4 + c%4; stored 2-D in the padded shape.
# * `L.weight_scale_2`: float32, one value, the global scale (comfy-kitchen: amax / (448 * 6)).
# * optionally `L.input_scale` (float32, the activations' global scale for an FP4 x FP4 matmul; no weight math).
# * value[r, k] = e2m1(code[r, k]) * fp32(S[r, k//16]) * weight_scale_2. Ours: e2m1 x block scale (exact in float32),
#   times the global scale (one rounding), then one rounding to the compute dtype. (comfy-kitchen's eager path
#   multiplies the two scales first, in the output dtype; the values agree wherever that product is exact.)
# * comfy-kitchen pads R and K to multiples of 16 (zeros) before quantizing; the file then holds the padded shape.
#   We read the stored shape as the logical one: a padded layer's shape differs from its module's and is refused.
# Quantizing (comfy-kitchen's, and our writer's): block scale = e4m3(min(block amax / 6 / global, 448)), values =
# the nearest e2m1 (ties to the even code) of x / (global * block scale), 0 where that product is 0.

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Between adjacent magnitudes: (midpoint, whether a tie goes up: to the even code).
_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _roundup(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def blocked_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The stored (swizzled, padded) shape of the block scales of `rows` rows of `blocks` blocks."""
    return _roundup(rows, 128), _roundup(blocks, 4)


def swizzled_index(rows: int, blocks: int, device: torch.device | str = "cpu") -> Tensor:
    """int64 [rows, blocks]: where block scale (r, c) lies in the flat swizzled storage."""
    r = torch.arange(rows, device=device).view(-1, 1)
    c = torch.arange(blocks, device=device).view(1, -1)
    column_tiles = blocked_shape(rows, blocks)[1] // 4
    tile = (r // 128) * column_tiles + c // 4
    return (tile * 32 + r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def unswizzle_block_scales(stored: Tensor, rows: int, blocks: int) -> Tensor:
    """The block scales [rows, blocks] (row-major, the stored dtype) of their swizzled, padded storage."""
    flat = stored.reshape(-1).view(torch.uint8)
    index = swizzled_index(rows, blocks, stored.device)
    return flat[index.reshape(-1)].view(rows, blocks).view(stored.dtype)


def swizzle_block_scales(scales: Tensor) -> Tensor:
    """Block scales [rows, blocks] in their stored layout: swizzled, zero-padded, 2-D of `blocked_shape`."""
    rows, blocks = scales.shape
    padded = blocked_shape(rows, blocks)
    flat = torch.zeros(padded[0] * padded[1], dtype=torch.uint8, device=scales.device)
    flat[swizzled_index(rows, blocks, scales.device).reshape(-1)] = (
        scales.contiguous().view(torch.uint8).reshape(-1)
    )
    return flat.view(padded).view(scales.dtype)


def unpack_codes(packed: Tensor) -> Tensor:
    """uint8 [R, K/2] -> the e2m1 codes uint8 [R, K]: each byte's high nibble first."""
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(*packed.shape[:-1], -1)


def pack_codes(codes: Tensor) -> Tensor:
    """e2m1 codes uint8 [R, K] -> uint8 [R, K/2]: column 2j in the high nibble, 2j+1 in the low one."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def dequantize_nvfp4(
    packed: Tensor, block_scales: Tensor, global_scale: Tensor, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """The weight [R, K] of packed values uint8 [R, K/2], row-major block scales [R, K/16] (float8_e4m3fn) and the
    global scale (one value): e2m1 x block scale x global scale in float32, one rounding to `out_dtype`."""
    rows = packed.shape[0]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[unpack_codes(packed).long()].view(rows, -1, BLOCK)
    scaled = values * block_scales.to(torch.float32).view(rows, -1, 1)
    return (scaled * global_scale.to(torch.float32).reshape(())).view(rows, -1).to(out_dtype)


def round_to_e2m1(values: Tensor) -> Tensor:
    """float32 values in [-6, 6] -> their nearest e2m1 codes (ties to the even code; the sign bit kept), uint8."""
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for midpoint, tie_up in _MIDPOINTS:
        code += (magnitude >= midpoint if tie_up else magnitude > midpoint).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def quantize_nvfp4(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[R, K] (K a multiple of 16) -> (packed uint8 [R, K/2], swizzled e4m3 block scales, float32 global scale [])."""
    rows, columns = matrix.shape
    if columns % BLOCK:
        raise ValueError(f"NVFP4 quantizes rows of whole {BLOCK}-value blocks, not {columns} columns")
    values = matrix.to(torch.float32)
    amax = torch.linalg.vector_norm(values, ord=float("inf")) if values.numel() else torch.zeros(())
    global_scale = (amax / (E4M3_MAX * E2M1_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    blocks = values.view(rows, -1, BLOCK)
    block_amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)
    block_scales = (block_amax / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    total = global_scale * block_scales.to(torch.float32)
    safe = torch.where(total == 0, torch.ones_like(total), total)
    scaled = torch.where(total.unsqueeze(-1) == 0, 0.0, blocks / safe.unsqueeze(-1))
    codes = round_to_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX).view(rows, columns))
    return pack_codes(codes), swizzle_block_scales(block_scales), global_scale
