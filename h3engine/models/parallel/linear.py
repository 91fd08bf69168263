"""Tensor-parallel linear layers that own both their shard of the math and the reading of that shard.

Each layer is built (usually on `meta`) with the full layer's sizes and its tensor-parallel group, holds only its
rank's part of the weight, and fills it with `load_shard(weight_files, key, device)`, which reads exactly that
part of the native checkpoint tensor. Sharding and loading come from the same ranges, so they cannot disagree.
None of the split H3 linears has a bias. `ColumnParallelLinear` splits the output features: the rank holds its
1/tp of each of the file's `segments` stacked row blocks (`GateValueParallelLinear`: fc1's [gate; value]), one
row range per block, no communication. `QKVParallelLinear` splits the fused QKV by heads: the file interleaves
rows per head, so a rank's heads are ONE row range, kept stacked [q; k; v] in memory like `Attention`.
`RowParallelLinear` splits the input features: reads a column range and sums the partial products over the group.
A LoRA's factors are sliced alike (`local_rows` of B, `local_columns` of A; h3engine.engine.lora.adapters), its partial
low-rank product added before that sum. Danger: `RowParallelLinear` sums partial products in the compute dtype
(bf16 is not bit-identical to one GEMM; fp32 agrees to rounding noise). Its input must be the matching shard of
the previous column-parallel layer (same group, same rank order), or the sum is silently wrong.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.checkpoint.dit_format import interleaved_to_stacked_qkv, stacked_to_interleaved_qkv
from h3engine.checkpoint.safetensors_io import DeferredReads, WeightFiles, parked, placed
from h3engine.errors import CheckpointError
from h3engine.models.dit_layers import LOW_RANK_ATTRIBUTE
from h3engine.models.parallel.collectives import all_reduce_sum
from h3engine.models.parallel.groups import GroupMembership


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {parts}")
    return size // parts


class ParallelLinear(nn.Module):
    """Shared parts: the full shape (what the file holds), the local weight, and checked assignment of a shard."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        local_shape: tuple[int, int],
        group: GroupMembership,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.weight = nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device), requires_grad=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.weight)

    def load_shard(
        self,
        weight_files: WeightFiles,
        key: str,
        device: torch.device | str,
        deferred: DeferredReads | None = None,
    ) -> None:
        """Replace the (meta) weight with this rank's part of `key`, cast to the layer's dtype on `device` (a parked
        weight and a reader of that part when `deferred` wants the key)."""
        info = weight_files.infos.get(key)
        if info is None:
            raise CheckpointError(f"{weight_files.description}: missing tensor '{key}'")
        if info.shape != (self.out_features, self.in_features):
            raise CheckpointError(
                f"{info.file}: tensor '{key}' has shape {list(info.shape)}, "
                f"expected {[self.out_features, self.in_features]}"
            )
        if deferred is not None and deferred.wants(key):
            deferred.add(key, partial(self._read_placed, weight_files, key, "cpu", self.weight.dtype))
            self.weight = nn.Parameter(parked(self.weight.shape, self.weight.dtype), requires_grad=False)
            return
        if deferred is not None and deferred.remembers(key):
            deferred.add(key, partial(self._read_placed, weight_files, key, "cpu", self.weight.dtype))
        shard = self._read_placed(weight_files, key, device, self.weight.dtype)
        if shard.shape != self.weight.shape:
            raise RuntimeError(
                f"'{key}': read a {list(shard.shape)} shard for a {list(self.weight.shape)} weight"
            )
        self.weight = nn.Parameter(shard, requires_grad=False)

    def _read_placed(
        self, weight_files: WeightFiles, key: str, device: torch.device | str, dtype: torch.dtype
    ) -> Tensor:
        try:
            shard = self._read_shard(weight_files, key)
        except Exception as error:  # safetensors raises its own error types
            info = weight_files.infos[key]
            raise CheckpointError(f"{info.file}: cannot read this rank's part of '{key}' ({error})") from None
        return placed(shard, device, dtype)

    def _read_shard(self, weight_files: WeightFiles, key: str) -> Tensor:
        raise NotImplementedError


