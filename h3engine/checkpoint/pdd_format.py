"""alibaba-pai's PDD acceleration adapters (MiniMax-H3-*-Acc-8Step.safetensors), read as our module's terms.

The published file holds two parts (the layout of aigc-apps/VideoX-Fun's `minimax_h3_pdd.py`, `pdd_state_dict`):
* a backbone LoRA on diffusers module names with bare `.lora_down` [r, in] / `.lora_up` [out, r] factors, scaled by
  `lora_alpha / r` (`lora_alpha` in `__metadata__`; absent: 64, that reference's default);
* interval heads: `proj_out.weight` [N, out, in] / `proj_out.bias` [N, out] and `audio_proj_out.*`, one copy of the
  DiT's `final_layer.video_out` / `audio_out` per interval of an N-interval grid (`pdd_num_steps`, default 32),
  trained in blocks of `pdd_block_size` intervals (default 4).

`read_pdd_adapter(path)` returns a `PddAdapterFile`: a `LoraFile` (layout "pdd", naming no partition) whose layers
are the backbone in our rows (QKV stacked, fc1 [gate; value]) plus its `PddHeads` (fp32); `is_pdd_header` tells the
layout from a header and `check_pdd_fits` checks the heads against a DiT config. Every refusal is a `LoraError`
naming the file and the tensor. h3engine.engine.sampling.pdd blends the heads per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from h3engine.checkpoint.dit_keys import FC1_WEIGHT, native_key, native_state_shapes, swap_halves
from h3engine.checkpoint.lora_format import LoraError, LoraFile, LoraLayer, read_lora_header
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig

# The DiT's output heads -> the file's name for their interval banks.
HEAD_PREFIXES: dict[str, str] = {
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
}
HEAD_KEYS: tuple[str, ...] = tuple(
    f"{p}.{kind}" for p in HEAD_PREFIXES.values() for kind in ("weight", "bias")
)
# `__metadata__` entries and the reference's defaults where a file leaves one out.
NUM_INTERVALS_KEY, BLOCK_SIZE_KEY, ALPHA_KEY = "pdd_num_steps", "pdd_block_size", "lora_alpha"
DEFAULT_NUM_INTERVALS, DEFAULT_BLOCK_SIZE, DEFAULT_ALPHA = 32, 4, 64.0
DOWN_SUFFIX, UP_SUFFIX = ".lora_down", ".lora_up"
# diffusers' separate q / k / v projections -> their row block of our stacked qkv_proj.
_QKV_PARTS = {".attn.to_q": 0, ".attn.to_k": 1, ".attn.to_v": 2}
_WHOLE = -1
_FC1_MODULE = FC1_WEIGHT.removesuffix(".weight")


@dataclass(frozen=True)
class PddHeads:
    """One adapter's interval heads, fp32 (meta after a header-only read): per DiT head module its weight bank
    [N, out, in] and bias bank [N, out] with the file's names for them, and the grid they were trained on."""

    banks: dict[str, tuple[Tensor, Tensor]]
    num_intervals: int
    block_size: int

    def tensor_name(self, module: str, kind: str = "weight") -> str:
        return f"{HEAD_PREFIXES[module]}.{kind}"


@dataclass(frozen=True)
class PddAdapterFile(LoraFile):
    """A PDD adapter: the backbone LoRA as a `LoraFile` (`partitions[None]`) and its interval heads (always set by
    `read_pdd_adapter`)."""

    heads: PddHeads | None = None


def is_pdd_header(keys: Iterable[str]) -> bool:
    """Whether a file's tensor names are the PDD layout's: an interval bank, or a bare `.lora_down` / `.lora_up`."""
    return any(key in HEAD_KEYS or key.endswith((DOWN_SUFFIX, UP_SUFFIX)) for key in keys)


def read_pdd_adapter(
    path: Path | str, *, name: str | None = None, shapes_only: bool = False
) -> PddAdapterFile:
    """Read a PDD adapter (`name`, default the file name, names it in errors). `shapes_only`: the header alone; the
    tensors are meta tensors of their shapes and the values' own checks wait for a full read."""
    path = Path(path)
    name = name or path.name
    keys, metadata = read_lora_header(path, name)
    if not is_pdd_header(keys):
        raise LoraError(
            f"LoRA file {name!r} is not a PDD adapter: it has no {HEAD_KEYS[0]!r} interval heads (alibaba-pai's "
            "files hold proj_out / audio_proj_out banks beside bare .lora_down / .lora_up factors)"
        )
    num_intervals, block_size, alpha = read_grid(metadata, name)
    tensors = _tensors(path, name, shapes_only)
    heads = PddHeads(_banks(tensors, num_intervals, name), num_intervals, block_size)
    layers = _backbone({k: t for k, t in tensors.items() if k not in HEAD_KEYS}, alpha, name)
    return PddAdapterFile(path, name, "pdd", {None: layers}, metadata, None, heads)


