"""Activation chunking of the DiT forward (h3engine.models.dit_chunks): the chunked forward computes what the whole one
does, on a tiny DiT with 4 heads and 149 packed rows (odd: the last row chunk is short; 120 video, 18 audio rows).

What is compared, and how exactly:
* Under `RowIndependentGemms` every F.linear is a plain sequence of elementwise products and sums, so each output
  element is computed the same way whatever rows or columns a call holds. Everything else (QK-norm + RoPE, the
  attention kernel, SwiGLU, the norms, the gathers) is elementwise, per row or per head in itself. The chunked
  forward must then equal the whole one BIT FOR BIT, fp32 and bf16, for every chunk count: any difference is the
  chunking's (a wrong slice, a lost LoRA update, a missed row). Also with a LoRA, streamed, under the step cache, and
  where the chunking falls back (a kernel that is not the local one, FP8, tensor- and sequence-parallel layers).
* The real kernels that chunking relies on give the same bits per head group and per row chunk (SDPA, the fused
  QK-norm + RoPE, SwiGLU): checked bit for bit. A streamed chunked DiT equals the resident chunked one bit for bit.
* With the platform's GEMMs the chunked forward equals the whole one only to rounding: MKL's fp32 GEMM sums in
  another order over a few rows (a GEMV for one row, other kernels below a dozen) and over column slices that are no
  multiple of 16 (a head group's q, k, v), measured here at <= 3e-7 of the largest output in fp32. bf16 GEMMs gave the
  same bits on any rows and columns here (the bf16 DiT differed only at one-row chunks, through its fp32 islands), but
  another CPU's may not (see the tolerances).
* A test must be able to fail: a head group written into another group's heads, and a row chunk left out, are caught.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dit_helpers import tiny_fl2va_request
from _lora_helpers import small_lora
from torch.overrides import TorchFunctionMode

from benchmarks._packed_request import max_relative_error
from h3engine.checkpoint.lora_format import LoraFile, LoraLayer
from h3engine.engine.lora.adapters import Adapter, apply_adapters, remove_adapters
from h3engine.engine.sampling.step_cache import CachePreset, StepCache
from h3engine.memory.layers import dit_layers
from h3engine.memory.streaming import LayerStream
from h3engine.models import dit_chunks, ops
from h3engine.models.dit import H3DiT, set_activation_chunks
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import LOW_RANK_ATTRIBUTE, Attention, FinalLayer, SwiGLU, attention
from h3engine.models.parallel.dit import SequenceParallelDiT, _apply_tensor_parallel
from h3engine.models.parallel.groups import GroupMembership
from h3engine.models.quantization import Fp8Linear, quantize_dit_linears

CONFIG = dataclasses.replace(DiTConfig.tiny(), num_heads=4, num_layers=3)
TEXT_ROWS = 11  # 149 packed rows
# Row chunks of 75/74, 50/50/49, 38 x 3 + 35, 22 x 6 + 17 rows and one row each; head groups of 2+2, 2+1+1, 1 x 4.
CHUNKS = (2, 3, 4, 7, 200)
# With the platform's GEMMs (see the module docstring): the fp32 forward to fp32 rounding, amplified by three blocks
# (the DiT parity tests' fp32 bound); bf16 keeps every bf16 rounding point, but a bf16 GEMM that sums in another
# order for fewer rows flips a rounding now and then, a few bf16 ulps (2^-8) of an output at most.
PLATFORM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# --- helpers ----------------------------------------------------------------------------------------------------


def sequential_linear(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T + b as x[:, 0] * W[:, 0] + x[:, 1] * W[:, 1] + ... (+ b), each op rounding in the inputs' dtype."""
    output = hidden[..., :1] * weight[:, 0]
    for feature in range(1, weight.shape[1]):
        output = output + hidden[..., feature : feature + 1] * weight[:, feature]
    return output if bias is None else output + bias


