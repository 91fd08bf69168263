"""The byte sizes a memory plan needs, from a checkpoint's configs and headers: no weight is read.

`checkpoint_sizes(checkpoint, weights, share)` builds each component of each partition on `meta` from its config
(the DiT via `dit_source(...).build()`, the VAEs via their sources, `H3TextEncoder(config)` with every file tensor in
the load dtype), so dtypes are loading's: the DiT bf16 with fp32 islands, both VAEs fp32. Each model is split as
h3engine.memory.layers streams it (its `LayerSpec`s): layers, the DiT's AdaLN projections, and the rest; parameters
and buffers both count. `weights="fp8"`: the large linears' 2-D weights (DiT layers, AdaLN, text-encoder layers)
count 1 byte per element + 4 per output row (fp32 scale); `layer_compute_bytes` keeps each layer unquantized.
`RankShare` is one worker-group rank's share: the tensor-parallel linears split (see `_split_bytes`), VAEs held or
not. The diffusers layout's partitions share one text encoder and VAE size object. ~0.5 s at the released size.

Danger: a renamed module attribute raises in h3engine.memory.layers; another FP8 scale scheme changes `_fp8_bytes`,
and the plan's ring and home sizes with it.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from h3engine.checkpoint.layout import CanvasRules, CheckpointLayout, PartitionPaths, detect_layout
from h3engine.checkpoint.loader import audio_vae_source, dit_source, text_encoder_skeleton, video_vae_source
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.text_encoder_files import (
    IMAGE_MAX_PIXELS,
    IMAGE_MIN_PIXELS,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
)
from h3engine.memory.layers import dit_layers, text_encoder_layers, video_decoder_layers
from h3engine.memory.types import WEIGHT_FORMATS
from h3engine.models.audio_vae import AudioVAEConfig
from h3engine.models.dit_config import DiTConfig
from h3engine.models.stored_linear import QUANTIZED_BUFFER, StoredLinear
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

# Bytes of one FP8 scale (fp32, one per output row: h3engine.models.quantization.quantize_rows).
FP8_SCALE_BYTES = 4

# Tensor-parallel splits, by the linear's attribute name: "rows" (column-parallel: output rows split), "columns"
# (row-parallel: input columns split), "kv" (key/value heads, replicated past their count).
_DIT_TP_SPLITS = {"qkv_proj": "rows", "fc1": "rows", "out_proj": "columns", "fc2": "columns"}
_ENCODER_TP_SPLITS = {
    "q_proj": "rows",
    "gate_proj": "rows",
    "up_proj": "rows",
    "o_proj": "columns",
    "down_proj": "columns",
    "k_proj": "kv",
    "v_proj": "kv",
}


@dataclass(frozen=True)
class RankShare:
    """What one rank of a worker group holds (the defaults: a single process holding everything)."""

    dit_tp: int = 1
    dit_sp: int = 1
    encoder_tp: int = 1
    holds_video_vae: bool = True
    holds_audio_vae: bool = True

    def __post_init__(self) -> None:
        for name in ("dit_tp", "dit_sp", "encoder_tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RankShare.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ModelSize:
    """One model as one rank holds it: its streamed layers (in run order), the rest, and the DiT's AdaLN part."""

    layer_bytes: tuple[int, ...] = ()  # each layer as stored (FP8 values and scales with --weights fp8)
    layer_compute_bytes: tuple[int, ...] = ()  # each layer unquantized (its compute dtype)
    other_bytes: int = 0
    adaln_bytes: int = 0  # the DiT's AdaLN projections, all of them
    adaln_largest_bytes: int = 0  # the largest one as stored
    adaln_largest_compute_bytes: int = 0  # the largest one unquantized
    layer_parameters: int = 0  # parameters of the largest layer (whole, before any split): its FLOPs per row
    # The largest weight a community file stores quantized (StoredLinear), dequantized: each is made where its layer
    # computes and dropped after, one at a time.
    dequantized_bytes: int = 0

    @property
    def layers_total(self) -> int:
        return sum(self.layer_bytes)

    @property
    def largest_layer(self) -> int:
        return max(self.layer_bytes, default=0)

    @property
    def largest_layer_compute(self) -> int:
        return max(self.layer_compute_bytes, default=0)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def total(self) -> int:
        """Everything the model holds: layers, other and AdaLN projections."""
        return self.layers_total + self.other_bytes + self.adaln_bytes

    @property
    def layers_compute_total(self) -> int:
        return sum(self.layer_compute_bytes)

    def leading_compute_bytes(self, count: int) -> int:
        """Bytes of the first `count` layers unquantized: what the device holds of layers that do not stream
        (h3engine.memory.placement dequantizes an FP8 model's resident and phase-moved layers)."""
        return sum(self.layer_compute_bytes[:count])

    def trailing_layers_bytes(self, count: int) -> int:
        """Bytes as stored of the layers after the first `count`: a streamed model's host images."""
        return sum(self.layer_bytes[count:])


