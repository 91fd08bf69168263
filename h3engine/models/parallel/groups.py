"""The parallel layouts of the three worker groups and their process groups: DiT, text encoder, VAE.

Every layout is the user's choice, validated before anything starts; every error names the flag. DiT group
(`ParallelLayout`, `--dit-sp` x `--dit-tp`, the whole default world): `create_dit_groups` gives this rank's
`DiTGroups`. Text encoder (`EncoderLayout`, `--encoder-tp`): `create_encoder_groups` gives this rank's replica's
tensor-parallel subgroup. VAE (`VAELayout`, `--vae-ranks`): the first `vae_ranks` ranks decode
(h3engine.models.parallel.vae), `create_vae_group` gives this rank's membership or None. A worker group
(`RuntimeLayout`) holds the four flags, each rank hosting its share of every component; `create_control_group`
gives the gloo group of the runtime's small CPU-side exchanges. This is the only module that creates process
groups: everything downstream receives a `GroupMembership` and calls `h3engine.models.parallel.collectives`, which do
nothing for a group of one, so world size 1 needs no `torch.distributed` at all.

Danger: `torch.distributed.new_group` is collective over the whole world: every rank must create every subgroup,
in the same order, even the ones it is not a member of. The `create_*` functions do exactly that, and must be
called by all ranks with the same layout, and in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from h3engine.models.dit_config import DiTConfig

if TYPE_CHECKING:  # transformers is imported only by the processes that build the text encoder
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

_RELEASED = DiTConfig.released()
# Qwen3-VL-32B's language model (docs/MODEL.md §4.1): 64 query heads, 8 key/value heads, MLP width 25600.
_RELEASED_ENCODER_HEADS = 64
_RELEASED_ENCODER_KV_HEADS = 8
_RELEASED_ENCODER_MLP_WIDTH = 25600


def _divisors(number: int) -> str:
    return ", ".join(str(value) for value in range(1, number + 1) if number % value == 0)


def _require_positive(flag: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """How the DiT group's `world_size` ranks split the work: `dit_sp` Ulysses ranks x `dit_tp` tensor ranks.

    Validated against the DiT's head count and FFN width: `dit_heads` / `dit_ffn_dim` are the model's (released
    defaults); use `for_dit` to take them from a config. Rank r sits at (sp_rank, tp_rank) = divmod(r, dit_tp):
    tensor-parallel partners are neighbouring ranks (the collective of every layer) and Ulysses partners are
    `dit_tp` apart (two all-to-alls per block).
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
            _require_positive(flag, value)
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
class EncoderLayout:
    """How the world runs the text encoder: replicas of `encoder_tp` tensor-parallel ranks each.

    The world is cut into `world_size / encoder_tp` replicas of neighbouring ranks; each runs the whole
    (tensor-parallel) encoder on the same prompt, so every rank ends up holding the text states the DiT needs
    without a broadcast, and no rank holds more than 1/encoder_tp of the encoder. `heads` / `kv_heads` /
    `mlp_width` are the Qwen3-VL language model's (released defaults); use `for_text_encoder` to take them from a
    config.
    """

    world_size: int
    encoder_tp: int = 1
    heads: int = _RELEASED_ENCODER_HEADS
    kv_heads: int = _RELEASED_ENCODER_KV_HEADS
    mlp_width: int = _RELEASED_ENCODER_MLP_WIDTH

    def __post_init__(self) -> None:
        _require_positive("number of GPUs", self.world_size)
        _require_positive("--encoder-tp", self.encoder_tp)
        tp, heads, kv_heads = self.encoder_tp, self.heads, self.kv_heads
        if self.world_size % tp:
            raise ValueError(
                f"--encoder-tp {tp} does not divide the {self.world_size} GPUs (the world is split into text "
                f"encoder replicas of {tp} ranks; divisors of {self.world_size}: {_divisors(self.world_size)})"
            )
        if heads % tp:
            raise ValueError(
                f"--encoder-tp {tp} does not divide the text encoder's {heads} attention heads (tensor "
                f"parallelism gives each rank whole heads; divisors of {heads}: {_divisors(heads)})"
            )
        # Either each rank holds whole key/value heads (tp divides them) or each key/value head is copied to the
        # tp / kv_heads ranks whose query heads read it (kv_heads divides tp); anything else would give one rank
        # query heads of two key/value heads with only part of either.
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(
                f"--encoder-tp {tp} and the text encoder's {kv_heads} key/value heads: one must divide the "
                f"other (split the key/value heads, or replicate each over tp / {kv_heads} ranks)"
            )
        if self.mlp_width % tp:
            raise ValueError(
                f"--encoder-tp {tp} does not divide the text encoder's MLP width {self.mlp_width}"
            )

    @classmethod
    def for_text_encoder(cls, config: Qwen3VLConfig, world_size: int, encoder_tp: int = 1) -> EncoderLayout:
        """A layout validated against `config`'s language model (the tiny test encoder has its own sizes)."""
        text = config.text_config
        return cls(
            world_size,
            encoder_tp,
            heads=text.num_attention_heads,
            kv_heads=text.num_key_value_heads,
            mlp_width=text.intermediate_size,
        )

    @property
    def local_heads(self) -> int:
        return self.heads // self.encoder_tp

    @property
    def local_kv_heads(self) -> int:
        """Key/value heads on each rank: a share of them, or one replicated head when tp exceeds their count."""
        return max(self.kv_heads // self.encoder_tp, 1)

    def first_kv_head(self, tp_rank: int) -> int:
        """The first key/value head tensor-parallel rank `tp_rank` holds (the one its query heads read)."""
        return tp_rank * self.kv_heads // self.encoder_tp

    def tensor_parallel_ranks(self, replica: int) -> list[int]:
        return [replica * self.encoder_tp + tp_rank for tp_rank in range(self.encoder_tp)]


@dataclass(frozen=True)
class VAELayout:
    """The VAE group: world ranks 0 .. vae_ranks - 1 share the tiled video decode."""

    world_size: int
    vae_ranks: int = 1

    def __post_init__(self) -> None:
        _require_positive("number of GPUs", self.world_size)
        _require_positive("--vae-ranks", self.vae_ranks)
        if self.vae_ranks > self.world_size:
            raise ValueError(f"--vae-ranks {self.vae_ranks} is more than the {self.world_size} GPUs")


# Worker-group size -> (dit_sp, dit_tp, encoder_tp, vae_ranks) for the flags the user leaves out.
PROFILES: dict[int, tuple[int, int, int, int]] = {
    1: (1, 1, 1, 1),
    # Ulysses over both GPUs: the whole DiT on each (next to half the encoder), and no collective inside its GEMMs.
    2: (2, 1, 2, 2),
    # The released four-GPU profile; `--dit-sp 4 --dit-tp 1` is the Ulysses-4 alternative (SGLang's example).
    4: (2, 2, 4, 4),
    8: (4, 2, 8, 8),
}


# --stage-layout: every rank holds a share of every model, or three groups (encoder, DiT, VAE) of their own.
STAGE_LAYOUTS = ("colocated", "split")


@dataclass(frozen=True)
class RuntimeLayout:
    """The worker processes of one replica: `world_size` ranks and the layout flags.

    `stages` "colocated": one group, each rank hosting its share of every component (rank r is DiT rank r,
    text-encoder rank r and, when r < vae_ranks, VAE rank r). "split": three groups of their own (each its own
    world): the DiT on `world_size` ranks, the text encoder on `encoder_tp` ranks (one tensor-parallel replica) and
    the VAE on `vae_ranks` ranks (h3engine.runtime.split). `choose` fills the flags the user left out from the
    profile of that world size (`PROFILES`). The checks here need no model; `dit_layout` and `encoder_layout` add
    the ones against the checkpoint's heads and widths. Errors are ValueErrors whose message starts with the flag.
    """

    world_size: int
    dit_sp: int
    dit_tp: int
    encoder_tp: int
    vae_ranks: int
    stages: str = "colocated"

    def __post_init__(self) -> None:
        if self.stages not in STAGE_LAYOUTS:
            raise ValueError(f"--stage-layout: expected colocated or split, got {self.stages!r}")
        _require_positive("number of GPUs", self.world_size)
        for flag, value in (
            ("--dit-sp", self.dit_sp),
            ("--dit-tp", self.dit_tp),
            ("--encoder-tp", self.encoder_tp),
            ("--vae-ranks", self.vae_ranks),
        ):
            _require_positive(flag, value)
        if self.dit_sp * self.dit_tp != self.world_size:
            raise ValueError(
                f"--dit-sp {self.dit_sp} x --dit-tp {self.dit_tp} = {self.dit_sp * self.dit_tp} ranks, but the "
                f"worker group has {self.world_size}: the product must equal the number of GPUs"
            )
        if self.split:
            return  # the encoder and VAE groups have sizes of their own
        if self.world_size % self.encoder_tp:
            raise ValueError(
                f"--encoder-tp {self.encoder_tp} does not divide the {self.world_size} GPUs (divisors: "
                f"{_divisors(self.world_size)})"
            )
        VAELayout(self.world_size, self.vae_ranks)

    @classmethod
    def choose(
        cls,
        world_size: int,
        dit_sp: int | None = None,
        dit_tp: int | None = None,
        encoder_tp: int | None = None,
        vae_ranks: int | None = None,
        stages: str = "colocated",
    ) -> RuntimeLayout:
        """The layout the flags ask for; a flag left out (None) comes from `PROFILES`, or, for a world size with
        no profile, from "Ulysses over every rank, the encoder over every rank, the VAE over every rank". One DiT
        flag alone gets the other from the world size. With `stages` "split" the profile's encoder and VAE sizes
        become those groups' sizes (by default on the DiT group's devices)."""
        _require_positive("number of GPUs", world_size)
        profile = PROFILES.get(world_size, (world_size, 1, world_size, world_size))
        if dit_sp is None and dit_tp is None:
            dit_sp, dit_tp = profile[0], profile[1]
        elif dit_tp is None:
            dit_tp = _complement("--dit-sp", dit_sp, world_size)
        elif dit_sp is None:
            dit_sp = _complement("--dit-tp", dit_tp, world_size)
        return cls(
            world_size,
            dit_sp,
            dit_tp,
            profile[2] if encoder_tp is None else encoder_tp,
            profile[3] if vae_ranks is None else vae_ranks,
            stages,
        )

    @property
    def split(self) -> bool:
        return self.stages == "split"

    def dit_layout(self, config: DiTConfig) -> ParallelLayout:
        return ParallelLayout.for_dit(config, self.world_size, self.dit_sp, self.dit_tp)

    def encoder_layout(self, config: Qwen3VLConfig) -> EncoderLayout:
        world_size = self.encoder_tp if self.split else self.world_size
        return EncoderLayout.for_text_encoder(config, world_size, self.encoder_tp)

    def vae_layout(self) -> VAELayout:
        return VAELayout(self.vae_ranks if self.split else self.world_size, self.vae_ranks)

    def describe(self) -> str:
        dit = f"DiT Ulysses {self.dit_sp} x tensor {self.dit_tp}"
        if self.split:
            return (
                f"split stages: {dit} on {self.world_size} ranks, text encoder tensor {self.encoder_tp} on "
                f"{self.encoder_tp}, VAE on {self.vae_ranks}"
            )
        return f"{self.world_size} ranks: {dit}, text encoder tensor {self.encoder_tp}, VAE over {self.vae_ranks}"


def _complement(flag: str, value: object, world_size: int) -> int:
    """The other DiT degree when only `flag` was given: world_size / value."""
    _require_positive(flag, value)
    if world_size % value:
        raise ValueError(
            f"{flag} {value} does not divide the {world_size} GPUs (divisors: {_divisors(world_size)})"
        )
    return world_size // value


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


@dataclass(frozen=True)
class EncoderGroups:
    """This rank's text-encoder replica and its tensor-parallel subgroup `tp` (neighbouring ranks)."""

    layout: EncoderLayout
    rank: int
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


def _joined_world_rank(what: str, world_size: int) -> int:
    """This rank in the default world, after checking that the world is the one the layout was made for."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"a {what} layout over {world_size} ranks needs torch.distributed initialized "
            "(see initialize_process_group)"
        )
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"the layout is for {world_size} ranks but torch.distributed has {dist.get_world_size()}"
        )
    return dist.get_rank()


def _own_subgroup(
    ranks_of: Callable[[int], list[int]], count: int, index: int, size: int, rank_in_group: int
) -> GroupMembership:
    """This rank's membership of subgroup `index` among `count` disjoint subgroups of `size` ranks, subgroup i
    being `ranks_of(i)`. Every rank creates every subgroup, in the same order, as new_group requires; subgroups of
    one are never created (their collectives are no-ops, and the decision is the same on every rank)."""
    own = GroupMembership.alone()
    if size > 1:
        for other in range(count):
            group = dist.new_group(ranks_of(other))
            if other == index:
                own = GroupMembership(group, size, rank_in_group)
    return own


def create_dit_groups(layout: ParallelLayout) -> DiTGroups:
    """This rank's `DiTGroups`; collective over the default world (all ranks call it with the same layout)."""
    if layout.world_size == 1:
        return DiTGroups(layout, 0, GroupMembership.alone(), GroupMembership.alone())
    rank = _joined_world_rank("DiT", layout.world_size)
    sp_rank, tp_rank = layout.coordinates(rank)
    tp = _own_subgroup(layout.tensor_parallel_ranks, layout.dit_sp, sp_rank, layout.dit_tp, tp_rank)
    sp = _own_subgroup(layout.sequence_parallel_ranks, layout.dit_tp, tp_rank, layout.dit_sp, sp_rank)
    return DiTGroups(layout, rank, sp, tp)


def create_encoder_groups(layout: EncoderLayout) -> EncoderGroups:
    """This rank's `EncoderGroups`; collective over the default world (all ranks call it with the same layout)."""
    if layout.world_size == 1:
        return EncoderGroups(layout, 0, GroupMembership.alone())
    rank = _joined_world_rank("text-encoder", layout.world_size)
    replica, tp_rank = divmod(rank, layout.encoder_tp)
    replicas = layout.world_size // layout.encoder_tp
    tp = _own_subgroup(layout.tensor_parallel_ranks, replicas, replica, layout.encoder_tp, tp_rank)
    return EncoderGroups(layout, rank, tp)


def create_vae_group(layout: VAELayout) -> GroupMembership | None:
    """This rank's place in the VAE group, or None when it is not one of the first `vae_ranks` ranks.

    Collective over the default world (all ranks call it with the same layout).
    """
    if layout.world_size == 1:
        return GroupMembership.alone()
    rank = _joined_world_rank("VAE", layout.world_size)
    if layout.vae_ranks == 1:
        return GroupMembership.alone() if rank == 0 else None
    group = dist.new_group(list(range(layout.vae_ranks)))
    return GroupMembership(group, layout.vae_ranks, rank) if rank < layout.vae_ranks else None


def create_control_group(world_size: int) -> GroupMembership:
    """A gloo group over the whole world for the runtime's small CPU-side exchanges.

    The request broadcast and the per-step cancel vote go through it, so they never queue behind GPU work even when
    the compute world is NCCL. Collective over the default world (all ranks call it, in the same order).
    """
    if world_size == 1:
        return GroupMembership.alone()
    rank = _joined_world_rank("control", world_size)
    # The decision depends only on the world's backend, the same on every rank, so new_group still lines up.
    group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return GroupMembership(group, world_size, rank)
