"""LoRA adapters on a DiT, beside its linears: y = W x + sum_i strength_i * scale_i * B_i (A_i x); W is never written.

`apply_adapters(dit, adapters, device)` gives every linear an adapter targets one `LowRankUpdate` (all adapters'
A stacked, their B's side by side, strength * alpha / r folded into B) and `remove_adapters(dit)` drops them, so
removing or switching restores the base exactly (its weights were never touched) and needs no copy of them. The
update rides on the layer as `h3engine.models.dit_layers.LOW_RANK_ATTRIBUTE`: a forward hook adds it wherever the layer is
called, and the two places that read weights instead (the stacked QKV chunks, the AdaLN projection with streamed
weights) add it themselves. The factors live on `device` in the linear's dtype (fp32 islands stay fp32; FP8 linears
get the DiT's compute dtype), as peft holds a bf16 model's: no activation is cast. Every change forgets the DiT's
cached AdaLN tables (h3engine.engine.sampling.modulation). Strength 0 adds nothing. Everything is checked before anything changes.
A tensor-parallel rank holds its slice of the factors (h3engine.models.parallel.linear: B's rows, A's columns; a
row-parallel layer adds its partial update before its all-reduce). `request_adapters` turns a request's `loras`
into adapters, reading files through a `LoraFiles` cache. A PDD adapter's backbone applies as a LoRA; its interval
heads are hooked onto the DiT's output heads (h3engine.engine.sampling.pdd).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from h3engine.checkpoint.lora_format import (
    LoraError,
    LoraFile,
    LoraLayer,
    Partition,
    adaln_update_on_a_pruned_dit,
    check_lora_fits,
    read_lora,
    read_lora_header,
)
from h3engine.checkpoint.pdd_format import PddAdapterFile, check_pdd_fits, is_pdd_header, read_pdd_adapter
from h3engine.engine.sampling.modulation import set_adapter_key
from h3engine.engine.sampling.pdd import install_heads, remove_heads
from h3engine.errors import RequestError
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import LOW_RANK_ATTRIBUTE
from h3engine.models.parallel.linear import ColumnParallelLinear, RowParallelLinear
from h3engine.models.stored_linear import StoredLinear
from h3engine.request.model import GenerationRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    """One LoRA file to apply at `strength` to the DiT partition `target` ("transformer": FL2VA / T2VA,
    "transformer_ref": Ref2VA)."""

    lora: LoraFile
    strength: float = 1.0
    target: Partition = "transformer"


@dataclass(frozen=True)
class LowRankUpdate:
    """The summed update of one linear's adapters: `up @ (down @ x)` with down [R, in], up [out, R] (scales folded),
    plus `offset` [out] where an AdaLN update was refit onto a pruned DiT's basis (its part along the curve's mean)."""

    down: Tensor
    up: Tensor
    offset: Tensor | None = None

    def __call__(self, hidden: Tensor) -> Tensor:
        update = F.linear(F.linear(hidden.to(self.down.dtype), self.down), self.up, self.offset)
        return update.to(hidden.dtype)

    def chunks(self, hidden: Tensor, parts: int) -> tuple[Tensor, ...]:
        """The update split into `parts` equal row blocks of the output (q, k, v), from one `down @ x`."""
        low = F.linear(hidden.to(self.down.dtype), self.down)
        offsets = self.offset.chunk(parts) if self.offset is not None else (None,) * parts
        return tuple(
            F.linear(low, up, offset).to(hidden.dtype)
            for up, offset in zip(self.up.chunk(parts), offsets, strict=True)
        )


@dataclass
class _Applied:
    adapters: tuple[Adapter, ...]
    handles: list[tuple[nn.Module, RemovableHandle | None]]


# DiT -> its adapters as given and the forward-hook handles of its adapted layers (absent: none).
_applied: weakref.WeakKeyDictionary[H3DiT, _Applied] = weakref.WeakKeyDictionary()


def adapter_layers(adapter: Adapter) -> dict[str, LoraLayer]:
    """The layers of `adapter` for its target: those the file names for it, or all of a file that names no
    partition; LoraError for a file that names only the other one."""
    lora = adapter.lora
    if adapter.target in lora.partitions:
        return lora.partitions[adapter.target]
    if None in lora.partitions:
        return lora.partitions[None]
    named = " and ".join(f"'{partition}'" for partition in lora.partitions)
    first = next(layer for layers in lora.partitions.values() for layer in layers.values())
    raise LoraError(
        f"LoRA file {lora.name!r}: key {first.source_key!r} targets {named}, not '{adapter.target}' "
        f"(the partition this adapter was asked to apply to)"
    )


def check_adapter(adapter: Adapter, config: DiTConfig) -> None:
    """LoraError naming the file (and the first offending key) unless `adapter` fits a DiT of `config` at a finite
    strength."""
    strength = adapter.strength
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise LoraError(
            f"LoRA file {adapter.lora.name!r}: strength must be a finite number, got {strength!r}"
        )
    adapter_layers(adapter)
    check_lora_fits(adapter.lora, config)
    if isinstance(adapter.lora, PddAdapterFile):
        check_pdd_fits(adapter.lora, config)


def apply_adapters(dit: H3DiT, adapters: Sequence[Adapter], device: torch.device | str | None = None) -> int:
    """Make `adapters` (in addition to none: earlier ones are removed first) the DiT's; returns how many linears
    carry an update. `device`: where the factors live (default: where `dit.condition_proj` is)."""
    adapters = tuple(adapters)
    for adapter in adapters:
        check_adapter(adapter, dit.config)
    device = torch.device(device) if device is not None else dit.condition_proj.bias.device
    # A PDD adapter's interval heads take the place of the DiT's output heads (h3engine.engine.sampling.pdd).
    heads = [
        a.lora.heads
        for a in adapters
        if isinstance(a.lora, PddAdapterFile) and a.lora.heads is not None and a.strength != 0
    ]
    if len(heads) > 1:
        raise LoraError(f"LoRA files {[a.lora.name for a in adapters]}: more than one PDD adapter")
    modules = dict(dit.named_modules())
    per_module: dict[str, list[tuple[Tensor, Tensor, Tensor | None]]] = {}
    for adapter in adapters:
        if adapter.strength == 0:
            continue
        refits = []
        for module, layer in adapter_layers(adapter).items():
            if adaln_update_on_a_pruned_dit(module, layer, dit.config):
                layer, offset, residual = refit_onto_basis(layer, dit.adaln_curve.mean, dit.adaln_curve.basis)
                refits.append(residual)
            else:
                offset = None
            down, up = _local_factors(modules[module], module, layer)
            scale = layer.scale * float(adapter.strength)
            per_module.setdefault(module, []).append(
                (down, up * scale, offset * scale if offset is not None else None)
            )
        if refits:
            logger.warning(
                "LoRA %s: %d AdaLN updates refit onto the pruned DiT's rank-%d basis; their largest part off the "
                "basis, dropped: %.3g (relative)",
                adapter.lora.name,
                len(refits),
                dit.config.adaln_rank,
                max(refits),
            )
    remove_adapters(dit)
    handles = []
    for module, factors in per_module.items():
        linear = modules[module]
        dtype = _factor_dtype(linear, dit)
        down = torch.cat([down for down, _, _ in factors]).to(device, dtype)
        up = torch.cat([up for _, up, _ in factors], dim=1).to(device, dtype)
        offsets = [offset for _, _, offset in factors if offset is not None]
        offset = torch.stack(offsets).sum(dim=0).to(device, dtype) if offsets else None
        setattr(linear, LOW_RANK_ATTRIBUTE, LowRankUpdate(down, up, offset))
        # A row-parallel layer adds its partial update itself, before the sum over its group.
        hook = None if isinstance(linear, RowParallelLinear) else linear.register_forward_hook(_add_update)
        handles.append((linear, hook))
    _applied[dit] = _Applied(adapters, handles)
    set_adapter_key(dit, adaln_adapter_key(adapters))
    if heads:
        install_heads(dit, heads[0], device)
    return len(handles)


# The DiT's AdaLN projections (their tables depend on the adapters on these alone).
_ADALN_SUFFIX = "adaln_proj.linear"


def adaln_adapter_key(adapters: Sequence[Adapter]) -> str:
    """What the AdaLN tables of a DiT carrying `adapters` depend on ("" when none touches an AdaLN projection): each
    such adapter's file, by the identity `LoraFiles` rereads it by (real path, size, modification time; a file that
    cannot be stat'ed by a digest of its AdaLN factors), its strength and its target."""
    parts = []
    for adapter in adapters:
        layers = {
            name: layer for name, layer in adapter_layers(adapter).items() if name.endswith(_ADALN_SUFFIX)
        }
        if not layers or adapter.strength == 0:
            continue
        try:
            stat = os.stat(adapter.lora.path)
            identity = f"{os.path.realpath(adapter.lora.path)}:{stat.st_size}:{stat.st_mtime_ns}"
        except (OSError, TypeError):
            digest = hashlib.sha256()
            for name in sorted(layers):
                digest.update(name.encode())
                for tensor in (layers[name].down, layers[name].up):
                    digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
                digest.update(repr(layers[name].scale).encode())
            identity = digest.hexdigest()
        parts.append(f"{identity}@{float(adapter.strength)!r}:{adapter.target}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest() if parts else ""


def remove_adapters(dit: H3DiT) -> None:
    """Drop every adapter of `dit` (its weights were never changed, so it computes exactly as before)."""
    applied = _applied.pop(dit, None)
    for linear, handle in applied.handles if applied is not None else []:
        if handle is not None:
            handle.remove()
        delattr(linear, LOW_RANK_ATTRIBUTE)
    remove_heads(dit)
    set_adapter_key(dit, "")


def applied_adapters(dit: H3DiT) -> tuple[Adapter, ...] | None:
    """The sequence last given to `apply_adapters` for `dit` (the same object), or None after `remove_adapters`."""
    applied = _applied.get(dit)
    return None if applied is None else applied.adapters


def adapted_layers(dit: H3DiT) -> int:
    """How many linears of `dit` carry an adapter update now."""
    applied = _applied.get(dit)
    return 0 if applied is None else len(applied.handles)


def refit_onto_basis(layer: LoraLayer, mean: Tensor, basis: Tensor) -> tuple[LoraLayer, Tensor, float]:
    """An AdaLN update B A s made for the released DiT's input s = SiLU(temb), on a DiT pruned to our basis form,
    whose projection reads c = (s - mean) @ basis: where s = mean + basis c (the pruning's premise), B A s =
    B (A basis) c + B A mean. Returns the layer with down A @ basis, the offset B A mean (unscaled, as up), and the
    relative part of A off the basis, ||A - A basis basisᵀ|| / ||A|| (what the refit drops; 0 where the update lies
    in the basis' span). fp32."""
    down, up = layer.down.float(), layer.up.float()
    basis, mean = basis.float().to(down.device), mean.float().to(down.device)
    fitted = down @ basis
    residual = float(torch.linalg.norm(down - fitted @ basis.T) / torch.linalg.norm(down).clamp_min(1e-30))
    return dataclasses.replace(layer, down=fitted), up @ (down @ mean), residual


def _local_factors(linear: nn.Module, module: str, layer: LoraLayer) -> tuple[Tensor, Tensor]:
    """(A, B) of `layer` for `linear`: whole, or a tensor-parallel rank's slice (B's rows for a column-parallel
    layer, A's columns for a row-parallel one, as the layer slices its weight); ValueError if the shapes differ."""
    # Every linear here (nn.Linear, the parallel ones, StoredLinear) says its shape; a StoredLinear's `weight` would
    # dequantize the whole weight to tell it.
    shape = (linear.out_features, linear.in_features)
    if shape != (layer.up.shape[0], layer.down.shape[1]):
        raise ValueError(
            f"{module} is a {list(shape)} linear, the adapter updates [{layer.up.shape[0]}, {layer.down.shape[1]}]"
        )
    if isinstance(linear, ColumnParallelLinear):
        return layer.down, linear.local_rows(layer.up)
    if isinstance(linear, RowParallelLinear):
        return linear.local_columns(layer.down), layer.up
    return layer.down, layer.up


def _factor_dtype(linear: nn.Module, dit: H3DiT) -> torch.dtype:
    if isinstance(linear, StoredLinear):
        return linear.dtype  # what its weight is dequantized to
    weight = getattr(linear, "weight", None)
    if isinstance(weight, Tensor) and weight.is_floating_point() and weight.element_size() > 1:
        return weight.dtype
    return dit.compute_dtype  # an Fp8Linear: the update runs in the activations' dtype


def _add_update(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
    return output + getattr(module, LOW_RANK_ATTRIBUTE)(args[0])


def default_targets(lora: LoraFile) -> tuple[Partition, ...]:
    """The DiTs diffusers 0.42.1 loads `lora` into without `load_into_transformer_ref`: those its key prefixes name,
    and "transformer" for keys without one."""
    return tuple(sorted({partition or "transformer" for partition in lora.partitions}))


class LoraFiles:
    """Parsed LoRA files and their sha256, by (path, size, mtime): a file read before is not read again until it
    changes. Holds the last `capacity` files (their factors in fp32, host memory)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._files: OrderedDict[tuple[str, str, int, int], tuple[LoraFile, str]] = OrderedDict()

    def read(self, path: str | os.PathLike[str]) -> tuple[LoraFile, str]:
        """(the file as `read_adapter` gives it (a LoRA, or a PDD adapter), named by its own file name; its sha256);
        LoraError like read_lora's."""
        name = Path(path).name
        try:
            stat = os.stat(path)
        except OSError as error:
            raise LoraError(f"LoRA file {name!r} cannot be read: {error.strerror}") from None
        key = (os.path.realpath(path), name, stat.st_size, stat.st_mtime_ns)
        if key in self._files:
            self._files.move_to_end(key)
            return self._files[key]
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        self._files[key] = (read_adapter(path, name), digest.hexdigest())
        while len(self._files) > self.capacity:
            self._files.popitem(last=False)
        return self._files[key]


class LoraHeaders:
    """Reads LoRA files as `LoraFiles` does, but their headers only (`read_adapter(shapes_only=True)`) and without a
    sha256: what the checks before a job need to refuse a file that does not fit (h3engine.runtime.front.EngineFront.resolve)."""

    def read(self, path: str | os.PathLike[str]) -> tuple[LoraFile, str]:
        return read_adapter(path, Path(path).name, shapes_only=True), ""


def read_adapter(path: str | os.PathLike[str], name: str, shapes_only: bool = False) -> LoraFile:
    """An adapter file as `read_lora` reads it, or a PDD adapter as `read_pdd_adapter` does (told apart by the
    header); LoraError naming the file."""
    keys, _ = read_lora_header(path, name)
    reader = read_pdd_adapter if is_pdd_header(keys) else read_lora
    return reader(path, name=name, shapes_only=shapes_only)


def request_adapters(
    request: GenerationRequest, target: Partition, config: DiTConfig, files: LoraFiles | LoraHeaders
) -> tuple[tuple[Adapter, str], ...]:
    """The validated `request`'s `loras` as adapters of its DiT (`target`, of `config`) with their files' sha256,
    each file read through `files` and checked against that DiT: RequestError naming `loras[i]`, the file and its
    first offending key, or a target other than the task's (None: `default_targets`)."""
    adapters = []
    for index, choice in enumerate(request.loras):
        field = f"loras[{index}]"
        try:
            lora, sha256 = files.read(choice.path)
            targets = (choice.target,) if choice.target is not None else default_targets(lora)
            if target not in targets:
                raise RequestError(
                    f"{field}.target",
                    f"{lora.name!r} targets {' and '.join(map(repr, targets))} (its key prefixes, "
                    f"else diffusers' default 'transformer'), a {request.task} request runs {target!r}: "
                    f"set target to {target}",
                )
            adapter = Adapter(lora, choice.strength, target)
            check_adapter(adapter, config)
        except LoraError as error:
            raise RequestError(field, str(error)) from None
        adapters.append((adapter, sha256))
    return tuple(adapters)


def same_adapters(first: Sequence[Adapter] | None, second: Sequence[Adapter]) -> bool:
    """Whether two adapter lists apply the same files (the same parsed objects) at the same strengths and targets."""
    return (
        first is not None
        and len(first) == len(second)
        and all(
            a.lora is b.lora and a.strength == b.strength and a.target == b.target
            for a, b in zip(first, second, strict=True)
        )
    )


def adapter_record(adapter: Adapter, sha256: str) -> dict[str, object]:
    """What a sidecar says about one adapter: the file's name (never its folder), sha256, strength and target."""
    return {
        "file": adapter.lora.name,
        "sha256": sha256,
        "strength": float(adapter.strength),
        "target": adapter.target,
    }
