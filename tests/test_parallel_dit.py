"""Parallel DiT on the CPU with gloo: Ulysses, tensor-parallel and both, against the single-process `H3DiT`.

Worker processes (started from the fork server, a FileStore rendezvous) load their shard from safetensors files and
run the full packed request; the parent compares every rank's velocities with the single-process forward (fp32,
max |parallel - single| / max |single|). The packed sequence has 149 rows, so Ulysses over 2 and 4 ranks pads 1
and 3 rows. An 8-head variant of the tiny DiT lets sp and tp in {1, 2, 4} divide the heads; the real tiny
checkpoint (2 heads) checks that each rank reads only its rows from the released folder layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _parallel_dit_helpers import (
    EIGHT_HEADS,
    SEED,
    TINY,
    TINY_LAYOUTS,
    packed_request,
    worker,
)

from benchmarks._packed_request import max_relative_error
from h3engine.checkpoint.dit_format import as_native_files, diffusers_to_module, native_to_module
from h3engine.checkpoint.dit_keys import native_to_diffusers, random_native_state
from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.tiny import save_sharded
from h3engine.errors import CheckpointError
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.parallel.dit import load_dit_shard
from h3engine.models.parallel.groups import ParallelLayout, create_dit_groups

# Ulysses alone runs the same attention over the same rows; tensor parallelism adds the split GEMMs' partial sums
# in another order (fp32 rounding noise).
TOLERANCE = 1e-5


def single_process_forward(model: H3DiT, config: DiTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(*packed_request(config).as_h3_arguments())


# --------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight_head_state() -> dict[str, torch.Tensor]:
    return random_native_state(EIGHT_HEADS, SEED)


@pytest.fixture(scope="module")
def eight_head_folder(tmp_path_factory, eight_head_state) -> Path:
    """The 8-head DiT written like a released transformer folder (two shards and an index)."""
    folder = tmp_path_factory.mktemp("eight_heads")
    save_sharded(eight_head_state, folder, "model", 2, "model.safetensors.index.json")
    return folder


@pytest.fixture(scope="module")
def eight_head_diffusers_folder(tmp_path_factory, eight_head_state) -> Path:
    """The same 8-head DiT written like a diffusers transformer folder."""
    folder = tmp_path_factory.mktemp("eight_heads_diffusers")
    index = "diffusion_pytorch_model.safetensors.index.json"
    save_sharded(native_to_diffusers(eight_head_state), folder, "diffusion_pytorch_model", 2, index)
    return folder


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=SEED)


@pytest.fixture(scope="module")
def tiny_dit_folder(tiny_checkpoint) -> Path:
    return detect_layout(tiny_checkpoint).for_task("t2va").dit


@pytest.fixture(scope="module")
def eight_head_reference(eight_head_state) -> tuple[torch.Tensor, torch.Tensor]:
    model = H3DiT(EIGHT_HEADS, dtype=torch.float32)
    model.load_state_dict(native_to_module(eight_head_state, EIGHT_HEADS), strict=True)
    return single_process_forward(model.eval(), EIGHT_HEADS)


@pytest.fixture(scope="module")
def eight_head_diffusers_reference(eight_head_diffusers_folder) -> tuple[torch.Tensor, torch.Tensor]:
    """One process holding the whole diffusers-layout checkpoint, converted the single-process loader's way."""
    files = WeightFiles.open(eight_head_diffusers_folder)
    model = H3DiT(EIGHT_HEADS, dtype=torch.float32)
    state = {key: files.tensor(key) for key in files.infos}
    model.load_state_dict(diffusers_to_module(state, EIGHT_HEADS), strict=True)
    return single_process_forward(model.eval(), EIGHT_HEADS)


@pytest.fixture(scope="module")
def tiny_reference(tiny_checkpoint) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's own single-process load of the tiny checkpoint."""
    layout = detect_layout(tiny_checkpoint)
    model = dit_source(layout, layout.for_task("t2va"), torch.float32).load(torch.device("cpu"))
    return single_process_forward(model, TINY)


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, eight_head_folder, eight_head_diffusers_folder, tiny_dit_folder):
    """world size -> every rank's results, spawning each world once for the whole module."""
    runs: dict[int, list[dict]] = {}

    def results(world_size: int) -> list[dict]:
        if world_size not in runs:
            scratch = tmp_path_factory.mktemp(f"world{world_size}")
            arguments = (
                world_size,
                str(scratch / "store"),
                str(eight_head_folder),
                str(eight_head_diffusers_folder),
                str(tiny_dit_folder),
                str(scratch),
            )
            mp.start_processes(
                worker, args=arguments, nprocs=world_size, join=True, start_method="forkserver"
            )
            runs[world_size] = [torch.load(scratch / f"rank{rank}.pt") for rank in range(world_size)]
        return runs[world_size]

    return results


