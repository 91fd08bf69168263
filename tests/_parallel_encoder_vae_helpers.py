"""Worker side of tests/test_parallel_encoder_vae.py: what each spawned rank runs, and what both sides share.

Kept apart from the test module so that a spawned worker does not import diffusers or the checkpoint writers.
Each worker runs every text-encoder layout and every VAE layout of its world once and saves its results; the
single-process VAE decode it is compared with bit for bit is made by VAE rank 0 itself, in the same process with
the same thread count, so that nothing but the distribution of the work differs.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _parallel_dit_helpers import RecordingWeightFiles

from h3engine.checkpoint import audio_vae_keys, video_vae_keys
from h3engine.checkpoint.text_encoder_files import (
    TINY_BASE_VOCAB_SIZE,
    TINY_TOKEN_IDS,
    open_text_encoder_files,
)
from h3engine.models.audio_vae import AudioVAE, AudioVAEConfig
from h3engine.models.parallel.groups import (
    EncoderLayout,
    VAELayout,
    create_encoder_groups,
    create_vae_group,
    initialize_process_group,
)
from h3engine.models.parallel.text_encoder import load_text_encoder_shard
from h3engine.models.parallel.vae import AUDIO_DECODE_RANK, decode_video_and_audio
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

SEED = 2468
# Two tiny Qwen3-VL text encoders: the checkpoint's own (2 heads, 1 key/value head) and one with 8 heads and 2
# key/value heads, so that tp 2 splits the key/value heads and tp 4 replicates each over two ranks.
TINY_ENCODER = "tiny"
EIGHT_HEAD_ENCODER = "eight_heads"
EIGHT_HEADS, EIGHT_HEAD_KV_HEADS = 8, 2
# world size -> the (encoder, encoder_tp) runs; tp 2 in a world of 4 runs two replicas side by side.
ENCODER_RUNS = {
    2: [(TINY_ENCODER, 2), (EIGHT_HEAD_ENCODER, 2)],
    4: [(EIGHT_HEAD_ENCODER, 4), (EIGHT_HEAD_ENCODER, 2)],
}
# world size -> the --vae-ranks runs; 1 of 2 and 3 of 4 leave ranks out of the VAE group.
VAE_RUNS = {2: [2, 1], 4: [4, 3]}
# name -> (video latent shape [B, C, T, h, w], audio latent count, autocast dtype). With 32 px tiles and 16 px
# overlap the 40 x 56 px canvas is 2 x 3 tiles; at 4 tiles per decoder call each window's 6 tiles make two calls of
# 3: 4 calls over two windows, and 2 (batch 2, T padded from 3 to 7) under the released fp16 autocast recipe, which
# do not divide evenly over 3 ranks (and leave ranks without a call).
VAE_CASES = {
    "two_windows": ((1, 4, 12, 10, 14), 9, None),
    "padded_batch2_fp16": ((2, 4, 3, 10, 14), 5, torch.float16),
}
SMALL_TILE, SMALL_OVERLAP = 32, 16
TILES_PER_CALL = 4


def encoder_inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Text ids around one picture block (a 4 x 6 patch grid: 6 merged tokens), and its pixel patches."""
    generator = torch.Generator().manual_seed(SEED)
    grid = torch.tensor([[1, 4, 6]])
    block = [TINY_TOKEN_IDS["<|vision_start|>"]] + [TINY_TOKEN_IDS["<|image_pad|>"]] * 6
    block += [TINY_TOKEN_IDS["<|vision_end|>"]]
    before = torch.randint(0, TINY_BASE_VOCAB_SIZE, (7,), generator=generator).tolist()
    after = torch.randint(0, TINY_BASE_VOCAB_SIZE, (15,), generator=generator).tolist()
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 16 * 16, generator=generator)
    return torch.tensor([before + block + after]), {"pixel_values": pixels, "image_grid_thw": grid}


def tiny_video_vae() -> VideoVAE:
    config = VideoVAEConfig.tiny()
    vae = VideoVAE(config).eval()
    vae.load_state_dict(video_vae_keys.random_native_state(config, SEED), strict=True)
    vae.set_tiling(True, SMALL_TILE, SMALL_OVERLAP)
    vae.decode_batch_tiles = TILES_PER_CALL
    return vae


def tiny_audio_vae() -> AudioVAE:
    config = AudioVAEConfig.tiny()
    vae = AudioVAE(config).eval()
    vae.load_state_dict(audio_vae_keys.random_native_state(config, SEED), strict=True)
    return vae


def vae_latents(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    video_shape, audio_count, _ = VAE_CASES[name]
    generator = torch.Generator().manual_seed(SEED + len(name))
    audio_shape = (2, AudioVAEConfig.tiny().latent_channels, audio_count)
    return torch.randn(video_shape, generator=generator), torch.randn(audio_shape, generator=generator)


def run_encoders(world_size: int, folders: dict[str, str]) -> dict:
    """(encoder, tp) -> this rank's encoder states and the reads (method, key, start, stop, elements) it made."""
    input_ids, vision = encoder_inputs()
    results = {}
    for name, encoder_tp in ENCODER_RUNS[world_size]:
        config, _ = open_text_encoder_files(Path(folders[name]))
        files = RecordingWeightFiles.open(Path(folders[name]))
        groups = create_encoder_groups(EncoderLayout.for_text_encoder(config, world_size, encoder_tp))
        encoder = load_text_encoder_shard(files, config, groups, torch.float32, "cpu")
        results[(name, encoder_tp)] = (encoder.encode(input_ids, **vision), files.reads)
    return results


def run_vae(world_size: int) -> dict:
    """vae_ranks -> case -> this rank's decode result (None outside rank 0); 'reference' -> one-process decodes."""
    video_vae, audio_vae = tiny_video_vae(), tiny_audio_vae()
    results: dict = {}
    for vae_ranks in VAE_RUNS[world_size]:
        group = create_vae_group(VAELayout(world_size, vae_ranks))
        results[vae_ranks] = {}
        for name, (_, _, autocast_dtype) in VAE_CASES.items():
            if group is None:
                results[vae_ranks][name] = "outside"
                continue
            video_latents, audio_latents = vae_latents(name)
            # Only the audio rank is handed the audio VAE, as the runtime loads it there only.
            audio = audio_vae if group.rank == AUDIO_DECODE_RANK else None
            with torch.no_grad():
                results[vae_ranks][name] = decode_video_and_audio(
                    video_vae, audio, video_latents, audio_latents, group, autocast_dtype
                )
    if dist.get_rank() == 0:
        results["reference"] = {}
        for name, (_, _, autocast_dtype) in VAE_CASES.items():
            video_latents, audio_latents = vae_latents(name)
            with torch.no_grad():
                results["reference"][name] = (
                    video_vae.decode(video_latents, autocast_dtype),
                    audio_vae.decode_stereo(audio_latents),
                )
    return results


def worker(rank: int, world_size: int, store: str, tiny: str, eight_heads: str, output: str) -> None:
    # Four workers share two busy cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    initialize_process_group(
        rank, world_size, f"file://{store}", torch.device("cpu"), timeout=timedelta(seconds=120)
    )
    results = {
        "encoder": run_encoders(world_size, {TINY_ENCODER: tiny, EIGHT_HEAD_ENCODER: eight_heads}),
        "vae": run_vae(world_size),
    }
    torch.save(results, Path(output) / f"rank{rank}.pt")
    dist.destroy_process_group()