@dataclass(frozen=True)
class TextEncoderDims:
    """The text encoder's widths the activation formulas need (H3TextEncoder's Qwen3-VL config)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vision_hidden: int
    vision_intermediate: int
    vision_depth: int
    vision_patch: int
    temporal_patch: int
    merge: int
    deepstack_levels: int
    image_min_pixels: int = IMAGE_MIN_PIXELS
    image_max_pixels: int = IMAGE_MAX_PIXELS
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS


@dataclass(frozen=True)
class PartitionSizes:
    """The models serving one partition, as one rank holds them, and the configs the formulas read."""

    partition: str
    dit: ModelSize
    text_encoder: ModelSize
    video_vae: ModelSize
    audio_vae: ModelSize
    dit_config: DiTConfig
    text_dims: TextEncoderDims
    video_config: VideoVAEConfig
    audio_config: AudioVAEConfig
    # True where the other partition holds the very same text encoder and VAEs (the diffusers layout).
    shared_with_other: bool = False
    # Bytes of one element of the compute dtype (activations of the DiT and the text encoder).
    dtype_bytes: int = 2

    def model(self, name: str) -> ModelSize:
        return getattr(self, name)


@dataclass(frozen=True)
class CheckpointSizes:
    """Every partition's sizes for one weight format and one rank share."""

    root: str
    layout_kind: str
    weights: str
    share: RankShare
    canvas: CanvasRules
    partitions: dict[str, PartitionSizes] = field(default_factory=dict)
    # What the files store the large linears as: "fp8" for a converted checkpoint (its layers can then stream from
    # the files in FP8), else "bf16".
    files_weights: str = "bf16"

    def other_partition(self, partition: str) -> PartitionSizes | None:
        """The partition that is not `partition` (None in a one-partition checkpoint)."""
        others = [sizes for name, sizes in self.partitions.items() if name != partition]
        return others[0] if others else None


# ----------------------------------------------------------------------------------------------------------------
# Counting bytes


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer, each tensor once (a shared one is held once)."""
    seen: set[int] = set()
    named = []
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            named.append((name, tensor))
    return named


def _plain_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _fp8_bytes(tensor: torch.Tensor) -> int:
    """An [rows, columns] weight stored in e4m3 with one fp32 scale per output row."""
    rows = tensor.shape[0]
    return tensor.numel() + FP8_SCALE_BYTES * rows


def _split_bytes(tensor: torch.Tensor, split: str | None, degree: int, stored_fp8: bool) -> tuple[int, int]:
    """(stored bytes, unquantized bytes) of this rank's share of a 2-D weight split `split` over `degree` ranks.

    As h3engine.models.parallel splits them: the DiT's qkv and fc1 (the refiner's too) by output rows, out_proj and fc2 by
    input columns over dit_tp; the text encoder's q/gate/up by rows, o/down by columns over encoder_tp, k/v by rows
    over min(encoder_tp, kv_heads) (more ranks than key/value heads replicate them). A split dimension is divided
    with ceil (exact for the released widths); an FP8 row-parallel layer keeps every output row's scale."""
    rows, columns = tensor.shape
    if split in ("rows", "kv"):
        rows = math.ceil(rows / degree)
    elif split == "columns":
        columns = math.ceil(columns / degree)
    unquantized = rows * columns * tensor.element_size()
    # A row-parallel layer's output rows are all there on every rank, so are their scales.
    stored = rows * columns + FP8_SCALE_BYTES * rows if stored_fp8 else unquantized
    return stored, unquantized


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    """A large linear's 2-D weight matrix (norms, biases and 1-D tensors never are)."""
    return name.endswith("weight") and tensor.dim() == 2 and tensor.is_floating_point()


