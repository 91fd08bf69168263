"""The DiT's files as our module reads them: config.json in either layout, and the in-memory QKV row order.

Contract
--------
`config_from_native` / `config_from_diffusers` parse a transformer/config.json into a `DiTConfig` (CheckpointError
naming the file on a missing, disagreeing or invalid field); `config_to_native` / `config_to_diffusers` write
what the release (or diffusers' `from_config`) reads. Our module's state-dict keys are the native checkpoint keys,
but `attn.qkv_proj.weight` is held stacked [q; k; v] (so q, k and v come from contiguous row blocks) where the
native file interleaves its rows per head: `native_to_module` / `module_to_native` convert a state dict,
`diffusers_to_module` / `module_to_diffusers` go through the diffusers key map of `dit_keys`.
`as_native_files` shows a diffusers-layout DiT's weight files as a native one, row and column ranges included,
so that tensor-parallel ranks read their shards from either layout with the same code. `adaln_form_from_shapes`
(h3engine.checkpoint.dit_pruned) sets the AdaLN form (exact or pruned) that the files' tensor shapes show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from h3engine.checkpoint.dit_keys import (
    FC1_WEIGHT,
    QKV_WEIGHT,
    ROPE_KEY,
    diffusers_keys,
    diffusers_to_native,
    native_state_shapes,
    native_to_diffusers,
)
from h3engine.checkpoint.dit_pruned import adaln_fields_from_json, adaln_fields_to_json

# The AdaLN form a DiT's files hold (h3engine.checkpoint.dit_pruned), re-exported for the loaders of every layout.
from h3engine.checkpoint.dit_pruned import adaln_form_from_shapes as adaln_form_from_shapes
from h3engine.checkpoint.dit_pruned import adaln_form_of_files as adaln_form_of_files
from h3engine.checkpoint.safetensors_io import FileExtent, TensorInfo, WeightFiles, row_extents
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import rope_inverse_frequencies

NATIVE_CLASS_NAME = "MiniMaxH3DiTModel"
DIFFUSERS_CLASS_NAME = "MiniMaxH3Transformer3DModel"

# Our field -> the names a native transformer/config.json may use for it (the release writes all of them and
# they must agree). The three eps names are one field for us: the release sets them all to 1e-5.
_NATIVE_FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_layers",),
    "num_refiner_layers": ("token_refiner_num_layers", "num_refiner_layers"),
    "num_heads": ("num_attention_heads",),
    "head_dim": ("attention_head_dim",),
    "ffn_dim": ("ffn_hidden_size", "ffn_dim"),
    "video_in_channels": ("latents_dim", "in_channels"),
    "audio_in_channels": ("audio_latents_dim", "audio_in_channels"),
    "patch_size": ("patch_size",),
    "text_dim": ("text_dim",),
    "timestep_dim": ("timestep_input_dim", "freq_dim"),
    "time_hidden_dim": ("time_embed_hidden_size", "time_embed_hidden_dim"),
    "time_embed_dim": ("time_embed_dim",),
    "rope_freq_dim": ("rope_inv_freq_len", "rope_freq_dim"),
    "rope_theta": ("rope_theta",),
    "eps": ("norm_eps", "qk_norm_eps", "final_norm_eps"),
}

# Our field -> diffusers MiniMaxH3Transformer3DModel constructor argument(s).
_DIFFUSERS_FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_layers",),
    "num_refiner_layers": ("num_refiner_layers",),
    "num_heads": ("num_attention_heads",),
    "head_dim": ("attention_head_dim",),
    "ffn_dim": ("ffn_dim",),
    "video_in_channels": ("in_channels",),
    "audio_in_channels": ("audio_in_channels",),
    "patch_size": ("patch_size",),
    "text_dim": ("text_dim",),
    "timestep_dim": ("freq_dim",),
    "time_hidden_dim": ("time_embed_hidden_dim",),
    "time_embed_dim": ("time_embed_dim",),
    "rope_freq_dim": ("rope_freq_dim",),
    "rope_theta": ("rope_theta",),
    "eps": ("norm_eps", "qk_norm_eps", "final_norm_eps"),
}


# --------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------


def _read_aliased_fields(
    config: dict[str, Any], names_by_field: dict[str, tuple[str, ...]], require_all_names: bool, source: str
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field_name, names in names_by_field.items():
        present = [name for name in names if name in config]
        missing = [name for name in names if name not in config]
        if not present or (require_all_names and missing):
            raise CheckpointError(
                f"{source}: missing DiT config field {' / '.join(repr(n) for n in missing)}"
            )
        distinct = {repr(config[name]) for name in present}
        if len(distinct) > 1:
            found = ", ".join(f"{name}={config[name]!r}" for name in present)
            raise CheckpointError(f"{source}: DiT config fields disagree ({found}); they must be equal")
        values[field_name] = config[present[0]]
    return values


def _parse(
    config: dict[str, Any],
    class_name: str,
    names_by_field: dict[str, tuple[str, ...]],
    native: bool,
    source: str,
) -> DiTConfig:
    found_class = config.get("_class_name", class_name)
    if found_class != class_name:
        raise CheckpointError(f"{source}: _class_name is {found_class!r}, expected {class_name!r}")
    values = _read_aliased_fields(config, names_by_field, require_all_names=not native, source=source)
    try:
        return DiTConfig(**values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: invalid DiT config: {error}") from error


def config_from_native(config: dict[str, Any], source: str = "transformer/config.json") -> DiTConfig:
    """Parse a native transformer/config.json; each field may appear under any of its aliases (all must agree)."""
    parsed = _parse(config, NATIVE_CLASS_NAME, _NATIVE_FIELD_ALIASES, native=True, source=source)
    parsed = adaln_fields_from_json(config, parsed, source)
    derived = {
        "adaln_out_features": parsed.adaln_out_features,
        "final_adaln_out_features": parsed.final_adaln_out_features,
    }
    for name, expected in derived.items():
        if name in config and config[name] != expected:
            raise CheckpointError(f"{source}: {name} is {config[name]!r}, the other fields imply {expected}")
    return parsed


def config_from_diffusers(config: dict[str, Any], source: str = "transformer/config.json") -> DiTConfig:
    """Parse a diffusers MiniMaxH3Transformer3DModel config.json (every constructor argument required)."""
    return _parse(config, DIFFUSERS_CLASS_NAME, _DIFFUSERS_FIELD_NAMES, native=False, source=source)


def _written(
    config: DiTConfig, class_name: str, names_by_field: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    written: dict[str, Any] = {"_class_name": class_name}
    for field_name, value in asdict(config).items():
        for name in names_by_field.get(field_name, ()):  # the AdaLN form's fields: `config_to_native`
            written[name] = list(value) if field_name == "patch_size" else value
    return written


def config_to_native(config: DiTConfig) -> dict[str, Any]:
    """The native config.json dict, with both alias sets written the way the release does."""
    native = _written(config, NATIVE_CLASS_NAME, _NATIVE_FIELD_ALIASES)
    native["adaln_out_features"] = config.adaln_out_features
    native["final_adaln_out_features"] = config.final_adaln_out_features
    return {**native, **adaln_fields_to_json(config)}


def config_to_diffusers(config: DiTConfig) -> dict[str, Any]:
    """A dict accepted by diffusers `MiniMaxH3Transformer3DModel.from_config` (the exact AdaLN form only)."""
    if config.adaln_form != "exact":
        raise CheckpointError(f"a pruned ({config.adaln_form}) AdaLN form has no diffusers config")
    return _written(config, DIFFUSERS_CLASS_NAME, _DIFFUSERS_FIELD_NAMES)


# --------------------------------------------------------------------------------------------------------------
# QKV row order
# --------------------------------------------------------------------------------------------------------------


def interleaved_to_stacked_qkv(weight: Tensor, num_heads: int) -> Tensor:
    """[head, (q, k, v), head_dim] rows (the native file's order) -> [(q, k, v), head, head_dim] rows."""
    return weight.unflatten(0, (num_heads, 3, -1)).transpose(0, 1).flatten(0, 2)


def stacked_to_interleaved_qkv(weight: Tensor, num_heads: int) -> Tensor:
    """Inverse of `interleaved_to_stacked_qkv`."""
    return weight.unflatten(0, (3, num_heads, -1)).transpose(0, 1).flatten(0, 2)


def native_to_module(state: dict[str, Tensor], config: DiTConfig) -> dict[str, Tensor]:
    """A native state dict (or part of one) as `H3DiT.load_state_dict` takes it: QKV rows stacked."""
    return {
        key: interleaved_to_stacked_qkv(tensor, config.num_heads).contiguous()
        if key.endswith(QKV_WEIGHT)
        else tensor
        for key, tensor in state.items()
    }


def module_to_native(state: dict[str, Tensor], config: DiTConfig) -> dict[str, Tensor]:
    """`H3DiT.state_dict()` (or part of it) in the native file's order: QKV rows interleaved per head."""
    return {
        key: stacked_to_interleaved_qkv(tensor, config.num_heads) if key.endswith(QKV_WEIGHT) else tensor
        for key, tensor in state.items()
    }


def diffusers_to_module(state: dict[str, Tensor], config: DiTConfig) -> dict[str, Tensor]:
    """A diffusers state dict as `H3DiT.load_state_dict` takes it (rope.inv_freq recomputed from `config`)."""
    return native_to_module(diffusers_to_native(state, config), config)


def module_to_diffusers(state: dict[str, Tensor], config: DiTConfig) -> dict[str, Tensor]:
    """`H3DiT.state_dict()` as a diffusers MiniMaxH3Transformer3DModel state dict."""
    return native_to_diffusers(module_to_native(state, config))


# --------------------------------------------------------------------------------------------------------------
# Weight files read in the native layout
# --------------------------------------------------------------------------------------------------------------


def as_native_files(files: WeightFiles, config: DiTConfig) -> WeightFiles:
    """`files` when they hold a native DiT, else (diffusers layout) a `DiffusersAsNativeFiles` view of them."""
    if (
        diffusers_keys("blocks.0." + QKV_WEIGHT)[0] in files.infos
        and "blocks.0." + QKV_WEIGHT not in files.infos
    ):
        return DiffusersAsNativeFiles(files, config)
    return files


class DiffusersAsNativeFiles(WeightFiles):
    """A diffusers-layout DiT's weight files under the native keys, shapes and row order.

    A row range reads only the diffusers rows that hold it: the QKV rows of whole heads are the same heads' rows of
    to_q, to_k and to_v, interleaved; fc1's [gate; value] rows are the other half of diffusers' [value; gate].
    `rope.inv_freq`, which diffusers does not store, is computed from the config.
    """

    def __init__(self, files: WeightFiles, config: DiTConfig) -> None:
        native_shapes = native_state_shapes(config)
        meta = {key: torch.empty(shape, device="meta") for key, shape in native_shapes.items()}
        files.check({key: tuple(tensor.shape) for key, tensor in native_to_diffusers(meta).items()})
        infos = {}
        for key, shape in native_shapes.items():
            sources = diffusers_keys(key)
            source = (
                files.infos[sources[0]] if sources else TensorInfo(Path(files.description), torch.float32, ())
            )
            infos[key] = TensorInfo(source.file, source.dtype, shape)
        super().__init__(infos, files.description)
        self.files = files
        self.config = config

    def tensor(self, key: str) -> Tensor:
        if key == ROPE_KEY:
            return rope_inverse_frequencies(self.config.rope_freq_dim, self.config.rope_theta)
        if key.endswith((QKV_WEIGHT, FC1_WEIGHT)):
            return self.row_slice(key, 0, self.infos[key].shape[0])
        return self.files.tensor(diffusers_keys(key)[0])

    def row_slice(self, key: str, start: int, stop: int) -> Tensor:
        sources = diffusers_keys(key)
        if key.endswith(QKV_WEIGHT):
            head_dim = self.config.head_dim
            if start % (3 * head_dim) or stop % (3 * head_dim):
                raise CheckpointError(f"'{key}': rows [{start}, {stop}) do not cover whole heads")
            parts = [self.files.row_slice(source, start // 3, stop // 3) for source in sources]
            return torch.stack([part.unflatten(0, (-1, head_dim)) for part in parts], dim=1).flatten(0, 2)
        if key.endswith(FC1_WEIGHT):
            rows = self.infos[key].shape[0]
            half = rows // 2
            pieces = [(max(start, low), min(stop, low + half)) for low in (0, half)]
            return torch.cat(
                [
                    self.files.row_slice(
                        sources[0], (first + half) % rows, (first + half) % rows + last - first
                    )
                    for first, last in pieces
                    if first < last
                ]
            )
        return self.files.row_slice(sources[0], start, stop)

    def column_slice(self, key: str, start: int, stop: int) -> Tensor:
        if key.endswith((QKV_WEIGHT, FC1_WEIGHT)):
            return self.tensor(key)[:, start:stop]
        return self.files.column_slice(diffusers_keys(key)[0], start, stop)


def module_extents(
    files: WeightFiles, config: DiTConfig, key: str, dtype: torch.dtype
) -> tuple[FileExtent, ...] | None:
    """Where a module key's bytes (QKV rows stacked) lie in a DiT's files of either layout, for a reader that copies
    them straight from the files (h3engine.memory.streaming); None where they are not stored as such (a cast, a
    placeholder, `rope.inv_freq` of the diffusers layout)."""
    if isinstance(files, DiffusersAsNativeFiles):
        sources = diffusers_keys(key)
        infos = [files.files.infos[source] for source in sources]
        if not infos:
            return None
        if key.endswith(FC1_WEIGHT):
            half = infos[0].shape[0] // 2
            return row_extents(infos[0], dtype, [(half, half, 0), (0, half, half)])
        if key.endswith(QKV_WEIGHT):
            parts = [row_extents(info, dtype) for info in infos]
            if any(part is None for part in parts):
                return None
            offset, extents = 0, []
            for (extent,) in parts:
                extents.append(FileExtent(extent.path, extent.offset, extent.length, offset))
                offset += extent.length
            return tuple(extents)
        return row_extents(infos[0], dtype)
    info = files.infos[key]
    if not key.endswith(QKV_WEIGHT):
        return row_extents(info, dtype)
    return row_extents(info, dtype, qkv_row_blocks(config))


def qkv_row_blocks(config: DiTConfig) -> list[tuple[int, int, int]]:
    """(file row, rows, module row) of each head's q, k and v: the file interleaves [head, (q, k, v), head_dim]
    rows, the module stacks [(q, k, v), head, head_dim]."""
    head_dim, heads = config.head_dim, config.num_heads
    return [
        ((head * 3 + which) * head_dim, head_dim, (which * heads + head) * head_dim)
        for which in range(3)
        for head in range(heads)
    ]


def module_fp8(
    files: WeightFiles, config: DiTConfig, key: str
) -> tuple[Callable[[], tuple[Tensor, Tensor]], Any, Any] | None:
    """For a module key the files store in FP8 (h3engine.checkpoint.fp8_files): a reader of its e4m3 values and row
    scales in the module's row order (QKV stacked), and the extents of both (None where they cannot be read straight
    from the files); None for a key stored otherwise."""
    if isinstance(files, DiffusersAsNativeFiles):
        sources = diffusers_keys(key)
        inner = files.files
        if not sources or any(source not in inner.scales for source in sources):
            return None

        def read_diffusers() -> tuple[Tensor, Tensor]:
            parts = [inner.fp8(source) for source in sources]
            values, scales = torch.cat([v for v, _ in parts]), torch.cat([s for _, s in parts])
            if key.endswith(FC1_WEIGHT):  # diffusers' [value; gate] -> [gate; value]
                values, scales = (torch.cat(part.chunk(2)[::-1]) for part in (values, scales))
            return values, scales

        return read_diffusers, None, None
    if key not in files.scales:
        return None
    info, scale_info = files.infos[key], files.scales[key]

    def read() -> tuple[Tensor, Tensor]:
        values, scales = files.fp8(key)
        if key.endswith(QKV_WEIGHT):
            values = interleaved_to_stacked_qkv(values, config.num_heads).contiguous()
            scales = interleaved_to_stacked_qkv(scales, config.num_heads).contiguous()
        return values, scales

    blocks = qkv_row_blocks(config) if key.endswith(QKV_WEIGHT) else None
    return read, row_extents(info, info.dtype, blocks), row_extents(scale_info, scale_info.dtype, blocks)
