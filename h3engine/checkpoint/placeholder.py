"""Placeholder checkpoints: the released folder layout and configs with weights drawn at load, not stored.

`make_placeholder_checkpoint(folder, seed)` writes the native layout at the released shapes (or the tiny ones), each
weight file a header whose data is a hole (h3engine.checkpoint.safetensors_io.write_placeholder_file): about 1 MB on
disk for the 120 GB a release holds. Every check passes and every loader works unchanged; the values are drawn per
key as they are read, on the host as a file's tensor arrives. Outputs are noise: this is for measuring the engine's
own processes at the released size (worker groups, split stages, the app) where the weights are not at hand. The
text side keeps the released encoder shapes with the tiny tokenizer and processor (their special ids go into the
encoder config). Loading one says so: a warning, `is_placeholder(folder)`, and `"weights": "placeholder"` in sidecars.
`real_bytes` names components (PLACEHOLDER_COMPONENTS) whose files hold those same drawn values as real bytes, written
a tensor at a time, so that reading their layers from the files measures the disk (the second partition's copies of the
text encoder and VAEs are hard links to the first's where the file system allows). `weights` a GGUF type (or `int8` /
`fp8_scaled`: h3engine.checkpoint.single_file_placeholder) writes each DiT as a GGUF (ComfyUI single safetensors)
file whose data is a hole (zeros), listed in gguf_files.json as a converted folder lists its files:
    python -m h3engine make-placeholder-checkpoint DIR [--seed 0] [--tiny] [--real-bytes dit,...] [--weights q4_k]
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from h3engine.checkpoint import dit_keys
from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.fp8_files import (
    SCALE_SUFFIX,
    dit_quantized_key,
    text_encoder_quantized_key,
    text_encoder_unused_key,
)
from h3engine.checkpoint.fp8_rows import FP8_DTYPE, quantize_rows
from h3engine.checkpoint.gguf_convert import gguf_file_name
from h3engine.checkpoint.gguf_files import DIFFUSION_MODEL_PREFIX
from h3engine.checkpoint.gguf_write import write_gguf_placeholder
from h3engine.checkpoint.layout import (
    DIT_FILES_JSON,
    GGUF_KINDS,
    NATIVE_PARTITION_FOLDERS,
    require_empty_folder,
)
from h3engine.checkpoint.safetensors_io import (
    PLACEHOLDER_DRAWN,
    PLACEHOLDER_VALUES_KEY,
    TensorInfo,
    WeightFiles,
    placeholder_values,
    write_placeholder_file,
    write_tensor_file,
)
from h3engine.checkpoint.single_file_placeholder import (
    SINGLE_FILE_WEIGHTS,
    single_file_name,
    write_single_file_placeholder,
)
from h3engine.checkpoint.text_encoder_files import (
    TINY_TOKEN_IDS,
    tiny_text_encoder_config,
    write_tiny_processor,
    write_tiny_tokenizer,
)
from h3engine.checkpoint.tiny import (
    TINY_CANVAS,
    NativeWeightWriters,
    component_seed,
    write_json,
    write_native_tree,
)
from h3engine.models.audio_vae import AudioVAE, AudioVAEConfig
from h3engine.models.dit_config import DiTConfig
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]

# The components whose weight files `real_bytes` may write as real bytes.
PLACEHOLDER_COMPONENTS = ("dit", "text_encoder", "video_vae", "audio_vae")

# Qwen3-VL-32B as H3 ships it (docs/MODEL.md §4.1): 64 decoder layers of which H3TextEncoder keeps 50, plus the
# vision tower (unused by T2VA but held in memory like the engine holds it).
RELEASED_TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]},
        "attention_bias": False,
        "dtype": "bfloat16",
    },
    "vision_config": {
        "model_type": "qwen3_vl",
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 5120,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
    },
}

# `--weights` of a placeholder whose DiTs are GGUF files (the types `convert --weights` writes).
GGUF_WEIGHTS = GGUF_KINDS
# The published pruned form's table (`--pruned-adaln`): 1,025 rows of the 8-wide curve.
PRUNED_RANK, PRUNED_TABLE_ROWS = 8, 1025


def placeholder_text_encoder_config(tiny: bool, text_dim: int) -> dict[str, Any]:
    """The encoder config a placeholder carries: the released shapes (or the tiny ones), and the tiny tokenizer's
    special ids, which is the tokenizer it ships."""
    if tiny:
        return tiny_text_encoder_config(text_dim)
    config = json.loads(json.dumps(RELEASED_TEXT_ENCODER_CONFIG))
    for field, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        config[field] = TINY_TOKEN_IDS[token]
    return config


def _module_shapes(module: torch.nn.Module) -> Shapes:
    return {key: (tuple(tensor.shape), tensor.dtype) for key, tensor in module.state_dict().items()}


def parse_components(text: str | None) -> tuple[str, ...]:
    """ "dit,text_encoder" -> the names, in PLACEHOLDER_COMPONENTS' order; ValueError naming any other name."""
    names = {name.strip() for name in (text or "").split(",") if name.strip()}
    unknown = sorted(names - set(PLACEHOLDER_COMPONENTS))
    if unknown:
        raise ValueError(
            f"unknown component {', '.join(unknown)} (expected some of {', '.join(PLACEHOLDER_COMPONENTS)})"
        )
    return tuple(name for name in PLACEHOLDER_COMPONENTS if name in names)


