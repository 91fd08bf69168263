"""On a GPU, the denoising loop's steady state never makes the host wait for the device (no .item(), no blocking
copies): torch's sync debug mode turns any synchronizing call between the first and the last step into an error."""

from __future__ import annotations

import pytest
import torch

from h3engine.engine.engine import Engine
from h3engine.request.model import GenerationRequest

pytestmark = pytest.mark.cuda


def test_steps_after_the_first_do_not_synchronize(tiny_checkpoints) -> None:
    engine = Engine.from_checkpoint(tiny_checkpoints("native", seed=5), "cuda", torch.bfloat16)
    checked_steps = []

    def on_step(event) -> None:
        # Armed after step 1 (the loop's prologue may copy), disarmed after the last step (decode may copy).
        if event.step == event.total:
            torch.cuda.set_sync_debug_mode(0)
        else:
            torch.cuda.set_sync_debug_mode("error")
            checked_steps.append(event.step + 1)

    try:
        engine.generate(GenerationRequest(task="t2va", prompt="a red kite", steps=6, seed=1), on_step=on_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert checked_steps == [2, 3, 4, 5, 6]
    # On a GPU the fused Triton ops run; the tiny DiT's 12-channel heads fit neither FA4 nor cuDNN (multiples of 8),
    # so its attention is SDPA, chosen up front rather than after a failing call (the released heads of 128 take
    # FA4: tests/test_ops_attention.py).
    report = engine.store.kernel_report()
    assert report == {"attention": "sdpa", "fused_ops": "triton"}, report
    # The mode really raises on a synchronizing call (so the test can fail).
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
