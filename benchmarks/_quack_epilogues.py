"""GEMM epilogues for benchmarks/epilogue_gemms.py, written with quack's epilogue frontend (imports quack: only
the GPU machine has it). Module-level so that quack can fingerprint and import them."""

from __future__ import annotations

from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.head_rmsnorm import HeadRstd
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import RowVecLoad
from quack.epilogue.rotary import rotary_cos_sin_load


@gemm_epilogue(ops={"gate": RowVecLoad("gate")})
def gated_residual_epi(acc, c, gate):
    """D = C + gate * (A @ B), one gate value per column."""
    return {"D": c + gate * acc}


def _squares(acc):
    return {"qk": acc * acc}


@gemm_epilogue(
    ops={"cs": rotary_cos_sin_load("cs"), "qk": HeadRstd("qk", eps=1e-5), "w": RowVecLoad("w")},
    prepass=_squares,
    prepass_outs=("qk",),
    mode="acc_pair",
)
def qk_norm_rope_epi(acc, cs, qk, w):
    """Per-head RMSNorm (weight w repeated per head), then RoPE on adjacent channel pairs (cos, sin interleaved)."""
    x1, x2 = unpack(acc * qk * w)
    c, s = unpack(cs)
    return {"D": pack(x1 * c - x2 * s, x1 * s + x2 * c)}
