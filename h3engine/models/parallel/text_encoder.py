"""H3's Qwen3-VL text encoder split over a tensor-parallel group, each rank reading only its shard.

`load_text_encoder_shard(weight_files, config, groups, dtype, device)` builds this rank's `H3TextEncoder` from what
`h3engine.checkpoint.text_encoder_files.open_text_encoder_files(folder)` opened (its config validates `--encoder-tp`
through `EncoderLayout.for_text_encoder` before any weight is read). `encode` is called like the single-process
one, with the same inputs on every rank of the group, and returns the full `[L, hidden]` states on every rank.

Split, in all 50 language layers: q_proj column-parallel by query heads, k_proj / v_proj by key/value heads (when
tp exceeds their count, each is replicated on the ranks whose query heads read it: `KeyValueParallelLinear`),
o_proj row-parallel; gate_proj / up_proj column-parallel, down_proj row-parallel. Embeddings, norms, rotary tables
and the vision tower are replicated. The layers are swapped in from outside, on the stock Qwen3-VL module types.

Danger: every rank must call `encode` with identical inputs (the row-parallel sums pair up by call order). bf16
differs from one process at the bf16 rounding level (partial sums are reduced in bf16). The attention projections
must have no bias (true of the release): a config with `attention_bias` is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextAttention, Qwen3VLTextMLP

from h3engine.checkpoint.safetensors_io import DeferredReads, WeightFiles
from h3engine.checkpoint.text_encoder_files import (
    check_text_encoder_files,
    read_text_encoder_tensors,
    require_float_tensor,
)
from h3engine.models.parallel.groups import EncoderGroups, EncoderLayout, GroupMembership
from h3engine.models.parallel.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from h3engine.models.text_encoder import H3TextEncoder


class KeyValueParallelLinear(ParallelLinear):
    """k_proj / v_proj of grouped-query attention: this rank's key/value heads, whole.

    The file's rows are [kv_head, head_dim]. With tp <= kv_heads the rank holds kv_heads / tp heads; with more
    ranks than key/value heads it holds the one head its query heads read (ranks r*tp/kv .. (r+1)*tp/kv - 1 all
    read head r). Either way it reads one contiguous row range.
    """

    def __init__(
        self,
        in_features: int,
        layout: EncoderLayout,
        head_dim: int,
        group: GroupMembership,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        self.head_dim = head_dim
        self.first_head = layout.first_kv_head(group.rank)
        self.local_heads = layout.local_kv_heads
        local_shape = (self.local_heads * head_dim, in_features)
        super().__init__(in_features, layout.kv_heads * head_dim, local_shape, group, dtype, device)

    def file_row_range(self) -> tuple[int, int]:
        start = self.first_head * self.head_dim
        return start, start + self.local_heads * self.head_dim

    def _read_shard(self, weight_files: WeightFiles, key: str) -> Tensor:
        return weight_files.row_slice(key, *self.file_row_range())


def _check_layout(config: Qwen3VLConfig, layout: EncoderLayout) -> None:
    text = config.text_config
    sizes = (text.num_attention_heads, text.num_key_value_heads, text.intermediate_size)
    if (layout.heads, layout.kv_heads, layout.mlp_width) != sizes:
        raise ValueError(
            f"the text-encoder layout was validated for {layout.heads} heads, {layout.kv_heads} key/value heads "
            f"and MLP width {layout.mlp_width}, but this Qwen3-VL has {sizes[0]}, {sizes[1]} and {sizes[2]} "
            "(use EncoderLayout.for_text_encoder)"
        )
    if text.attention_bias:
        raise ValueError("tensor-parallel Qwen3-VL needs attention projections without bias (attention_bias)")


def _apply_tensor_parallel(encoder: H3TextEncoder, groups: EncoderGroups, dtype: torch.dtype) -> None:
    """Swap the parallel layers into every language-model attention and MLP (no edits to the model code)."""
    text, layout, tp = encoder.config.text_config, groups.layout, groups.tp
    hidden, head_dim = text.hidden_size, text.head_dim
    for module in list(encoder.model.language_model.modules()):
        if isinstance(module, Qwen3VLTextAttention):
            module.q_proj = ColumnParallelLinear(
                hidden, text.num_attention_heads * head_dim, tp, dtype, "meta"
            )
            module.k_proj = KeyValueParallelLinear(hidden, layout, head_dim, tp, dtype, "meta")
            module.v_proj = KeyValueParallelLinear(hidden, layout, head_dim, tp, dtype, "meta")
            module.o_proj = RowParallelLinear(text.num_attention_heads * head_dim, hidden, tp, dtype, "meta")
            # transformers' attention repeats each key/value head this many times to meet the query heads.
            module.num_key_value_groups = layout.local_heads // layout.local_kv_heads
        elif isinstance(module, Qwen3VLTextMLP):
            module.gate_proj = ColumnParallelLinear(hidden, text.intermediate_size, tp, dtype, "meta")
            module.up_proj = ColumnParallelLinear(hidden, text.intermediate_size, tp, dtype, "meta")
            module.down_proj = RowParallelLinear(text.intermediate_size, hidden, tp, dtype, "meta")


def load_text_encoder_shard(
    weight_files: WeightFiles,
    config: Qwen3VLConfig,
    groups: EncoderGroups,
    dtype: torch.dtype,
    device: torch.device | str,
    deferred: DeferredReads | None = None,
) -> H3TextEncoder:
    """This rank's text encoder: its row / column shard of each split weight, every other tensor whole (the keys
    `deferred` wants: a parked tensor and a reader of this rank's part each).

    The files are checked exactly as `load_text_encoder` checks them (every needed key at its full shape,
    nothing unexpected) before anything is read.
    """
    _check_layout(config, groups.layout)
    device = torch.device(device)
    with torch.device("meta"):
        encoder = H3TextEncoder(config)
    needed_shapes = check_text_encoder_files(encoder, weight_files)
    _apply_tensor_parallel(encoder, groups, dtype)
    sharded = {
        f"{name}.weight": layer
        for name, layer in encoder.named_modules()
        if isinstance(layer, ParallelLinear)
    }
    for key, layer in sharded.items():
        require_float_tensor(weight_files, key)
        layer.load_shard(weight_files, key, device, deferred)
    replicated = [key for key in needed_shapes if key not in sharded]
    read_text_encoder_tensors(encoder, weight_files, replicated, device, dtype, deferred)
    encoder.rebuild_computed_buffers(device)
    return encoder.eval().requires_grad_(False)
