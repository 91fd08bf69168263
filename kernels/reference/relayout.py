"""The two permute-and-copy steps around the Ulysses all-to-alls of `h3engine.models.parallel.collectives`, in torch.

Contract
--------
* `pack_heads_for_exchange(tensor [rows, *lead, heads, D], size)` -> contiguous [size, rows, *lead, heads/size, D]:
  block j of dim 0 holds head block j (heads [j*heads/size, (j+1)*heads/size)), the send buffer of
  `sequence_to_heads`.
* `unpack_exchanged_heads(received [size, rows, *lead, local_heads, D])` -> contiguous
  [rows, *lead, size*local_heads, D]: the head blocks received from ranks 0..size-1 put back side by side, as
  `heads_to_sequence` does after its all-to-all.
"""

from __future__ import annotations

from torch import Tensor


def pack_heads_for_exchange(tensor: Tensor, size: int) -> Tensor:
    """[rows, *lead, heads, D] -> contiguous [size, rows, *lead, heads / size, D] (heads split into `size` blocks)."""
    per_rank_heads = tensor.unflatten(-2, (size, tensor.shape[-2] // size))
    return per_rank_heads.movedim(-3, 0).contiguous()


def unpack_exchanged_heads(received: Tensor) -> Tensor:
    """[size, rows, *lead, local_heads, D] -> contiguous [rows, *lead, size * local_heads, D]."""
    return received.movedim(0, -3).flatten(-3, -2).contiguous()
