"""Tensor-parallel text encoder and parallel VAE decode on the CPU with gloo, against one process.

Text encoder: worker processes (from the fork server, FileStore rendezvous) load only their shard of a
tiny Qwen3-VL from its safetensors files and encode text around a picture block; every rank's states are compared
with the single-process `H3TextEncoder.encode` (fp32, max |parallel - single| / max |single|). The checkpoint's
tiny encoder (2 heads, 1 key/value head) runs tp 2 with the key/value head replicated; an 8-head, 2-key/value-head
variant runs tp 2 (key/value heads split), tp 4 (each replicated twice) and two tp-2 replicas in a world of 4.
The reads each rank makes are recorded and checked against the row / column ranges it must read.

VAE: the tiny video VAE with 32 px tiles (2 x 3 tiles per window) decodes over 2, 1 of 2, 4 and 3 of 4 ranks and
must equal the single-process `VideoVAE.decode` bit for bit (fp32, and the fp16 autocast recipe); the audio VAE
decodes on rank 0 only.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _parallel_encoder_vae_helpers import (
    EIGHT_HEAD_ENCODER,
    EIGHT_HEAD_KV_HEADS,
    EIGHT_HEADS,
    ENCODER_RUNS,
    SEED,
    TINY_ENCODER,
    VAE_CASES,
    VAE_RUNS,
    encoder_inputs,
    tiny_audio_vae,
    tiny_video_vae,
    vae_latents,
    worker,
)

from h3engine.checkpoint.loader import load_text_encoder
from h3engine.checkpoint.text_encoder_files import (
    open_text_encoder_files,
    random_text_encoder_state,
    tiny_text_encoder_config,
    write_tiny_text_encoder,
)
from h3engine.checkpoint.tiny import save_sharded, write_json
from h3engine.models.parallel.groups import (
    EncoderLayout,
    GroupMembership,
    VAELayout,
    create_encoder_groups,
    create_vae_group,
)
from h3engine.models.parallel.text_encoder import load_text_encoder_shard
from h3engine.models.parallel.vae import decode_video_and_audio, tile_share
from h3engine.models.text_encoder import H3TextEncoder

# Measured on CPU (torch 2.14.1, gloo), max relative error of the encoder states over 50 layers: tiny tp2 7.3e-7,
# 8 heads tp2 1.6e-6, tp4 1.7e-6, two tp-2 replicas 1.6e-6 (the row-parallel partial sums add in another order).
# The VAE decode is bit-identical (0.0): the same decoder calls on the same inputs, gathered without arithmetic.
TOLERANCE = 1e-5


def max_relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def eight_head_config() -> dict:
    config = tiny_text_encoder_config()
    config["text_config"].update(num_attention_heads=EIGHT_HEADS, num_key_value_heads=EIGHT_HEAD_KV_HEADS)
    return config


# --------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoder_folders(tmp_path_factory) -> dict[str, Path]:
    """The checkpoint's tiny text encoder, and the 8-head variant written the same way (config + two shards)."""
    root = tmp_path_factory.mktemp("text_encoders")
    write_tiny_text_encoder(root / TINY_ENCODER, SEED)
    config = eight_head_config()
    write_json(root / EIGHT_HEAD_ENCODER / "config.json", config)
    state = random_text_encoder_state(config, SEED)
    save_sharded(state, root / EIGHT_HEAD_ENCODER, "model", 2, "model.safetensors.index.json")
    return {TINY_ENCODER: root / TINY_ENCODER, EIGHT_HEAD_ENCODER: root / EIGHT_HEAD_ENCODER}


@pytest.fixture(scope="module")
def encoder_references(encoder_folders) -> dict[str, torch.Tensor]:
    """The engine's single-process encoder on each folder (fp32)."""
    input_ids, vision = encoder_inputs()
    return {
        name: load_text_encoder(folder, "cpu", torch.float32).encode(input_ids, **vision)
        for name, folder in encoder_folders.items()
    }


