"""MiniMax H3 video VAE (H3-VisualVAE) with the released temporal chunking and spatial tiling (f16 t4 c24); its
causal 3D-CNN encoder and ViT decoder are in `h3engine.models.video_vae_networks` (precision notes there).

* `encode(pixels)`: ImageNet-normalized RGB [B, 3, F, H, W] -> posterior (mean, logvar) [B, C, T, H/16, W/16] in
  fp32, logvar clamped to [-30, 20]. One frame is encoded alone; more are padded (last frame repeated) to whole
  17-frame clips, each encoded independently, and the last `token_drop` (3) latents are dropped: 17n+5 -> 5n+2.
* `decode(latents)`: UN-normalized latents (`denormalize_latents`) -> pixels [B, 3, F, 16h, 16w] in the same space,
  decoded in windows of 7 latents (5 + 2 overlap) cross-faded over 5 frames. Three steps that can run apart:
  `plan_decode` lists the tiles, `decode_tiles` makes whole decoder calls (`DecodePlan.call_batches`),
  `assemble_decode` stitches and cross-fades; `h3engine.models.parallel.vae` spreads the calls over ranks bit-identically.
* Spatial tiling (256 px tiles, >= 64 px overlap, linear cross-fade) is ON in the released recipe both ways and part
  of the function: the decoder's RoPE positions are relative to the tile it sees, so tiling changes the pixels.
* State-dict keys are the native `video_vae/source/model.safetensors` keys (560 for the release), including the
  all-zero `decoder.mask_token` that the file carries and the forward never reads. The weights are fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from h3engine.models.video_vae_config import IMAGENET_MEAN, IMAGENET_STD, VideoVAEConfig
from h3engine.models.video_vae_networks import VideoEncoder, ViTDecoder, autocast_off

# Decoder calls take up to this many tiles at once (one 768p window is 28 tiles: two calls of 14).
DECODE_BATCH_TILES = 16


def decode_autocast(
    device: torch.device, autocast_dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """The context `decode` runs its decoder calls in: `autocast_dtype` autocast on `device`, or none. Autocast's
    cache of cast weights is off: each call casts the weights it reads (the same values), so the decoder never holds
    a second copy of its 2.4 B parameters (4.8 GB in fp16) besides the fp32 ones."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=autocast_dtype, cache_enabled=False)


# ==================================================================================================== tiling helpers


def tile_layout(length: int, tile_size: int, overlap_min: int, step: int) -> tuple[list[int], int, list[int]]:
    """Tiles along one axis: (start offsets, tile size, overlaps between consecutive tiles).

    The fewest `tile_size` tiles whose overlaps are all >= `overlap_min`; the surplus coverage is spread round-robin
    over the overlaps in whole `step`s (the spatial ratio) so every boundary stays latent-aligned. A surplus that is
    not a multiple of `step` makes the last tile run past `length`; slicing then simply shortens it.
    """
    if tile_size >= length:
        return [0], length, []
    count = math.ceil(length / tile_size)
    while tile_size * count - overlap_min * (count - 1) < length:
        count += 1
    overlaps = [overlap_min] * (count - 1)
    surplus = tile_size * count - overlap_min * (count - 1) - length
    for index in range(surplus // step):
        overlaps[index % (count - 1)] += step
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile_size - overlap)
    return starts, tile_size, overlaps


