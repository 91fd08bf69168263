"""A tiny checkpoint whose FL2VA DiT has 256- and 512-wide linears, so K-quant blocks and ConvRot groups of 256 fit.

The tiny DiT's linears are 8 to 32 wide: no 256-value block or group fits them. `write_wide_checkpoint(source,
target)` copies a tiny checkpoint and replaces its FL2VA DiT with a random one of `WIDE`'s sizes (fc2 288 wide, so
one linear of partial blocks stays; condition_proj 8 wide).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from h3engine.checkpoint import dit_format
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.models.dit_config import DiTConfig

WIDE = {"hidden_size": 512, "num_heads": 2, "head_dim": 128, "ffn_dim": 288, "time_embed_dim": 256}


def write_wide_checkpoint(source: Path, target: Path, seed: int = 11) -> Path:
    """`source` copied to `target` with a wide random FL2VA DiT (native layout); returns `target`."""
    shutil.copytree(source, target)
    folder = target / "FL2VA" / "transformer"
    shutil.rmtree(folder)
    folder.mkdir()
    config = dataclasses.replace(DiTConfig.tiny(), **WIDE)
    (folder / "config.json").write_text(json.dumps(dit_format.config_to_native(config)))
    save_file(
        random_native_state(config, seed=seed), str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    return target
