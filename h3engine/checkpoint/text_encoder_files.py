"""The text side's files: reading a stock Qwen3-VL `text_encoder/` folder and H3's tokenizer, and writing tiny ones.

Reading: `open_text_encoder_files` reads `config.json` (refusing a stack of 50 layers or fewer: H3 reads the
un-normed output of layer 50) and opens the weights (`model.safetensors` or an index and its shards) by their
headers; `check_text_encoder_files` and `read_text_encoder_tensors` check and fill an `H3TextEncoder` strictly (a
missing, misshapen or unknown key, a missing or truncated shard, a non-float tensor raise CheckpointError naming the
file and the key; layers >= 50, the final norm and `lm_head` may be present and are never read). `load_tokenizer`
loads a local tokenizer folder and checks that it carries H3's tokens.

Tiny writers (byte-deterministic; nothing is downloaded): `write_tiny_text_encoder(folder, seed, text_dim)` writes a
52-layer bf16 Qwen3-VL in two shards with no norm or bias at its identity value; `write_tiny_tokenizer(folder)` a
byte-level BPE `Qwen2Tokenizer` trained on a built-in text with Qwen's added tokens, then H3's `<d>` / `</d>`;
`write_tiny_processor(folder)` a `processor/` folder. `TINY_TOKEN_IDS` ties the tiny config to the tokenizer:
changing the training text or the added tokens changes both (the builder refuses ids out of place).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2TokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

from h3engine.checkpoint.component_files import (
    TEXT_ENCODER_PREFIXES,
    open_component_file,
    text_encoder_key,
)
from h3engine.checkpoint.safetensors_io import DeferredReads, WeightFiles, parked, placed, row_extents
from h3engine.checkpoint.text_encoder_gguf import open_gguf_text_encoder
from h3engine.errors import CheckpointError
from h3engine.models.stored_linear import StoredLinear
from h3engine.models.text_encoder import (
    H3_DIALOGUE_TOKENS,
    H3_TEXT_ENCODER_LAYERS,
    QWEN_VISION_BLOCK_TOKENS,
    H3TextEncoder,
)

CONFIG_FILE_NAME = "config.json"
SINGLE_WEIGHTS_FILE_NAME = "model.safetensors"
WEIGHTS_INDEX_FILE_NAME = "model.safetensors.index.json"
# Keys of a full checkpoint that H3 never reads, besides those of the decoder layers >= 50.
_UNUSED_TOP_KEYS = {"model.language_model.norm.weight", "lm_head.weight"}

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

# Stock Qwen3-VL processor pixel limits (images: 256^2 .. 4096^2 pixels; videos: per-clip budget).
IMAGE_MIN_PIXELS = 65536
IMAGE_MAX_PIXELS = 16777216
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824


# ---------------------------------------------------------------------------------------------------- reading


def open_text_encoder_files(
    folder: Path, weights: Path | None = None, keep_quantized: bool = False
) -> tuple[Qwen3VLConfig, WeightFiles]:
    """The stock Qwen3-VL config of a `text_encoder/` folder and its weight files (headers only); `weights`: a single
    file (`--text-encoder`, h3engine.checkpoint.component_files) replacing the folder's weights, its quantized linears
    kept so with `keep_quantized` (their `stored_forms` for `store_linears`), else dequantized when read."""
    folder = Path(folder)
    config = _read_qwen3_vl_config(folder / CONFIG_FILE_NAME)
    if weights is None:
        return config, WeightFiles.open(_weights_path(folder))
    with torch.device("meta"):
        encoder = H3TextEncoder(config)
    linears = {f"{name}.weight" for name, module in encoder.named_modules() if type(module) is nn.Linear}
    if Path(weights).suffix == ".gguf":
        expected = {key: tuple(tensor.shape) for key, tensor in encoder.state_dict().items()}
        return config, open_gguf_text_encoder(
            Path(weights),
            expected,
            config.text_config,
            config.vision_config,
            keep_quantized=linears if keep_quantized else (),
        )
    return config, open_component_file(
        Path(weights),
        "text encoder",
        encoder.state_dict(),
        TEXT_ENCODER_PREFIXES,
        text_encoder_key,
        keep_quantized=linears if keep_quantized else (),
    )


def _read_qwen3_vl_config(config_path: Path) -> Qwen3VLConfig:
    if not config_path.is_file():
        raise CheckpointError(f"missing text encoder config: {config_path}")
    try:
        raw_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {config_path}: {error}") from error
    if not isinstance(raw_config, dict) or raw_config.get("model_type") != "qwen3_vl":
        found = raw_config.get("model_type") if isinstance(raw_config, dict) else type(raw_config).__name__
        raise CheckpointError(f"{config_path}: key model_type is {found!r}, expected 'qwen3_vl'")
    try:
        config = Qwen3VLConfig.from_dict(raw_config)
    except Exception as error:  # transformers validates the fields with several error types
        raise CheckpointError(f"{config_path}: not a valid Qwen3-VL config: {error}") from error
    total_layers = config.text_config.num_hidden_layers
    if total_layers <= H3_TEXT_ENCODER_LAYERS:
        # A stack of exactly 50 layers would only give the post-norm state, which is not what H3 was trained on.
        raise CheckpointError(
            f"{config_path}: key text_config.num_hidden_layers is {total_layers}; H3 reads the un-normed output of "
            f"decoder layer {H3_TEXT_ENCODER_LAYERS}, so the checkpoint needs more than {H3_TEXT_ENCODER_LAYERS}"
        )
    return config


def _weights_path(folder: Path) -> Path:
    for name in (WEIGHTS_INDEX_FILE_NAME, SINGLE_WEIGHTS_FILE_NAME):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder} has neither {WEIGHTS_INDEX_FILE_NAME} nor {SINGLE_WEIGHTS_FILE_NAME}")


def check_text_encoder_files(encoder: H3TextEncoder, weight_files: WeightFiles) -> dict[str, tuple[int, ...]]:
    """Check that the files hold every tensor `encoder` (built, on meta) needs at its full shape and nothing
    unknown; returns those shapes by key."""
    needed_shapes = {key: tuple(tensor.shape) for key, tensor in encoder.state_dict().items()}
    weight_files.check(needed_shapes, ignored=_unused_checkpoint_keys(encoder))
    return needed_shapes


def _unused_checkpoint_keys(encoder: H3TextEncoder) -> set[str]:
    """Keys a full checkpoint carries that H3 never needs: layers >= 50, the final norm and lm_head."""
    # A StoredLinear's bytes stand for its weight (a layer H3 does not build is never kept quantized).
    layer_suffixes = [
        name.removeprefix("language_model.layers.0.").replace(".quantized", ".weight")
        for name in encoder.model.state_dict()
        if name.startswith("language_model.layers.0.") and not name.endswith(".scale")
    ]
    unused = set(_UNUSED_TOP_KEYS)
    for layer_index in range(H3_TEXT_ENCODER_LAYERS, encoder.checkpoint_num_hidden_layers):
        unused.update(f"model.language_model.layers.{layer_index}.{suffix}" for suffix in layer_suffixes)
    return unused


def require_float_tensor(weight_files: WeightFiles, key: str) -> None:
    info = weight_files.infos[key]
    if not info.dtype.is_floating_point:
        raise CheckpointError(f"{info.file}: key {key} is stored as {info.dtype}, not a float")


def read_text_encoder_tensors(
    encoder: H3TextEncoder,
    weight_files: WeightFiles,
    keys: Iterable[str],
    device: torch.device,
    dtype: torch.dtype,
    deferred: DeferredReads | None = None,
) -> None:
    """Read the tensors `keys` whole, cast to `dtype` on `device`, into `encoder`'s parameters and buffers; the ones
    `deferred` wants get a parked tensor and a reader instead."""
    for key in sorted(keys):
        owner_name, _, leaf_name = key.rpartition(".")
        owner = encoder.get_submodule(owner_name)
        # A StoredLinear's bytes and scale keep their own dtypes (h3engine.models.stored_linear).
        stored = isinstance(owner, StoredLinear) and leaf_name in StoredLinear.STORED_TENSORS
        if not stored:
            require_float_tensor(weight_files, key)
        key_dtype = getattr(owner, leaf_name).dtype if stored else dtype
        if (
            stored
        ):  # it computes in the dtype the rest of the encoder is read in (it was built in the config's)
            owner.dtype = dtype
        if deferred is not None and deferred.wants(key):
            shape = getattr(owner, leaf_name).shape
            tensor = parked(shape, key_dtype)
            deferred.add(
                key,
                partial(_read_whole, weight_files, key, key_dtype),
                row_extents(weight_files.infos[key], key_dtype),
                _fp8_reads(weight_files, key),
            )
        else:
            tensor = placed(weight_files.tensor(key), device, key_dtype)
        if leaf_name in owner._parameters:
            setattr(owner, leaf_name, nn.Parameter(tensor, requires_grad=False))
        else:
            owner._buffers[leaf_name] = tensor


def _fp8_reads(weight_files: WeightFiles, key: str) -> tuple | None:
    """A weight the files store in FP8: (its raw reader, the extents of its values and of its row scales)."""
    if key not in weight_files.scales:
        return None
    info, scale_info = weight_files.infos[key], weight_files.scales[key]
    return (
        partial(weight_files.fp8, key),
        row_extents(info, info.dtype),
        row_extents(scale_info, scale_info.dtype),
    )


def _read_whole(weight_files: WeightFiles, key: str, dtype: torch.dtype) -> torch.Tensor:
    return placed(weight_files.tensor(key), "cpu", dtype)


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """Load H3's tokenizer from a local folder only (never the hub) and check it carries H3's tokens."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"missing tokenizer folder: {folder}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers raises several error types for unreadable tokenizer folders
        raise CheckpointError(f"cannot load the tokenizer in {folder}: {error}") from error
    vocabulary = tokenizer.get_vocab()
    for token in QWEN_VISION_BLOCK_TOKENS + H3_DIALOGUE_TOKENS:
        if token not in vocabulary:
            raise CheckpointError(f"{folder}: the tokenizer has no token {token}; H3 needs its own tokenizer")
    return tokenizer


# ---------------------------------------------------------------------------------------------------- tiny writers

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


# The settings the Qwen3-VL release's image and video processors share (patch 16, merge 2, temporal patch 2).
_SHARED_PROCESSOR_SETTINGS = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "temporal_patch_size": 2,
}


def tiny_image_processor_settings() -> dict:
    """Qwen2-VL image processor settings of the Qwen3-VL release, as transformers saves them."""
    return {
        **_SHARED_PROCESSOR_SETTINGS,
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"longest_edge": IMAGE_MAX_PIXELS, "shortest_edge": IMAGE_MIN_PIXELS},
    }


def tiny_video_processor_settings() -> dict:
    """Qwen3-VL video processor settings of the Qwen3-VL release (H3 samples its own frames and turns sampling off)."""
    return {
        **_SHARED_PROCESSOR_SETTINGS,
        "do_sample_frames": True,
        "fps": 2,
        "max_frames": 768,
        "min_frames": 4,
        "return_metadata": False,
        "size": {"longest_edge": VIDEO_MAX_PIXELS, "shortest_edge": VIDEO_MIN_PIXELS},
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
