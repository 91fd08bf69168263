"""A released checkpoint written as a folder whose DiTs are single files (GGUF, INT8 ConvRot safetensors), shared by
h3engine.checkpoint.gguf_convert and h3engine.checkpoint.int8_convert.

`convert_checkpoint_dits(source, out, file_name, write_dit)` writes the released layout with every file hard-linked
(else copied, h3engine.checkpoint.fp8_files.link_or_copy) but the DiT folders' weight files, each partition's DiT
written by `write_dit` as `file_name(partition)` beside them and, last, `gguf_files.json` ({partition: file name},
read back by h3engine.checkpoint.layout.detect_layout, so the folder loads as it is); on failure (Ctrl-C included)
what it wrote is removed. Also here: what the per-partition writers share (a key's tensor as the module holds it,
whether a key is a linear's weight the module holds in its compute dtype).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from h3engine.checkpoint import dit_format
from h3engine.checkpoint.fp8_files import link_or_copy
from h3engine.checkpoint.layout import (
    DIT_FILES_JSON,
    CheckpointLayout,
    PartitionPaths,
    detect_layout,
    require_empty_folder,
)
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.models.dit import FP32_PARAMETER_NAMES, PRUNED_FP32_NAMES
from h3engine.models.dit_config import DiTConfig


@dataclass(frozen=True)
class DiTConversion:
    """One DiT written as a single file: its file, the source tensors' bytes as stored (rope.inv_freq aside) and the
    file's size, and per native key the type or format it is stored in and its error (RMS error / RMS value of the
    stored values)."""

    path: Path
    bytes_before: int
    bytes_after: int
    types: dict[str, str] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)


# (layout, partition's paths, file to write) -> the conversion written.
DiTWriter = Callable[[CheckpointLayout, PartitionPaths, Path], DiTConversion]


def module_tensor(files: WeightFiles, config: DiTConfig, key: str) -> Tensor:
    """A native key's tensor as the module holds it (QKV rows stacked), as stored."""
    return dit_format.native_to_module({key: files.tensor(key)}, config)[key]


def linear_weight(module: nn.Module, key: str) -> tuple[bool, bool]:
    """(whether `key` is the weight of a linear layer of `module`, whether the module holds that layer in fp32: an
    island, built in bf16 on the meta device)."""
    path, _, leaf = key.rpartition(".")
    try:
        layer = module.get_submodule(path)
    except AttributeError:
        return False, False
    linear = leaf == "weight" and isinstance(layer, nn.Linear)
    return linear, linear and layer.weight.dtype == torch.float32


def is_fp32_island(key: str, fp32: bool = False) -> bool:
    """Kept in full precision whatever the format asked for: named islands, or `fp32` (the module holds it so)."""
    return fp32 or key in FP32_PARAMETER_NAMES or key in PRUNED_FP32_NAMES


def _is_weight_file(path: Path) -> bool:
    return path.name.endswith((".safetensors", ".safetensors.index.json"))


def convert_checkpoint_dits(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    file_name: Callable[[str], str],
    write_dit: DiTWriter,
) -> dict[str, DiTConversion]:
    """Write `source` (a released checkpoint, either layout) into the empty or missing folder `out` with each
    partition's DiT as the file `write_dit` writes (see the module doc); returns each partition's conversion."""
    source, out = Path(source), Path(out)
    layout = detect_layout(source)
    require_empty_folder(out)
    created = out  # the outermost folder made here, removed on failure (None: `out` was there)
    while not created.parent.exists():
        created = created.parent
    created = None if out.exists() else created
    dit_folders = {paths.dit for paths in layout.partitions.values()}
    conversions: dict[str, DiTConversion] = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.rglob("*")):
            in_dit = any(folder in path.parents for folder in dit_folders)
            if path.is_file() and not (in_dit and _is_weight_file(path)):
                link_or_copy(path, out / path.relative_to(source))
        names: dict[str, str] = {}
        for partition, paths in sorted(layout.partitions.items()):
            names[partition] = file_name(partition)
            conversions[partition] = write_dit(layout, paths, out / names[partition])
        # Written last: a folder without it is an unfinished conversion.
        (out / DIT_FILES_JSON).write_text(json.dumps(names, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        _remove_written(out, created)
        raise
    return conversions


def _remove_written(out: Path, created: Path | None) -> None:
    """Undo a failed conversion: the folders made here, else everything in `out` (it was empty)."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    elif out.is_dir():
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