def cross_fade(previous: torch.Tensor, current: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """`current` with its first `extent` entries along `dim` blended linearly from `previous`'s last ones
    (weights 1 - i/e for previous, i/e for current, i = 0..e-1)."""
    extent = min(previous.shape[dim], current.shape[dim], extent)
    ramp_shape = [1] * current.ndim
    ramp_shape[dim] = extent
    ramp = (torch.arange(extent, device=current.device, dtype=current.dtype) / extent).view(ramp_shape)
    tail = previous.narrow(dim, previous.shape[dim] - extent, extent)
    head = current.narrow(dim, 0, extent)
    blended = tail * (1 - ramp) + head * ramp
    if extent == current.shape[dim]:
        return blended
    return torch.cat([blended, current.narrow(dim, extent, current.shape[dim] - extent)], dim=dim)


def stitch_tiles(
    tiles: list[list[torch.Tensor]], row_overlaps: list[int], column_overlaps: list[int]
) -> torch.Tensor:
    """Blend a grid of overlapping tiles (last two dims = H, W) into one tensor.

    Released order: each tile is first blended with the raw tile above it, then with the raw tile to its left, and
    then loses its trailing overlaps. The left neighbour used is the un-blended one, which makes the corners
    asymmetric; that asymmetry is part of the released output.
    """
    rows = []
    last_row, last_column = len(tiles) - 1, len(tiles[0]) - 1
    for row_index, row in enumerate(tiles):
        pieces = []
        for column_index, tile in enumerate(row):
            if row_index > 0:
                tile = cross_fade(
                    tiles[row_index - 1][column_index], tile, row_overlaps[row_index - 1], dim=-2
                )
            if column_index > 0:
                tile = cross_fade(row[column_index - 1], tile, column_overlaps[column_index - 1], dim=-1)
            if row_index < last_row:
                tile = tile[..., : tile.shape[-2] - row_overlaps[row_index], :]
            if column_index < last_column:
                tile = tile[..., : tile.shape[-1] - column_overlaps[column_index]]
            pieces.append(tile)
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)


@dataclass(frozen=True)
class DecodeTile:
    """One tile of `VideoVAE.decode` (one decoder input): latent [start, stop) ranges of the prepared (padded)
    latents along frames (one temporal window), rows and columns (one spatial tile of that window)."""

    frames: tuple[int, int]
    rows: tuple[int, int]
    columns: tuple[int, int]


@dataclass(frozen=True)
class DecodePlan:
    """Every tile of one `VideoVAE.decode`, and what putting their outputs back together needs.

    `tiles` lists the windows in order, each as its `grid` (tile rows x tile columns) in row-major order: the
    order the single-process decode decodes them in (`call_batches` groups them into decoder calls). Overlaps are
    in pixels. Every tile is independent of the others (the decoder's positions are relative to the tile it sees),
    so the calls may run anywhere, in any order, as long as `assemble_decode` receives each output in its planned
    place.
    """

    original_count: int
    pad_latents: int
    window_count: int
    grid: tuple[int, int]
    row_overlaps: tuple[int, ...]
    column_overlaps: tuple[int, ...]
    tiles: tuple[DecodeTile, ...]

    @property
    def tiles_per_window(self) -> int:
        return self.grid[0] * self.grid[1]

    def window_tiles(self, window: int) -> tuple[DecodeTile, ...]:
        return self.tiles[window * self.tiles_per_window : (window + 1) * self.tiles_per_window]

    def call_batches(self, max_tiles: int) -> tuple[range, ...]:
        """The decoder calls as runs of tile indices, in plan order: consecutive tiles of one window with the same
        latent shape, at most `max_tiles` per call, a longer run split into near-equal calls (the longer first).

        A batch is one decoder call over its tiles stacked along the batch axis (`VideoVAE.decode_batch`); the
        single-process and the parallel decode make the very same calls, so their outputs stay bit-identical.
        """
        if max_tiles < 1:
            raise ValueError(f"a decoder call takes at least one tile, got max_tiles={max_tiles}")
        batches: list[range] = []
        for window in range(self.window_count):
            start = window * self.tiles_per_window
            stop = start + self.tiles_per_window
            while start < stop:
                run_end = start + 1
                while run_end < stop and _tile_extent(self.tiles[run_end]) == _tile_extent(self.tiles[start]):
                    run_end += 1
                calls = math.ceil((run_end - start) / max_tiles)
                longer, remainder = divmod(run_end - start, calls)
                for call in range(calls):
                    size = longer + int(call < remainder)
                    batches.append(range(start, start + size))
                    start += size
        return tuple(batches)


def _tile_extent(tile: DecodeTile) -> tuple[int, int, int]:
    """A tile's latent frames, rows and columns: tiles with equal extents can share one decoder call."""
    return tuple(stop - start for start, stop in (tile.frames, tile.rows, tile.columns))