def check_pdd_fits(adapter: PddAdapterFile, config: DiTConfig) -> None:
    """LoraError naming the file and tensor unless each interval bank is [N, out, in] / [N, out] of the DiT's head."""
    assert adapter.heads is not None, "read by read_pdd_adapter"
    shapes = native_state_shapes(config)
    for module, (weight, _) in adapter.heads.banks.items():
        expected = shapes[f"{module}.weight"]
        if tuple(weight.shape[1:]) != expected:
            raise LoraError(
                f"PDD adapter {adapter.name!r}: tensor {adapter.heads.tensor_name(module)!r} is "
                f"{list(weight.shape)}, the DiT's {module}.weight is {list(expected)}: its heads must be "
                f"[{weight.shape[0]}, {expected[0]}, {expected[1]}] (an adapter of another model?)"
            )


def read_grid(metadata: dict[str, str], name: str) -> tuple[int, int, float]:
    """(N intervals, block size L, alpha) from a PDD adapter's `__metadata__`, the reference's defaults where one is
    absent (LoraError naming the file and the entry)."""
    values: list[int] = []
    for key, default in ((NUM_INTERVALS_KEY, DEFAULT_NUM_INTERVALS), (BLOCK_SIZE_KEY, DEFAULT_BLOCK_SIZE)):
        text = metadata.get(key, str(default))
        if not text.isdigit() or int(text) < 1:
            raise LoraError(f"PDD adapter {name!r}: __metadata__ {key!r} is {text!r}, not a positive integer")
        values.append(int(text))
    text = metadata.get(ALPHA_KEY, str(DEFAULT_ALPHA))
    try:
        alpha = float(text)
    except ValueError:
        alpha = math.nan
    if not (math.isfinite(alpha) and alpha > 0):
        raise LoraError(f"PDD adapter {name!r}: __metadata__ {ALPHA_KEY!r} is {text!r}, not a number > 0")
    num_intervals, block_size = values
    if num_intervals % block_size:
        raise LoraError(
            f"PDD adapter {name!r}: __metadata__ {NUM_INTERVALS_KEY!r} {num_intervals} is not a whole number of "
            f"{BLOCK_SIZE_KEY!r} {block_size} blocks"
        )
    return num_intervals, block_size, alpha