class RowIndependentGemms(TorchFunctionMode):
    """Inside, every F.linear is `sequential_linear`: unlike a BLAS GEMM, whose blocking (and so summation order)
    depends on how many rows and columns a call holds, each output element is then computed the same way always."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear or func is torch._C._nn.linear:
            return sequential_linear(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def random_dit(dtype: torch.dtype, config: DiTConfig = CONFIG, seed: int = 0) -> H3DiT:
    """A tiny DiT with every weight drawn (no block is an identity), as tests/test_memory_streaming.py makes them."""
    torch.manual_seed(seed)
    dit = H3DiT(config, dtype=dtype)
    with torch.no_grad():
        for parameter in dit.parameters():
            parameter.normal_(0.0, 0.3)
    return dit.eval().requires_grad_(False)


def copy_of(dit: H3DiT, kind: type[H3DiT] = H3DiT, *args: object) -> H3DiT:
    twin = kind(dit.config, *args, dtype=dit.compute_dtype)
    twin.load_state_dict(dit.state_dict())
    return twin.eval().requires_grad_(False)


def request_for(dtype: torch.dtype, config: DiTConfig = CONFIG):
    request = tiny_fl2va_request(config, dtype, seed=1, text_rows=TEXT_ROWS)
    assert request.timestep_index.numel() % 2 == 1
    return request


def forward(dit: H3DiT, request, chunks: int, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    set_activation_chunks(dit, chunks)
    with torch.inference_mode():
        return dit(*request.as_h3_arguments(), **kwargs)


def exact_forward(dit: H3DiT, request, chunks: int, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    with RowIndependentGemms():
        return forward(dit, request, chunks, **kwargs)


def identical(first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def in_memory_lora(config: DiTConfig, seed: int, only: str = "") -> Adapter:
    """`small_lora` (every linear, or those whose name holds `only`) as a parsed file, without writing one."""
    lora = small_lora(config, seed, only)
    layers = {
        module: LoraLayer(
            lora.down[module], lora.up[module], lora.alpha[module] / lora.down[module].shape[0], module
        )
        for module in lora.down
    }
    return Adapter(LoraFile(Path(f"small-{seed}.safetensors"), f"small-{seed}", "original", {None: layers}))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dit_and_request(request):
    dtype = request.param
    dit, packed = random_dit(dtype), request_for(dtype)
    return dit, packed, exact_forward(dit, packed, 1)


# --- the pieces ---------------------------------------------------------------------------------------------------


def test_rows_split_ceil_divided_and_heads_as_evenly_as_possible() -> None:
    def sizes(slices: list[slice]) -> list[int]:
        return [part.stop - part.start for part in slices]

    for rows, chunks in [(149, 1), (149, 2), (149, 3), (149, 4), (149, 7), (9, 16), (1, 3), (0, 3)]:
        slices = dit_chunks.row_slices(rows, chunks)
        assert [part.start for part in slices] == [0, *[part.stop for part in slices]][: len(slices)]
        assert sum(sizes(slices)) == rows and all(size > 0 for size in sizes(slices))
        assert all(size == -(-rows // chunks) for size in sizes(slices)[:-1])
    assert sizes(dit_chunks.row_slices(149, 4)) == [38, 38, 38, 35]
    assert sizes(dit_chunks.row_slices(9, 16)) == [1] * 9
    assert sizes(dit_chunks.head_groups(4, 3)) == [2, 1, 1]
    assert sizes(dit_chunks.head_groups(4, 7)) == [1, 1, 1, 1]
    assert sizes(dit_chunks.head_groups(56, 8)) == [7] * 8
    assert sizes(dit_chunks.head_groups(56, 5)) == [12, 11, 11, 11, 11]
    groups = dit_chunks.head_groups(56, 5)
    assert groups[0].start == 0 and groups[-1].stop == 56
    assert all(a.stop == b.start for a, b in zip(groups, groups[1:], strict=False))


def test_the_setting_reaches_every_reader_and_is_checked() -> None:
    dit = random_dit(torch.float32)
    readers = [module for module in dit.modules() if isinstance(module, Attention | SwiGLU | FinalLayer)]
    assert len(readers) == 2 * (CONFIG.num_layers + CONFIG.num_refiner_layers) + 1
    assert dit.activation_chunks == 1 and all(module.activation_chunks == 1 for module in readers)
    state = {key: value.clone() for key, value in dit.state_dict().items()}
    set_activation_chunks(dit, 5)
    assert dit.activation_chunks == 5 and all(module.activation_chunks == 5 for module in readers)
    # A plain attribute: nothing registered, nothing allocated, the state unchanged.
    assert dit.state_dict().keys() == state.keys()
    assert all(torch.equal(dit.state_dict()[key], value) for key, value in state.items())
    for wrong in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="activation_chunks"):
            set_activation_chunks(dit, wrong)
    assert dit.activation_chunks == 5
    with pytest.raises(AttributeError):
        dit.activation_chunks = 3  # only set_activation_chunks reaches the submodules that read it


def test_the_kernels_chunking_relies_on_give_the_same_bits_per_head_group_and_row_chunk() -> None:
    """The real SDPA kernel, the fused QK-norm + RoPE and SwiGLU (not RowIndependentGemms) on a head group or a row
    chunk compute exactly that part of their whole-tensor result."""
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        rows, heads, head_dim = 149, 4, 12
        query, key, value = (
            torch.randn(rows, heads, head_dim, generator=generator).to(dtype) for _ in range(3)
        )
        cos, sin = (torch.randn(rows, 12, generator=generator).to(dtype) for _ in range(2))
        q_weight, k_weight = (torch.randn(head_dim, generator=generator).to(dtype) for _ in range(2))
        whole_attention = attention(query, key, value)
        whole_query, whole_key = ops.qk_norm_rope(query, key, q_weight, k_weight, 1e-5, cos, sin)
        for group in dit_chunks.head_groups(heads, 3):
            parts = [tensor[:, group].contiguous() for tensor in (query, key, value)]
            assert torch.equal(attention(*parts), whole_attention[:, group])
            normed = ops.qk_norm_rope(parts[0], parts[1], q_weight, k_weight, 1e-5, cos, sin)
            assert torch.equal(normed[0], whole_query[:, group]) and torch.equal(
                normed[1], whole_key[:, group]
            )
        fused = torch.randn(rows, 64, generator=generator).to(dtype)
        assert torch.equal(dit_chunks.map_rows(ops.swiglu, fused, 3), ops.swiglu(fused))


# --- the chunked forward against the whole one ----------------------------------------------------------------


@pytest.mark.parametrize("chunks", CHUNKS)
def test_a_chunked_forward_computes_the_whole_ones_bits(dit_and_request, chunks: int) -> None:
    dit, request, expected = dit_and_request
    assert identical(exact_forward(dit, request, chunks), expected)
    # One chunk again is the plain path.
    assert identical(exact_forward(dit, request, 1), expected)


@pytest.mark.parametrize("chunks", CHUNKS)
def test_with_the_platforms_gemms_a_chunked_forward_is_within_rounding(dit_and_request, chunks: int) -> None:
    dit, request, _ = dit_and_request
    expected = forward(dit, request, 1)
    got = forward(dit, request, chunks)
    tolerance = PLATFORM_TOLERANCE[dit.compute_dtype]
    for velocity, reference in zip(got, expected, strict=True):
        assert max_relative_error(velocity, reference) <= tolerance


@pytest.mark.parametrize("only", ["", "attn.qkv_proj"], ids=["every-linear", "qkv-only"])
def test_a_lora_is_added_to_every_chunk_and_head_group(dit_and_request, only: str) -> None:
    dit, request, plain = dit_and_request
    adapter = in_memory_lora(CONFIG, 21, only)
    adapted = copy_of(dit)
    apply_adapters(adapted, [adapter])
    try:
        assert hasattr(adapted.blocks[0].attn.qkv_proj, LOW_RANK_ATTRIBUTE)
        expected = exact_forward(adapted, request, 1)
        # The update moves the outputs, so a chunked path that dropped it (from any head group) would show.
        assert all(max_relative_error(a, b) > 1e-3 for a, b in zip(expected, plain, strict=True))
        for chunks in (2, 3, 7):
            assert identical(exact_forward(adapted, request, chunks), expected)
    finally:
        remove_adapters(adapted)
    assert identical(exact_forward(adapted, request, 3), plain)


def test_a_streamed_dit_computes_the_same_chunked_or_not(dit_and_request) -> None:
    dit, request, expected = dit_and_request
    streamed = copy_of(dit)
    stream = LayerStream(dit_layers(streamed), 0, "cpu", 2)
    layers = len(stream.layers)
    for number, chunks in enumerate((3, 1, 7), start=1):
        assert identical(exact_forward(streamed, request, chunks), expected)
        # The attn / mlp hooks still bracket every block's weight reads: every layer visited once, in order.
        assert stream.visits == number * layers and stream.restarts == 0
    # With the platform's GEMMs too, streaming changes nothing: the same chunked arithmetic on the same values.
    assert identical(forward(streamed, request, 3), forward(dit, request, 3))
    stream.remove()


def test_the_step_cache_runs_the_chunked_blocks_alike(dit_and_request) -> None:
    dit, request, _ = dit_and_request
    preset = CachePreset(
        "test", first_blocks=1, last_blocks=0, threshold=10.0, warmup_steps=0, max_consecutive=-1
    )
    results = {}
    for chunks in (1, 3):
        cache = StepCache(preset)
        cache.use_rows(request.video_index, request.audio_index)
        results[chunks] = [exact_forward(dit, request, chunks, blocks_runner=cache.run) for _ in range(3)]
        assert cache.decisions.skipped == 2  # the later forwards reuse the middle blocks' residual
    assert all(identical(a, b) for a, b in zip(results[1], results[3], strict=True))


# --- where chunking falls back ------------------------------------------------------------------------------------


@pytest.fixture
def chunk_calls(monkeypatch):
    """Record the chunk count of every `map_rows` call by the function it maps, and every head-group attention."""
    calls: dict[str, list] = {"rows": [], "heads": []}
    map_rows, by_head_groups = dit_chunks.map_rows, dit_chunks.attention_by_head_groups

    def recording_map_rows(function, rows, chunks):
        calls["rows"].append((function.__qualname__.split(".")[0], chunks))
        return map_rows(function, rows, chunks)

    def recording_head_groups(attn, *args):
        calls["heads"].append(attn)
        return by_head_groups(attn, *args)

    monkeypatch.setattr(dit_chunks, "map_rows", recording_map_rows)
    monkeypatch.setattr(dit_chunks, "attention_by_head_groups", recording_head_groups)
    return calls


def test_a_kernel_that_is_not_the_local_one_gets_every_head_at_once(dit_and_request, chunk_calls) -> None:
    dit, request, expected = dit_and_request
    seen_heads = []

    def exchanging_kernel(query, key, value):  # stands for one that trades rows between ranks (Ulysses)
        seen_heads.append(query.shape[1])
        return attention(query, key, value)

    arguments = request.as_h3_arguments()
    layout = dataclasses.replace(dit.prepare_layout(*arguments[4:]), attend=exchanging_kernel)
    set_activation_chunks(dit, 3)
    with RowIndependentGemms(), torch.inference_mode():
        got = dit.forward_with_layout(*arguments[:4], layout)
    assert identical(got, expected)
    assert seen_heads == [CONFIG.num_heads] * CONFIG.num_layers
    # Only the token refiner's attention (which always attends locally) went by head groups.
    assert chunk_calls["heads"] == [block.attn for block in dit.token_refiner.blocks]
    assert ("SwiGLU", 3) in chunk_calls["rows"] and ("fp32_velocities", 3) in chunk_calls["rows"]


def test_fp8_layers_are_not_chunked(chunk_calls) -> None:
    dit, request = random_dit(torch.float32), request_for(torch.float32)
    quantize_dit_linears(dit)
    assert isinstance(dit.blocks[0].attn.qkv_proj, Fp8Linear)
    expected = exact_forward(dit, request, 1)
    chunk_calls["rows"].clear()
    assert identical(exact_forward(dit, request, 4), expected)
    assert chunk_calls["heads"] == [block.attn for block in dit.token_refiner.blocks]
    refiner, blocks = CONFIG.num_refiner_layers, CONFIG.num_layers
    assert chunk_calls["rows"].count(("SwiGLU", 4)) == refiner
    assert chunk_calls["rows"].count(("SwiGLU", 1)) == blocks


def test_tensor_and_sequence_parallel_layers_are_not_chunked(dit_and_request, chunk_calls) -> None:
    """At world size 1 (groups of one, no process group): the parallel layers' sums are no-ops, so the results must
    be the plain DiT's; chunking skips the layers that would sum per call and the Ulysses kernel."""
    dit, request, expected = dit_and_request
    tensor_parallel = H3DiT(dit.config, dtype=dit.compute_dtype)
    _apply_tensor_parallel(tensor_parallel, GroupMembership.alone())
    tensor_parallel.load_state_dict(dit.state_dict())
    tensor_parallel.eval().requires_grad_(False)
    assert identical(exact_forward(tensor_parallel, request, 3), expected)
    assert chunk_calls["heads"] == [] and ("SwiGLU", 3) not in chunk_calls["rows"]
    sequence_parallel = copy_of(dit, SequenceParallelDiT, GroupMembership.alone())
    chunk_calls["rows"].clear()
    assert identical(
        exact_forward(sequence_parallel, request, 3), exact_forward(sequence_parallel, request, 1)
    )
    # Its attention kernel exchanges rows (refiner aside); its FFN (plain linears on local rows) and heads chunk.
    assert chunk_calls["heads"] == [block.attn for block in sequence_parallel.token_refiner.blocks]
    assert ("SwiGLU", 3) in chunk_calls["rows"] and ("fp32_velocities", 3) in chunk_calls["rows"]


# --- the comparison catches a wrong chunking ----------------------------------------------------------------------


def test_a_head_group_written_into_other_heads_is_caught(dit_and_request, monkeypatch) -> None:
    dit, request, expected = dit_and_request
    attend_head_group = dit_chunks.attend_head_group

    def next_groups_heads(attn, hidden, heads, *args):
        width = heads.stop - heads.start
        start = (heads.start + width) % attn.num_heads
        return attend_head_group(attn, hidden, slice(start, start + width), *args)

    monkeypatch.setattr(dit_chunks, "attend_head_group", next_groups_heads)
    assert not identical(exact_forward(dit, request, 2), expected)  # groups (0, 1) and (2, 3) swapped
    monkeypatch.undo()
    assert identical(exact_forward(dit, request, 2), expected)


def test_a_row_chunk_left_out_is_caught(dit_and_request, monkeypatch) -> None:
    dit, request, expected = dit_and_request
    row_slices = dit_chunks.row_slices
    monkeypatch.setattr(dit_chunks, "row_slices", lambda rows, chunks: row_slices(rows, chunks)[:-1])
    got = exact_forward(dit, request, 3)
    assert not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
