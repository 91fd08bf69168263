"""Shared by tests/test_step_cache.py and the ranks it spawns: a random tiny DiT, a run of forwards with a step cache.

Kept apart from the test module so that a spawned rank imports only torch and the DiT code.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _dit_helpers import tiny_fl2va_request

from benchmarks._packed_request import PackedRequest
from h3engine.engine.sampling.step_cache import CachePreset, ReduceGroups, StepCache
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.parallel.dit import SequenceParallelDiT, modality_rows, worker_groups
from h3engine.models.parallel.groups import ParallelLayout, create_dit_groups, initialize_process_group

# Six blocks: one first block, four middle ones to skip, one last block for the presets with last_blocks=1.
CONFIG = dataclasses.replace(DiTConfig.tiny(), num_layers=6)
# Skips often on the random DiT (its first block's residual moves ~5-20 % between these forwards).
EAGER = CachePreset("eager", first_blocks=1, last_blocks=1, threshold=0.07, warmup_steps=1, max_consecutive=2)
FORWARDS = 8


def random_dit(config: DiTConfig = CONFIG, dit_class: type = H3DiT, **arguments) -> H3DiT:
    """The same random DiT in every process (seeded), every weight drawn so no block is an identity."""
    torch.manual_seed(0)
    state = H3DiT(config, dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point() and name != "rope.inv_freq":
            tensor.normal_(0.0, 0.3)
    dit = dit_class(config, dtype=torch.float32, **arguments)
    dit.load_state_dict(state)
    return dit.eval().requires_grad_(False)


def step_request(step: int) -> PackedRequest:
    """The packed request of forward `step`: the rows drift a little from one forward to the next, like a sampler's."""
    request = tiny_fl2va_request(CONFIG, torch.float32, seed=1)
    generator = torch.Generator().manual_seed(100 + step)
    drift = 0.02 * step
    request.video_rows = request.video_rows + drift * torch.randn(
        request.video_rows.shape, generator=generator
    )
    request.audio_rows = request.audio_rows + drift * torch.randn(
        request.audio_rows.shape, generator=generator
    )
    return request


def cached_forwards(
    dit: H3DiT, preset: CachePreset | None, forwards: int = FORWARDS
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], StepCache | None]:
    """Every forward's velocities with one step cache across them (None: the plain forward, no runner passed)."""
    cache = None if preset is None else StepCache(preset, ReduceGroups(*worker_groups(dit)))
    outputs = []
    with torch.inference_mode():
        for step in range(forwards):
            arguments = step_request(step).as_h3_arguments()
            if cache is None:
                outputs.append(dit(*arguments))
                continue
            layout = dit.prepare_layout(*arguments[4:])
            cache.use_rows(*modality_rows(layout))
            outputs.append(dit(*arguments, layout=layout, blocks_runner=cache.run))
    return outputs, cache


def worker(rank: int, world_size: int, store: str, output: str) -> None:
    """One Ulysses rank: the eager cache over the forwards; saves its decisions, differences and velocities."""
    torch.set_num_threads(1)
    initialize_process_group(
        rank, world_size, f"file://{store}", torch.device("cpu"), timeout=timedelta(seconds=120)
    )
    groups = create_dit_groups(ParallelLayout.for_dit(CONFIG, world_size, world_size, 1))
    dit = random_dit(CONFIG, SequenceParallelDiT, sequence_group=groups.sp)
    outputs, cache = cached_forwards(dit, EAGER)
    decisions = cache.decisions
    torch.save(
        {"skipped": decisions.skipped_steps, "differences": decisions.differences, "outputs": outputs},
        Path(output) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()
