"""The MiniMax H3 diffusion transformer ("H3-Omni-Transformer"), one packed request per forward.

`H3DiT.forward` takes one packed request with no batch axis (docs/MODEL.md §2.1, §3): fp32 video rows
[Nv, C*prod(patch)], fp32 audio rows [Na, Ca], text states [Lt, text_dim], the M distinct timesteps (fp32,
t = 1 is clean, unscaled), per-row `timestep_index` and modality `tags` (0 video, 1 text, 2 audio), float64
(t, h, w) `positions`, and the sequence positions of each modality's rows. It returns fp32 velocities for every
video and audio row, in the order of `video_index` / `audio_index` (condition rows included). `state_dict()` keys
are the native checkpoint keys (docs/MODEL.md §1.2), `rope.inv_freq` included; `attn.qkv_proj` rows are held stacked
[q; k; v] where the file interleaves them per head (h3engine.checkpoint.dit_format converts).

Danger: the checkpoint is mixed precision. `FP32_PARAMETER_NAMES` (patch projections, time MLP, output heads,
`rope.inv_freq`; pruned: `PRUNED_FP32_NAMES`, AdaLN projections) stay fp32, the rest runs in the constructor's
`dtype`: never `.to(torch.bfloat16)` / `.half()` the whole module (that rounds the fp32 islands), choose the dtype
at construction. A module built on `meta` and materialized with `to_empty()` holds garbage, `rope.inv_freq`
included, until a full state is loaded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from h3engine.models import dit_chunks
from h3engine.models.dit_adaln import TABLE_KEY, AdaLNCurve, interpolate_table
from h3engine.models.dit_config import NUM_MODALITIES, DiTConfig
from h3engine.models.dit_layers import (
    BlocksRunner,
    DiTBlock,
    FinalLayer,
    MultiAxisRope,
    PackedLayout,
    StepModulation,
    TimestepEmbedder,
    TokenRefiner,
    packed_rows,
    run_blocks,
)

# State-dict keys that the release stores in fp32 and that must be computed in fp32 whatever the compute dtype.
FP32_PARAMETER_NAMES: frozenset[str] = frozenset(
    {
        "video_patch_proj.weight",
        "video_patch_proj.bias",
        "audio_patch_proj.weight",
        "audio_patch_proj.bias",
        "time_embedder.proj_in.weight",
        "time_embedder.proj_in.bias",
        "time_embedder.proj_out.weight",
        "time_embedder.proj_out.bias",
        "final_layer.video_out.weight",
        "final_layer.video_out.bias",
        "final_layer.audio_out.weight",
        "final_layer.audio_out.bias",
        "rope.inv_freq",
    }
)
# The pruned forms' fp32 tensors (h3engine.models.dit_adaln): the published table and our basis form's mean and basis.
PRUNED_FP32_NAMES: frozenset[str] = frozenset({TABLE_KEY, "adaln_curve.mean", "adaln_curve.basis"})


class H3DiT(nn.Module):
    """The H3 DiT over one packed request (see the module docstring for the contract and the fp32 islands)."""

    def __init__(
        self, config: DiTConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.video_patch_proj = nn.Linear(
            config.video_patch_dim, config.hidden_size, dtype=torch.float32, device=device
        )
        self.audio_patch_proj = nn.Linear(
            config.audio_in_channels, config.hidden_size, dtype=torch.float32, device=device
        )
        self.condition_proj = nn.Linear(config.text_dim, config.hidden_size, dtype=dtype, device=device)
        # The AdaLN input (`adaln_input`): the time embedder, and our basis form's curve; the published table form
        # has no embedder, only its table (h3engine.models.dit_adaln).
        if config.adaln_form == "table":
            table = torch.zeros(
                config.adaln_table_rows, config.adaln_rank, dtype=torch.float32, device=device
            )
            self.register_buffer(TABLE_KEY, table)
        else:
            self.time_embedder = TimestepEmbedder(config, device)
        if config.adaln_form == "basis":
            self.adaln_curve = AdaLNCurve(config, device)
        self.rope = MultiAxisRope(config, device)
        self.token_refiner = TokenRefiner(config, dtype, device)
        self.blocks = nn.ModuleList(DiTBlock(config, dtype, device) for _ in range(config.num_layers))
        self.final_layer = FinalLayer(config, dtype, device)

    @property
    def activation_chunks(self) -> int:
        """Row chunks and head groups of the forward (1: off); change it with `set_activation_chunks`."""
        return self.final_layer.activation_chunks

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the packed sequence: that of the (bf16 in the release) non-island weights, read off a bias (a
        community file's quantized condition_proj would dequantize its weight to tell)."""
        return self.condition_proj.bias.dtype

    def prepare_layout(
        self,
        timestep_index: Tensor,
        tags: Tensor,
        positions: Tensor,
        video_index: Tensor,
        audio_index: Tensor,
        text_index: Tensor,
    ) -> PackedLayout:
        """Request-static work: RoPE cos/sin from the fp64 positions and each row's AdaLN table row."""
        sequence_length = positions.shape[0]
        if positions.shape != (sequence_length, 3):
            raise ValueError(f"positions must be [S, 3], got {list(positions.shape)}")
        if tags.shape != (sequence_length,) or timestep_index.shape != (sequence_length,):
            raise ValueError(
                f"tags {list(tags.shape)} and timestep_index {list(timestep_index.shape)} must both be "
                f"[S] with S = {sequence_length}"
            )
        if video_index.numel() + audio_index.numel() + text_index.numel() != sequence_length:
            raise ValueError(
                f"video/audio/text index lengths {video_index.numel()}+{audio_index.numel()}+"
                f"{text_index.numel()} must add up to S = {sequence_length}"
            )
        return PackedLayout(
            rope_cos_sin=self.rope.cos_sin(positions, self.compute_dtype),
            adaln_index=timestep_index * NUM_MODALITIES + tags,
            timestep_index=timestep_index,
            video_index=video_index,
            audio_index=audio_index,
            text_index=text_index,
        )

    def forward(
        self,
        video_rows: Tensor,
        audio_rows: Tensor,
        text_states: Tensor,
        timesteps: Tensor,
        timestep_index: Tensor,
        tags: Tensor,
        positions: Tensor,
        video_index: Tensor,
        audio_index: Tensor,
        text_index: Tensor,
        layout: PackedLayout | None = None,
        modulation: StepModulation | None = None,
        blocks_runner: BlocksRunner | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One packed request -> (video velocity [Nv, C*prod(patch)] fp32, audio velocity [Na, Ca] fp32).

        A denoising loop passes the request-static `layout` (from `prepare_layout` on the same index tensors) and
        this step's `modulation` (h3engine.engine.sampling.modulation.schedule_modulation) so that neither is rebuilt every step.
        `blocks_runner` runs the block chain instead of `run_blocks` (the step cache, h3engine.engine.sampling.step_cache).
        """
        if layout is None:
            layout = self.prepare_layout(
                timestep_index, tags, positions, video_index, audio_index, text_index
            )
        return self.forward_with_layout(
            video_rows, audio_rows, text_states, timesteps, layout, modulation, blocks_runner
        )

    def check_packed_inputs(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor, layout: PackedLayout
    ) -> None:
        """Raise ValueError unless the row tensors have the layout's row counts and the config's widths."""
        expected = {
            "video_rows": (video_rows, layout.video_index.numel(), self.config.video_patch_dim, "Nv"),
            "audio_rows": (audio_rows, layout.audio_index.numel(), self.config.audio_in_channels, "Na"),
            "text_states": (text_states, layout.text_index.numel(), self.config.text_dim, "Lt"),
        }
        for name, (rows, count, width, symbol) in expected.items():
            if rows.shape != (count, width):
                raise ValueError(f"{name} must be [{symbol}, {width}], got {list(rows.shape)}")

    def forward_with_layout(
        self,
        video_rows: Tensor,
        audio_rows: Tensor,
        text_states: Tensor,
        timesteps: Tensor,
        layout: PackedLayout,
        modulation: StepModulation | None = None,
        blocks_runner: BlocksRunner | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`forward` with the request-static tensors (and optionally this step's AdaLN tables) already prepared:
        the rows are embedded into the packed sequence, run through the blocks (`run_blocks`, or `blocks_runner`
        when given), and the head reads them out."""
        self.check_packed_inputs(video_rows, audio_rows, text_states, layout)
        if modulation is None:
            modulation = self.modulation(timesteps)
        # The embedded rows go straight in: no name here keeps them alive while the blocks run.
        embedded = [self.embed(video_rows, audio_rows, text_states, layout)]
        runner = run_blocks if blocks_runner is None else blocks_runner
        hidden = runner(self.blocks, modulation.blocks, embedded.pop(), layout.local)
        return self.head(hidden, modulation.final_tables(), layout)

    def project_inputs(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(video, audio, text) rows of width hidden_size: video and audio through their fp32 patch projections in
        fp32, text through the condition projection and the token refiner (its dtype sets the packed sequence's)."""
        video = self.video_patch_proj(video_rows.to(torch.float32))
        audio = self.audio_patch_proj(audio_rows.to(torch.float32))
        text = self.token_refiner(self.condition_proj(text_states.to(self.compute_dtype)))
        return video, audio, text

    def embed(
        self, video_rows: Tensor, audio_rows: Tensor, text_states: Tensor, layout: PackedLayout
    ) -> Tensor:
        """The packed sequence [S, hidden] the blocks run on: each modality's projected rows at its positions."""
        if self.activation_chunks > 1:
            return dit_chunks.embed_by_rows(self, video_rows, audio_rows, text_states, layout)
        video, audio, text = self.project_inputs(video_rows, audio_rows, text_states)
        return packed_rows(
            layout.sequence_length,
            (text, layout.text_index),
            (video, layout.video_index),
            (audio, layout.audio_index),
        )

    def head(
        self, hidden: Tensor, final_tables: tuple[Tensor, Tensor], layout: PackedLayout
    ) -> tuple[Tensor, Tensor]:
        """The blocks' output -> fp32 (video, audio) velocities in the order of the layout's row indices."""
        return self.final_layer(hidden, final_tables, layout)

    def adaln_input(self, timesteps: Tensor) -> Tensor:
        """What every AdaLN projection reads for these M timesteps (fp32 [M]): the fp32 temb [M, time_embed_dim]
        (exact form: each projection applies SiLU and casts only after it), or the fp32 curve c(t) [M, adaln_rank]
        of a pruned form (no SiLU follows; h3engine.models.dit_adaln)."""
        if self.config.adaln_form == "table":
            return interpolate_table(getattr(self, TABLE_KEY), timesteps)
        temb = self.time_embedder(timesteps)
        return self.adaln_curve(temb) if self.config.adaln_form == "basis" else temb

    def modulation(self, timesteps: Tensor) -> StepModulation:
        """Every AdaLN table of one forward with these M timesteps (fp32 [M], on the compute device)."""
        adaln_input = self.adaln_input(timesteps)
        return StepModulation(
            blocks=tuple(block.modulation(adaln_input) for block in self.blocks),
            final=self.final_layer.modulation(adaln_input),
        )


def set_activation_chunks(dit: H3DiT, chunks: int) -> None:
    """Chunk `dit`'s activations from its next forward on (h3engine.models.dit_chunks; 1: off, ValueError below)."""
    dit_chunks.set_chunks(dit, chunks)