class EvenlySplitLinear(ParallelLinear):
    """A layer split evenly over its group; `_local_shape` says along which axis, and checks that it divides."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: GroupMembership,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        local_shape = self._local_shape(in_features, out_features, group.size)
        super().__init__(in_features, out_features, local_shape, group, dtype, device)

    def _local_shape(self, in_features: int, out_features: int, parts: int) -> tuple[int, int]:
        raise NotImplementedError


class ColumnParallelLinear(EvenlySplitLinear):
    """y_local = x W_local^T with W_local = this rank's 1/tp of each of the `segments` stacked row blocks."""

    segments = 1

    def _local_shape(self, in_features: int, out_features: int, parts: int) -> tuple[int, int]:
        self.segment_rows = _split(out_features, self.segments, "output features")
        self.local_segment_rows = _split(self.segment_rows, parts, "output rows per segment")
        return self.segments * self.local_segment_rows, in_features

    def file_row_ranges(self) -> list[tuple[int, int]]:
        """The [start, stop) rows of the file tensor this rank holds, one range per segment, in local order."""
        first = self.group.rank * self.local_segment_rows
        return [
            (
                segment * self.segment_rows + first,
                segment * self.segment_rows + first + self.local_segment_rows,
            )
            for segment in range(self.segments)
        ]

    def _read_shard(self, weight_files: WeightFiles, key: str) -> Tensor:
        return torch.cat([weight_files.row_slice(key, start, stop) for start, stop in self.file_row_ranges()])

    def local_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of a tensor with the whole layer's rows in the module's order (a LoRA's B), in the
        local weight's order."""
        return torch.cat([full[start:stop] for start, stop in self.file_row_ranges()])


class GateValueParallelLinear(ColumnParallelLinear):
    """fc1 of a SwiGLU: rows [gate; value], each half split alike (the local output is still [gate; value])."""

    segments = 2


class QKVParallelLinear(ColumnParallelLinear):
    """Fused QKV split by heads: file rows per head [q; k; v] (one range per rank), kept stacked in memory."""

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        head_dim: int,
        group: GroupMembership,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        self.local_heads = _split(num_heads, group.size, "attention heads")
        super().__init__(in_features, 3 * num_heads * head_dim, group, dtype, device)

    def _read_shard(self, weight_files: WeightFiles, key: str) -> Tensor:
        return interleaved_to_stacked_qkv(super()._read_shard(weight_files, key), self.local_heads)

    def local_rows(self, full: Tensor) -> Tensor:
        """As the base weight: the module's stacked rows put in the file's per-head order, sliced, stacked again."""
        interleaved = stacked_to_interleaved_qkv(full, self.local_heads * self.group.size)
        return interleaved_to_stacked_qkv(super().local_rows(interleaved), self.local_heads)


class RowParallelLinear(EvenlySplitLinear):
    """y = sum over ranks of x_local W[:, local columns]^T; every rank ends with the full output."""

    def _local_shape(self, in_features: int, out_features: int, parts: int) -> tuple[int, int]:
        self.local_in_features = _split(in_features, parts, "input features")
        return out_features, self.local_in_features

    def file_column_range(self) -> tuple[int, int]:
        start = self.group.rank * self.local_in_features
        return start, start + self.local_in_features

    def forward(self, hidden: Tensor) -> Tensor:
        partial = F.linear(hidden, self.weight)
        update = getattr(self, LOW_RANK_ATTRIBUTE, None)  # a LoRA's partial product, on its columns of A
        if update is not None:
            partial = partial + update(hidden)
        return all_reduce_sum(partial, self.group)

    def local_columns(self, full: Tensor) -> Tensor:
        """This rank's columns of a tensor with the whole layer's input features (a LoRA's A)."""
        return full[:, slice(*self.file_column_range())]

    def _read_shard(self, weight_files: WeightFiles, key: str) -> Tensor:
        return weight_files.column_slice(key, *self.file_column_range())