class _WeightWriter:
    """Writes one placeholder weight file: a header and a hole, or (a real-bytes component) the drawn values, one
    tensor in memory at a time; a real-bytes file written before with the same seed (the other partition's identical
    copy) is hard-linked, not written again. With `weights` "fp8" the DiT's and the text encoder's large linears are
    stored as a converted checkpoint stores them (h3engine.checkpoint.fp8_files): e4m3 values and row scales, the
    quantized form of the bf16 placeholder's values."""

    def __init__(self, real_bytes: tuple[str, ...], weights: str = "bf16") -> None:
        self.real_bytes = real_bytes
        self.weights = weights
        self.written: dict[tuple[str, int], Path] = {}

    def _fp8_shapes(self, component: str, shapes: Shapes) -> Shapes:
        stored: Shapes = {}
        for key, (shape, dtype) in shapes.items():
            quantized = (
                dit_quantized_key(key)
                if component == "dit"
                else text_encoder_quantized_key(key, tuple(shape))
            )
            if quantized:
                stored[key] = (shape, FP8_DTYPE)
                stored[key + SCALE_SUFFIX] = ((shape[0], 1), torch.float32)
            elif not (component == "text_encoder" and text_encoder_unused_key(key)):
                stored[key] = (shape, dtype)
        return stored

    def __call__(self, component: str, path: Path, shapes: Shapes, seed: int) -> None:
        drawn = shapes
        if self.weights == "fp8" and component in ("dit", "text_encoder"):
            shapes = self._fp8_shapes(component, shapes)
        if component not in self.real_bytes:
            write_placeholder_file(path, shapes, seed)
            return
        earlier = self.written.get((component, seed))
        if earlier is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(earlier, path)
                return
            except OSError:
                pass  # no hard links here: written again
        specs = [(key, tuple(shape), dtype) for key, (shape, dtype) in shapes.items()]

        quantized: dict[str, torch.Tensor] = {}

        def values(key: str) -> torch.Tensor:
            shape, dtype = shapes[key]
            if dtype == FP8_DTYPE or key.removesuffix(SCALE_SUFFIX) in quantized:
                # As the hole file's reader gives them: the quantized rows of the bf16 draw (scales right after).
                if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in quantized:
                    return quantized.pop(key.removesuffix(SCALE_SUFFIX))
                bf16_shape, _ = drawn[key]
                info = TensorInfo(path, torch.bfloat16, tuple(bf16_shape), placeholder_seed=seed)
                fp8_values, quantized[key] = quantize_rows(placeholder_values(key, info))
                return fp8_values
            # Exactly what the hole file's reader draws (the same seed, key, shape and dtype).
            return placeholder_values(key, TensorInfo(path, dtype, tuple(shape), placeholder_seed=seed))

        # No seed in the metadata: the engine reads the bytes (as stored) and still knows they are a placeholder's.
        write_tensor_file(path, specs, values, {PLACEHOLDER_VALUES_KEY: PLACEHOLDER_DRAWN})
        self.written[(component, seed)] = path


