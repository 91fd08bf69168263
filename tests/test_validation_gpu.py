"""The validation kit on a CUDA GPU (every test here skips, with its reason, without one; the reference runner needs
diffusers, the test extra): ours at the released precision (bf16 through the fused Triton ops) on the GPU against the
reference runner at fp32 on the CPU, T2VA and FL2VA in the sglang convention, tiny checkpoint. `compare --tol bf16`
must say MATCH (the bf16 bounds were set from CPU runs; this shows they hold for the GPU's kernels), and the default
fp32 bounds must not (a bf16 run is not an fp32 one: the bounds tell them apart). Each table is printed (-s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _parity_helpers import synthetic_image

from h3engine.cli.main import main

pytestmark = pytest.mark.cuda
PROMPT = "A red fox runs. <d>[English] Look!</d>"
SEED = 5


def run(command: str, checkpoint: Path, capture: Path, *extra: str) -> int:
    return main(
        [command, "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--seed", str(SEED), "--steps", "4",
         "--recipe", "sglang", "--capture", str(capture), *extra]
    )  # fmt: skip


def test_ours_in_bf16_on_a_gpu_matches_the_fp32_reference_within_the_bf16_bounds(
    tiny_checkpoints, tmp_path: Path, capsys
) -> None:
    pytest.importorskip("diffusers", reason="the reference runner needs diffusers (requirements-dev.txt)")
    checkpoint = tiny_checkpoints("diffusers", seed=3)
    keyframe = tmp_path / "first.png"
    synthetic_image(72, 40, 1).save(keyframe)
    for task, inputs in (("t2va", ()), ("fl2va", ("--first-frame", str(keyframe)))):
        ours, theirs = tmp_path / f"ours_{task}", tmp_path / f"reference_{task}"
        gpu = ("--device", "cuda", "--dtype", "bfloat16", "-q", "--out", str(tmp_path / f"{task}.mp4"))
        assert run("generate", checkpoint, ours, *inputs, *gpu) == 0, task
        assert run("reference", checkpoint, theirs, *inputs) == 0, task
        capsys.readouterr()
        bf16 = main(["compare", str(ours), str(theirs), "--tol", "bf16"])
        table = capsys.readouterr().out
        with capsys.disabled():
            print(f"\n{task}, ours bf16 on {tmp_path.name} vs the fp32 reference:\n{table}")
        assert bf16 == 0 and "verdict: MATCH" in table, table
        assert main(["compare", str(ours), str(theirs)]) == 1, task
        assert "verdict: DIVERGED first at text_states" in capsys.readouterr().out, task