# --------------------------------------------------------------------------------------------------------------
# Layout validation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"world_size": 3, "dit_sp": 3}, "--dit-sp 3 does not divide the 56 attention heads"),
        ({"world_size": 3, "dit_tp": 3}, "--dit-tp 3 does not divide the 56 attention heads"),
        ({"world_size": 4, "dit_sp": 2}, "--dit-sp 2 x --dit-tp 1 = 2 ranks, but the DiT group has 4"),
        ({"world_size": 16, "dit_sp": 8, "dit_tp": 2}, "--dit-sp 8 x --dit-tp 2 = 16 does not divide the 56"),
        ({"world_size": 0}, "number of GPUs must be a positive integer, got 0"),
        ({"world_size": 2, "dit_sp": 0, "dit_tp": 2}, "--dit-sp must be a positive integer, got 0"),
        (
            {"world_size": 2, "dit_tp": 2, "dit_heads": 8, "dit_ffn_dim": 9},
            "--dit-tp 2 does not divide the DiT's FFN",
        ),
    ],
)
def test_layout_errors_name_the_flag(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelLayout(**arguments)


def test_released_profiles_and_rank_coordinates() -> None:
    for world_size, sp, tp in [
        (1, 1, 1),
        (2, 2, 1),
        (2, 1, 2),
        (4, 2, 2),
        (4, 4, 1),
        (8, 8, 1),
        (8, 2, 4),
        (7, 7, 1),
    ]:
        ParallelLayout(world_size, sp, tp)
    layout = ParallelLayout(8, dit_sp=2, dit_tp=4)
    assert [layout.coordinates(rank) for rank in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert layout.tensor_parallel_ranks(1) == [4, 5, 6, 7]
    assert layout.sequence_parallel_ranks(2) == [2, 6]


# --------------------------------------------------------------------------------------------------------------
# World size 1 (no torch.distributed) and refusals
# --------------------------------------------------------------------------------------------------------------


def test_world_size_one_computes_exactly_the_single_process_model(
    eight_head_folder, eight_head_reference
) -> None:
    groups = create_dit_groups(ParallelLayout.for_dit(EIGHT_HEADS, 1))
    model = load_dit_shard(WeightFiles.open(eight_head_folder), EIGHT_HEADS, groups, torch.float32, "cpu")
    video, audio = single_process_forward(model, EIGHT_HEADS)
    assert torch.equal(video, eight_head_reference[0]) and torch.equal(audio, eight_head_reference[1])


def test_layout_must_match_the_model(eight_head_folder) -> None:
    groups = create_dit_groups(ParallelLayout(1))  # validated for the released 56 heads
    with pytest.raises(ValueError, match="validated for 56 heads"):
        load_dit_shard(WeightFiles.open(eight_head_folder), EIGHT_HEADS, groups, torch.float32, "cpu")


def test_diffusers_layout_at_world_size_one_computes_exactly_the_single_process_model(
    eight_head_diffusers_folder, eight_head_diffusers_reference, eight_head_reference
) -> None:
    # Both layouts hold the same weights: one process computes the same bits from either.
    assert all(map(torch.equal, eight_head_diffusers_reference, eight_head_reference))
    groups = create_dit_groups(ParallelLayout.for_dit(EIGHT_HEADS, 1))
    files = WeightFiles.open(eight_head_diffusers_folder)
    model = load_dit_shard(files, EIGHT_HEADS, groups, torch.float32, "cpu")
    video, audio = single_process_forward(model, EIGHT_HEADS)
    assert torch.equal(video, eight_head_diffusers_reference[0])
    assert torch.equal(audio, eight_head_diffusers_reference[1])


def test_shards_of_a_diffusers_layout_without_whole_heads_are_refused(eight_head_diffusers_folder) -> None:
    files = as_native_files(WeightFiles.open(eight_head_diffusers_folder), EIGHT_HEADS)
    with pytest.raises(CheckpointError, match="whole heads"):
        files.row_slice("blocks.0.attn.qkv_proj.weight", 0, EIGHT_HEADS.head_dim)


# --------------------------------------------------------------------------------------------------------------
# Gloo worlds of 2 and 4
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, sp, tp",
    [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 1, 4), (4, 2, 2)],
    ids=["ulysses2", "tp2", "ulysses4", "tp4", "ulysses2xtp2"],
)
def test_parallel_forward_matches_single_process(
    parallel_runs, eight_head_reference, world_size: int, sp: int, tp: int
) -> None:
    reference_video, reference_audio = eight_head_reference
    for rank, results in enumerate(parallel_runs(world_size)):
        video, audio = results["eight_heads"][(sp, tp)]
        assert video.shape == reference_video.shape and audio.shape == reference_audio.shape
        video_error = max_relative_error(video, reference_video)
        audio_error = max_relative_error(audio, reference_audio)
        assert video_error <= TOLERANCE, f"rank {rank}: video error {video_error:.3g}"
        assert audio_error <= TOLERANCE, f"rank {rank}: audio error {audio_error:.3g}"


