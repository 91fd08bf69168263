"""AdaLN-modulated RMSNorm and the gated residual of `DiTBlock.forward` / `FinalLayer.forward`, in plain torch.

Contract
--------
`hidden` / `update` are [S, H]; `weight` is the RMSNorm weight [H]; `scale_plus_one`, `shift` and `gate` are small
AdaLN tables [R, H] indexed per row by `rows` [S] (int64 or int32). Everything is in one dtype. The expressions are
the model's, so each elementwise op rounds to that dtype exactly where the model's does:

    modulated_rms_norm = F.rms_norm(hidden, (H,), weight, eps) * scale_plus_one[rows] + shift[rows]
    gated_residual     = hidden + gate[rows] * update

F.rms_norm reduces in fp32 and multiplies by the weight in fp32 before its single rounding to the dtype.

The video VAE decoder's blocks keep an fp32 residual stream with fp32 layer scales [H] and feed fp16 GEMMs under
autocast; its two ops widen to fp32, normalize there and round once to `out_dtype` (the GEMM's input dtype):

    rms_norm_to                  = F.rms_norm(hidden.float(), (H,), weight.float(), eps).to(out_dtype)
    scaled_residual_rms_norm_to  = (new = hidden + update * scale, rms_norm_to(new, weight, eps, out_dtype))

where `update * scale` follows torch's type promotion (an fp16 update times the fp32 scale is an fp32 product).
"""

from __future__ import annotations

import torch
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


def rms_norm_to(hidden: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """RMSNorm of every row computed in fp32 (hidden and weight widened), rounded once to `out_dtype`."""
    return F.rms_norm(hidden.float(), (hidden.shape[-1],), weight.float(), eps).to(out_dtype)


def scaled_residual_rms_norm_to(
    hidden: Tensor, update: Tensor, scale: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(new = hidden + update * scale, rms_norm_to(new, weight, eps, out_dtype)); `scale` is one [H] vector."""
    new_hidden = hidden + update * scale
    return new_hidden, rms_norm_to(new_hidden, weight, eps, out_dtype)
