"""Per-head QK RMSNorm followed by the partial rotate-half RoPE of `Attention.forward`, in plain torch.

Contract
--------
`query` / `key` are [S, heads, D]; `q_weight` / `k_weight` the QK-norm weights [D]; `cos` / `sin` are [S, R] in the
activations' dtype with R even and R <= D, or both None (no rotation, as in the text refiner). The first R channels
of every head rotate as NeoX rotate-half pairs (c, c + R/2); channels >= R pass through. Roundings are the
model's: F.rms_norm rounds once, then `x * cos` and `rotate_half(x) * sin` each round, then their sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rotate_first_channels(hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rotary_dim = cos.shape[-1]
    rotated_part, passed_part = hidden[..., :rotary_dim], hidden[..., rotary_dim:]
    first_half, second_half = rotated_part.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = rotated_part * cos + torch.cat((-second_half, first_half), dim=-1) * sin
    return torch.cat((rotated, passed_part), dim=-1)


def qk_norm_rope(
    query: Tensor,
    key: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor | None,
    sin: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(RMSNorm(query) then RoPE, RMSNorm(key) then RoPE), each [S, heads, D]."""
    head_dim = query.shape[-1]
    query = F.rms_norm(query, (head_dim,), q_weight, eps)
    key = F.rms_norm(key, (head_dim,), k_weight, eps)
    if cos is None and sin is None:
        return query, key
    if cos is None or sin is None:
        raise ValueError("qk_norm_rope: cos and sin must both be tensors or both be None")
    return rotate_first_channels(query, cos, sin), rotate_first_channels(key, cos, sin)