def _group_bytes(
    tensors: Iterable[tuple[str, torch.Tensor]],
    fp8: bool,
    splits: dict[str, str],
    degree: int,
    kv_degree: int,
) -> tuple[int, int]:
    """(stored, unquantized) bytes of a group of tensors of which the large linears' weights may be FP8 and
    tensor-parallel (`splits`: the linear's attribute name -> how it splits)."""
    stored = unquantized = 0
    for name, tensor in tensors:
        if not _quantizable(name, tensor):
            stored += _plain_bytes(tensor)
            unquantized += _plain_bytes(tensor)
            continue
        owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        split = splits.get(owner)
        split_degree = kv_degree if split == "kv" else degree
        if split is None:
            split_degree = 1
        part_stored, part_unquantized = _split_bytes(tensor, split, split_degree, fp8)
        stored += part_stored
        unquantized += part_unquantized
    return stored, unquantized


def _parts_tensors(module: nn.Module, parts: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
    named = []
    for path in parts:
        part = module.get_submodule(path)
        named += [(f"{path}.{name}" if path else name, tensor) for name, tensor in _tensors(part)]
    return named


def _parameters(layer: nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """The parameters (multiply-adds per row) of a layer's tensors: a StoredLinear's bytes and scale stand for its
    in x out weight."""
    count = 0
    for name, tensor in named:
        owner_path, _, leaf = name.rpartition(".")
        owner = layer.get_submodule(owner_path) if owner_path else layer
        if isinstance(owner, StoredLinear) and leaf in StoredLinear.STORED_TENSORS:
            count += owner.in_features * owner.out_features if leaf == QUANTIZED_BUFFER else 0
        else:
            count += tensor.numel()
    return count


def _layered_size(
    module: nn.Module,
    spec_layers: Sequence[nn.Module],
    parts: Sequence[str],
    fp8_layers: bool,
    splits: dict[str, str],
    degree: int,
    kv_degree: int = 1,
    adaln_modules: Sequence[nn.Module] = (),
    fp8_adaln: bool = False,
) -> ModelSize:
    """A model's size split into its streamed layers (`parts` of each of `spec_layers`), its AdaLN projections
    (`adaln_modules`, replicated) and everything else."""
    counted: set[int] = set()
    layer_bytes, layer_compute_bytes = [], []
    largest_parameters = 0
    for layer in spec_layers:
        named = _parts_tensors(layer, parts)
        counted.update(id(tensor) for _, tensor in named)
        stored, unquantized = _group_bytes(named, fp8_layers, splits, degree, kv_degree)
        layer_bytes.append(stored)
        layer_compute_bytes.append(unquantized)
        largest_parameters = max(largest_parameters, _parameters(layer, named))
    adaln_stored, largest_stored, largest_unquantized = 0, 0, 0
    for projection in adaln_modules:
        named = _tensors(projection)
        counted.update(id(tensor) for _, tensor in named)
        stored, unquantized = _group_bytes(named, fp8_adaln, {}, 1, 1)
        adaln_stored += stored
        if stored > largest_stored:
            largest_stored, largest_unquantized = stored, unquantized
    other = sum(_plain_bytes(tensor) for _, tensor in _tensors(module) if id(tensor) not in counted)
    return ModelSize(
        layer_bytes=tuple(layer_bytes),
        layer_compute_bytes=tuple(layer_compute_bytes),
        other_bytes=other,
        adaln_bytes=adaln_stored,
        adaln_largest_bytes=largest_stored,
        adaln_largest_compute_bytes=largest_unquantized,
        layer_parameters=largest_parameters,
    )


# ----------------------------------------------------------------------------------------------------------------
# The models


def dit_size(dit: nn.Module, weights: str, share: RankShare) -> ModelSize:
    """A DiT (built on meta in its compute dtype, fp32 islands kept), split as h3engine.memory.layers streams it."""
    spec = dit_layers(dit)
    projections = [block.adaln_proj for block in dit.blocks] + [dit.final_layer.adaln_proj]
    fp8 = weights == "fp8"
    size = _layered_size(
        dit,
        spec.layers,
        spec.streamed_parts,
        fp8,
        _DIT_TP_SPLITS,
        share.dit_tp,
        adaln_modules=projections,
        # A pruned form's projections are not quantized (h3engine.engine.sampling.modulation.offload_adaln).
        fp8_adaln=fp8 and dit.config.adaln_form == "exact",
    )
    return replace(size, dequantized_bytes=_largest_dequantized(dit))


def _largest_dequantized(model: nn.Module) -> int:
    """Bytes of the largest weight a community file stores quantized in `model`, dequantized (0: none)."""
    stored = [module for module in model.modules() if isinstance(module, StoredLinear)]
    return max((m.in_features * m.out_features * m.dtype.itemsize for m in stored), default=0)


def text_encoder_size(encoder: H3TextEncoder, weights: str, share: RankShare) -> ModelSize:
    text_config = encoder.config.text_config
    kv_degree = min(share.encoder_tp, text_config.num_key_value_heads)
    spec = text_encoder_layers(encoder)
    size = _layered_size(
        encoder,
        spec.layers,
        spec.streamed_parts,
        weights == "fp8",
        _ENCODER_TP_SPLITS,
        share.encoder_tp,
        kv_degree=kv_degree,
    )
    return replace(size, dequantized_bytes=_largest_dequantized(encoder))


def _as_loaded(encoder: H3TextEncoder, dtype: torch.dtype) -> H3TextEncoder:
    """The meta-built encoder with every tensor the checkpoint fills in `dtype`, as `read_text_encoder_tensors`
    loads them (a fresh Qwen3-VL builds its vision tower in fp32; the rotary tables, rebuilt at load, keep theirs)."""
    for key, tensor in encoder.state_dict().items():
        owner_name, _, leaf = key.rpartition(".")
        owner = encoder.get_submodule(owner_name)
        if isinstance(owner, StoredLinear) and leaf in StoredLinear.STORED_TENSORS:
            continue  # a community file's quantized linear keeps its bytes and scale
        loaded = torch.empty(tensor.shape, dtype=dtype, device="meta")
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(loaded, requires_grad=False)
        else:
            owner._buffers[leaf] = loaded
    return encoder


def video_vae_size(vae: VideoVAE) -> ModelSize:
    spec = video_decoder_layers(vae)
    # fp32 and replicated: never FP8, never split.
    return _layered_size(vae, spec.layers, spec.streamed_parts, False, {}, 1)


def _text_dims(encoder: H3TextEncoder, processor_folder: Path) -> TextEncoderDims:
    text, vision = encoder.config.text_config, encoder.config.vision_config
    image_pixels = _processor_pixels(
        processor_folder / "preprocessor_config.json", IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS
    )
    video_pixels = _processor_pixels(
        processor_folder / "video_preprocessor_config.json", VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS
    )
    return TextEncoderDims(
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        heads=text.num_attention_heads,
        kv_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        layers=len(encoder.model.language_model.layers),
        vision_hidden=vision.hidden_size,
        vision_intermediate=vision.intermediate_size,
        vision_depth=vision.depth,
        vision_patch=vision.patch_size,
        temporal_patch=vision.temporal_patch_size,
        merge=vision.spatial_merge_size,
        deepstack_levels=len(getattr(vision, "deepstack_visual_indexes", ()) or ()),
        image_min_pixels=image_pixels[0],
        image_max_pixels=image_pixels[1],
        video_min_pixels=video_pixels[0],
        video_max_pixels=video_pixels[1],
    )


def _processor_pixels(path: Path, minimum: int, maximum: int) -> tuple[int, int]:
    """(shortest_edge, longest_edge) pixel bounds of a Qwen processor config; the release's where unreadable (the
    bounds only size the vision tokens of a worst-case request)."""
    try:
        size = json.loads(path.read_text(encoding="utf-8")).get("size", {})
        return int(size.get("shortest_edge", minimum)), int(size.get("longest_edge", maximum))
    except (OSError, ValueError, AttributeError, TypeError):
        return minimum, maximum


def _partition_sizes(
    layout: CheckpointLayout,
    paths: PartitionPaths,
    dtype: torch.dtype,
    weights: str,
    share: RankShare,
    cache: dict[tuple[str, Path], object],
) -> PartitionSizes:
    """One partition; components in a folder already sized (the diffusers layout's shared ones) are reused."""

    def cached(kind: str, folder: Path, make: Callable[[], Any]) -> Any:
        key = (kind, folder)
        if key not in cache:
            cache[key] = make()
        return cache[key]

    dit_source_ = dit_source(layout, paths, dtype)
    with torch.device("meta"):
        dit = dit_size(dit_source_.build(), weights, share)

    def text_side() -> tuple[ModelSize, TextEncoderDims]:
        _, build = text_encoder_skeleton(paths.text_encoder, paths.text_encoder_weights)
        with torch.device("meta"):
            encoder = _as_loaded(build(), dtype)
        return text_encoder_size(encoder, weights, share), _text_dims(encoder, paths.processor)

    def video_side() -> tuple[ModelSize, VideoVAEConfig]:
        source = video_vae_source(layout, paths)
        with torch.device("meta"):
            vae = source.build()
        return video_vae_size(vae), source.config

    def audio_side() -> tuple[ModelSize, AudioVAEConfig]:
        source = audio_vae_source(layout, paths)
        with torch.device("meta"):
            vae = source.build()
        return ModelSize(other_bytes=sum(_plain_bytes(tensor) for _, tensor in _tensors(vae))), source.config

    text_encoder, text_dims = cached("text_encoder", paths.text_encoder_home, text_side)
    video_vae, video_config = cached("video_vae", paths.video_vae_home, video_side)
    audio_vae, audio_config = cached("audio_vae", paths.audio_vae_home, audio_side)
    return PartitionSizes(
        partition=paths.partition,
        dit=dit,
        text_encoder=text_encoder,
        video_vae=video_vae if share.holds_video_vae else ModelSize(),
        audio_vae=audio_vae if share.holds_audio_vae else ModelSize(),
        dit_config=dit_source_.config,
        text_dims=text_dims,
        video_config=video_config,
        audio_config=audio_config,
        shared_with_other=layout.kind == "diffusers",
        dtype_bytes=torch.empty((), dtype=dtype, device="meta").element_size(),
    )


def checkpoint_sizes(
    checkpoint: str | Path | CheckpointLayout,
    weights: str = "bf16",
    share: RankShare | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> CheckpointSizes:
    """Every partition's model sizes (a checkpoint folder or a detected layout), headers and configs only.

    CheckpointError (naming the file) for a missing folder or an invalid config, as loading would raise it."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    share = share or RankShare()
    layout = checkpoint if isinstance(checkpoint, CheckpointLayout) else detect_layout(checkpoint)
    files_weights = stored_weights(layout)
    if files_weights == "fp8":
        weights = (
            "fp8"  # the files hold FP8 values: holding them in bf16 would double the bytes, not the precision
        )
    cache: dict[tuple[str, Path], object] = {}
    partitions = {
        name: _partition_sizes(layout, paths, dtype, weights, share, cache)
        for name, paths in layout.partitions.items()
    }
    return CheckpointSizes(
        root=str(layout.root),
        layout_kind=layout.kind,
        weights=weights,
        share=share,
        canvas=layout.canvas,
        partitions=partitions,
        files_weights=files_weights,
    )


def stored_weights(layout: CheckpointLayout) -> str:
    """What a checkpoint's files store the large linears as: "fp8" for a converted one (h3engine.checkpoint.fp8_files,
    its DiT files read by their headers), else "bf16"."""
    folders = [paths.dit for paths in layout.partitions.values() if paths.dit_weights is None]
    # A partition whose DiT is a community file (`--dit`) says nothing of the folders' format.
    return "fp8" if folders and WeightFiles.open(folders[0]).stores_fp8 else "bf16"


# ----------------------------------------------------------------------------------------------------------------
# Request geometry that needs the models' own code
