"""benchmarks.dit_forward's fp32 yardstick: a bf16 model whose weights are widened only where they are used
computes the same forward as a model built in fp32 with those (bf16-valued) weights, and leaves its block linears
in bf16."""

from __future__ import annotations

import torch

from benchmarks import dit_forward
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig


def relative_l2(value: torch.Tensor, expected: torch.Tensor) -> float:
    return float((value - expected).norm() / expected.norm())


def test_fp32_reference_forward_matches_a_model_built_in_fp32() -> None:
    config = DiTConfig.tiny()
    device = torch.device("cpu")
    request = dit_forward.t2va_request(config, tiny=True, seed=0)
    arguments = request.as_h3_arguments()
    bf16_model = dit_forward.build_ours(config, device, seed=3)
    fp32_model = H3DiT(config, dtype=torch.float32, device="cpu").eval()
    fp32_model.load_state_dict({key: tensor.float() for key, tensor in bf16_model.state_dict().items()})

    with torch.no_grad():
        bf16_video, bf16_audio = bf16_model(*arguments)
        expected_video, expected_audio = fp32_model(*arguments)
        video, audio = dit_forward.fp32_reference_forward(bf16_model, arguments, device)

    assert video.dtype == audio.dtype == torch.float32
    assert relative_l2(video, expected_video) < 1e-5
    assert relative_l2(audio, expected_audio) < 1e-5
    # The yardstick is far closer to the fp32 model than the bf16 forward is (what it exists to measure).
    assert relative_l2(bf16_video, expected_video) > 100 * relative_l2(video, expected_video)
    assert relative_l2(bf16_audio, expected_audio) > 100 * relative_l2(audio, expected_audio)
    # Block linears went back to bf16 and the blocks' own forward is restored.
    block = bf16_model.blocks[0]
    assert all(p.dtype == torch.bfloat16 for n, p in block.named_parameters() if p.ndim == 2)
    assert "forward_from" not in vars(block)
