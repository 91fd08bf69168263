"""Placeholder checkpoints: the released folder layout and configs with weights drawn at load, not stored.

`make_placeholder_checkpoint(folder, seed)` writes the native layout at the released shapes (or the tiny ones), each
weight file a header whose data is a hole (h3engine.checkpoint.safetensors_io.write_placeholder_file): about 1 MB on
disk for the 120 GB a release holds. Every check passes and every loader works unchanged; the values are drawn per
key as they are read, on the host as a file's tensor arrives. Outputs are noise: this is for measuring the engine's
own processes at the released size (worker groups, split stages, the app) where the weights are not at hand. The
text side keeps the released encoder shapes with the tiny tokenizer and processor (their special ids go into the
encoder config). Loading one says so: a warning, `is_placeholder(folder)`, and `"weights": "placeholder"` in sidecars.

    python -m h3engine make-placeholder-checkpoint /tmp/h3-placeholder [--seed 0] [--tiny]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from h3engine.checkpoint import dit_keys
from h3engine.checkpoint.layout import NATIVE_PARTITION_FOLDERS, require_empty_folder
from h3engine.checkpoint.safetensors_io import WeightFiles, write_placeholder_file
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
from h3engine.models.dit import DiTConfig
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]

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


def make_placeholder_checkpoint(folder: str | Path, seed: int = 0, tiny: bool = False) -> Path:
    """Write a native placeholder checkpoint (both partitions) into an empty or missing `folder`."""
    folder = Path(folder)
    require_empty_folder(folder)
    if tiny:
        configs = (DiTConfig.tiny(), VideoVAEConfig.tiny(), AudioVAEConfig.tiny())
    else:
        configs = (DiTConfig.released(), VideoVAEConfig.released(), AudioVAEConfig.released())

    def dit(partition: str, config: DiTConfig, transformer: Path) -> None:
        shapes = {
            key: (shape, dit_keys.native_storage_dtype(key))
            for key, shape in dit_keys.native_state_shapes(config).items()
        }
        write_placeholder_file(transformer / "model.safetensors", shapes, component_seed(seed, partition))

    def video_vae(config: VideoVAEConfig, path: Path) -> None:
        with torch.device("meta"):
            shapes = _module_shapes(VideoVAE(config))
        write_placeholder_file(path, shapes, component_seed(seed, "video_vae"))

    def audio_vae(config: AudioVAEConfig, path: Path) -> None:
        with torch.device("meta"):
            shapes = _module_shapes(AudioVAE(config))
        write_placeholder_file(path, shapes, component_seed(seed, "audio_vae"))

    def text_side(partition_folder: Path, text_dim: int) -> None:
        config = placeholder_text_encoder_config(tiny, text_dim)
        write_json(partition_folder / "text_encoder" / "config.json", config)
        with torch.device("meta"):
            full_model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(config))
        shapes = {key: (shape, torch.bfloat16) for key, (shape, _) in _module_shapes(full_model).items()}
        path = partition_folder / "text_encoder" / "model.safetensors"
        write_placeholder_file(path, shapes, component_seed(seed, "text_encoder"))
        write_tiny_tokenizer(partition_folder / "tokenizer")
        write_tiny_processor(partition_folder / "processor")

    writers = NativeWeightWriters(dit=dit, video_vae=video_vae, audio_vae=audio_vae, text_side=text_side)
    folder.mkdir(parents=True, exist_ok=True)
    write_native_tree(folder, configs, TINY_CANVAS if tiny else {}, writers)
    return folder


def is_placeholder(root: Path) -> bool:
    """Whether a native checkpoint folder's DiT weights are placeholders (values drawn at load, outputs noise)."""
    transformer = Path(root) / next(iter(NATIVE_PARTITION_FOLDERS.values())) / "transformer"
    try:
        return WeightFiles.open(transformer).placeholder
    except Exception:
        return False
