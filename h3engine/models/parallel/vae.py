"""The final decode split over the VAE group: video tiles spread over its ranks, the audio decode on one.

`decode_video_and_audio(...)` is called by every rank of the VAE group with the same (un-normalized) latents and
returns `(pixels, waveform)` on VAE-group rank 0, None on the others. The pixels are exactly
`video_vae.decode(video_latents, autocast_dtype)`, bit for bit: each rank decodes its share of the tiles and rank 0
assembles the very tensors one process would have made. A group of one makes no `torch.distributed` call.

Danger: the gather is collective: every rank must call this with latents of the same shape, or the plans disagree
and the gather deadlocks or mixes tiles. Rank 0 holds every decoded tile (overlaps included) before stitching.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from h3engine.models.audio_vae import AudioVAE
from h3engine.models.parallel.groups import GroupMembership
from h3engine.models.video_vae import DecodePlan, VideoVAE, decode_autocast

# The VAE-group rank that loads the audio VAE and decodes the audio; it is also where the pixels are gathered.
AUDIO_DECODE_RANK = 0


def tile_share(tile_count: int, ranks: int, rank: int) -> range:
    """The planned decoder calls `rank` makes: a contiguous run, the longer runs on the last ranks."""
    shorter, longer_count = divmod(tile_count, ranks)
    shorter_count = ranks - longer_count
    start = rank * shorter + max(rank - shorter_count, 0)
    return range(start, start + shorter + int(rank >= shorter_count))


def rank_tiles(video_vae: VideoVAE, plan: DecodePlan, ranks: int, rank: int) -> range:
    """The plan's tile indices `rank` decodes: its `tile_share` of the decoder calls (`DecodePlan.call_batches`)."""
    calls = plan.call_batches(video_vae.decode_batch_tiles)
    share = tile_share(len(calls), ranks, rank)
    if not share:
        return range(0)
    return range(calls[share.start].start, calls[share.stop - 1].stop)


def _gather_tiles_to_first_rank(
    video_vae: VideoVAE,
    plan: DecodePlan,
    batch: int,
    local_tiles: list[Tensor],
    group: GroupMembership,
) -> list[Tensor] | None:
    """Every rank's decoded tiles -> all of them, in plan order, on group rank 0 (None elsewhere)."""
    if group.size == 1:
        return local_tiles
    # Every rank knows every tile's shape from the plan, so one flat buffer per rank (padded to the longest share)
    # carries the tiles with no shape exchange; they are copied, never converted.
    dtype = video_vae.decoder.proj_out.weight.dtype
    device = video_vae.decoder.proj_out.weight.device
    shapes = [video_vae.decoded_tile_shape(batch, tile) for tile in plan.tiles]
    shares = [rank_tiles(video_vae, plan, group.size, rank) for rank in range(group.size)]
    share_elements = [sum(torch.Size(shapes[index]).numel() for index in share) for share in shares]
    buffer = torch.zeros(max(share_elements), dtype=dtype, device=device)
    offset = 0
    for tile in local_tiles:
        if tile.dtype != dtype:
            raise RuntimeError(f"a decoded tile is {tile.dtype}, the gather carries {dtype}")
        buffer[offset : offset + tile.numel()].copy_(tile.reshape(-1))
        offset += tile.numel()
    first_rank = dist.get_global_rank(group.process_group, 0)
    if group.rank != 0:
        dist.gather(buffer, None, dst=first_rank, group=group.process_group)
        return None
    received = [torch.empty_like(buffer) for _ in range(group.size)]
    dist.gather(buffer, received, dst=first_rank, group=group.process_group)
    tiles = []
    for share, flat in zip(shares, received, strict=True):
        offset = 0
        for index in share:
            elements = torch.Size(shapes[index]).numel()
            tiles.append(flat[offset : offset + elements].view(shapes[index]))
            offset += elements
    return tiles


def decode_video_and_audio(
    video_vae: VideoVAE,
    audio_vae: AudioVAE | None,
    video_latents: Tensor,
    audio_latents: Tensor,
    group: GroupMembership,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Un-normalized latents -> (pixels [B, 3, F, H, W], waveform [2, N]) on VAE rank 0; None on the others.

    `audio_vae` is needed on `AUDIO_DECODE_RANK` only.

    Every rank makes its `tile_share` (a contiguous run) of the plan's decoder calls (`VideoVAE.plan_decode`,
    `DecodePlan.call_batches`) with `VideoVAE.decode_tiles`; the outputs are gathered to rank 0 without arithmetic
    (copied into one flat buffer per rank, in the decoder's output dtype) and rank 0 runs `VideoVAE.assemble_decode`.
    The waveform is `audio_vae.decode_stereo(audio_latents)` on `AUDIO_DECODE_RANK` (rank 0, the only rank that loads
    the audio VAE); with uneven shares rank 0 gets the smaller one and decodes the audio meanwhile.
    """
    if group.rank == AUDIO_DECODE_RANK and audio_vae is None:
        raise ValueError(f"VAE rank {AUDIO_DECODE_RANK} decodes the audio and needs the audio VAE")
    plan = video_vae.plan_decode(video_latents.shape)
    latents = video_vae.prepare_decode_latents(video_latents, plan)
    share = rank_tiles(video_vae, plan, group.size, group.rank)
    with decode_autocast(latents.device, autocast_dtype):
        local_tiles = video_vae.decode_tiles(latents, plan, share)
    waveform = audio_vae.decode_stereo(audio_latents) if group.rank == AUDIO_DECODE_RANK else None
    tiles = _gather_tiles_to_first_rank(video_vae, plan, latents.shape[0], local_tiles, group)
    if tiles is None:
        return None
    per_window = plan.tiles_per_window
    windows = [tiles[start : start + per_window] for start in range(0, len(tiles), per_window)]
    with decode_autocast(latents.device, autocast_dtype):
        pixels = video_vae.assemble_decode(plan, windows)
    return pixels, waveform


def latent_frame_shares(video_vae: VideoVAE, latent_shape: torch.Size, ranks: int) -> list[tuple[int, int]]:
    """Per VAE-group rank, the latent frames [start, stop) its tiles read, in the un-padded latents of
    `latent_shape` ([B, C, T, h, w]): what a rank needs to receive to run its share of `decode_video_and_audio`.

    The padding repeats the last latent, so a share that reaches into it ends at T and starts no later than T - 1;
    an empty share is (0, 0). The frames outside a rank's share are never read by its tiles.
    """
    plan = video_vae.plan_decode(latent_shape)
    count = latent_shape[2]
    shares = []
    for rank in range(ranks):
        tiles = [plan.tiles[index] for index in rank_tiles(video_vae, plan, ranks, rank)]
        if not tiles:
            shares.append((0, 0))
            continue
        start = min(tile.frames[0] for tile in tiles)
        stop = max(tile.frames[1] for tile in tiles)
        shares.append((min(start, count - 1), min(stop, count)))
    return shares
