"""The attention dispatch point: backend choice, the forcing variable, fallback, and (on a GPU) every backend
against the SDPA reference twin."""

from __future__ import annotations

import pytest
import torch

from h3engine.models import attention as attention_ops


@pytest.fixture(autouse=True)
def fresh_failures(monkeypatch):
    monkeypatch.setattr(attention_ops, "_failed", {})
    monkeypatch.delenv(attention_ops.FORCE_ENVIRONMENT_VARIABLE, raising=False)


def random_qkv(rows: int, heads: int, head_dim: int, dtype=torch.float32, device="cpu"):
    generator = torch.Generator(device=device).manual_seed(rows * 31 + heads)
    return [
        torch.randn(rows, heads, head_dim, generator=generator, device=device, dtype=torch.float32).to(dtype)
        for _ in range(3)
    ]


def explicit_attention(query, key, value):
    scores = torch.einsum("qhd,khd->hqk", query.double(), key.double()) / query.shape[-1] ** 0.5
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), value.double())


def test_cpu_uses_the_sdpa_reference_and_it_is_exact_attention() -> None:
    query, key, value = random_qkv(37, 3, 12)
    assert attention_ops.candidate_backends(torch.device("cpu"), torch.float32, 12) == ["sdpa"]
    assert attention_ops.selected_backend(query) == "sdpa"
    output = attention_ops.attention(query, key, value)
    assert output.shape == (37, 3, 12)
    torch.testing.assert_close(output.double(), explicit_attention(query, key, value), rtol=1e-5, atol=1e-6)


def test_forcing_variable_is_validated_and_honoured(monkeypatch) -> None:
    monkeypatch.setenv(attention_ops.FORCE_ENVIRONMENT_VARIABLE, "nonsense")
    with pytest.raises(ValueError, match="H3_ATTENTION"):
        attention_ops.candidate_backends(torch.device("cpu"), torch.float32, 12)
    monkeypatch.setenv(attention_ops.FORCE_ENVIRONMENT_VARIABLE, "fa4")
    assert attention_ops.candidate_backends(torch.device("cpu"), torch.float32, 12) == ["fa4"]
    # A forced backend that cannot run raises instead of silently falling back.
    monkeypatch.setattr(attention_ops, "_fa4_function", lambda: None)
    with pytest.raises(RuntimeError, match="FlashAttention-4"):
        attention_ops.attention(*random_qkv(8, 2, 16))


def test_a_failing_fast_backend_falls_back_once_and_is_remembered(monkeypatch) -> None:
    calls = []

    def broken(query, key, value):
        calls.append(1)
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(attention_ops, "candidate_backends", lambda *args: ["fa4", "sdpa"])
    monkeypatch.setitem(attention_ops._IMPLEMENTATIONS, "fa4", broken)
    query, key, value = random_qkv(16, 2, 8)
    expected = attention_ops.sdpa_attention(query, key, value)
    assert torch.equal(attention_ops.attention(query, key, value), expected)
    assert torch.equal(attention_ops.attention(query, key, value), expected)
    assert len(calls) == 1
    assert attention_ops.selected_backend(query) == "sdpa"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["fa4", "cudnn"])
@pytest.mark.parametrize("shape", [(1000, 4, 128), (4097, 3, 64), (333, 2, 128)])
def test_gpu_backends_match_the_reference(backend, shape) -> None:
    if backend == "fa4" and attention_ops._fa4_function() is None:
        pytest.skip("FlashAttention-4 is not installed on this GPU machine")
    query, key, value = random_qkv(*shape, dtype=torch.bfloat16, device="cuda")
    expected = explicit_attention(query, key, value)
    output = attention_ops._IMPLEMENTATIONS[backend](query, key, value)
    reference = attention_ops.sdpa_attention(query, key, value)
    error = (output.double() - expected).norm() / expected.norm()
    reference_error = (reference.double() - expected).norm() / expected.norm()
    # Both are exact attention with bf16 rounding: the same error against fp64 within a small factor.
    assert error <= 2 * reference_error, (error, reference_error)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1000, 4097, 38_222])
def test_gpu_fa4_tuned_tiles_match_the_reference_without_host_syncs(rows, monkeypatch) -> None:
    if attention_ops._fa4_function() is None:
        pytest.skip("FlashAttention-4 is not installed on this GPU machine")
    monkeypatch.setattr(attention_ops, "_untuned", set())
    heads = 56 if rows == 38_222 else 3
    query, key, value = random_qkv(rows, heads, 128, dtype=torch.bfloat16, device="cuda")
    tiles = attention_ops.fa4_tiles(query)
    major, _ = torch.cuda.get_device_capability()
    if major == 9:
        assert tiles is not None and tiles["tile_mn"] == (192, 128)
    attention_ops.fa4_attention(query, key, value)  # compiles outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        output = attention_ops.fa4_attention(query, key, value)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not attention_ops._untuned, "the tuned FA4 call failed and fell back"
    # Against float64 on a slice of the query rows (all keys): the same error as torch's SDPA within a small factor.
    sample = slice(0, 512)
    expected = explicit_attention(query[sample], key, value)
    reference = attention_ops.sdpa_attention(query, key, value)[sample]
    error = (output[sample].double() - expected).norm() / expected.norm()
    reference_error = (reference.double() - expected).norm() / expected.norm()
    assert error <= 2 * reference_error, (error, reference_error)


@pytest.mark.cuda
def test_gpu_candidates_leave_out_head_sizes_the_fast_kernels_do_not_take() -> None:
    device = torch.device("cuda")
    assert attention_ops.candidate_backends(device, torch.bfloat16, 12) == ["sdpa"]
    assert attention_ops.candidate_backends(device, torch.bfloat16, 128)[-2:] == ["cudnn", "sdpa"]
