"""LoRA adapters on a 2-rank gloo DiT group (CPU): Ulysses 2 and tensor-parallel 2 equal one process (fp32).

Each tensor-parallel rank applies its slice of the factors (B's rows for qkv_proj and fc1, A's columns for out_proj
and fc2, whose partial low-rank products join the layer's all-reduce); a Ulysses rank applies them whole. Two
files at once (fused QKV and diffusers' split q / k / v with [value; gate] fc1) cover both row orders; removal
restores each rank's base velocities bit-exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from _lora_helpers import RandomLora, random_lora, write_lora
from _parallel_dit_helpers import EIGHT_HEADS, SEED, packed_request
from _parallel_lora_helpers import LAYOUTS, adapters, worker

from benchmarks._packed_request import max_relative_error
from h3engine.checkpoint.dit_format import native_to_module
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.checkpoint.tiny import save_sharded
from h3engine.engine.lora.adapters import apply_adapters
from h3engine.models.dit import H3DiT

# The tensor-parallel partial sums (base and low-rank) add in another order: fp32 rounding noise.
TOLERANCE = 1e-5


def shrunk(seed: int) -> RandomLora:
    """A LoRA on every linear that moves the velocities by ~10 %, not to noise."""
    lora = random_lora(EIGHT_HEADS, seed)
    return RandomLora({m: d * 0.02 for m, d in lora.down.items()}, lora.up, lora.alpha)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    folder = tmp_path_factory.mktemp("eight_heads")
    state = random_native_state(EIGHT_HEADS, SEED)
    save_sharded(state, folder, "model", 2, "model.safetensors.index.json")
    loras = []
    for layout, seed, strength in (("original", 31, 0.7), ("diffusers", 32, -0.5)):
        path = folder / f"{layout}.safetensors"
        write_lora(path, shrunk(seed), layout, EIGHT_HEADS)
        loras.append((str(path), strength))
    model = H3DiT(EIGHT_HEADS, dtype=torch.float32)
    model.load_state_dict(native_to_module(state, EIGHT_HEADS), strict=True)
    arguments = packed_request(EIGHT_HEADS).as_h3_arguments()
    with torch.no_grad():
        base = model.eval()(*arguments)
        apply_adapters(model, adapters(loras), "cpu")
        adapted = model(*arguments)
    scratch = tmp_path_factory.mktemp("world2")
    mp.start_processes(
        worker,
        args=(2, str(scratch / "store"), str(folder), loras, str(scratch)),
        nprocs=2,
        join=True,
        start_method="forkserver",
    )
    ranks = [torch.load(scratch / f"rank{rank}.pt") for rank in range(2)]
    return ranks, {"base": base, "adapted": adapted}


@pytest.mark.parametrize(("sp", "tp"), LAYOUTS, ids=["ulysses2", "tp2"])
def test_a_dit_group_with_loras_equals_one_process(runs, sp: int, tp: int) -> None:
    ranks, single = runs
    for rank in ranks:
        result = rank[(sp, tp)]
        for got, expected, base in zip(result["adapted"], single["adapted"], single["base"], strict=True):
            assert max_relative_error(got, expected) <= TOLERANCE
            assert max_relative_error(base, expected) > 1e-2  # the LoRAs move the velocities
        for removed, before in zip(result["removed"], result["base"], strict=True):
            assert torch.equal(removed, before)