@pytest.mark.parametrize(
    "world_size, sp, tp", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["ulysses2", "tp2", "ulysses2xtp2"]
)
def test_diffusers_layout_shards_match_single_process(
    parallel_runs,
    eight_head_diffusers_reference,
    eight_head_diffusers_folder,
    world_size: int,
    sp: int,
    tp: int,
) -> None:
    whole = sum(
        torch.Size(info.shape).numel()
        for info in WeightFiles.open(eight_head_diffusers_folder).infos.values()
    )
    for rank, results in enumerate(parallel_runs(world_size)):
        (video, audio), reads = results["eight_heads_diffusers"][(sp, tp)]
        video_error = max_relative_error(video, eight_head_diffusers_reference[0])
        audio_error = max_relative_error(audio, eight_head_diffusers_reference[1])
        assert video_error <= TOLERANCE, f"rank {rank}: video error {video_error:.3g}"
        assert audio_error <= TOLERANCE, f"rank {rank}: audio error {audio_error:.3g}"
        elements_read = sum(elements for *_, elements in reads)
        assert elements_read < whole if tp > 1 else elements_read == whole, f"rank {rank}"


def test_ulysses_all_to_all_trades_rows_for_heads(parallel_runs) -> None:
    whole = torch.arange(8 * 2 * 8 * 3, dtype=torch.float32).view(8, 2, 8, 3)
    for rank, results in enumerate(parallel_runs(4)):
        by_heads, back = results["all_to_all"]
        assert torch.equal(by_heads, whole[:, :, 2 * rank : 2 * rank + 2])
        assert torch.equal(back, whole[2 * rank : 2 * rank + 2])


@pytest.mark.parametrize("sp, tp", TINY_LAYOUTS, ids=["ulysses2", "tp2"])
def test_tiny_checkpoint_shard_matches_engine_load(parallel_runs, tiny_reference, sp: int, tp: int) -> None:
    for rank, results in enumerate(parallel_runs(2)):
        (video, audio), _ = results["tiny"][(sp, tp)]
        assert max_relative_error(video, tiny_reference[0]) <= TOLERANCE, f"rank {rank}"
        assert max_relative_error(audio, tiny_reference[1]) <= TOLERANCE, f"rank {rank}"


def expected_tensor_parallel_reads(key: str, rank: int, ranks: int) -> list[tuple[str, int, int]] | None:
    """Rows / columns rank `rank` must read of a split tensor (docs/MODEL.md §1.3), or None for a replicated one."""
    qkv_rows, fc1_rows = 3 * TINY.inner_dim // ranks, TINY.ffn_dim // ranks
    if key.endswith("attn.qkv_proj.weight"):  # per-head interleaved: a rank's heads are one row range
        return [("row_slice", rank * qkv_rows, (rank + 1) * qkv_rows)]
    if key.endswith("mlp.fc1.weight"):  # [gate; value]: the same slice of each half
        gate = (rank * fc1_rows, (rank + 1) * fc1_rows)
        return [("row_slice", *gate), ("row_slice", gate[0] + TINY.ffn_dim, gate[1] + TINY.ffn_dim)]
    if key.endswith("attn.out_proj.weight"):
        columns = TINY.inner_dim // ranks
        return [("column_slice", rank * columns, (rank + 1) * columns)]
    if key.endswith("mlp.fc2.weight"):
        return [("column_slice", rank * fc1_rows, (rank + 1) * fc1_rows)]
    return None


def test_tensor_parallel_ranks_read_only_their_rows(parallel_runs, tiny_dit_folder) -> None:
    files = WeightFiles.open(tiny_dit_folder)
    split_elements = 0
    for rank, results in enumerate(parallel_runs(2)):
        _, reads = results["tiny"][(1, 2)]
        by_key: dict[str, list[tuple[str, int, int]]] = {}
        elements_read = 0
        for method, key, start, stop, elements in reads:
            by_key.setdefault(key, []).append((method, start, stop))
            elements_read += elements
        assert set(by_key) == set(files.infos), "every tensor is read, and only once per rank"
        for key, key_reads in by_key.items():
            expected = expected_tensor_parallel_reads(key, rank, 2)
            assert key_reads == (expected or [("tensor", 0, 0)]), key
            if expected is not None:
                split_elements += sum(elements for method, k, *_, elements in reads if k == key)
        whole = sum(torch.Size(info.shape).numel() for info in files.infos.values())
        assert elements_read < whole
    split_whole = sum(
        torch.Size(info.shape).numel()
        for key, info in files.infos.items()
        if expected_tensor_parallel_reads(key, 0, 2) is not None
    )
    assert split_elements == split_whole, "the two ranks' shards tile the split tensors exactly"
