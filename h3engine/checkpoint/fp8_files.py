"""Checkpoints whose large linears are stored in FP8, and the converter that writes them from the released files.

The format (ours): the released folder layout and configs, and in the DiT's and the text encoder's weight files every
weight that `--weights fp8` stores in FP8 (`quantized_key`: the DiT blocks' and the token refiner's attention and
feed-forward linears, the AdaLN projections, the text encoder's decoder-layer linears) as e4m3 values `KEY` with one
fp32 scale per output row `KEY_scale` [rows, 1], in the file's own row order: exactly `quantize_rows` of the released
bf16 tensor, so a converted checkpoint computes bit for bit what `--weights fp8` computes from the original (a row
scale does not care about the row order; the loader reorders values and scales alike). Each file says so in its
metadata (FORMAT_KEY). h3engine.checkpoint.safetensors_io.WeightFiles reads such files: dequantized (fp32, then the
module's dtype: `quantize_rows`' one rounding), or raw (`fp8`) for FP8 layer images.

`convert_checkpoint(source, out)` writes one, a tensor at a time (the host holds one tensor, never a model), keeping
the shards; the VAEs, tokenizer, processor and configs are hard-linked where the filesystem allows, else copied; the
text encoder's layers past H3's 50th, its final norm and lm_head (never read) are left out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint.fp8_rows import FP8_DTYPE, quantize_rows
from h3engine.checkpoint.layout import detect_layout, folder_fingerprint, require_empty_folder
from h3engine.checkpoint.safetensors_io import FP8_SCALE_SUFFIX, WeightFiles, read_header, write_tensor_file
from h3engine.errors import CheckpointError
from h3engine.models.text_encoder import H3_TEXT_ENCODER_LAYERS

SCALE_SUFFIX = FP8_SCALE_SUFFIX
FORMAT_KEY = "h3_weights"
FORMAT_FP8 = "fp8-e4m3-row-scales"

# The DiT's weights --weights fp8 stores in FP8, native names (a diffusers name maps to its native one first).
_DIT_FP8 = re.compile(
    r"^(token_refiner\.)?blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)\.weight$"
    r"|^(blocks\.\d+|final_layer)\.adaln_proj\.linear\.weight$"
)
_TEXT_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def dit_quantized_key(native_key: str) -> bool:
    return _DIT_FP8.match(native_key) is not None


def text_encoder_quantized_key(key: str, shape: tuple[int, ...]) -> bool:
    """A 2-D weight of one of the decoder layers H3 reads."""
    match = _TEXT_LAYER.match(key)
    return (
        match is not None
        and int(match.group(1)) < H3_TEXT_ENCODER_LAYERS
        and key.endswith(".weight")
        and len(shape) == 2
    )


def text_encoder_unused_key(key: str) -> bool:
    """A key a full Qwen3-VL checkpoint carries that H3 never reads (layers past its 50th, the final norm, lm_head)."""
    match = _TEXT_LAYER.match(key)
    if match is not None:
        return int(match.group(1)) >= H3_TEXT_ENCODER_LAYERS
    return key in ("model.language_model.norm.weight", "lm_head.weight")


def stores_fp8(files: WeightFiles) -> bool:
    """Whether these weight files store some of their weights in FP8 (this format)."""
    return bool(files.scales)


# ----------------------------------------------------------------------------------------------------------------
# The converter


def _weight_files_of(folder: Path) -> list[Path]:
    """The safetensors files of a component folder (or the file itself), and its index if it has one."""
    if folder.is_file():
        return [folder]
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json"))


def link_or_copy(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` where the filesystem allows, else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _convert_file(
    source: Path,
    target: Path,
    quantized: Callable[[str, tuple[int, ...]], bool],
    dropped: Callable[[str], bool],
) -> tuple[list[str], int]:
    """One weight file converted into `target`: its quantized keys as values and row scales, the rest as stored, the
    dropped ones left out. Returns (the keys written, the bytes written)."""
    infos = read_header(source)
    files = WeightFiles(dict(infos), str(source))
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    makers: dict[str, Callable[[], Tensor]] = {}
    for key, info in infos.items():
        if dropped(key):
            continue
        if info.dtype.is_floating_point and quantized(key, info.shape):
            if info.dtype not in (torch.bfloat16, torch.float16):
                raise CheckpointError(
                    f"{source}: tensor '{key}' is {info.dtype}; --weights fp8 converts bf16 files"
                )
            rows = info.shape[0]
            specs += [(key, info.shape, FP8_DTYPE), (key + SCALE_SUFFIX, (rows, 1), torch.float32)]
            # Values and scales come from one quantization, made when the first of the two is asked for.
            pair: dict[str, Tensor] = {}

            def part(name: str, key: str = key, pair: dict[str, Tensor] = pair) -> Tensor:
                if not pair:
                    pair["values"], pair["scales"] = quantize_rows(files.tensor(key))
                return pair.pop(name)

            makers[key] = lambda part=part: part("values")
            makers[key + SCALE_SUFFIX] = lambda part=part: part("scales")
        else:
            specs.append((key, info.shape, info.dtype))
            makers[key] = lambda key=key: files.tensor(key)
    # Keys are written sorted: "KEY" before "KEY_scale", so each scale follows its values.
    write_tensor_file(target, specs, lambda key: makers[key](), {FORMAT_KEY: FORMAT_FP8})
    files.close()
    return [key for key, _, _ in specs], target.stat().st_size


def _convert_component(
    folder: Path,
    target_folder: Path,
    quantized: Callable[[str, tuple[int, ...]], bool],
    dropped: Callable[[str], bool] = lambda key: False,
) -> int:
    """A component folder's weight files converted (and its index rewritten for the keys written); other files
    linked. Returns the bytes of the weight files written."""
    written = 0
    index_paths = []
    weight_map: dict[str, str] = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else [folder]:
        target = target_folder / path.name
        if path.name.endswith(".safetensors.index.json"):
            index_paths.append(path)
        elif path.suffix == ".safetensors":
            keys, size = _convert_file(path, target, quantized, dropped)
            weight_map.update(dict.fromkeys(keys, path.name))
            written += size
        elif path.is_file():
            link_or_copy(path, target)
    for index_path in index_paths:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.setdefault("metadata", {})["total_size"] = written
        (target_folder / index_path.name).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return written


def convert_checkpoint(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dit_writer: Callable[[Path, Path], int] | None = None,
) -> dict[str, int]:
    """Write `source` (a released checkpoint, either layout) into the empty or missing folder `out` in this format;
    returns the bytes written per converted component ("dit:<folder>", "text_encoder:<folder>"). `dit_writer(folder,
    target)` writes each DiT folder instead (h3engine.checkpoint.prune_adaln) and returns its weight bytes. A pruned
    AdaLN form's projections (h3engine.checkpoint.dit_pruned) are not quantized: rows of a few inputs."""
    from h3engine.checkpoint.dit_keys import native_key
    from h3engine.checkpoint.dit_pruned import holds_pruned_adaln

    source, out = Path(source), Path(out)
    layout = detect_layout(source)
    require_empty_folder(out)
    dit_folders = {paths.dit for paths in layout.partitions.values()}
    text_folders = {paths.text_encoder for paths in layout.partitions.values()}
    sizes: dict[str, int] = {}

    def dit_key(key: str, shape: tuple[int, ...], pruned: bool = False) -> bool:
        name = key if layout.kind == "native" else native_key(key)
        return dit_quantized_key(name) and not (pruned and "adaln_proj" in name)

    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if any(folder == path or folder in path.parents for folder in dit_folders | text_folders):
            continue
        if path.is_file():
            link_or_copy(path, out / relative)
    for folder in sorted(dit_folders):
        target = out / folder.relative_to(source)
        if dit_writer is not None:
            sizes[f"dit:{folder.relative_to(source)}"] = dit_writer(folder, target)
            continue
        pruned = holds_pruned_adaln(WeightFiles.open(folder))
        sizes[f"dit:{folder.relative_to(source)}"] = _convert_component(
            folder, target, lambda key, shape, pruned=pruned: dit_key(key, shape, pruned)
        )
    converted: dict[
        str, Path
    ] = {}  # a text encoder's fingerprint -> its converted folder (the release has 2 copies)
    for folder in sorted(text_folders):
        target = out / folder.relative_to(source)
        fingerprint = folder_fingerprint(folder)
        if fingerprint in converted:
            for path in sorted(converted[fingerprint].iterdir()):
                link_or_copy(path, target / path.name)
            continue
        sizes[f"text_encoder:{folder.relative_to(source)}"] = _convert_component(
            folder, target, text_encoder_quantized_key, text_encoder_unused_key
        )
        converted[fingerprint] = target
    return sizes
