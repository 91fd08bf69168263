"""H3's Qwen3-VL text encoder split over a tensor-parallel group, each rank reading only its shard.

Contract
--------
`open_text_encoder_files(folder)` reads the stock Qwen3-VL `config.json` and opens the weight files (headers
only); the config validates the user's `--encoder-tp` (`EncoderLayout.for_text_encoder`) before any weight is
read. `load_text_encoder_shard(weight_files, config, groups, dtype, device)` builds this rank's `H3TextEncoder`
and fills it. Its `encode` is called exactly like the single-process one, with the same inputs on every rank of
the tensor-parallel group, and returns the full `[L, hidden]` states on every rank.

What is split, in all 50 language layers (layers >= 50 are never built, as in `H3TextEncoder.load`):
* q_proj: column-parallel by query heads (rank r holds heads [r*H/tp, (r+1)*H/tp)), k_proj / v_proj: by
  key/value heads; when tp exceeds the key/value head count, each key/value head is replicated on the
  tp / kv_heads ranks whose query heads read it (`KeyValueParallelLinear`), as vLLM does. o_proj: row-parallel
  (sum over the group).
* gate_proj / up_proj: column-parallel over the MLP width, down_proj: row-parallel.
Replicated: token embeddings, every norm (q_norm / k_norm act per head, so they need no split), the rotary
tables and the whole vision tower (small next to the language model). The swap is done from outside, on module
types of the stock Qwen3-VL model: the attention keeps running transformers' own code, with its
`num_key_value_groups` set to this rank's query heads per key/value head.

Danger
------
Every rank of the group must call `encode` with identical inputs: the row-parallel sums pair up by call order.
bf16 results differ from one process at the bf16 rounding level (partial sums are reduced in bf16); fp32 agrees
to rounding noise. Qwen3-VL's attention projections must have no bias (true of the release): the parallel
linears carry none, and a config with `attention_bias` is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextAttention, Qwen3VLTextMLP

from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.errors import CheckpointError
from h3engine.models.text_encoder import (
    CONFIG_FILE_NAME,
    H3TextEncoder,
    _read_qwen3_vl_config,
    _weights_path,
)
from h3engine.parallel.groups import EncoderGroups, EncoderLayout, GroupMembership
from h3engine.parallel.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear


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


def open_text_encoder_files(folder: Path) -> tuple[Qwen3VLConfig, WeightFiles]:
    """The stock Qwen3-VL config of a `text_encoder/` folder and its weight files (headers only)."""
    folder = Path(folder)
    return _read_qwen3_vl_config(folder / CONFIG_FILE_NAME), WeightFiles.open(_weights_path(folder))


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
) -> H3TextEncoder:
    """This rank's text encoder: its row / column shard of each split weight, every other tensor whole.

    The files are checked exactly as `H3TextEncoder.load` checks them (every needed key at its full shape,
    nothing unexpected) before anything is read.
    """
    _check_layout(config, groups.layout)
    device = torch.device(device)
    with torch.device("meta"):
        encoder = H3TextEncoder(config)
    needed_shapes = {key: tuple(tensor.shape) for key, tensor in encoder.state_dict().items()}
    weight_files.check(needed_shapes, ignored=encoder._skippable_checkpoint_keys())
    _apply_tensor_parallel(encoder, groups, dtype)
    sharded = {
        f"{name}.weight": layer
        for name, layer in encoder.named_modules()
        if isinstance(layer, ParallelLinear)
    }
    for key, layer in sharded.items():
        info = weight_files.infos[key]
        if not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.file}: key {key} is stored as {info.dtype}, not a float")
        layer.load_shard(weight_files, key, device)
    replicated = {key: shape for key, shape in needed_shapes.items() if key not in sharded}
    encoder._read_needed_tensors(weight_files, replicated, device, dtype)
    encoder._rebuild_computed_buffers(device)
    return encoder.eval().requires_grad_(False)
