"""Every collective the parallel DiT uses, each a no-op for a group of one.

Contract
--------
* `all_reduce_sum` / `all_reduce_max`: sum (the row-parallel partial products) or maximum over the group, in place.
* `all_gather_rows`: concatenate each rank's rows in rank order (final velocities back to the full sequence).
* `sequence_to_heads` / `heads_to_sequence`: the Ulysses all-to-all pair. A rank holding rows
  [r*S/n, (r+1)*S/n) of every head swaps them for all S rows of heads [r*H/n, (r+1)*H/n), and back. Both keep
  sequence order (rank-major, i.e. the global row order) and head order, so composing them is the identity.

Danger
------
Inference only: these call `torch.distributed` directly and are invisible to autograd. Each is collective: every
member of the group must call it, in the same order, with the same shapes (the Ulysses pair needs the row count
divisible by the group size on the sequence side and the head count divisible on the head side).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from h3engine.models import ops
from h3engine.models.parallel.groups import GroupMembership


def all_reduce_sum(tensor: Tensor, group: GroupMembership) -> Tensor:
    """Sum `tensor` over the group in place; returns it."""
    if group.size > 1:
        dist.all_reduce(tensor, group=group.process_group)
    return tensor


def all_reduce_max(tensor: Tensor, group: GroupMembership) -> Tensor:
    """The elementwise maximum of `tensor` over the group, in place; returns it."""
    if group.size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.process_group)
    return tensor


def all_gather_rows(tensor: Tensor, group: GroupMembership) -> Tensor:
    """[rows, ...] on each rank -> [size * rows, ...], rank 0's rows first (every rank must hold as many rows)."""
    if group.size == 1:
        return tensor
    # The list form (one extra copy of a small tensor) exists in every torch we meet; torch 2.14 renames the
    # single-buffer form (all_gather_into_tensor -> all_gather_single) and the GPU machines run 2.11.
    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.process_group)
    return torch.cat(parts)


def sequence_to_heads(tensor: Tensor, group: GroupMembership) -> Tensor:
    """[local_rows, *lead, heads, head_dim] -> [size * local_rows, *lead, heads / size, head_dim].

    `lead` axes (e.g. a stacked (q, k, v) axis) travel along untouched, so one exchange serves several tensors.
    """
    if group.size == 1:
        return tensor
    # Chunk j of the send buffer (dim 0) goes to rank j: it must hold the head block that rank j will own.
    send = ops.pack_heads_for_exchange(tensor, group.size)
    received = send.new_empty(send.shape)
    dist.all_to_all_single(received, send, group=group.process_group)
    # Chunk i received came from rank i, i.e. it holds rows [i*local_rows, (i+1)*local_rows): rank-major order.
    return received.flatten(0, 1)


def heads_to_sequence(tensor: Tensor, group: GroupMembership) -> Tensor:
    """Inverse of `sequence_to_heads`: [rows, *lead, local_heads, head_dim] -> [rows / size, *lead, heads, ...]."""
    if group.size == 1:
        return tensor
    send = tensor.unflatten(0, (group.size, tensor.shape[0] // group.size)).contiguous()
    received = send.new_empty(send.shape)
    dist.all_to_all_single(received, send, group=group.process_group)
    # Chunk i holds rank i's head block for this rank's rows; head blocks go back next to each other in rank order.
    return ops.unpack_exchanged_heads(received)
