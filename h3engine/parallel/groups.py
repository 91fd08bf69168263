"""The DiT group's parallel layout (Ulysses sequence parallel x tensor parallel) and its process groups.

Contract
--------
`ParallelLayout` is the user's choice (`--dit-sp`, `--dit-tp`), validated against the DiT's head count and FFN
width before anything starts; every error names the flag. `create_dit_groups` turns a layout into this rank's
`DiTGroups`: its coordinates and the two subgroups it belongs to. Rank r of the DiT group sits at
(sp_rank, tp_rank) = divmod(r, dit_tp): tensor-parallel partners are neighbouring ranks (the collective of every
layer) and Ulysses partners are `dit_tp` apart (two all-to-alls per block).

This is the only module that creates process groups. Everything downstream receives a `GroupMembership` and
calls `h3engine.parallel.collectives`, which do nothing for a group of one, so world size 1 needs no
`torch.distributed` at all.

Danger
------
`torch.distributed.new_group` is collective over the whole world: every rank must create every subgroup, in the
same order, even the ones it is not a member of. `create_dit_groups` does exactly that, and must be called by all
ranks with the same layout. The DiT group is the whole default world.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from h3engine.models.dit import DiTConfig

_RELEASED = DiTConfig.released()


def _divisors(number: int) -> str:
    return ", ".join(str(value) for value in range(1, number + 1) if number % value == 0)


@dataclass(frozen=True)
class ParallelLayout:
    """How the DiT group's `world_size` ranks split the work: `dit_sp` Ulysses ranks x `dit_tp` tensor ranks.

    `dit_heads` / `dit_ffn_dim` are the model's (released defaults); use `for_dit` to take them from a config.
    """

    world_size: int
    dit_sp: int = 1
    dit_tp: int = 1
    dit_heads: int = _RELEASED.num_heads
    dit_ffn_dim: int = _RELEASED.ffn_dim

    def __post_init__(self) -> None:
        for flag, value in (
            ("number of GPUs", self.world_size),
            ("--dit-sp", self.dit_sp),
            ("--dit-tp", self.dit_tp),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        heads, sp, tp = self.dit_heads, self.dit_sp, self.dit_tp
        if sp * tp != self.world_size:
            raise ValueError(
                f"--dit-sp {sp} x --dit-tp {tp} = {sp * tp} ranks, but the DiT group has {self.world_size}: "
                "the product must equal the number of GPUs"
            )
        if heads % sp:
            raise ValueError(
                f"--dit-sp {sp} does not divide the {heads} attention heads (Ulysses gives each rank whole heads; "
                f"divisors of {heads}: {_divisors(heads)})"
            )
        if heads % tp:
            raise ValueError(
                f"--dit-tp {tp} does not divide the {heads} attention heads (tensor parallelism gives each rank "
                f"whole heads; divisors of {heads}: {_divisors(heads)})"
            )
        if self.dit_ffn_dim % tp:
            raise ValueError(f"--dit-tp {tp} does not divide the DiT's FFN width {self.dit_ffn_dim}")
        if heads % (sp * tp):
            raise ValueError(
                f"--dit-sp {sp} x --dit-tp {tp} = {sp * tp} does not divide the {heads} attention heads: each "
                f"tensor-parallel rank holds {heads // tp} heads, which Ulysses cannot split {sp} ways"
            )

    @classmethod
    def for_dit(cls, config: DiTConfig, world_size: int, dit_sp: int = 1, dit_tp: int = 1) -> ParallelLayout:
        """A layout validated against `config`'s head count and FFN width (the tiny test DiT has its own)."""
        return cls(world_size, dit_sp, dit_tp, dit_heads=config.num_heads, dit_ffn_dim=config.ffn_dim)

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(sp_rank, tp_rank) of DiT-group rank `rank`; tensor-parallel partners are neighbours."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the DiT group of {self.world_size}")
        return divmod(rank, self.dit_tp)

    def tensor_parallel_ranks(self, sp_rank: int) -> list[int]:
        return [sp_rank * self.dit_tp + tp_rank for tp_rank in range(self.dit_tp)]

    def sequence_parallel_ranks(self, tp_rank: int) -> list[int]:
        return [sp_rank * self.dit_tp + tp_rank for sp_rank in range(self.dit_sp)]


@dataclass(frozen=True)
class GroupMembership:
    """This rank's place in one process group. `process_group` is None for a group of one (no communication)."""

    process_group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def alone(cls) -> GroupMembership:
        return cls(None, 1, 0)


@dataclass(frozen=True)
class DiTGroups:
    """This rank's DiT-group coordinates and subgroups: `sp` (Ulysses partners) and `tp` (tensor partners)."""

    layout: ParallelLayout
    rank: int
    sp: GroupMembership
    tp: GroupMembership


def initialize_process_group(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout: timedelta | None = None,
) -> None:
    """Join the default world: NCCL when this rank computes on a CUDA device, gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device,
        )
    else:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )


def create_dit_groups(layout: ParallelLayout) -> DiTGroups:
    """This rank's `DiTGroups`; collective over the default world (all ranks call it with the same layout)."""
    if layout.world_size == 1:
        return DiTGroups(layout, 0, GroupMembership.alone(), GroupMembership.alone())
    if not dist.is_initialized():
        raise RuntimeError(
            f"a DiT group of {layout.world_size} ranks needs torch.distributed initialized "
            "(see initialize_process_group)"
        )
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"the layout is for {layout.world_size} ranks but torch.distributed has {dist.get_world_size()}"
        )
    rank = dist.get_rank()
    sp_rank, tp_rank = layout.coordinates(rank)
    # Subgroups of one are never created: their collectives are no-ops. The decision is the same on every rank,
    # so the new_group calls still line up.
    tp = GroupMembership.alone()
    if layout.dit_tp > 1:
        for other_sp_rank in range(layout.dit_sp):
            group = dist.new_group(layout.tensor_parallel_ranks(other_sp_rank))
            if other_sp_rank == sp_rank:
                tp = GroupMembership(group, layout.dit_tp, tp_rank)
    sp = GroupMembership.alone()
    if layout.dit_sp > 1:
        for other_tp_rank in range(layout.dit_tp):
            group = dist.new_group(layout.sequence_parallel_ranks(other_tp_rank))
            if other_tp_rank == tp_rank:
                sp = GroupMembership(group, layout.dit_sp, sp_rank)
    return DiTGroups(layout, rank, sp, tp)
