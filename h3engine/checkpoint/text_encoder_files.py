"""Writers of a tiny but complete Qwen3-VL text encoder, tokenizer and processor in the released folder shapes.

Contract
- `write_tiny_text_encoder(folder, seed, text_dim)` writes `config.json` (stock Qwen3-VL layout, as transformers
  4.57 writes it for Qwen3-VL-32B) and bf16 weights split into two shards plus `model.safetensors.index.json`.
  The text model has more than 50 layers because H3 reads `hidden_states[50]` (the reference pipeline refuses
  fewer). Weights are random, drawn from `torch.Generator().manual_seed(seed)`; no norm scale or bias is left at
  its identity value, so a test can tell a skipped block from a computed one.
- `write_tiny_tokenizer(folder)` writes a byte-level BPE `Qwen2Tokenizer` trained on a built-in English text, with
  Qwen's added tokens in Qwen's order and H3's `<d>` / `</d>` after them. The token ids that `config.json` names
  (image/video pad, vision start/end) are the ones this tokenizer assigns (`TINY_TOKEN_IDS`).
- `write_tiny_processor(folder)` writes the contents of a `processor/` folder: the Qwen2-VL image processor and
  Qwen3-VL video processor settings (patch 16, merge 2, temporal patch 2, stock Qwen3-VL pixel limits), the
  processor config as transformers 5 saves it, a chat template and the tokenizer files.
- Each writer writes into the folder it is given (the caller picks `text_encoder/`, `tokenizer/`, `processor/`).
- Every writer is byte-deterministic: the same arguments give the same bytes.

Danger
- `TINY_TOKEN_IDS` ties the config to the tokenizer; changing the training text or the added-token list changes
  both, and the tokenizer builder refuses a vocabulary of an unexpected size or ids out of place.
- Nothing here downloads anything; the tokenizer is trained locally from `_TOKENIZER_TRAINING_TEXT`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2TokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

# Byte-level BPE: the 256 byte symbols plus the merges learned from the training text.
TINY_BASE_VOCAB_SIZE = 320

# Qwen2/Qwen3 added tokens in Qwen's id order (stock ids 151643..151668), with their `special` flag.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
# H3's dialogue markers. The release calls them special tokens; their exact flags are not public.
H3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (("<d>", True), ("</d>", True))

TINY_TOKEN_IDS: dict[str, int] = {
    token: TINY_BASE_VOCAB_SIZE + position
    for position, (token, _) in enumerate(QWEN_ADDED_TOKENS + H3_ADDED_TOKENS)
}
# Like the stock 151,936, the embedding table is padded past the tokenizer's last id, to a multiple of 128.
TINY_TEXT_VOCAB_SIZE = 128 * math.ceil((TINY_BASE_VOCAB_SIZE + len(TINY_TOKEN_IDS)) / 128)

TINY_TEXT_NUM_LAYERS = 52  # two layers past H3's 50, so that skipping "layers >= 50" is exercised
TINY_TEXT_NUM_HEADS = 2
TINY_TEXT_NUM_KV_HEADS = 1
TINY_TEXT_HEAD_DIM = 8  # heads x head_dim (16) differs from the hidden size (8) on purpose
TINY_TEXT_MROPE_SECTION = (2, 1, 1)  # (t, h, w) frequency counts; sums to head_dim / 2
# Far below the stock 5,000,000 so that the rotary positions (and Qwen's mRoPE layout) visibly move the output.
TINY_TEXT_ROPE_THETA = 10000
TINY_VISION_DEPTH = 2
TINY_VISION_HIDDEN_SIZE = 16
TINY_VISION_NUM_HEADS = 2
TINY_VISION_POSITION_EMBEDDINGS = 16  # a 4 x 4 learned grid, resampled per image like the stock 48 x 48
TINY_VISION_DEEPSTACK_INDEXES = (0, 1)

SHARD_FILE_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
WEIGHTS_INDEX_FILE_NAME = "model.safetensors.index.json"

# Stock Qwen3-VL processor pixel limits (images: 256^2 .. 4096^2 pixels; videos: per-clip budget).
IMAGE_MIN_PIXELS = 65536
IMAGE_MAX_PIXELS = 16777216
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824

_TOKENIZER_TRAINING_TEXT = (
    "A red fox runs across the snowy field at dawn while the camera slowly pans to the left.",
    "Waves crash on the dark rocks; seagulls call above the harbor as soft piano music fades in.",
    "The old fisherman looks up and says: [English] Good morning! The sea is calm today.",
    "A girl in a yellow raincoat laughs, then answers [English] Let's go home, it is 7 o'clock.",
    "Close-up of hands kneading bread on a wooden table, flour drifting in warm window light.",
    "A city street at night, neon signs reflected in puddles, cars passing with a low hum.",
    "Drone shot over green hills and a winding river; birds sing and wind rustles the grass.",
    "He whispers [English] Quiet, the baby is sleeping. and closes the door gently.",
)


def tiny_text_encoder_config(text_dim: int = 8) -> dict:
    """The tiny `config.json` dict, in the stock Qwen3-VL layout, whose text hidden size is `text_dim`."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": TINY_TOKEN_IDS["<|image_pad|>"],
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": TINY_TOKEN_IDS["<|endoftext|>"],
            "dtype": "bfloat16",
            "eos_token_id": TINY_TOKEN_IDS["<|im_end|>"],
            "head_dim": TINY_TEXT_HEAD_DIM,
            "hidden_act": "silu",
            "hidden_size": text_dim,
            "initializer_range": 0.02,
            "intermediate_size": 2 * text_dim,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": TINY_TEXT_NUM_HEADS,
            "num_hidden_layers": TINY_TEXT_NUM_LAYERS,
            "num_key_value_heads": TINY_TEXT_NUM_KV_HEADS,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": list(TINY_TEXT_MROPE_SECTION),
                "rope_type": "default",
            },
            "rope_theta": TINY_TEXT_ROPE_THETA,
            "use_cache": True,
            "vocab_size": TINY_TEXT_VOCAB_SIZE,
        },
        "tie_word_embeddings": False,
        "video_token_id": TINY_TOKEN_IDS["<|video_pad|>"],
        "vision_config": {
            "deepstack_visual_indexes": list(TINY_VISION_DEEPSTACK_INDEXES),
            "depth": TINY_VISION_DEPTH,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": TINY_VISION_HIDDEN_SIZE,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 2 * TINY_VISION_HIDDEN_SIZE,
            "model_type": "qwen3_vl",
            "num_heads": TINY_VISION_NUM_HEADS,
            "num_position_embeddings": TINY_VISION_POSITION_EMBEDDINGS,
            "out_hidden_size": text_dim,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": TINY_TOKEN_IDS["<|vision_end|>"],
        "vision_start_token_id": TINY_TOKEN_IDS["<|vision_start|>"],
    }


