"""H3's text encoder: the first 50 decoder layers of a stock Qwen3-VL, plus its vision tower.

- `H3TextEncoder(config)` builds only what H3 reads: the token embeddings, decoder layers 0..49 and the whole vision
  tower (layers >= 50, the final norm and `lm_head` are never built). Its `state_dict()` keys are the stock
  checkpoint keys (`model.language_model.*`, `model.visual.*`); `h3engine.checkpoint.loader.load_text_encoder`
  fills it from a checkpoint folder.
- `encode(input_ids, ...)` returns `[L, hidden]` in the weights' dtype: the residual stream after decoder layer 50,
  i.e. `hidden_states[50]` of the full `Qwen3VLForConditionalGeneration`, with Qwen's own multimodal rope index
  (all-ones attention mask, no cache), exactly as the reference pipelines call the inner Qwen3-VL model.
- `tokenize_prompt` and `text_row_tags` are the tokenizer side: no chat template, no special tokens added, and the
  per-row modality tags of the text stream (vision-block rows are tagged as video).

Danger: a stock model truncated to 50 layers applies the final RMSNorm to the output of layer 50; H3 was trained on
the UN-normed stream, so the final norm is an identity here (never "fix" it back). The inner Qwen3-VL model keeps
`rope_deltas` between calls (a generation cache); they are cleared before every call.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLModel,
    Qwen3VLTextRotaryEmbedding,
    Qwen3VLVisionRotaryEmbedding,
)

from h3engine.errors import CheckpointError

# H3 conditions on `hidden_states[50]`: the output of the 50th decoder layer (index 0 is the embedding output).
H3_TEXT_ENCODER_LAYERS = 50

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

    def rebuild_computed_buffers(self, device: torch.device) -> None:
        """Rebuild the rotary tables on `device` (a meta-device build leaves them empty) and check that nothing
        else is left unmaterialized. They are computed from the config in fp32, as Qwen builds them."""
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
