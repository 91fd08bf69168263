"""Worker side of tests/test_parallel_adapters.py: each spawned rank loads its shard of the 8-head tiny DiT, runs the
packed request with the LoRAs, without them, and with them again after a removal, and saves the velocities.

Kept apart from the test module so that a spawned worker imports only torch, the DiT code and the LoRA reader.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _parallel_dit_helpers import EIGHT_HEADS, packed_request

from h3engine.checkpoint.lora_format import read_lora
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.engine.lora.adapters import Adapter, apply_adapters, remove_adapters
from h3engine.models.parallel.dit import load_dit_shard
from h3engine.models.parallel.groups import ParallelLayout, create_dit_groups, initialize_process_group

# (sp, tp) layouts on two ranks: Ulysses alone, tensor parallel alone.
LAYOUTS = [(2, 1), (1, 2)]


def adapters(loras: list[tuple[str, float]]) -> list[Adapter]:
    return [Adapter(read_lora(path), strength) for path, strength in loras]


def worker(rank: int, world_size: int, store: str, folder: str, loras: list, output: str) -> None:
    torch.set_num_threads(1)
    initialize_process_group(
        rank, world_size, f"file://{store}", torch.device("cpu"), timeout=timedelta(seconds=120)
    )
    arguments = packed_request(EIGHT_HEADS).as_h3_arguments()
    results = {}
    for sp, tp in LAYOUTS:
        groups = create_dit_groups(ParallelLayout.for_dit(EIGHT_HEADS, world_size, sp, tp))
        model = load_dit_shard(WeightFiles.open(folder), EIGHT_HEADS, groups, torch.float32, "cpu")
        with torch.no_grad():
            base = model(*arguments)
            apply_adapters(model, adapters(loras), "cpu")
            adapted = model(*arguments)
            remove_adapters(model)
            removed = model(*arguments)
        results[(sp, tp)] = {"base": base, "adapted": adapted, "removed": removed}
    torch.save(results, Path(output) / f"rank{rank}.pt")
    dist.destroy_process_group()
