"""LoRA adapter files for the H3 DiT, in every layout diffusers 0.42.1 loads for MiniMax H3, as our module's terms.

`read_lora(path)` reads one .safetensors file (never pickle) and returns a `LoraFile`: per target linear of
`h3engine.models.dit.H3DiT` (module name, e.g. `blocks.3.attn.qkv_proj`) the fp32 down A [r, in] and up B
[out, r] matrices and the scale (alpha / r), grouped by the partition the file names (`transformer`,
`transformer_ref`, or None when it names none). B's rows follow our module: `qkv_proj` stacked [q; k; v],
`mlp.fc1` [gate; value]. `check_lora_fits(lora, config)` checks every target against a DiT config. Both raise
`LoraError` naming the file and the first offending key; neither touches a model.

Danger
------
* A fused `qkv_proj` LoRA is stacked [q; k; v] in every layout but DiffSynth-Studio's (`.default.` infix over
  the original names), whose rows are interleaved per head: its de-interleave needs the head width (128 in the
  release, `head_dim=` otherwise), and `check_lora_fits` refuses a config of another width.
* diffusers' `ff.net.0.proj` is [value; gate]; the original names' `mlp.fc1` is [gate; value] like our module.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from h3engine.checkpoint.dit_keys import FC1_WEIGHT, QKV_WEIGHT, native_key, native_state_shapes, swap_halves
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig

Partition = Literal["transformer", "transformer_ref"]
PARTITIONS: tuple[Partition, ...] = ("transformer", "transformer_ref")
# The head width DiffSynth-Studio's interleaved QKV is read with unless told otherwise (every released partition).
RELEASED_HEAD_DIM = 128
# diffusers' own adapter config (a JSON string) in the file's __metadata__, and the bare network alpha entry.
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
ALPHA_METADATA_KEY = "alpha"

# Prefixes that mark the original checkpoint's module names (ai-toolkit, generate.py / ComfyUI, musubi-tuner).
_ORIGINAL_PREFIXES = ("diffusion_model.", "blocks.", "token_refiner.blocks.", "final_layer.", "lora_unet_")
_KOHYA_PREFIX = "lora_unet_"
# musubi-tuner's flattened module names (every "." written "_") -> the dotted original name.
_FLATTENED_MODULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
        (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
        (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
        (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
        (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
        (r"(video|audio)_patch_proj", r"\1_patch_proj"),
        (r"condition_proj", r"condition_proj"),
        (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
        (r"final_layer_adaln_proj_linear", r"final_layer.adaln_proj.linear"),
        (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
    )
)
# Tensor-name endings of one module's entries -> the role they play.
_ROLE_SUFFIXES: dict[str, str] = {
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".alpha": "alpha",
}
_DIFFUSERS_QKV_PARTS = (".attn.to_q", ".attn.to_k", ".attn.to_v")
# The part index of a module's entries when the file holds its whole weight (every module but diffusers' QKV).
_WHOLE = -1
_QKV_MODULE = "." + QKV_WEIGHT.removesuffix(".weight")
_FC1_MODULE = "." + FC1_WEIGHT.removesuffix(".weight")


class LoraError(CheckpointError):
    """A LoRA file that cannot be read or does not fit the DiT; the message names the file and the first key."""


@dataclass(frozen=True)
class LoraLayer:
    """The low-rank update of one linear: weight += scale * up @ down (fp32, rows in our module's order)."""

    down: Tensor
    up: Tensor
    scale: float
    source_key: str

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def delta(self) -> Tensor:
        """The dense fp32 update [out, in] (for tests and fusing; the engine may keep the factors instead)."""
        return (self.up @ self.down) * self.scale


@dataclass(frozen=True)
class LoraFile:
    """One adapter file as read: layers per partition (None: the file names none), its layout and metadata."""

    path: Path
    name: str
    layout: str
    partitions: dict[Partition | None, dict[str, LoraLayer]]
    metadata: dict[str, str] = field(default_factory=dict)
    qkv_head_dim: int | None = None

    def layers(self, partition: Partition | None = None) -> dict[str, LoraLayer]:
        """The layers of `partition` (none: {}), or with no argument those of the file's only partition."""
        if partition is None:
            if len(self.partitions) != 1:
                raise ValueError(
                    f"LoRA file {self.name!r} names the partitions {sorted(map(str, self.partitions))}"
                )
            return next(iter(self.partitions.values()))
        return self.partitions.get(partition, {})


@dataclass
class _Entry:
    """What a module's file tensors say before they become a `LoraLayer`."""

    source_key: str
    down: Tensor | None = None
    up: Tensor | None = None
    alpha: Tensor | None = None

    def put(self, key: str, role: str, tensor: Tensor) -> None:
        setattr(self, role, tensor)
        if role == "down":
            self.source_key = (
                key  # errors about the module name its down factor (kohya files list .alpha first)
            )


def read_lora(
    path: Path | str, *, name: str | None = None, head_dim: int = RELEASED_HEAD_DIM, shapes_only: bool = False
) -> LoraFile:
    """Read a .safetensors LoRA in any H3 layout diffusers accepts; `name` (default: the file name) names it in errors.

    `head_dim` is the head width a DiffSynth-Studio file's interleaved QKV is read with. `shapes_only`: read the
    header (and the scalar `.alpha` tensors) only; the factors are meta tensors of the shapes and scales a full read
    gives, for the checks before a job (`check_lora_fits`, the targets); the values' own checks wait for that read.
    """
    path = Path(path)
    name = name or path.name
    tensors, metadata = _load_shapes(path, name) if shapes_only else _load(path, name)
    if not tensors:
        raise LoraError(f"LoRA file {name!r} holds no tensors")
    for key in tensors:
        if "dora_scale" in key or "lora_magnitude_vector" in key:
            raise LoraError(
                f"LoRA file {name!r}: key {key!r} is a DoRA magnitude; DoRA adapters are not supported"
            )
    if any(key.startswith(_ORIGINAL_PREFIXES) for key in tensors):
        layout, entries = _original_entries(tensors, name, head_dim)
    else:
        layout, entries = _diffusers_entries(tensors, name)
    scales = _Scales(metadata, any(key.endswith(".alpha") for key in tensors), name)
    grouped: dict[Partition | None, dict[str, dict[int, LoraLayer]]] = {}
    for (partition, module, part), entry in entries.items():
        layer = _layer(entry, scales, partition, name)
        grouped.setdefault(partition, {}).setdefault(module, {})[part] = layer
    merged = {
        partition: {module: _merge_qkv_parts(parts, name) for module, parts in modules.items()}
        for partition, modules in grouped.items()
    }
    diffsynth_qkv = layout == "diffsynth" and any(
        module.endswith(_QKV_MODULE) for modules in merged.values() for module in modules
    )
    return LoraFile(path, name, layout, merged, metadata, head_dim if diffsynth_qkv else None)


def adaln_update_on_a_pruned_dit(module: str, layer: LoraLayer, config: DiTConfig) -> bool:
    """Whether `layer` updates an AdaLN projection as the released DiT has it (on the time_embed_dim-wide SiLU(temb))
    while `config`'s DiT is pruned (its projections read the rank-wide curve)."""
    return (
        config.adaln_form != "exact"
        and module.endswith("adaln_proj.linear")
        and layer.down.shape[1] == config.time_embed_dim
        and layer.up.shape[0]
        == (
            config.final_adaln_out_features
            if module.startswith("final_layer.")
            else config.adaln_out_features
        )
    )


def check_lora_fits(lora: LoraFile, config: DiTConfig) -> None:
    """Raise `LoraError` naming the file and the first key whose module is not a linear of `config`'s DiT or whose
    shape does not fit it."""
    if lora.qkv_head_dim is not None and lora.qkv_head_dim != config.head_dim:
        first = next(
            layer for ls in lora.partitions.values() for m, layer in ls.items() if m.endswith(_QKV_MODULE)
        )
        raise LoraError(
            f"LoRA file {lora.name!r}: key {first.source_key!r} was de-interleaved with head_dim "
            f"{lora.qkv_head_dim}, the DiT's heads are {config.head_dim} wide"
        )
    shapes = native_state_shapes(config)
    for layers in lora.partitions.values():
        for module, layer in layers.items():
            shape = shapes.get(f"{module}.weight")
            if adaln_update_on_a_pruned_dit(module, layer, config):
                if config.adaln_form == "table":
                    raise LoraError(
                        f"LoRA file {lora.name!r}: key {layer.source_key!r} updates an AdaLN projection on the "
                        f"{config.time_embed_dim}-wide time embedding, and this DiT is pruned to the published AdaLN "
                        "table, which keeps no basis to refit the update onto: use the adapter on the released DiT "
                        "or on one pruned by `convert --prune-adaln`"
                    )
                continue  # refit onto the DiT's basis when applied (h3engine.engine.lora.adapters)
            if shape is None or len(shape) != 2:
                raise LoraError(
                    f"LoRA file {lora.name!r}: key {layer.source_key!r} names no linear layer of the DiT "
                    f"({config.num_layers} blocks, {config.num_refiner_layers} refiner blocks)"
                )
            if (layer.up.shape[0], layer.down.shape[1]) != shape:
                raise LoraError(
                    f"LoRA file {lora.name!r}: key {layer.source_key!r} updates a [{layer.up.shape[0]}, "
                    f"{layer.down.shape[1]}] weight, the DiT's {module}.weight is {list(shape)} (was the adapter "
                    "trained on another, e.g. pruned, checkpoint?)"
                )


# --------------------------------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------------------------------


def read_lora_header(path: Path | str, name: str | None = None) -> tuple[list[str], dict[str, str]]:
    """A LoRA file's tensor names and `__metadata__`, no tensor read (LoraError naming the file, as `read_lora`)."""
    path = Path(path)
    name = name or path.name
    if not path.is_file():
        raise LoraError(f"LoRA file {name!r} does not exist or is not a file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys()), dict(handle.metadata() or {})
    except Exception as error:  # safetensors raises its own error types for every malformed file
        raise _unreadable(name, error) from None


def _unreadable(name: str, error: Exception) -> LoraError:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return LoraError(
        f"LoRA file {name!r} is not a readable .safetensors file ({detail}); only safetensors LoRAs are read"
    )


def _load(path: Path, name: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    _, metadata = read_lora_header(path, name)
    try:
        return load_file(str(path), device="cpu"), metadata
    except Exception as error:  # the header read, a tensor did not
        raise _unreadable(name, error) from None


def _load_shapes(path: Path, name: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Meta tensors of the header's shapes (float32 for float factors), real `.alpha` scalars."""
    _, metadata = read_lora_header(path, name)
    tensors: dict[str, Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(".alpha"):
                    tensors[key] = handle.get_tensor(key)
                    continue
                info = handle.get_slice(key)
                floating = info.get_dtype().startswith(("F", "BF"))
                dtype = torch.float32 if floating else torch.int64
                tensors[key] = torch.empty(info.get_shape(), dtype=dtype, device="meta")
    except Exception as error:  # the header read, a tensor did not
        raise _unreadable(name, error) from None
    return tensors, metadata


def _split_role(key: str, name: str, allowed: tuple[str, ...]) -> tuple[str, str]:
    """'blocks.0.attn.qkv_proj.lora_A.weight' -> ('blocks.0.attn.qkv_proj', 'down')."""
    for suffix in allowed:
        if key.endswith(suffix):
            return key[: -len(suffix)], _ROLE_SUFFIXES[suffix]
    raise LoraError(
        f"LoRA file {name!r}: key {key!r} is no LoRA factor (expected a name ending in {' / '.join(allowed)})"
    )


def _original_entries(
    tensors: dict[str, Tensor], name: str, head_dim: int
) -> tuple[str, dict[tuple[None, str, int], _Entry]]:
    """The original checkpoint's module names: bare, under `diffusion_model.`, flattened `lora_unet_`, or with
    DiffSynth's `.default.` infix. Fused QKV B rows come back stacked [q; k; v]."""
    diffsynth = any(".lora_A.default.weight" in key or ".lora_B.default.weight" in key for key in tensors)
    kohya = any(key.startswith(_KOHYA_PREFIX) for key in tensors)
    layout = "diffsynth" if diffsynth else "kohya" if kohya else "original"
    entries: dict[tuple[None, str, int], _Entry] = {}
    for key, tensor in tensors.items():
        local = key.removeprefix("diffusion_model.")
        if diffsynth:
            local = local.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if kohya:
            flat, dot, rest = local.removeprefix(_KOHYA_PREFIX).partition(".")
            dotted = next((p.sub(r, flat) for p, r in _FLATTENED_MODULES if p.fullmatch(flat)), None)
            if not local.startswith(_KOHYA_PREFIX) or dotted is None:
                raise LoraError(
                    f"LoRA file {name!r}: key {key!r} names no H3 module in musubi-tuner's layout"
                )
            local = dotted + dot + rest
        module, role = _split_role(local, name, tuple(_ROLE_SUFFIXES))
        entry = entries.setdefault((None, module, _WHOLE), _Entry(key))
        entry.put(key, role, tensor)
    if diffsynth:
        for (_, module, _), entry in entries.items():
            if module.endswith(_QKV_MODULE) and entry.up is not None:
                entry.up = _deinterleave_qkv(entry.up, head_dim, entry.source_key, name)
    return layout, entries


def _deinterleave_qkv(up: Tensor, head_dim: int, key: str, name: str) -> Tensor:
    if up.ndim != 2 or up.shape[0] % (3 * head_dim):
        raise LoraError(
            f"LoRA file {name!r}: key {key!r} has {up.shape[0] if up.ndim else 0} rows, not whole "
            f"per-head-interleaved QKV heads of width {head_dim}"
        )
    return up.unflatten(0, (-1, 3, head_dim)).transpose(0, 1).flatten(0, 2)


def _diffusers_entries(
    tensors: dict[str, Tensor], name: str
) -> tuple[str, dict[tuple[Partition | None, str, int], _Entry]]:
    """diffusers names under `transformer.` / `transformer_ref.`, or a bare peft dump with the `.default.` infix."""
    prefixed = any(key.startswith(tuple(p + "." for p in PARTITIONS)) for key in tensors)
    peft_dump = not prefixed and any(".default.weight" in key for key in tensors)
    if not prefixed and not peft_dump:
        first = next(iter(tensors))
        raise LoraError(
            f"LoRA file {name!r}: key {first!r} is in no H3 LoRA layout (expected diffusers names under "
            "'transformer.' / 'transformer_ref.', a peft dump, or the original module names)"
        )
    entries: dict[tuple[Partition | None, str, int], _Entry] = {}
    for key, tensor in tensors.items():
        partition: Partition | None = None
        local = key.replace(".default.", ".") if peft_dump else key
        if prefixed:
            partition = next((p for p in PARTITIONS if key.startswith(p + ".")), None)
            if partition is None:
                raise LoraError(
                    f"LoRA file {name!r}: key {key!r} names neither 'transformer.' nor 'transformer_ref.'"
                )
            local = key.removeprefix(partition + ".")
        diffusers_module, role = _split_role(local, name, (".lora_A.weight", ".lora_B.weight"))
        part = next((i for i, s in enumerate(_DIFFUSERS_QKV_PARTS) if diffusers_module.endswith(s)), _WHOLE)
        try:
            module = native_key(diffusers_module + ".weight").removesuffix(".weight")
        except CheckpointError:
            raise LoraError(f"LoRA file {name!r}: key {key!r} names no module of the H3 DiT") from None
        entry = entries.setdefault((partition, module, part), _Entry(key))
        if role == "up" and module.endswith(_FC1_MODULE):
            tensor = swap_halves(tensor)  # diffusers' [value; gate] -> our [gate; value]
        entry.put(key, role, tensor)
    return ("diffusers" if prefixed else "peft"), entries


# --------------------------------------------------------------------------------------------------------------
# Scales and layers
# --------------------------------------------------------------------------------------------------------------


class _Scales:
    """alpha / r per module as diffusers sets it: a per-module `.alpha` tensor; else diffusers' own adapter config
    (`lora_adapter_metadata`); else, only when the file has no alpha tensor at all, a numeric `__metadata__` alpha;
    else alpha == r."""

    def __init__(self, metadata: dict[str, str], has_alpha_tensors: bool, name: str) -> None:
        self.name = name
        self.network_alpha: float | None = None
        self.adapter: dict[str, object] = {}
        if ADAPTER_METADATA_KEY in metadata:
            try:
                adapter = json.loads(metadata[ADAPTER_METADATA_KEY])
            except ValueError:
                raise LoraError(
                    f"LoRA file {name!r}: __metadata__ {ADAPTER_METADATA_KEY!r} is not JSON"
                ) from None
            self.adapter = adapter if isinstance(adapter, dict) else {}
        elif not has_alpha_tensors and ALPHA_METADATA_KEY in metadata:
            try:
                self.network_alpha = float(metadata[ALPHA_METADATA_KEY])
            except ValueError:
                return  # diffusers ignores a non-numeric entry (alpha == rank), and so do we
            if not (math.isfinite(self.network_alpha) and self.network_alpha > 0):
                raise LoraError(
                    f"LoRA file {name!r}: __metadata__ alpha {metadata[ALPHA_METADATA_KEY]!r} is not a number > 0"
                )

    def scale(self, entry: _Entry, rank: int, partition: Partition | None) -> float:
        if entry.alpha is not None:
            if entry.alpha.numel() != 1:
                raise LoraError(
                    f"LoRA file {self.name!r}: the alpha of key {entry.source_key!r} is not one number"
                )
            return float(entry.alpha.float().item()) / rank
        if self.network_alpha is not None:
            return self.network_alpha / rank
        prefix = f"{partition or 'transformer'}."
        config = {k.removeprefix(prefix): v for k, v in self.adapter.items() if k.startswith(prefix)}
        if not config:
            return 1.0
        if config.get("alpha_pattern") or config.get("use_dora"):
            raise LoraError(
                f"LoRA file {self.name!r}: its {ADAPTER_METADATA_KEY} sets alpha_pattern or use_dora "
                f"(key {entry.source_key!r}); only one lora_alpha per partition is supported"
            )
        alpha = float(config.get("lora_alpha", rank))  # type: ignore[arg-type]
        return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _layer(entry: _Entry, scales: _Scales, partition: Partition | None, name: str) -> LoraLayer:
    if entry.down is None or entry.up is None:
        missing = "down (lora_A / lora_down)" if entry.down is None else "up (lora_B / lora_up)"
        raise LoraError(f"LoRA file {name!r}: key {entry.source_key!r} has no {missing} factor beside it")
    if not (entry.down.is_floating_point() and entry.up.is_floating_point()):
        raise LoraError(f"LoRA file {name!r}: key {entry.source_key!r} is not a floating-point factor")
    down, up = entry.down.to(torch.float32), entry.up.to(torch.float32)
    if not down.is_meta and not (torch.isfinite(down).all() and torch.isfinite(up).all()):
        raise LoraError(f"LoRA file {name!r}: key {entry.source_key!r} holds NaN or infinite values")
    if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1] or down.shape[0] == 0:
        raise LoraError(
            f"LoRA file {name!r}: key {entry.source_key!r}: down {list(down.shape)} and up {list(up.shape)} "
            "are not [rank, in] and [out, rank] matrices of one rank"
        )
    return LoraLayer(
        down.contiguous(), up.contiguous(), scales.scale(entry, down.shape[0], partition), entry.source_key
    )


def _merge_qkv_parts(parts: dict[int, LoraLayer], name: str) -> LoraLayer:
    """One layer from diffusers' separate to_q / to_k / to_v (a missing part adds zero rows): one shared down when
    the parts share theirs (what diffusers' converter writes), else the downs stacked and the ups block-diagonal."""
    if set(parts) == {_WHOLE}:
        return parts[_WHOLE]
    ordered = [parts[index] for index in sorted(parts)]
    first = ordered[0]
    rows, in_features = first.up.shape[0], first.down.shape[1]
    for part in ordered:
        if part.up.shape[0] != rows or part.down.shape[1] != in_features:
            raise LoraError(
                f"LoRA file {name!r}: key {part.source_key!r}: its to_q / to_k / to_v LoRAs differ in shape"
            )
    if len(parts) == 3 and all(_same_down(p.down, first.down) and p.scale == first.scale for p in ordered):
        return LoraLayer(first.down, torch.cat([p.up for p in ordered]), first.scale, first.source_key)
    same_scale = all(p.scale == first.scale for p in ordered)
    up = torch.zeros(3 * rows, sum(p.rank for p in ordered), device=first.up.device)
    column = 0
    for index, part in sorted(parts.items()):
        factor = 1.0 if same_scale else part.scale
        up[index * rows : (index + 1) * rows, column : column + part.rank] = part.up * factor
        column += part.rank
    down = torch.cat([p.down for p in ordered])
    return LoraLayer(down, up, first.scale if same_scale else 1.0, first.source_key)


def _same_down(down: Tensor, other: Tensor) -> bool:
    """Whether two parts share their down factor (for a shapes-only read: whether they could; either way the merged
    layer has the same outer shape)."""
    if down.is_meta:
        return down.shape == other.shape
    return torch.equal(down, other)
