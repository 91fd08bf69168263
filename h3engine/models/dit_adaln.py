"""The AdaLN input of the pruned DiT forms (h3engine.models.dit_config.DiTConfig.adaln_form): an adaln_rank-wide
curve c(t) that the AdaLN projections read in place of SiLU(temb), with no SiLU of their own.

* "table" (the community's pruned files): `adaln_t_table` [rows, rank], row i holding c at t = i / (rows - 1) (t in
  [0, 1], the DiT's own timestep, not scaled by 1000), linearly interpolated in fp32 between the two neighbouring
  rows. `interpolate_table` follows ComfyUI's `MiniMaxH3Model._forward` (comfy/ldm/minimax/model.py, Comfy-Org/ComfyUI):
  pos = clamp(t, 0, 1) * (rows - 1), i0 = min(floor(pos), rows - 2), c = lerp(table[i0], table[i0 + 1], pos - i0);
  the table is an fp32 buffer and the projections run in fp32 there (`adaln_dtype = torch.float32` in curve mode).
* "basis" (ours, `python -m h3engine convert --prune-adaln`): the exact embedder and time MLP kept, then
  c(t) = (SiLU(temb) - mean) @ basis in fp32 (`AdaLNCurve`), mean [time_embed_dim], basis [time_embed_dim, rank].
  The projections hold W @ basis and b + W @ mean (h3engine.checkpoint.prune_adaln folds them), so W' c + b' is
  W SiLU(temb) + b wherever SiLU(temb) - mean lies in the span of the basis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from h3engine.models.dit_config import DiTConfig

# The published table's state-dict key (at the DiT's top level) and our basis form's submodule.
TABLE_KEY = "adaln_t_table"
CURVE_MODULE = "adaln_curve"


def interpolate_table(table: Tensor, timesteps: Tensor) -> Tensor:
    """[rows, rank] table, [M] t in [0, 1] -> [M, rank] fp32: linear interpolation between the two rows around
    t * (rows - 1) (t clamped to [0, 1]; t = 1 lands on the last row as the end of the last interval)."""
    table = table.to(torch.float32)
    rows = table.shape[0]
    position = timesteps.to(device=table.device, dtype=torch.float32).clamp(0.0, 1.0) * (rows - 1)
    lower = position.floor().long().clamp(max=rows - 2)
    return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))


class AdaLNCurve(nn.Module):
    """Our basis form's curve: (SiLU(temb) - mean) @ basis, fp32 buffers `mean` and `basis` (saved in the file)."""

    def __init__(self, config: DiTConfig, device: torch.device | str | None) -> None:
        super().__init__()
        width, rank = config.time_embed_dim, config.adaln_rank
        self.register_buffer("mean", torch.zeros(width, dtype=torch.float32, device=device))
        self.register_buffer("basis", torch.zeros(width, rank, dtype=torch.float32, device=device))

    def forward(self, temb: Tensor) -> Tensor:
        centred = F.silu(temb.to(torch.float32)) - self.mean
        return centred @ self.basis
