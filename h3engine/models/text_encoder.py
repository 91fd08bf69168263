"""H3's text encoder: the first 50 decoder layers of a stock Qwen3-VL, plus its vision tower.

Contract
- `H3TextEncoder.load(folder, device, dtype)` reads a stock Qwen3-VL checkpoint folder (`config.json` plus
  `model.safetensors` or `model.safetensors.index.json` and its shards) and builds only what H3 reads: the token
  embeddings, decoder layers 0..49 and the whole vision tower. Decoder layers >= 50, the final norm and `lm_head`
  are never built and their bytes are never read, but their keys may be present in the files.
- `encode(input_ids, ...)` returns `[L, hidden]` in the load dtype: the residual stream after decoder layer 50,
  i.e. `hidden_states[50]` of the full `Qwen3VLForConditionalGeneration`, with Qwen's own multimodal rope index
  (all-ones attention mask, no cache), exactly as the reference pipelines call the inner Qwen3-VL model.
- The parameter names (`state_dict()` keys) are the stock checkpoint keys (`model.language_model.*`,
  `model.visual.*`), so the files load with no renaming.
- `tokenize_prompt`, `load_tokenizer` and `text_row_tags` are the tokenizer side: no chat template, no special
  tokens added, and the per-row modality tags of the text stream (vision-block rows are tagged as video).

Danger
- A stock model truncated to 50 layers applies the final RMSNorm to the output of layer 50; H3 was trained on the
  UN-normed stream. The final norm is replaced by an identity here; never "fix" it back.
- Loading is strict: a missing key, a wrong shape, an unknown key, a missing or truncated shard all raise
  `CheckpointError` naming the file and the key, before any request is served.
- The inner Qwen3-VL model keeps `rope_deltas` between calls (a generation cache). An encoder call must never reuse
  them, so they are cleared before every call.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLModel,
    Qwen3VLTextRotaryEmbedding,
    Qwen3VLVisionRotaryEmbedding,
)

from h3engine.checkpoint.safetensors_io import WeightFiles, placed
from h3engine.errors import CheckpointError

# H3 conditions on `hidden_states[50]`: the output of the 50th decoder layer (index 0 is the embedding output).
H3_TEXT_ENCODER_LAYERS = 50

CONFIG_FILE_NAME = "config.json"
SINGLE_WEIGHTS_FILE_NAME = "model.safetensors"
WEIGHTS_INDEX_FILE_NAME = "model.safetensors.index.json"

# Per-row modality tags of the DiT's packed sequence (they index its AdaLN table, so they are a checkpoint contract).
VIDEO_ROW_TAG = 0
TEXT_ROW_TAG = 1

# The rows of a Qwen vision block inside the text stream; H3 tags all of them as video, including start and end.
QWEN_VISION_BLOCK_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>")
# H3's dialogue markers; a tokenizer without them as single tokens is a stock Qwen tokenizer, not H3's.
H3_DIALOGUE_TOKENS = ("<d>", "</d>")

# Qwen's own multimodal token types that drive its mRoPE layout (not H3's row tags).
_QWEN_TEXT_TOKEN_TYPE = 0
_QWEN_IMAGE_TOKEN_TYPE = 1
_QWEN_VIDEO_TOKEN_TYPE = 2

_UNUSED_TOP_KEYS = {"model.language_model.norm.weight", "lm_head.weight"}


class H3TextEncoder(nn.Module):
    """Qwen3-VL cut after decoder layer 50 with the final norm removed; see the module docstring."""

    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__()
        total_layers = config.text_config.num_hidden_layers
        if total_layers <= H3_TEXT_ENCODER_LAYERS:
            raise ValueError(
                f"H3 needs more than {H3_TEXT_ENCODER_LAYERS} decoder layers, the config has {total_layers}"
            )
        self.checkpoint_num_hidden_layers = total_layers
        truncated_config = copy.deepcopy(config)
        truncated_config.text_config.num_hidden_layers = H3_TEXT_ENCODER_LAYERS
        self.config = truncated_config
        self.model = Qwen3VLModel(truncated_config)
        # The released conditioning is the residual stream itself; the final norm belongs after layer 63.
        self.model.language_model.norm = nn.Identity()

    @classmethod
    def load(
        cls, folder: Path, device: torch.device | str, dtype: torch.dtype = torch.bfloat16
    ) -> H3TextEncoder:
        """Build the encoder from a stock Qwen3-VL checkpoint folder, reading only the tensors H3 needs."""
        folder = Path(folder)
        config = _read_qwen3_vl_config(folder / CONFIG_FILE_NAME)
        with torch.device("meta"):
            encoder = cls(config)
        needed_shapes = {key: tuple(tensor.shape) for key, tensor in encoder.state_dict().items()}
        weight_files = WeightFiles.open(_weights_path(folder))
        weight_files.check(needed_shapes, ignored=encoder._skippable_checkpoint_keys())
        encoder._read_needed_tensors(weight_files, needed_shapes, torch.device(device), dtype)
        encoder._rebuild_computed_buffers(torch.device(device))
        encoder.eval()
        encoder.requires_grad_(False)
        return encoder

    def _skippable_checkpoint_keys(self) -> set[str]:
        """Keys a full checkpoint carries that H3 never needs: layers >= 50, the final norm and lm_head."""
        layer_suffixes = [
            name.removeprefix("language_model.layers.0.")
            for name in self.model.state_dict()
            if name.startswith("language_model.layers.0.")
        ]
        skippable = set(_UNUSED_TOP_KEYS)
        for layer_index in range(H3_TEXT_ENCODER_LAYERS, self.checkpoint_num_hidden_layers):
            skippable.update(
                f"model.language_model.layers.{layer_index}.{suffix}" for suffix in layer_suffixes
            )
        return skippable

    def _read_needed_tensors(
        self,
        weight_files: WeightFiles,
        needed_shapes: dict[str, tuple[int, ...]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        for key in sorted(needed_shapes):
            info = weight_files.infos[key]
            if not info.dtype.is_floating_point:
                raise CheckpointError(f"{info.file}: key {key} is stored as {info.dtype}, not a float")
            self._assign_tensor(key, placed(weight_files.tensor(key), device, dtype))

    def _assign_tensor(self, key: str, tensor: torch.Tensor) -> None:
        owner_name, _, leaf_name = key.rpartition(".")
        owner = self.get_submodule(owner_name)
        if leaf_name in owner._parameters:
            setattr(owner, leaf_name, nn.Parameter(tensor, requires_grad=False))
        else:
            owner._buffers[leaf_name] = tensor

    def _rebuild_computed_buffers(self, device: torch.device) -> None:
        # The rotary tables are computed from the config, not stored, so the meta-device build left them empty;
        # they are rebuilt in fp32 (as Qwen builds them) whatever the weight dtype.
        self.model.language_model.rotary_emb = Qwen3VLTextRotaryEmbedding(self.config.text_config).to(device)
        self.model.visual.rotary_pos_emb = Qwen3VLVisionRotaryEmbedding(self.config.vision_config).to(device)
        still_empty = [name for name, tensor in self.named_parameters() if tensor.is_meta]
        still_empty += [name for name, tensor in self.named_buffers() if tensor.is_meta]
        if still_empty:
            raise RuntimeError(f"text encoder tensors left unmaterialized after loading: {still_empty[:5]}")

    @torch.no_grad()
    def encode(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the un-normed output of decoder layer 50 for one presentation, shape [L, hidden]."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [1, L] with L >= 1, got {list(input_ids.shape)}")
        device = self.model.language_model.embed_tokens.weight.device
        input_ids = input_ids.to(device=device, dtype=torch.long)
        vision_inputs = {
            name: value.to(device)
            for name, value in (
                ("pixel_values", pixel_values),
                ("image_grid_thw", image_grid_thw),
                ("pixel_values_videos", pixel_values_videos),
                ("video_grid_thw", video_grid_thw),
            )
            if value is not None
        }
        # Each call is a fresh sequence; stale deltas from a previous call would shift the rotary positions.
        self.model.rope_deltas = None
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=self._qwen_token_types(input_ids),
            use_cache=False,
            **vision_inputs,
        )
        return outputs.last_hidden_state[0]

    def _qwen_token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Only the pad tokens count as image/video for Qwen's rope index; vision start/end are text to it.
        token_types = torch.full_like(input_ids, _QWEN_TEXT_TOKEN_TYPE)
        token_types[input_ids == self.config.image_token_id] = _QWEN_IMAGE_TOKEN_TYPE
        token_types[input_ids == self.config.video_token_id] = _QWEN_VIDEO_TOKEN_TYPE
        return token_types

    def verify_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raise CheckpointError unless the tokenizer's vision token ids are the ones this encoder was built for."""
        expected_ids = {
            "<|vision_start|>": self.config.vision_start_token_id,
            "<|vision_end|>": self.config.vision_end_token_id,
            "<|image_pad|>": self.config.image_token_id,
            "<|video_pad|>": self.config.video_token_id,
        }
        for token, config_id in expected_ids.items():
            tokenizer_id = tokenizer.convert_tokens_to_ids(token)
            if tokenizer_id != config_id:
                raise CheckpointError(
                    f"tokenizer maps {token} to id {tokenizer_id}, but the text encoder config.json says {config_id}"
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


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    """Token ids [1, L] of a text exactly as H3 presents it: no chat template, no BOS/EOS or other added tokens."""
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([token_ids], dtype=torch.long)


def text_row_tags(input_ids: torch.Tensor, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Per-row modality tags [L] of the text stream: video (0) for Qwen vision-block rows, text (1) otherwise."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, L], got {list(input_ids.shape)}")
    vision_block_ids = torch.tensor(
        [tokenizer.convert_tokens_to_ids(token) for token in QWEN_VISION_BLOCK_TOKENS], dtype=torch.long
    )
    row_ids = input_ids[0].to(device="cpu", dtype=torch.long)
    return torch.where(torch.isin(row_ids, vision_block_ids), VIDEO_ROW_TAG, TEXT_ROW_TAG).to(torch.long)