def make_placeholder_checkpoint(
    folder: str | Path,
    seed: int = 0,
    tiny: bool = False,
    real_bytes: Iterable[str] = (),
    weights: str = "bf16",
    partitions: Iterable[str] | None = None,
    pruned_adaln: bool = False,
) -> Path:
    """Write a native placeholder checkpoint (both partitions, or those `partitions` names) into an empty or missing
    `folder`; the components named in `real_bytes` get files holding their drawn values (ValueError for a name not
    in PLACEHOLDER_COMPONENTS); `weights` "fp8": the large linears stored as a converted checkpoint stores them; a
    GGUF type (GGUF_WEIGHTS): each DiT a GGUF file of that type whose data is a hole (zeros), listed in the folder's
    gguf_files.json as `convert --weights q4_k` lists its files; "int8" / "fp8_scaled" / "nvfp4"
    (SINGLE_FILE_WEIGHTS): the same with a ComfyUI single safetensors file (the header `convert --weights int8`
    writes); `pruned_adaln`: the DiTs in the published pruned form (an `adaln_t_table` of PRUNED_TABLE_ROWS x
    PRUNED_RANK)."""
    folder = Path(folder)
    if weights not in ("bf16", "fp8", *GGUF_WEIGHTS, *SINGLE_FILE_WEIGHTS):
        choices = ", ".join(("bf16", "fp8", *GGUF_WEIGHTS, *SINGLE_FILE_WEIGHTS))
        raise ValueError(f"weights must be one of {choices}; got {weights!r}")
    write = _WeightWriter(parse_components(",".join(real_bytes)), weights if weights == "fp8" else "bf16")
    require_empty_folder(folder)
    if tiny:
        configs = (DiTConfig.tiny(), VideoVAEConfig.tiny(), AudioVAEConfig.tiny())
    else:
        configs = (DiTConfig.released(), VideoVAEConfig.released(), AudioVAEConfig.released())
    if pruned_adaln:
        pruned = dataclasses.replace(configs[0], adaln_rank=PRUNED_RANK, adaln_table_rows=PRUNED_TABLE_ROWS)
        configs = (pruned, *configs[1:])
    gguf_files: dict[str, str] = {}

    def dit(partition: str, config: DiTConfig, transformer: Path) -> None:
        shapes = {
            key: (shape, dit_keys.native_storage_dtype(key))
            for key, shape in dit_keys.native_state_shapes(config).items()
        }
        if weights in GGUF_WEIGHTS:
            gguf_files[partition] = gguf_file_name(partition, weights)
            tensors = {DIFFUSION_MODEL_PREFIX + k: shape for k, (shape, _) in shapes.items() if k != ROPE_KEY}
            write_gguf_placeholder(folder / gguf_files[partition], tensors, weights.upper())
            return
        if weights in SINGLE_FILE_WEIGHTS:
            gguf_files[partition] = single_file_name(partition, weights)
            write_single_file_placeholder(folder / gguf_files[partition], config, weights)
            return
        write("dit", transformer / "model.safetensors", shapes, component_seed(seed, partition))

    def video_vae(config: VideoVAEConfig, path: Path) -> None:
        with torch.device("meta"):
            shapes = _module_shapes(VideoVAE(config))
        write("video_vae", path, shapes, component_seed(seed, "video_vae"))

    def audio_vae(config: AudioVAEConfig, path: Path) -> None:
        with torch.device("meta"):
            shapes = _module_shapes(AudioVAE(config))
        write("audio_vae", path, shapes, component_seed(seed, "audio_vae"))

    def text_side(partition_folder: Path, text_dim: int) -> None:
        config = placeholder_text_encoder_config(tiny, text_dim)
        write_json(partition_folder / "text_encoder" / "config.json", config)
        with torch.device("meta"):
            full_model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(config))
        shapes = {key: (shape, torch.bfloat16) for key, (shape, _) in _module_shapes(full_model).items()}
        path = partition_folder / "text_encoder" / "model.safetensors"
        write("text_encoder", path, shapes, component_seed(seed, "text_encoder"))
        write_tiny_tokenizer(partition_folder / "tokenizer")
        write_tiny_processor(partition_folder / "processor")

    writers = NativeWeightWriters(dit=dit, video_vae=video_vae, audio_vae=audio_vae, text_side=text_side)
    folder.mkdir(parents=True, exist_ok=True)
    write_native_tree(folder, configs, TINY_CANVAS if tiny else {}, writers, partitions=partitions)
    if gguf_files:
        write_json(folder / DIT_FILES_JSON, gguf_files)
    return folder


def is_placeholder(root: Path) -> bool:
    """Whether a native checkpoint folder's DiT weights are placeholders (values drawn at load, outputs noise)."""
    transformer = Path(root) / next(iter(NATIVE_PARTITION_FOLDERS.values())) / "transformer"
    try:
        return WeightFiles.open(transformer).placeholder
    except Exception:
        return False
