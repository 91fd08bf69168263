"""The SwiGLU activation between `SwiGLU.fc1` and `fc2`, in plain torch.

Contract
--------
`fused` is fc1's output [S, 2F] with the gate in the FIRST half of the last dim. The result [S, F] is
`F.silu(gate) * value`: silu computes in fp32 and rounds once to the dtype, then the product rounds.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def swiglu(fused: Tensor) -> Tensor:
    """[S, 2F] (gate | value) -> [S, F] = silu(gate) * value."""
    gate, value = fused.chunk(2, dim=-1)
    return F.silu(gate) * value
