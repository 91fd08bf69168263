"""AdaLN-modulated RMSNorm and the gated residual of `DiTBlock.forward` / `FinalLayer.forward`, in plain torch.

Contract
--------
`hidden` / `update` are [S, H]; `weight` is the RMSNorm weight [H]; `scale_plus_one`, `shift` and `gate` are small
AdaLN tables [R, H] indexed per row by `rows` [S] (int64 or int32). Everything is in one dtype. The expressions are
the model's, so each elementwise op rounds to that dtype exactly where the model's does:

    modulated_rms_norm = F.rms_norm(hidden, (H,), weight, eps) * scale_plus_one[rows] + shift[rows]
    gated_residual     = hidden + gate[rows] * update

F.rms_norm reduces in fp32 and multiplies by the weight in fp32 before its single rounding to the dtype.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def modulated_rms_norm(
    hidden: Tensor, weight: Tensor, eps: float, scale_plus_one: Tensor, shift: Tensor, rows: Tensor
) -> Tensor:
    """RMSNorm of every row of `hidden`, then `* scale_plus_one[rows] + shift[rows]`: [S, H] -> [S, H]."""
    normed = F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)
    return normed * scale_plus_one.index_select(0, rows) + shift.index_select(0, rows)


def gated_residual(hidden: Tensor, gate: Tensor, rows: Tensor, update: Tensor) -> Tensor:
    """`hidden + gate[rows] * update`: the product rounds to the dtype, then the sum does."""
    return hidden + gate.index_select(0, rows) * update


def gated_residual_rms_norm(
    hidden: Tensor,
    gate: Tensor,
    rows: Tensor,
    update: Tensor,
    weight: Tensor,
    eps: float,
    scale_plus_one: Tensor,
    shift: Tensor,
) -> tuple[Tensor, Tensor]:
    """`gated_residual`, then `modulated_rms_norm` of its result: (new hidden, modulated new hidden)."""
    new_hidden = gated_residual(hidden, gate, rows, update)
    return new_hidden, modulated_rms_norm(new_hidden, weight, eps, scale_plus_one, shift, rows)