@pytest.fixture(scope="module")
def decode_references() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """case -> this process's single-process (pixels, waveform)."""
    video_vae, audio_vae = tiny_video_vae(), tiny_audio_vae()
    references = {}
    for name, (_, _, autocast_dtype) in VAE_CASES.items():
        video_latents, audio_latents = vae_latents(name)
        with torch.no_grad():
            references[name] = (
                video_vae.decode(video_latents, autocast_dtype),
                audio_vae.decode_stereo(audio_latents),
            )
    return references


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, encoder_folders):
    """world size -> every rank's results, spawning each world once for the whole module."""
    runs: dict[int, list[dict]] = {}

    def results(world_size: int) -> list[dict]:
        if world_size not in runs:
            scratch = tmp_path_factory.mktemp(f"world{world_size}")
            arguments = (
                world_size,
                str(scratch / "store"),
                str(encoder_folders[TINY_ENCODER]),
                str(encoder_folders[EIGHT_HEAD_ENCODER]),
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
        (
            {"world_size": 6, "encoder_tp": 3},
            "--encoder-tp 3 does not divide the text encoder's 64 attention",
        ),
        ({"world_size": 4, "encoder_tp": 8}, "--encoder-tp 8 does not divide the 4 GPUs"),
        ({"world_size": 6, "encoder_tp": 4}, "--encoder-tp 4 does not divide the 6 GPUs"),
        (
            {"world_size": 6, "encoder_tp": 6, "heads": 12, "kv_heads": 4, "mlp_width": 24},
            "4 key/value heads",
        ),
        (
            {"world_size": 4, "encoder_tp": 4, "mlp_width": 30},
            "does not divide the text encoder's MLP width 30",
        ),
        ({"world_size": 2, "encoder_tp": 0}, "--encoder-tp must be a positive integer, got 0"),
        ({"world_size": 2, "encoder_tp": True}, "--encoder-tp must be a positive integer, got True"),
    ],
)
def test_encoder_layout_errors_name_the_flag(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EncoderLayout(**arguments)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"world_size": 4, "vae_ranks": 5}, "--vae-ranks 5 is more than the 4 GPUs"),
        ({"world_size": 4, "vae_ranks": 0}, "--vae-ranks must be a positive integer, got 0"),
        ({"world_size": 0}, "number of GPUs must be a positive integer, got 0"),
    ],
)
def test_vae_layout_errors_name_the_flag(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        VAELayout(**arguments)


def test_released_encoder_profiles_and_key_value_heads() -> None:
    # Qwen3-VL-32B: 64 query heads, 8 key/value heads. tp 16 copies each key/value head to two ranks.
    for world_size, tp, local_kv_heads, kv_heads_of_ranks in [
        (1, 1, 8, [0]),
        (2, 2, 4, [0, 4]),
        (4, 4, 2, [0, 2, 4, 6]),
        (8, 4, 2, [0, 2, 4, 6]),
        (8, 8, 1, list(range(8))),
        (16, 16, 1, [rank // 2 for rank in range(16)]),
    ]:
        layout = EncoderLayout(world_size, tp)
        assert layout.local_heads == 64 // tp and layout.local_kv_heads == local_kv_heads
        assert [layout.first_kv_head(rank) for rank in range(tp)] == kv_heads_of_ranks
    assert EncoderLayout(8, 4).tensor_parallel_ranks(1) == [4, 5, 6, 7]
    for world_size in (1, 2, 4, 8):
        VAELayout(world_size, world_size)


def test_tile_shares_cover_every_tile_once_with_the_short_ones_first() -> None:
    for tile_count in range(1, 30):
        for ranks in range(1, 9):
            shares = [tile_share(tile_count, ranks, rank) for rank in range(ranks)]
            assert [index for share in shares for index in share] == list(range(tile_count))
            lengths = [len(share) for share in shares]
            assert lengths == sorted(lengths) and lengths[-1] - lengths[0] <= 1


# --------------------------------------------------------------------------------------------------------------
# World size 1 (no torch.distributed) and refusals
# --------------------------------------------------------------------------------------------------------------


def test_world_size_one_encoder_is_the_single_process_encoder(encoder_folders, encoder_references) -> None:
    config, files = open_text_encoder_files(encoder_folders[EIGHT_HEAD_ENCODER])
    groups = create_encoder_groups(EncoderLayout.for_text_encoder(config, 1))
    encoder = load_text_encoder_shard(files, config, groups, torch.float32, "cpu")
    input_ids, vision = encoder_inputs()
    assert torch.equal(encoder.encode(input_ids, **vision), encoder_references[EIGHT_HEAD_ENCODER])


def test_encoder_layout_must_match_the_model(encoder_folders) -> None:
    config, files = open_text_encoder_files(encoder_folders[TINY_ENCODER])
    groups = create_encoder_groups(EncoderLayout(1))  # validated for the released 64 / 8 heads
    with pytest.raises(ValueError, match="validated for 64 heads, 8 key/value heads"):
        load_text_encoder_shard(files, config, groups, torch.float32, "cpu")
    biased = copy.deepcopy(config)
    biased.text_config.attention_bias = True
    groups = create_encoder_groups(EncoderLayout.for_text_encoder(biased, 1))
    with pytest.raises(ValueError, match="without bias"):
        load_text_encoder_shard(files, biased, groups, torch.float32, "cpu")


def test_encoder_tp_that_does_not_fit_the_tiny_encoder_is_refused(encoder_folders) -> None:
    config, _ = open_text_encoder_files(encoder_folders[TINY_ENCODER])
    with pytest.raises(ValueError, match=re.escape("--encoder-tp 4 does not divide the text encoder's 2")):
        EncoderLayout.for_text_encoder(config, 4, 4)


def test_world_size_one_decode_is_the_single_process_decode(decode_references) -> None:
    video_vae, audio_vae = tiny_video_vae(), tiny_audio_vae()
    assert create_vae_group(VAELayout(1)) == GroupMembership.alone()
    for name, (_, _, autocast_dtype) in VAE_CASES.items():
        video_latents, audio_latents = vae_latents(name)
        with torch.no_grad():
            pixels, waveform = decode_video_and_audio(
                video_vae, audio_vae, video_latents, audio_latents, GroupMembership.alone(), autocast_dtype
            )
        assert torch.equal(pixels, decode_references[name][0]), name
        assert torch.equal(waveform, decode_references[name][1]), name


def test_the_audio_rank_needs_the_audio_vae() -> None:
    video_latents, audio_latents = vae_latents("two_windows")
    with pytest.raises(ValueError, match="needs the audio VAE"):
        decode_video_and_audio(tiny_video_vae(), None, video_latents, audio_latents, GroupMembership.alone())


# --------------------------------------------------------------------------------------------------------------
# Gloo worlds of 2 and 4
# --------------------------------------------------------------------------------------------------------------

ENCODER_CASES = [(world_size, *run) for world_size, runs in ENCODER_RUNS.items() for run in runs]


@pytest.mark.parametrize(
    "world_size, name, tp",
    ENCODER_CASES,
    ids=[f"world{world}-{name}-tp{tp}" for world, name, tp in ENCODER_CASES],
)
def test_parallel_encoder_matches_single_process(
    parallel_runs, encoder_references, world_size: int, name: str, tp: int
) -> None:
    reference = encoder_references[name]
    for rank, results in enumerate(parallel_runs(world_size)):
        states, _ = results["encoder"][(name, tp)]
        assert states.shape == reference.shape and states.dtype == torch.float32
        error = max_relative_error(states, reference)
        assert error <= TOLERANCE, f"rank {rank}: relative error {error:.3g}"


def expected_encoder_reads(
    key: str, tp_rank: int, layout: EncoderLayout
) -> list[tuple[str, int, int]] | None:
    """Rows / columns tensor-parallel rank `tp_rank` must read of a split tensor, or None for a replicated one."""
    head_dim = tiny_text_encoder_config()["text_config"]["head_dim"]
    if not key.startswith("model.language_model.layers."):
        return None
    query_rows = layout.heads * head_dim // layout.encoder_tp
    mlp_share = layout.mlp_width // layout.encoder_tp
    if key.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        if layout.encoder_tp > layout.kv_heads:  # tp / kv ranks share each key/value head, whole
            head = tp_rank // (layout.encoder_tp // layout.kv_heads)
            return [("row_slice", head * head_dim, (head + 1) * head_dim)]
        kv_rows = layout.kv_heads * head_dim // layout.encoder_tp
        return [("row_slice", tp_rank * kv_rows, (tp_rank + 1) * kv_rows)]
    if key.endswith("self_attn.q_proj.weight"):
        return [("row_slice", tp_rank * query_rows, (tp_rank + 1) * query_rows)]
    if key.endswith("self_attn.o_proj.weight"):
        return [("column_slice", tp_rank * query_rows, (tp_rank + 1) * query_rows)]
    if key.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return [("row_slice", tp_rank * mlp_share, (tp_rank + 1) * mlp_share)]
    if key.endswith("mlp.down_proj.weight"):
        return [("column_slice", tp_rank * mlp_share, (tp_rank + 1) * mlp_share)]
    return None


@pytest.mark.parametrize(
    "world_size, name, tp",
    [(2, TINY_ENCODER, 2), (4, EIGHT_HEAD_ENCODER, 4), (4, EIGHT_HEAD_ENCODER, 2)],
    ids=["tiny-tp2", "eight-tp4", "eight-tp2-replicas"],
)
def test_encoder_ranks_read_only_their_rows(
    parallel_runs, encoder_folders, world_size: int, name: str, tp: int
) -> None:
    config, files = open_text_encoder_files(encoder_folders[name])
    layout = EncoderLayout.for_text_encoder(config, world_size, tp)
    with torch.device("meta"):
        needed = set(H3TextEncoder(config).state_dict())
    split_elements = 0
    for rank, results in enumerate(parallel_runs(world_size)):
        _, reads = results["encoder"][(name, tp)]
        by_key: dict[str, list[tuple[str, int, int]]] = {}
        for method, key, start, stop, elements in reads:
            by_key.setdefault(key, []).append((method, start, stop))
            if rank < tp and expected_encoder_reads(key, rank, layout) is not None:
                split_elements += elements
        # Every tensor of the first 50 layers, the embeddings and the vision tower once; layers >= 50, the final
        # norm and lm_head never.
        assert set(by_key) == needed
        for key, key_reads in by_key.items():
            assert key_reads == (expected_encoder_reads(key, rank % tp, layout) or [("tensor", 0, 0)]), key
    split_whole = sum(
        torch.Size(files.infos[key].shape).numel()
        for key in needed
        if expected_encoder_reads(key, 0, layout) is not None
    )
    # One replica's ranks read each query / MLP weight exactly once between them; key/value rows replicated
    # over tp / kv_heads ranks are read that many times.
    kv_copies = max(tp // layout.kv_heads, 1)
    kv_whole = sum(
        torch.Size(files.infos[key].shape).numel()
        for key in needed
        if key.endswith(("k_proj.weight", "v_proj.weight"))
    )
    assert split_elements == split_whole + (kv_copies - 1) * kv_whole


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_decode_is_bit_identical_to_one_process(parallel_runs, world_size: int) -> None:
    ranks = parallel_runs(world_size)
    reference = ranks[0]["vae"]["reference"]
    for vae_ranks in VAE_RUNS[world_size]:
        for name in VAE_CASES:
            pixels, waveform = ranks[0]["vae"][vae_ranks][name]
            expected_pixels, expected_waveform = reference[name]
            assert pixels.dtype == expected_pixels.dtype == torch.float32
            assert torch.equal(pixels, expected_pixels), f"{vae_ranks} VAE ranks, {name}"
            assert torch.equal(waveform, expected_waveform), f"{vae_ranks} VAE ranks, {name}"
            for rank in range(1, world_size):
                result = ranks[rank]["vae"][vae_ranks][name]
                assert result is None if rank < vae_ranks else result == "outside", f"rank {rank}"


def test_worker_reference_is_this_process_decode(parallel_runs, decode_references) -> None:
    """The bit-for-bit reference is made in the worker (one thread); it agrees with this process's decode."""
    for name in VAE_CASES:
        worker_pixels, worker_waveform = parallel_runs(2)[0]["vae"]["reference"][name]
        assert max_relative_error(worker_pixels, decode_references[name][0]) <= TOLERANCE, name
        assert max_relative_error(worker_waveform, decode_references[name][1]) <= TOLERANCE, name