# ==================================================================================================== the VAE


class VideoVAE(nn.Module):
    """The H3 video VAE with the released temporal chunking and spatial tiling (see the module docstring)."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = VideoEncoder(config)
        self.quant_conv = nn.Conv3d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(config.latent_channels, config.latent_channels, 1)
        self.decoder = ViTDecoder(config)
        self.encoder_tiling = config.encoder_tiling
        self.decoder_tiling = config.decoder_tiling
        self.tile_size = config.tile_size
        self.tile_overlap_min = config.tile_overlap_min
        # Tiles per decoder call (`DecodePlan.call_batches`): fewer holds less activation memory at once.
        self.decode_batch_tiles = DECODE_BATCH_TILES

    def set_tiling(self, enabled: bool, tile_size: int | None = None, overlap_min: int | None = None) -> None:
        """Switch spatial tiling for both directions and optionally change the tile geometry (pixels)."""
        tile_size = self.tile_size if tile_size is None else tile_size
        overlap_min = self.tile_overlap_min if overlap_min is None else overlap_min
        ratio = self.config.spatial_compression_ratio
        if tile_size % ratio or overlap_min % ratio or not 0 < overlap_min < tile_size:
            raise ValueError(
                f"tile {tile_size}/{overlap_min} px must be multiples of {ratio} with 0 < overlap < tile"
            )
        self.encoder_tiling = self.decoder_tiling = enabled
        self.tile_size, self.tile_overlap_min = tile_size, overlap_min

    # ---------------------------------------------------------------------------------------------- latent statistics

    def _latent_statistics(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32).view(shape)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32).view(shape)
        return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(z - mean[c]) / std[c]: the space the DiT works in."""
        mean, std = self._latent_statistics(latents)
        return (latents - mean) / std

    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """z * std[c] + mean[c]: what `decode` expects."""
        mean, std = self._latent_statistics(latents)
        return latents * std + mean

    @staticmethod
    def _imagenet_statistics(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, 3) + (1,) * (like.ndim - 2)
        mean = torch.tensor(IMAGENET_MEAN, dtype=like.dtype, device=like.device).view(shape)
        std = torch.tensor(IMAGENET_STD, dtype=like.dtype, device=like.device).view(shape)
        return mean, std

    @staticmethod
    def from_unit_range(rgb: torch.Tensor) -> torch.Tensor:
        """[0, 1] RGB [B, 3, ...] -> the VAE's ImageNet-normalized pixel space ((x - mean) / std per channel)."""
        mean, std = VideoVAE._imagenet_statistics(rgb)
        return (rgb - mean) / std

    @staticmethod
    def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
        """The VAE's pixel space [B, 3, ...] -> [0, 1] RGB (x * std + mean, clamped)."""
        mean, std = VideoVAE._imagenet_statistics(pixels)
        return (pixels * std + mean).clamp(0.0, 1.0)

    @staticmethod
    def sample_posterior(
        mean: torch.Tensor, logvar: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """mean + exp(logvar/2) * eps, eps drawn in one call of shape `mean.shape` on the generator's device (the
        conditioning recipe uses a fresh CPU generator seeded 42) and moved to `mean`'s device."""
        noise_device = generator.device if generator is not None else mean.device
        noise = torch.randn(mean.shape, generator=generator, device=noise_device, dtype=mean.dtype)
        return mean + torch.exp(0.5 * logvar) * noise.to(mean.device)

    # ---------------------------------------------------------------------------------------------- encode

    def _spatial_tiles(
        self, height: int, width: int
    ) -> tuple[list[int], int, list[int], list[int], int, list[int]]:
        ratio = self.config.spatial_compression_ratio
        row_starts, row_size, row_overlaps = tile_layout(height, self.tile_size, self.tile_overlap_min, ratio)
        column_starts, column_size, column_overlaps = tile_layout(
            width, self.tile_size, self.tile_overlap_min, ratio
        )
        return row_starts, row_size, row_overlaps, column_starts, column_size, column_overlaps

    def _encode_clip(self, pixels: torch.Tensor) -> torch.Tensor:
        if not self.encoder_tiling:
            return self.quant_conv(self.encoder(pixels))
        row_starts, row_size, row_overlaps, column_starts, column_size, column_overlaps = self._spatial_tiles(
            pixels.shape[-2], pixels.shape[-1]
        )
        tiles = [
            [
                self.quant_conv(self.encoder(pixels[..., top : top + row_size, left : left + column_size]))
                for left in column_starts
            ]
            for top in row_starts
        ]
        ratio = self.config.spatial_compression_ratio
        return stitch_tiles(tiles, [o // ratio for o in row_overlaps], [o // ratio for o in column_overlaps])

    def _clips(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Whole `clip_length`-frame clips; the video is padded at the end by repeating its last frame."""
        clip_length = self.config.clip_length
        missing = (-pixels.shape[2]) % clip_length
        if missing:
            pixels = torch.cat([pixels, pixels[:, :, -1:].expand(-1, -1, missing, -1, -1)], dim=2)
        return pixels.split(clip_length, dim=2)

    def encode(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ImageNet-normalized pixels [B, 3, F, H, W] -> posterior (mean, logvar), each [B, C, T, h, w], in fp32."""
        weight = self.quant_conv.weight
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        with autocast_off(pixels):
            if pixels.shape[2] == 1:
                # A still image is encoded as itself: repeating it to a 17-frame clip would yield 2 latents, not 1.
                moments = self._encode_clip(pixels)
            else:
                moments = torch.cat([self._encode_clip(clip) for clip in self._clips(pixels)], dim=2)
                if self.config.token_drop:
                    moments = moments[:, :, : moments.shape[2] - self.config.token_drop]
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    # ---------------------------------------------------------------------------------------------- decode

    def plan_decode(self, latent_shape: Sequence[int]) -> DecodePlan:
        """Every tile `decode` decodes for latents of `latent_shape` ([B, C, T, h, w]), in its order.

        Windows of `latents_per_clip + window_overlap_latents` (5 + 2) latents start every `latents_per_clip`; T
        that is not 5n+2 is padded by repeating the last latent (see `prepare_decode_latents`). Each window is cut
        into the spatial tiles of the current tiling (one tile when tiling is off).
        """
        config = self.config
        chunk = config.latents_per_clip
        original_count, height, width = latent_shape[2], latent_shape[-2], latent_shape[-1]
        padded_count = original_count + config.token_drop
        pad_latents = (-padded_count) % chunk
        window_count = (padded_count + pad_latents) // chunk - int(config.token_drop > 0)
        if window_count < 1:
            raise ValueError(
                f"cannot decode {original_count} latent frames: at least {chunk - config.token_drop + 1} are needed "
                "for one decode window"
            )
        ratio = config.spatial_compression_ratio
        if self.decoder_tiling:
            row_starts, row_size, row_overlaps, column_starts, column_size, column_overlaps = (
                self._spatial_tiles(height * ratio, width * ratio)
            )
        else:
            row_starts, row_size, row_overlaps = [0], height * ratio, []
            column_starts, column_size, column_overlaps = [0], width * ratio, []
        latent_count = original_count + pad_latents

        def latent_span(start: int, size: int, length: int) -> tuple[int, int]:
            # A tile that runs past the canvas is shortened, exactly as slicing past the end does.
            return min(start, length), min(start + size, length)

        window_length = chunk + config.window_overlap_latents
        tiles = tuple(
            DecodeTile(
                frames=latent_span(window * chunk, window_length, latent_count),
                rows=latent_span(top // ratio, row_size // ratio, height),
                columns=latent_span(left // ratio, column_size // ratio, width),
            )
            for window in range(window_count)
            for top in row_starts
            for left in column_starts
        )
        return DecodePlan(
            original_count=original_count,
            pad_latents=pad_latents,
            window_count=window_count,
            grid=(len(row_starts), len(column_starts)),
            row_overlaps=tuple(row_overlaps),
            column_overlaps=tuple(column_overlaps),
            tiles=tiles,
        )

    def prepare_decode_latents(self, latents: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """The latents the plan's tiles index into: in the weights' dtype, padded by repeating the last latent."""
        latents = latents.to(self.post_quant_conv.weight.dtype)
        if plan.pad_latents:
            latents = torch.cat([latents, latents[:, :, -1:].expand(-1, -1, plan.pad_latents, -1, -1)], dim=2)
        return latents

    def decode_batch(self, latents: torch.Tensor, tiles: Sequence[DecodeTile]) -> list[torch.Tensor]:
        """One decoder call on prepared latents for tiles of equal extent stacked along the batch axis (the tokens
        of one tile never meet another's: attention is per sample): each tile's pixels `decoded_tile_shape(B,
        tile)`, in order. Several tiles per call keep the decoder's GEMMs large (a 768p tile is 1,797 tokens)."""
        crops = [
            latents[:, :, slice(*tile.frames), slice(*tile.rows), slice(*tile.columns)] for tile in tiles
        ]
        if len({crop.shape for crop in crops}) != 1:
            raise ValueError(
                f"one decoder call needs tiles of one extent, got {[tuple(c.shape) for c in crops]}"
            )
        stacked = crops[0] if len(crops) == 1 else torch.cat(crops, dim=0)
        return list(self.decoder(self.post_quant_conv(stacked)).split(latents.shape[0], dim=0))

    def decode_tiles(
        self, latents: torch.Tensor, plan: DecodePlan, indices: Iterable[int]
    ) -> list[torch.Tensor]:
        """The planned tiles `indices` (whole `plan.call_batches` runs, in order) decoded, one output per tile."""
        wanted = list(indices)
        starts = set(wanted)
        calls = [batch for batch in plan.call_batches(self.decode_batch_tiles) if batch.start in starts]
        if [index for batch in calls for index in batch] != wanted:
            raise ValueError(f"tiles {wanted} are not whole decoder calls of the plan, in order")
        outputs: list[torch.Tensor] = []
        for batch in calls:
            outputs += self.decode_batch(latents, [plan.tiles[index] for index in batch])
        return outputs

    def decoded_tile_shape(self, batch: int, tile: DecodeTile) -> tuple[int, int, int, int, int]:
        config = self.config
        ratio, ratio_t = config.spatial_compression_ratio, config.temporal_compression_ratio
        return (
            batch,
            config.out_channels,
            (tile.frames[1] - tile.frames[0]) * ratio_t,
            (tile.rows[1] - tile.rows[0]) * ratio,
            (tile.columns[1] - tile.columns[0]) * ratio,
        )

    def assemble_decode(self, plan: DecodePlan, windows: Iterable[Sequence[torch.Tensor]]) -> torch.Tensor:
        """Decoded tiles, one sequence per window in plan order -> pixels [B, 3, F, H, W]: `assembled_pieces`
        joined along the frame axis."""
        return torch.cat(list(self.assembled_pieces(plan, windows)), dim=2)

    def assembled_pieces(
        self, plan: DecodePlan, windows: Iterable[Sequence[torch.Tensor]]
    ) -> Iterator[torch.Tensor]:
        """Decoded tiles, one sequence per window in plan order -> the output's frames [B, 3, n, H, W] in order,
        each piece final as soon as its window is decoded (`decoded_frame_count(plan)` frames in all).

        Each window's tiles are stitched; each window's first clip (minus `frame_pre_padding` leading frames) is
        emitted, cross-faded with the previous window's tail, and its tail is carried to the next window; the
        frames of padding latents are cut at the end. `windows` may be a generator: one window is held at a time.
        """
        config = self.config
        clip_frames = config.latents_per_clip * config.temporal_compression_ratio
        carries_tail = config.token_drop > 0
        rows, columns = plan.grid
        remaining = self.decoded_frame_count(plan)
        carried_tail = None

        def kept(piece: torch.Tensor) -> torch.Tensor:
            nonlocal remaining
            piece = piece[:, :, :remaining]
            remaining -= piece.shape[2]
            return piece

        for tiles in windows:
            window = stitch_tiles(
                [list(tiles[row * columns : (row + 1) * columns]) for row in range(rows)],
                list(plan.row_overlaps),
                list(plan.column_overlaps),
            )
            head = window[:, :, config.frame_pre_padding : clip_frames]
            if carried_tail is not None:
                head = cross_fade(carried_tail, head, config.window_crossfade_frames, dim=2)
            yield kept(head)
            if carries_tail:
                carried_tail = window[:, :, clip_frames + config.frame_pre_padding : 2 * clip_frames]
        if carried_tail is not None:
            yield kept(carried_tail)

    def decoded_frame_count(self, plan: DecodePlan) -> int:
        """Frames `assemble_decode` returns for `plan`, from the plan alone (the same slicing, on lengths)."""
        config = self.config
        clip_frames = config.latents_per_clip * config.temporal_compression_ratio
        total = tail = 0
        for window in range(plan.window_count):
            window_frames = self.decoded_tile_shape(1, plan.window_tiles(window)[0])[2]
            total += max(0, min(clip_frames, window_frames) - config.frame_pre_padding)
            if config.token_drop > 0:
                tail = max(0, min(2 * clip_frames, window_frames) - clip_frames - config.frame_pre_padding)
        return total + tail - self._padding_frames(plan.original_count, plan.pad_latents)

    def decode(self, latents: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Un-normalized latents [B, C, T, h, w] -> ImageNet-normalized pixels [B, 3, F, H, W] (fp32).

        `autocast_dtype=None` computes in the weights' dtype (fp32: parity). `torch.float16` runs SGLang's released
        recipe (fp16 autocast with the reference's fp32 islands; see the module docstring).

        The same three steps as the parallel decode (`h3engine.models.parallel.vae`), with every tile decoded here:
        `plan_decode`, `decode_tiles` over every planned call, `assemble_decode`.
        """
        return torch.cat(list(self.decode_pieces(latents, autocast_dtype)), dim=2)

    def decode_pieces(
        self, latents: torch.Tensor, autocast_dtype: torch.dtype | None = None
    ) -> Iterator[torch.Tensor]:
        """`decode`'s output in frame order, one piece per decoded window (`assembled_pieces`): a consumer can use
        the first frames while the later windows decode; `decoded_video_shape(latents.shape)` says how many."""
        plan = self.plan_decode(latents.shape)
        latents = self.prepare_decode_latents(latents, plan)

        def decoded_window(window: int) -> list[torch.Tensor]:
            # Autocast covers the decoder calls only, never the consumer's code between two pieces (stitching and
            # cross-fading are elementwise: autocast leaves them alone either way).
            first = window * plan.tiles_per_window
            with decode_autocast(latents.device, autocast_dtype):
                return self.decode_tiles(latents, plan, range(first, first + plan.tiles_per_window))

        yield from self.assembled_pieces(
            plan, (decoded_window(window) for window in range(plan.window_count))
        )

    def decoded_video_shape(self, latent_shape: Sequence[int]) -> tuple[int, int, int]:
        """(frames, height, width) of what `decode` returns for latents of `latent_shape` [B, C, T, h, w]."""
        ratio = self.config.spatial_compression_ratio
        frames = self.decoded_frame_count(self.plan_decode(latent_shape))
        return frames, latent_shape[-2] * ratio, latent_shape[-1] * ratio

    def _padding_frames(self, original_count: int, pad_latents: int) -> int:
        """Pixel frames produced by the repeated padding latents: a clip's last latent covers only
        `clip_length % ratio_t` frames (1 of 17), every other latent covers `ratio_t` (4)."""
        config = self.config
        ratio_t = config.temporal_compression_ratio
        last_latent_frames = config.clip_length % ratio_t
        return sum(
            last_latent_frames
            if last_latent_frames and (original_count + index) % config.latents_per_clip == 0
            else ratio_t
            for index in range(pad_latents)
        )
