"""Worker side of tests/test_parallel_dit.py: what each spawned rank runs, and the constants both sides share.

Kept apart from the test module so that a spawned worker imports only torch and the DiT code: the test module
pulls in the tiny-checkpoint maker and with it transformers, seconds of import per worker on a busy machine.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _dit_helpers import tiny_fl2va_request

from benchmarks._packed_request import PackedRequest
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.models.dit_config import DiTConfig
from h3engine.models.parallel.collectives import heads_to_sequence, sequence_to_heads
from h3engine.models.parallel.dit import load_dit_shard
from h3engine.models.parallel.groups import ParallelLayout, create_dit_groups, initialize_process_group

SEED = 4321
EIGHT_HEADS = dataclasses.replace(DiTConfig.tiny(), num_heads=8)
TINY = DiTConfig.tiny()
# (world size) -> the (dit_sp, dit_tp) layouts its workers run on the 8-head DiT.
EIGHT_HEAD_LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (1, 4), (2, 2)]}
# The same DiT written in the diffusers layout: Ulysses 2 and TP 2 on two ranks, both at once on four.
DIFFUSERS_LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}
# The tiny checkpoint has 2 heads: world size 2 only.
TINY_LAYOUTS = [(2, 1), (1, 2)]


def packed_request(config: DiTConfig) -> PackedRequest:
    """11 text rows (2 vision rows), one keyframe (t = 0.999), audio, 4 target frames: 149 rows in all."""
    return tiny_fl2va_request(config, torch.float32, SEED + 1, text_rows=11)


class RecordingWeightFiles(WeightFiles):
    """WeightFiles that logs every read as (method, key, start, stop, elements read)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[str, str, int, int, int]] = []

    def tensor(self, key: str) -> torch.Tensor:
        tensor = super().tensor(key)
        self.reads.append(("tensor", key, 0, 0, tensor.numel()))
        return tensor

    def row_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        tensor = super().row_slice(key, start, stop)
        self.reads.append(("row_slice", key, start, stop, tensor.numel()))
        return tensor

    def column_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        tensor = super().column_slice(key, start, stop)
        self.reads.append(("column_slice", key, start, stop, tensor.numel()))
        return tensor


def run_layouts(
    config: DiTConfig, folder: str, layouts: list[tuple[int, int]], world_size: int, recording: bool = False
) -> dict:
    """Each (sp, tp) layout's velocities on this rank (and its reads, when `recording`)."""
    results = {}
    arguments = packed_request(config).as_h3_arguments()
    for sp, tp in layouts:
        groups = create_dit_groups(ParallelLayout.for_dit(config, world_size, sp, tp))
        files = (RecordingWeightFiles if recording else WeightFiles).open(folder)
        model = load_dit_shard(files, config, groups, torch.float32, "cpu")
        with torch.no_grad():
            velocities = model(*arguments)
        results[(sp, tp)] = (velocities, files.reads) if recording else velocities
    return results


def all_to_all_round_trip(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [8 rows, 2 (lead), 8 heads, 3] tensor whose values name their place; this rank holds its rows."""
    groups = create_dit_groups(ParallelLayout.for_dit(EIGHT_HEADS, world_size, world_size, 1))
    whole = torch.arange(8 * 2 * 8 * 3, dtype=torch.float32).view(8, 2, 8, 3)
    rows = 8 // world_size
    local = whole[groups.rank * rows : (groups.rank + 1) * rows]
    by_heads = sequence_to_heads(local, groups.sp)
    return by_heads, heads_to_sequence(by_heads, groups.sp)


def worker(
    rank: int,
    world_size: int,
    store: str,
    eight_heads: str,
    eight_heads_diffusers: str,
    tiny: str,
    output: str,
) -> None:
    # Four workers share two busy cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    initialize_process_group(
        rank, world_size, f"file://{store}", torch.device("cpu"), timeout=timedelta(seconds=120)
    )
    results = {
        "eight_heads": run_layouts(EIGHT_HEADS, eight_heads, EIGHT_HEAD_LAYOUTS[world_size], world_size),
        "eight_heads_diffusers": run_layouts(
            EIGHT_HEADS, eight_heads_diffusers, DIFFUSERS_LAYOUTS[world_size], world_size, recording=True
        ),
    }
    if world_size == 2:
        results["tiny"] = run_layouts(TINY, tiny, TINY_LAYOUTS, world_size, recording=True)
    else:
        results["all_to_all"] = all_to_all_round_trip(world_size)
    torch.save(results, Path(output) / f"rank{rank}.pt")
    dist.destroy_process_group()
