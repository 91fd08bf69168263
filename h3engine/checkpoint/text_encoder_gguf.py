"""A llama.cpp GGUF text encoder (`--text-encoder FILE.gguf`): the Qwen3-VL language model in one GGUF file and its
vision tower in the `mmproj` GGUF beside it, read as the text encoder's `WeightFiles` under our module's keys.

Names: llama.cpp's converter writes the language model under gguf-py's names for the `qwen3vl` architecture
(`blk.0.attn_q.weight`, `token_embd.weight`) and the vision tower under its `clip` names (`v.blk.0.attn_qkv.weight`),
except where it reshapes: the merger's `linear_fc1` / `linear_fc2` / `norm` become `mm.0` / `mm.2` / `v.post_ln`, a
deepstack merger `j` becomes `v.deepstack.{layer}` with the vision layer it taps (`deepstack_visual_indexes[j]`),
and the [out, in, 2, p, p] patch convolution is split along time into `v.patch_embd.weight` and `.weight.1` (stacked
back here). `llama_cpp_name` maps a stock key to its file name with gguf-py's own TensorNameMap plus those cases.
A quantized linear of `keep_quantized` stays the file's bytes (a StoredLinear's `quantized`); any other quantized
tensor (the token embeddings) is dequantized when read. The mmproj file is found beside the text file (`mmproj`
in its name; the one sharing the text file's stem when several do).

Refusals (CheckpointError naming the file, and the tensor where one is at fault): an mmproj file given as the text
file, another architecture, no or an ambiguous mmproj file, a tensor missing or of another shape, a type not read.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint import gguf_blocks
from h3engine.checkpoint.dit_file_weights import GGUF_FLOATS
from h3engine.checkpoint.gguf_blocks import GGMLType
from h3engine.checkpoint.gguf_files import GGUFFile, GGUFTensor
from h3engine.checkpoint.safetensors_io import TensorInfo, WeightFiles
from h3engine.errors import CheckpointError
from h3engine.models.stored_linear import QUANTIZED_BUFFER, WeightForm

TEXT_ARCHITECTURE = "qwen3vl"
VISION_ARCHITECTURE = "clip"
LANGUAGE_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
PATCH_KEY = VISION_PREFIX + "patch_embed.proj.weight"
# The second temporal half of the patch convolution, as the converter names it.
PATCH_SECOND_SUFFIX = ".1"
# A quantization suffix of a GGUF file's stem ('-Q4_K_M', '.IQ2_XS', '-UD-Q2_K_XL', '-BF16'), left out to match stems.
_QUANT_SUFFIX = re.compile(r"[-_.](?:ud-)?(?:i?q\d\w*|bf16|f16|f32)$", re.IGNORECASE)


def llama_cpp_name(key: str, layers: int, depth: int, deepstack_layers: list[int]) -> str:
    """The name llama.cpp's converter gives the stock Qwen3-VL key `key` (`layers` decoder layers, a vision tower of
    `depth` blocks tapped for deepstack at `deepstack_layers`); the patch convolution's first half for PATCH_KEY."""
    from gguf import MODEL_ARCH, MODEL_TENSOR, TENSOR_NAMES, TensorNameMap

    suffixes = (".weight", ".bias")
    if key.startswith(LANGUAGE_PREFIX):
        hf_name = "model." + key.removeprefix(LANGUAGE_PREFIX)
        name = TensorNameMap(MODEL_ARCH.QWEN3VL, layers).get_name(hf_name, try_suffixes=suffixes)
    elif key.startswith(VISION_PREFIX):
        rest = key.removeprefix(VISION_PREFIX)
        module, _, leaf = rest.rpartition(".")
        parts = module.split(".")
        if parts[0] == "deepstack_merger_list":
            kinds = {"norm": MODEL_TENSOR.V_DS_NORM, "linear_fc1": MODEL_TENSOR.V_DS_FC1}
            kinds |= {"linear_fc2": MODEL_TENSOR.V_DS_FC2}
            index = int(parts[1])
            known = parts[2] in kinds and index < len(deepstack_layers)
            name = (
                TENSOR_NAMES[kinds[parts[2]]].format(bid=deepstack_layers[index]) + f".{leaf}"
                if known
                else None
            )
        elif parts[0] == "merger":
            merger = {"linear_fc1": TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ].format(bid=0)}
            merger |= {"linear_fc2": TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ].format(bid=2)}
            merger |= {"norm": TENSOR_NAMES[MODEL_TENSOR.V_POST_NORM]}
            name = merger[parts[1]] + f".{leaf}" if parts[1] in merger else None
        else:
            name = TensorNameMap(MODEL_ARCH.MMPROJ, depth).get_name("visual." + rest, try_suffixes=suffixes)
    else:
        name = None
    if name is None:
        raise CheckpointError(f"text encoder key {key!r} has no llama.cpp GGUF name")
    return name


def find_mmproj(path: Path) -> Path:
    """The mmproj GGUF beside the text encoder's GGUF `path`: the one `.gguf` with 'mmproj' in its name, or of several
    the one whose name holds the text file's stem without its quantization suffix."""
    found = sorted(
        other for other in path.parent.glob("*.gguf") if "mmproj" in other.name.lower() and other != path
    )
    if len(found) > 1:
        stem = _QUANT_SUFFIX.sub("", path.stem).lower()
        found = [other for other in found if stem in other.name.lower()] or found
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(
            f"{path}: no mmproj file beside this GGUF text encoder: its vision tower (Qwen3-VL's, for image "
            "references) is a separate llama.cpp 'mmproj' GGUF; put it in the same folder with 'mmproj' in its name"
        )
    raise CheckpointError(
        f"{path}: several mmproj files beside this GGUF text encoder fit it "
        f"({', '.join(other.name for other in found)}); keep the one of this model there"
    )


