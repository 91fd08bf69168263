"""A community single file that replaces the weights of a shared component (`--video-vae`, `--audio-vae`,
`--text-encoder FILE`), read as that component's `WeightFiles` under our module's keys.

The files are ComfyUI-style single safetensors files (h3engine.checkpoint.single_files: bf16 / fp16 / fp32, FP8
scaled, INT8, INT8 ConvRot, mixed). Their names are the native ones (our module's) behind at most one prefix, chosen
as the one under which most names are the module's (`VAE_PREFIXES`, `TEXT_ENCODER_PREFIXES`); a text encoder's names
may also take the alternative spellings of Qwen3-VL re-packs (`text_encoder_key`). A float tensor is read as stored
(the loader casts it to the module's dtype); a quantized one is dequantized at load (float32, one rounding to the
module's dtype then), except a text encoder's linears on one rank, which stay quantized (`keep_quantized`).

A GGUF text encoder is h3engine.checkpoint.text_encoder_gguf's.

Refusals (CheckpointError naming the file, and the tensor where one is at fault): a GGUF VAE file, a file that is
no safetensors file, a tensor in a format not read here, another component's file (none of its names is the
module's: a DiT file given as `--video-vae`), and, at `check`, a tensor missing, extra or of another shape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint.dit_file_weights import SCALED_FORMATS, scaled_parts
from h3engine.checkpoint.safetensors_io import TensorInfo, WeightFiles
from h3engine.checkpoint.single_file_formats import DIFFUSION_MODEL_PREFIX, PLAIN_FORMATS
from h3engine.checkpoint.single_files import SingleFile
from h3engine.errors import CheckpointError
from h3engine.models.stored_linear import WeightForm

# The prefixes a VAE single file may put before the native names (ComfyUI's VAE loader reads bare names; whole
# checkpoints put `first_stage_model.` or `vae.`); "" is tried too.
VAE_PREFIXES = ("vae.", "first_stage_model.", "video_vae.", "audio_vae.", "model.", "audio_model.")
# The prefixes a text-encoder single file may put before Qwen3-VL's names.
TEXT_ENCODER_PREFIXES = (
    "text_encoder.",
    "text_encoders.qwen3vl.transformer.",
    "transformer.",
    "cond_stage_model.",
)
# Qwen3-VL's stock names (our module's) and the alternative spellings re-packs use for them, as SGLang accepts them
# (docs/H3_CHECKPOINT_LAYOUT.md §3): the language model without its `language_model` level or without `model.`,
# the vision tower without `model.`.
_TEXT_ENCODER_SPELLINGS = (
    ("model.language_model.", "model.language_model."),
    ("model.visual.", "model.visual."),
    ("language_model.model.", "model.language_model."),
    ("language_model.", "model.language_model."),
    ("model.", "model.language_model."),
    ("visual.", "model.visual."),
)


def text_encoder_key(name: str) -> str:
    """Qwen3-VL's stock name for `name` in any of the spellings re-packs use (`model.layers.0...`,
    `language_model.layers.0...`, `visual.blocks.0...`), `lm_head.weight` and unknown names unchanged."""
    for spelling, stock in _TEXT_ENCODER_SPELLINGS:
        if name.startswith(spelling):
            return stock + name.removeprefix(spelling)
    return name


class ComponentFileWeights(WeightFiles):
    """The tensors of one component single file under the module's keys (see the module doc). Of the keys in
    `keep_quantized`, a linear's scaled weight `X.weight` is the keys of a StoredLinear instead (`X.quantized`, `X.scale`: the file's
    bytes; `stored_forms` lists them for `store_linears`), as h3engine.checkpoint.dit_file_weights presents a DiT's."""

    def __init__(
        self, single: SingleFile, names: dict[str, str], keep_quantized: Collection[str] = ()
    ) -> None:
        # names: module key -> the file's record name
        self.single = single
        self.path = single.path
        self.names = names
        self.stored_forms: dict[str, WeightForm] = {}
        self.stored: dict[str, Tensor] = {}  # a StoredLinear's key -> its view of the map
        infos = {}
        for key, name in names.items():
            record = single.records[name]
            if key in keep_quantized and record.format in SCALED_FORMATS and key.endswith(".weight"):
                layer = key.removesuffix(".weight")
                self.stored_forms[layer], parts = scaled_parts(record)
                for leaf, view, offset in parts:
                    self.stored[f"{layer}.{leaf}"] = view
                    infos[f"{layer}.{leaf}"] = TensorInfo(
                        single.path, view.dtype, tuple(view.shape), offset=offset
                    )
                continue
            if record.format in PLAIN_FORMATS.values():
                dtype, offset = record.values.dtype, record.part("values").offset
            else:
                dtype, offset = torch.float32, -1  # dequantized when read: its bytes are not the module's
            infos[key] = TensorInfo(single.path, dtype, tuple(record.shape), offset=offset)
        super().__init__(infos, str(single.path))

    def _read(self, key: str, rows: slice | None = None, columns: slice | None = None) -> Tensor:
        if key in self.stored:
            tensor = self.stored[key]
            if columns is not None:
                raise CheckpointError(
                    f"{self.path}: {key!r} is quantized by rows; its columns are not read apart"
                )
            return tensor[rows] if rows is not None else tensor
        record = self.single.records[self.names[key]]
        if record.format in PLAIN_FORMATS.values():
            tensor = record.values.view(record.shape)
        else:
            tensor = self.single.tensor(record.name)
        if rows is not None:
            tensor = tensor[rows]
        return tensor[:, columns] if columns is not None else tensor


def open_component_file(
    path: Path,
    what: str,
    expected: Collection[str],
    prefixes: tuple[str, ...],
    rename: Callable[[str], str] = lambda name: name,
    keep_quantized: Collection[str] = (),
) -> ComponentFileWeights:
    """The single file `path` of component `what` as WeightFiles keyed by the module's keys `expected`: its names
    renamed by `rename` behind the prefix of `prefixes` (or none) under which most of them are expected keys."""
    path = Path(path)
    if path.suffix == ".gguf":
        raise CheckpointError(
            f"{path}: a GGUF {what} file is not read (no GGUF layout of it is published); give a ComfyUI single "
            ".safetensors file"
        )
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: a {what} file must be a single safetensors (.safetensors) file")
    single = SingleFile.open(path)
    single.check_supported()
    expected = set(expected)
    best: tuple[int, dict[str, str]] = (0, {})
    for prefix in ("", *prefixes):
        names = {
            rename(name.removeprefix(prefix)): name for name in single.records if name.startswith(prefix)
        }
        names |= {name: name for name in single.records if not name.startswith(prefix)}
        matched = len(expected & set(names))
        if matched > best[0]:
            best = (matched, names)
    if best[0] == 0:
        architecture = single.metadata.get("modelspec.architecture")
        sample = next(iter(single.records), None)
        stored = single.records[sample].stored_name if sample is not None else None
        dit = (
            " (a DiT file: its names carry 'model.diffusion_model.')"
            if stored and stored.startswith(DIFFUSION_MODEL_PREFIX)
            else ""
        )
        raise CheckpointError(
            f"{path}: not an H3 {what} file{dit}: none of its {len(single.records)} tensors (e.g. {stored!r}; "
            f"architecture {architecture!r}) is one of the {what}'s, e.g. {min(expected)!r}"
        )
    names = best[1]
    if len(names) != len(single.records):
        twice = sorted(set(single.records) - set(names.values()))[0]
        raise CheckpointError(f"{path}: tensor {twice!r} names a {what} tensor that the file holds twice")
    return ComponentFileWeights(single, names, keep_quantized)