def random_text_encoder_state(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 weights for every key of the full Qwen3-VL checkpoint (all layers, final norm, lm_head)."""
    with torch.device("meta"):
        full_model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(config))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    # Drawn in the model's own key order, so the same seed always gives the same tensor to the same key.
    for key, meta_tensor in full_model.state_dict().items():
        shape = tuple(meta_tensor.shape)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        state[key] = _scale_noise_for(key, shape, noise).to(torch.bfloat16)
    return state


def _scale_noise_for(key: str, shape: tuple[int, ...], noise: torch.Tensor) -> torch.Tensor:
    # Norm scales sit near 1 and biases near 0 but never exactly there; matrices are scaled by 1/sqrt(fan_in) so
    # the 52-layer residual stream stays O(1..10) and bf16 keeps its precision.
    if "norm" in key and key.endswith(".weight"):
        return 1.0 + 0.1 * noise
    if key.endswith(".bias"):
        return 0.1 * noise
    if key.endswith("embed_tokens.weight") or key.endswith("pos_embed.weight"):
        return 0.5 * noise
    return noise / math.sqrt(math.prod(shape[1:]))


def write_tiny_text_encoder(folder: Path, seed: int, text_dim: int = 8) -> None:
    """Write `config.json`, two bf16 shards and `model.safetensors.index.json` of the tiny Qwen3-VL."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_text_encoder_config(text_dim)
    _write_json(folder / "config.json", config)
    state = random_text_encoder_state(config, seed)

    # Split in model order at half of the bytes, as transformers shards by size: the vision tower and the embeddings
    # fill the first shard; the decoder layers (the unused ones >= 50 too), final norm and lm_head the second. Both
    # shards hold keys H3 needs.
    total_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    shards: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    bytes_before = 0
    for key, tensor in state.items():
        shards[0 if bytes_before < total_bytes // 2 else 1][key] = tensor
        bytes_before += tensor.numel() * tensor.element_size()
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(SHARD_FILE_NAMES, shards, strict=True):
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(folder / WEIGHTS_INDEX_FILE_NAME, index)


def build_tiny_tokenizer() -> Qwen2TokenizerFast:
    """The tiny Qwen2 tokenizer, trained in memory on the built-in text; ids as in `TINY_TOKEN_IDS`."""
    # Qwen2's own normalizer and pre-tokenizer, so the learned merges are the ones Qwen2Tokenizer will apply.
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.NFC()
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_BASE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    trainer_tokenizer.train_from_iterator(_TOKENIZER_TRAINING_TEXT, trainer=trainer)
    trained_model = json.loads(trainer_tokenizer.to_str())["model"]
    if len(trained_model["vocab"]) != TINY_BASE_VOCAB_SIZE:
        raise RuntimeError(
            f"the tiny BPE vocabulary has {len(trained_model['vocab'])} entries, expected {TINY_BASE_VOCAB_SIZE}"
        )

    # The constructor registers `<|endoftext|>` (as pad and eos) first, so it takes the first added id as in Qwen;
    # the rest are added one at a time to keep Qwen's order. eos then becomes `<|im_end|>`, as in Qwen3-VL.
    tokenizer = Qwen2TokenizerFast(
        vocab=trained_model["vocab"],
        merges=[tuple(merge) for merge in trained_model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=262144,
    )
    for token, is_special in QWEN_ADDED_TOKENS[1:] + H3_ADDED_TOKENS:
        tokenizer.add_tokens(
            [AddedToken(token, special=is_special, normalized=False)], special_tokens=is_special
        )
    tokenizer.eos_token = "<|im_end|>"
    for token, expected_id in TINY_TOKEN_IDS.items():
        if tokenizer.convert_tokens_to_ids(token) != expected_id:
            raise RuntimeError(f"the tiny tokenizer gave {token} id {tokenizer.convert_tokens_to_ids(token)}")
    return tokenizer


def write_tiny_tokenizer(folder: Path) -> None:
    """Write the tiny tokenizer's files (`tokenizer.json`, `tokenizer_config.json`) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(str(folder))


def tiny_image_processor_settings() -> dict:
    """Qwen2-VL image processor settings of the Qwen3-VL release, as transformers saves them."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": 16,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": IMAGE_MAX_PIXELS, "shortest_edge": IMAGE_MIN_PIXELS},
        "temporal_patch_size": 2,
    }


def tiny_video_processor_settings() -> dict:
    """Qwen3-VL video processor settings of the Qwen3-VL release (H3 samples its own frames and turns sampling off)."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": True,
        "fps": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_frames": 768,
        "merge_size": 2,
        "min_frames": 4,
        "patch_size": 16,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "return_metadata": False,
        "size": {"longest_edge": VIDEO_MAX_PIXELS, "shortest_edge": VIDEO_MIN_PIXELS},
        "temporal_patch_size": 2,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }


# A plain ChatML template with Qwen's vision blocks. H3 never applies a chat template; this only completes the folder.
_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- else -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def write_tiny_processor(folder: Path) -> None:
    """Write a `processor/` folder: image/video processor configs, processor config, chat template, tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    image_settings = tiny_image_processor_settings()
    video_settings = tiny_video_processor_settings()
    # The per-processor files of a Qwen3-VL release and the nested processor_config.json that transformers 5
    # writes carry the same values, so it does not matter which of them a loader prefers.
    _write_json(
        folder / "preprocessor_config.json", {**image_settings, "processor_class": "Qwen3VLProcessor"}
    )
    _write_json(
        folder / "video_preprocessor_config.json", {**video_settings, "processor_class": "Qwen3VLProcessor"}
    )
    _write_json(
        folder / "processor_config.json",
        {
            "image_processor": image_settings,
            "processor_class": "Qwen3VLProcessor",
            "video_processor": video_settings,
        },
    )
    (folder / "chat_template.jinja").write_text(_CHAT_TEMPLATE, encoding="utf-8")
    write_tiny_tokenizer(folder)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