def _tensors(path: Path, name: str, shapes_only: bool) -> dict[str, Tensor]:
    """The file's tensors (CPU), or meta tensors of their shapes (float32 for floating ones) for `shapes_only`."""
    tensors: dict[str, Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if not shapes_only:
                    tensors[key] = handle.get_tensor(key)
                    continue
                info = handle.get_slice(key)
                dtype = torch.float32 if info.get_dtype().startswith(("F", "BF")) else torch.int64
                tensors[key] = torch.empty(info.get_shape(), dtype=dtype, device="meta")
    except Exception as error:  # the header read, a tensor did not
        detail = (str(error).splitlines() or [type(error).__name__])[0]
        raise LoraError(f"PDD adapter {name!r}: a tensor cannot be read ({detail})") from None
    return tensors


def _checked(tensor: Tensor, key: str, name: str) -> Tensor:
    """`tensor` as fp32 (LoraError naming the tensor unless floating point and, when read, finite)."""
    if not tensor.is_floating_point():
        raise LoraError(f"PDD adapter {name!r}: tensor {key!r} is {tensor.dtype}, not floating point")
    if not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
        raise LoraError(f"PDD adapter {name!r}: tensor {key!r} holds NaN or infinite values")
    return tensor.to(torch.float32).contiguous()


def _banks(tensors: dict[str, Tensor], num_intervals: int, name: str) -> dict[str, tuple[Tensor, Tensor]]:
    """Each head's (weight [N, out, in], bias [N, out]) bank, fp32."""
    banks = {}
    for module, prefix in HEAD_PREFIXES.items():
        weight_key, bias_key = f"{prefix}.weight", f"{prefix}.bias"
        for key in (weight_key, bias_key):
            if key not in tensors:
                raise LoraError(
                    f"PDD adapter {name!r}: tensor {key!r} (the {module} interval heads) is missing"
                )
        weight, bias = tensors[weight_key], tensors[bias_key]
        if weight.ndim != 3 or weight.shape[0] != num_intervals:
            raise LoraError(
                f"PDD adapter {name!r}: tensor {weight_key!r} is {list(weight.shape)}, not [{num_intervals}, out, "
                f"in] ({num_intervals} interval heads: {NUM_INTERVALS_KEY})"
            )
        if tuple(bias.shape) != tuple(weight.shape[:2]):
            raise LoraError(
                f"PDD adapter {name!r}: tensor {bias_key!r} is {list(bias.shape)}, not {list(weight.shape[:2])} "
                f"beside {weight_key!r}"
            )
        banks[module] = (_checked(weight, weight_key, name), _checked(bias, bias_key, name))
    return banks


def _backbone(tensors: dict[str, Tensor], alpha: float, name: str) -> dict[str, LoraLayer]:
    """The backbone factors as one `LoraLayer` per module of ours (diffusers' q / k / v merged into qkv_proj)."""
    factors: dict[str, dict[int, dict[str, tuple[str, Tensor]]]] = {}
    for key, tensor in tensors.items():
        if not key.endswith((DOWN_SUFFIX, UP_SUFFIX)):
            raise LoraError(
                f"PDD adapter {name!r}: tensor {key!r} is neither an interval head nor a {DOWN_SUFFIX} / "
                f"{UP_SUFFIX} factor"
            )
        role = "down" if key.endswith(DOWN_SUFFIX) else "up"
        diffusers_module = key.removesuffix(DOWN_SUFFIX if role == "down" else UP_SUFFIX)
        try:
            module = native_key(diffusers_module + ".weight").removesuffix(".weight")
        except CheckpointError:
            raise LoraError(f"PDD adapter {name!r}: tensor {key!r} names no module of the H3 DiT") from None
        if module in HEAD_PREFIXES:
            raise LoraError(
                f"PDD adapter {name!r}: tensor {key!r} updates {module}, which its interval heads replace"
            )
        part = next((index for s, index in _QKV_PARTS.items() if diffusers_module.endswith(s)), _WHOLE)
        factors.setdefault(module, {}).setdefault(part, {})[role] = (key, _checked(tensor, key, name))
    return {module: _layer(module, parts, alpha, name) for module, parts in factors.items()}


def _layer(
    module: str, parts: dict[int, dict[str, tuple[str, Tensor]]], alpha: float, name: str
) -> LoraLayer:
    """One module's layer: its factors checked, fc1's up rows swapped into our order, q / k / v stacked with their
    downs side by side and their ups block-diagonal (a missing part adds zero rows)."""
    pairs: dict[int, tuple[str, Tensor, Tensor]] = {}
    for part, roles in sorted(parts.items()):
        present = next(iter(roles.values()))[0]
        if set(roles) != {"down", "up"}:
            missing = UP_SUFFIX if "down" in roles else DOWN_SUFFIX
            raise LoraError(f"PDD adapter {name!r}: tensor {present!r} has no {missing} factor beside it")
        (down_key, down), (_, up) = roles["down"], roles["up"]
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1] or down.shape[0] == 0:
            raise LoraError(
                f"PDD adapter {name!r}: tensor {down_key!r}: down {list(down.shape)} and up {list(up.shape)} are "
                "not [rank, in] and [out, rank] matrices of one rank"
            )
        pairs[part] = (down_key, down, swap_halves(up) if module.endswith(_FC1_MODULE) else up)
    if set(pairs) == {_WHOLE}:
        key, down, up = pairs[_WHOLE]
        return LoraLayer(down, up, alpha / down.shape[0], key)
    ordered = [pairs[part] for part in sorted(pairs)]
    shapes = {(up.shape[0], down.shape[1]) for _, down, up in ordered}
    if len(shapes) != 1:
        raise LoraError(
            f"PDD adapter {name!r}: tensor {ordered[0][0]!r}: its q / k / v factors differ in shape"
        )
    rows = shapes.pop()[0]
    # One rank: the scale stays beside the factors (as a diffusers file's q / k / v read); else it is folded in.
    ranks = {down.shape[0] for _, down, _ in ordered}
    shared = len(ranks) == 1
    scale = alpha / next(iter(ranks)) if shared else 1.0
    up = torch.zeros(3 * rows, sum(down.shape[0] for _, down, _ in ordered), device=ordered[0][1].device)
    column = 0
    for part, (_, down, part_up) in sorted(pairs.items()):
        factor = 1.0 if shared else alpha / down.shape[0]
        up[part * rows : (part + 1) * rows, column : column + down.shape[0]] = part_up * factor
        column += down.shape[0]
    return LoraLayer(torch.cat([down for _, down, _ in ordered]), up, scale, ordered[0][0])