class GGUFTextEncoderWeights(WeightFiles):
    """The stock Qwen3-VL keys `expected` (module key -> shape) read from a text GGUF and its mmproj GGUF (see the
    module doc); of `keep_quantized` (linear weights `X.weight`), a quantized one is `X.quantized` instead, its form
    in `stored_forms` for `store_linears`."""

    def __init__(
        self,
        text: GGUFFile,
        vision: GGUFFile,
        expected: Mapping[str, tuple[int, ...]],
        names: Mapping[str, str],
        keep_quantized: Collection[str] = (),
    ) -> None:
        self.path = text.path
        self.records: dict[str, GGUFTensor] = {}
        self.stored_forms: dict[str, WeightForm] = {}
        infos: dict[str, TensorInfo] = {}
        for key, shape in expected.items():
            source = text if key.startswith(LANGUAGE_PREFIX) else vision
            record = _checked(source, names[key], shape if key != PATCH_KEY else _patch_half(shape))
            if key in keep_quantized and record.ggml_type not in GGUF_FLOATS:
                layer = key.removesuffix(".weight")
                self.stored_forms[layer] = WeightForm.gguf(record.ggml_type)
                key = f"{layer}.{QUANTIZED_BUFFER}"
                view = record.raw.view(shape[0], -1)
                infos[key] = TensorInfo(source.path, view.dtype, tuple(view.shape), offset=record.offset)
            elif record.ggml_type in GGUF_FLOATS and key != PATCH_KEY:
                dtype = GGUF_FLOATS[GGMLType(record.ggml_type)]
                infos[key] = TensorInfo(source.path, dtype, shape, offset=record.offset)
            else:  # dequantized (or stacked) when read: its bytes are not the module's
                infos[key] = TensorInfo(source.path, torch.float32, shape, offset=-1)
            self.records[key] = record
        if PATCH_KEY in expected:
            second = names[PATCH_KEY] + PATCH_SECOND_SUFFIX
            self.records[PATCH_KEY + PATCH_SECOND_SUFFIX] = _checked(
                vision, second, _patch_half(expected[PATCH_KEY])
            )
        super().__init__(infos, str(text.path))

    def _read(self, key: str, rows: slice | None = None, columns: slice | None = None) -> Tensor:
        record = self.records[key]
        if key.endswith(QUANTIZED_BUFFER):
            if columns is not None:
                raise CheckpointError(
                    f"{self.path}: {key!r} is quantized by rows; its columns are not read apart"
                )
            tensor = record.raw.view(record.shape[0], -1)
        elif key == PATCH_KEY:
            halves = (record, self.records[PATCH_KEY + PATCH_SECOND_SUFFIX])
            tensor = torch.stack([_values(half) for half in halves], dim=2)
        else:
            tensor = _values(record)
        if rows is not None:
            tensor = tensor[rows]
        return tensor[:, columns] if columns is not None else tensor


def open_gguf_text_encoder(
    path: Path,
    expected: Mapping[str, tuple[int, ...]],
    text_config: object,
    vision_config: object,
    keep_quantized: Collection[str] = (),
) -> GGUFTextEncoderWeights:
    """The GGUF text encoder `path` (and the mmproj file beside it) as WeightFiles of the keys `expected`."""
    text = GGUFFile.open(path)
    if text.architecture == VISION_ARCHITECTURE:
        raise CheckpointError(
            f"{path}: an mmproj (vision tower) GGUF, not the text encoder's: give the language model's GGUF (e.g. "
            "'...-Q4_K_M.gguf') and keep this file beside it"
        )
    if text.architecture != TEXT_ARCHITECTURE:
        raise CheckpointError(
            f"{path}: not a Qwen3-VL text encoder GGUF (architecture {text.architecture!r}, expected "
            f"{TEXT_ARCHITECTURE!r})"
        )
    vision_path = find_mmproj(path)
    vision = GGUFFile.open(vision_path)
    if vision.architecture != VISION_ARCHITECTURE:
        raise CheckpointError(
            f"{vision_path}: not an mmproj GGUF (architecture {vision.architecture!r}, expected "
            f"{VISION_ARCHITECTURE!r})"
        )
    layers = int(text_config.num_hidden_layers)
    depth = int(vision_config.depth)
    deepstack = [int(layer) for layer in getattr(vision_config, "deepstack_visual_indexes", ())]
    names = {key: llama_cpp_name(key, layers, depth, deepstack) for key in expected}
    return GGUFTextEncoderWeights(text, vision, expected, names, keep_quantized)


def _checked(source: GGUFFile, name: str, shape: tuple[int, ...]) -> GGUFTensor:
    record = source.record(name)
    if tuple(record.shape) != tuple(shape):
        raise CheckpointError(
            f"{source.path}: tensor {name!r} has shape {list(record.shape)}, the text encoder's is {list(shape)}"
        )
    if not record.supported:
        source.tensor(name)  # raises, naming the type and the tensor
    return record


def _patch_half(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One temporal half of the [out, in, 2, p, p] patch convolution, as the converter splits it."""
    if len(shape) != 5 or shape[2] != 2:
        raise CheckpointError(
            f"a GGUF text encoder's patch convolution is split in 2 along time, not {list(shape)}"
        )
    return (shape[0], shape[1], *shape[3:])


def _values(record: GGUFTensor) -> Tensor:
    if record.ggml_type in GGUF_FLOATS:
        return record.raw.view(GGUF_FLOATS[GGMLType(record.ggml_type)]).view(record.shape)
    return gguf_blocks.dequantize(record.raw, record.ggml_type, record.shape, record.stored_name)
