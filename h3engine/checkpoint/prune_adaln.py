"""`python -m h3engine convert --prune-adaln`: a released checkpoint's DiTs in our pruned "basis" AdaLN form.

Per DiT: SiLU(temb(t)) is sampled with the file's own fp32 embedder on a dense grid of t in [0, 1] plus the given
timesteps, mean-centred, and its leading `rank` right singular vectors (fp64 SVD) become `adaln_curve.basis`
[time_embed_dim, rank] beside `adaln_curve.mean` (fp32). Every AdaLN projection (blocks and final layer) is folded:
W' = W @ basis, b' = b + W @ mean, computed in fp32 from the stored weights and stored in their dtype (bf16 in the
release); the time embedder stays, so timesteps stay exact (h3engine.models.dit_adaln). The DiT is written a tensor
at a time (one projection in memory, never the model), config.json gains `adaln_rank`; everything else is
hard-linked where the filesystem allows, else copied (with `fp8`: h3engine.checkpoint.fp8_files writes the rest).

The report (`PruneReport`) measures the pruned tables W'c + b' against W SiLU(temb) + b, both in fp32 math on the
stored weights: per table (projection, t), the relative L2 error ||P' - P|| / ||P||, its maximum over the grid and
its midpoints and over the given check timesteps; and, for scale, the same error of the exact engine's own bf16
rounding (SiLU(temb) and the table rounded to bf16).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from h3engine.checkpoint.dit_pruned import BASIS_KEY, MEAN_KEY, TIME_EMBEDDER_KEY, adaln_fields_to_json
from h3engine.checkpoint.fp8_files import (
    FORMAT_FP8,
    FORMAT_KEY,
    SCALE_SUFFIX,
    convert_checkpoint,
    dit_quantized_key,
    link_or_copy,
)
from h3engine.checkpoint.fp8_rows import FP8_DTYPE, quantize_rows
from h3engine.checkpoint.layout import CheckpointLayout, detect_layout, require_empty_folder
from h3engine.checkpoint.loader import read_dit_config
from h3engine.checkpoint.safetensors_io import WeightFiles, read_header, write_tensor_file
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import TimestepEmbedder

DEFAULT_RANK = 8
DEFAULT_GRID_POINTS = 1025
# Rows of a projection folded and measured at once (bounds the working memory, not the result).
_ROW_CHUNK = 8192


@dataclass(frozen=True)
class PruneReport:
    """One DiT folder's pruning: sizes of its weight files, the basis and the errors of its tables (module doc)."""

    folder: str
    rank: int
    samples: int  # points the basis was fitted on
    captured: float  # share of the centred curve's energy the basis holds
    bytes_before: int
    bytes_after: int
    grid_error: float  # max relative L2 error of a pruned table, over the grid and its midpoints
    check_error: float  # the same at the check timesteps
    bf16_error: float  # the exact engine's own bf16 rounding, over the grid


@dataclass
class _Errors:
    """Per evaluation point: sums of squared differences and of squared exact values, over one projection."""

    points: int
    worst: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.worst = torch.zeros(2, self.points, dtype=torch.float64)  # [pruned, bf16 engine] x points
        self._sums = torch.zeros(3, self.points, dtype=torch.float64)

    def add(self, exact: Tensor, pruned: Tensor, engine: Tensor) -> None:
        self._sums[0] += (pruned - exact).double().square().sum(dim=1).cpu()
        self._sums[1] += (engine - exact).double().square().sum(dim=1).cpu()
        self._sums[2] += exact.double().square().sum(dim=1).cpu()

    def close_projection(self) -> None:
        """The relative errors of the projection just summed; the worst over projections is kept."""
        norms = self._sums[2].clamp(min=torch.finfo(torch.float64).tiny).sqrt()
        relative = self._sums[:2].sqrt() / norms
        self.worst = torch.maximum(self.worst, relative)
        self._sums.zero_()


class _Curve:
    """A DiT's sampled SiLU(temb) curve, its basis, and the projections folded onto it one at a time."""

    def __init__(
        self,
        files: WeightFiles,
        config: DiTConfig,
        rank: int,
        fit: Tensor,
        grid: Tensor,
        check: Tensor,
        device: torch.device,
    ) -> None:
        embedder = TimestepEmbedder(config, device)
        state = {name: files.tensor(f"time_embedder.{name}") for name, _ in embedder.state_dict().items()}
        embedder.load_state_dict(state)

        def activated(timesteps: Tensor) -> Tensor:
            with torch.no_grad():
                return F.silu(embedder(timesteps.to(device=device, dtype=torch.float32)))

        samples = activated(fit).double()
        mean = samples.mean(dim=0)
        _, singular, right = torch.linalg.svd(samples - mean, full_matrices=False)
        energy = singular.square()
        self.captured = float(energy[:rank].sum() / energy.sum()) if energy.sum() > 0 else 1.0
        self.mean = mean.to(torch.float32)
        self.basis = right[:rank].T.contiguous().to(torch.float32)
        self.samples = fit.numel()
        self.grid_points = grid.numel()
        points = torch.cat((grid, check))
        self.activated = activated(points)  # [T, D] fp32: the exact input, before the engine's bf16 cast
        self.curve = (self.activated - self.mean) @ self.basis  # [T, rank] fp32, as the engine computes c(t)
        self.errors = _Errors(points.numel())
        self.device = device

    def fold(self, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """(W @ basis, b + W @ mean) in the stored weights' dtype; measures the tables they make on the way."""
        dtype, bias_dtype = _stored_dtype(weight.dtype), _stored_dtype(bias.dtype)
        folded_weight = torch.empty(weight.shape[0], self.basis.shape[1], dtype=dtype)
        folded_bias = torch.empty(weight.shape[0], dtype=bias_dtype)
        engine_input = self.activated.to(torch.bfloat16).to(torch.float32)
        for start in range(0, weight.shape[0], _ROW_CHUNK):
            rows = slice(start, start + _ROW_CHUNK)
            chunk = weight[rows].to(device=self.device, dtype=torch.float32)
            chunk_bias = bias[rows].to(device=self.device, dtype=torch.float32)
            stored_weight = (chunk @ self.basis).to(dtype)
            stored_bias = (chunk_bias + chunk @ self.mean).to(bias_dtype)
            exact = self.activated @ chunk.T + chunk_bias
            pruned = self.curve @ stored_weight.to(torch.float32).T + stored_bias.to(torch.float32)
            engine = (engine_input @ chunk.T + chunk_bias).to(torch.bfloat16).to(torch.float32)
            self.errors.add(exact, pruned, engine)
            folded_weight[rows], folded_bias[rows] = stored_weight.cpu(), stored_bias.cpu()
        self.errors.close_projection()
        return folded_weight, folded_bias

    def report(self, folder: str, rank: int, before: int, after: int) -> PruneReport:
        pruned, engine = self.errors.worst
        grid = slice(0, self.grid_points)
        check = slice(self.grid_points, None)
        return PruneReport(
            folder=folder,
            rank=rank,
            samples=self.samples,
            captured=self.captured,
            bytes_before=before,
            bytes_after=after,
            grid_error=float(pruned[grid].max()),
            check_error=float(pruned[check].max()) if pruned[check].numel() else math.nan,
            bf16_error=float(engine[grid].max()),
        )


def _stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """A folded projection's dtype: the source's (bf16 in the release), bf16 for anything but a float of 16 or 32."""
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def _projection(key: str) -> tuple[str, str] | None:
    """(weight key, bias key) of the AdaLN projection a native key belongs to, or None."""
    for suffix in ("adaln_proj.linear.weight", "adaln_proj.linear.bias"):
        if key.endswith(suffix) and (key.startswith("blocks.") or key.startswith("final_layer.")):
            prefix = key.removesuffix(suffix)
            return prefix + "adaln_proj.linear.weight", prefix + "adaln_proj.linear.bias"
    return None


def _file_specs(
    infos: dict, rank: int, fp8: bool, quantized: Callable[[str], bool]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What one pruned shard holds: its projections `rank` wide, FP8 values and row scales with `fp8`, the curve's
    mean and basis beside the time embedder, the rest as stored."""
    specs = []
    for key, info in infos.items():
        pair = _projection(key)
        dtype = _stored_dtype(info.dtype)
        if pair is not None and key == pair[0]:
            specs.append((key, (info.shape[0], rank), dtype))
        elif pair is not None:
            specs.append((key, info.shape, dtype))
        elif fp8 and quantized(key):
            specs += [(key, info.shape, FP8_DTYPE), (key + SCALE_SUFFIX, (info.shape[0], 1), torch.float32)]
        else:
            specs.append((key, info.shape, info.dtype))
    return specs


def _write_dit_file(
    source: Path, target: Path, files: WeightFiles, curve: _Curve, fp8: bool, made: dict[str, Tensor]
) -> tuple[list[str], int]:
    """One DiT shard written pruned; returns (the keys written, its bytes). `made`: tensors made with another
    (a projection's bias folded with its weight, in this shard or a later one) until their turn comes."""
    infos = read_header(source)
    specs = _file_specs(infos, curve.basis.shape[1], fp8, dit_quantized_key)
    if TIME_EMBEDDER_KEY in infos:
        width, rank = curve.basis.shape
        specs += [(MEAN_KEY, (width,), torch.float32), (BASIS_KEY, (width, rank), torch.float32)]

    def make(key: str) -> Tensor:
        if key in made:
            return made.pop(key)
        if key == MEAN_KEY:
            return curve.mean.cpu()
        if key == BASIS_KEY:
            return curve.basis.cpu()
        pair = _projection(key)
        if pair is not None:
            made[pair[0]], made[pair[1]] = curve.fold(files.tensor(pair[0]), files.tensor(pair[1]))
            return made.pop(key)
        if fp8 and dit_quantized_key(key):
            # Keys go sorted, "KEY" before "KEY_scale": the scales wait in `made` for their turn.
            made[key], made[key + SCALE_SUFFIX] = quantize_rows(files.tensor(key))
            return made.pop(key)
        return files.tensor(key)

    write_tensor_file(target, specs, make, {FORMAT_KEY: FORMAT_FP8} if fp8 else None)
    return [key for key, _, _ in specs], target.stat().st_size


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def _evaluation_points(grid_points: int, timesteps: Sequence[float]) -> tuple[Tensor, Tensor, Tensor]:
    """(fit: the grid and `timesteps`, grid: the grid and its midpoints, check: `timesteps`), fp32 t in [0, 1]."""
    grid = torch.linspace(0.0, 1.0, grid_points, dtype=torch.float64).to(torch.float32)
    check = torch.tensor(sorted(set(map(float, timesteps))), dtype=torch.float32)
    fine = torch.linspace(0.0, 1.0, 2 * grid_points - 1, dtype=torch.float64).to(torch.float32)
    return torch.cat((grid, check)).unique(), fine, check


def prunable(
    layout: CheckpointLayout, folder: Path, rank: int, grid_points: int
) -> tuple[DiTConfig, WeightFiles]:
    """The config and files of the DiT `folder` of `layout`, which must hold the exact AdaLN form in bf16 (or fp32)
    weights and admit the rank (CheckpointError naming the folder otherwise)."""
    paths = next(paths for paths in layout.partitions.values() if paths.dit == folder)
    config = read_dit_config(layout, paths)
    if config.adaln_form != "exact":
        raise CheckpointError(f"{folder}: its DiT is already pruned (the {config.adaln_form} AdaLN form)")
    if not 1 <= rank <= config.time_embed_dim or grid_points < 2:
        raise CheckpointError(
            f"{folder}: a rank in [1, {config.time_embed_dim}] and at least 2 grid points are needed, got rank "
            f"{rank} and {grid_points} points"
        )
    files = WeightFiles.open(folder)
    if files.stores_fp8:
        raise CheckpointError(
            f"{folder}: its weights are stored in FP8; prune the bf16 checkpoint (add --weights fp8 for FP8 files)"
        )
    return config, files


def prune_dit_folder(
    layout: CheckpointLayout,
    folder: Path,
    target: Path,
    rank: int = DEFAULT_RANK,
    grid_points: int = DEFAULT_GRID_POINTS,
    timesteps: Sequence[float] = (),
    fp8: bool = False,
    device: torch.device | str | None = None,
) -> PruneReport:
    """Write the DiT `folder` of `layout` pruned into `target` (with `fp8`, its large linears as FP8 with row scales,
    h3engine.checkpoint.fp8_files' format); `timesteps` join the fit and are where `check_error` is measured."""
    config, files = prunable(layout, folder, rank, grid_points)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    curve = _Curve(files, config, rank, *_evaluation_points(grid_points, timesteps), device)
    target.mkdir(parents=True, exist_ok=True)
    written, weight_map, index_paths, made = 0, {}, [], {}
    for path in sorted(folder.iterdir()):
        if path.name.endswith(".safetensors.index.json"):
            index_paths.append(path)
        elif path.suffix == ".safetensors":
            keys, size = _write_dit_file(path, target / path.name, files, curve, fp8, made)
            weight_map.update(dict.fromkeys(keys, path.name))
            written += size
        elif path.name == "config.json":
            raw = json.loads(path.read_text(encoding="utf-8"))
            raw.update(adaln_fields_to_json(dataclasses.replace(config, adaln_rank=rank)))
            (target / path.name).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
        elif path.is_file():
            link_or_copy(path, target / path.name)
    for index_path in index_paths:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.setdefault("metadata", {})["total_size"] = written
        (target / index_path.name).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    files.close()
    relative = str(folder.relative_to(layout.root)) if folder.is_relative_to(layout.root) else str(folder)
    return curve.report(relative, rank, _folder_bytes(folder), written)


def prune_checkpoint(
    source: str | Path,
    out: str | Path,
    rank: int = DEFAULT_RANK,
    grid_points: int = DEFAULT_GRID_POINTS,
    timesteps: Sequence[float] = (),
    fp8: bool = False,
    device: torch.device | str | None = None,
) -> tuple[list[PruneReport], dict[str, int]]:
    """Write `source` (a native-layout checkpoint) into the empty or missing folder `out` with its DiTs pruned (and,
    with `fp8`, in h3engine.checkpoint.fp8_files' format); returns each DiT's report and the bytes written per
    converted component."""
    source, out = Path(source), Path(out)
    layout = detect_layout(source)
    if layout.kind != "native":
        raise CheckpointError(
            f"{source}: --prune-adaln writes the native layout (a transformer/ folder per partition); this "
            "checkpoint is in the diffusers layout"
        )
    require_empty_folder(out)
    dit_folders = sorted({paths.dit for paths in layout.partitions.values()})
    for folder in dit_folders:  # every refusal before anything is written
        prunable(layout, folder, rank, grid_points)
    reports: list[PruneReport] = []

    def write_dit(folder: Path, target: Path) -> int:
        reports.append(prune_dit_folder(layout, folder, target, rank, grid_points, timesteps, fp8, device))
        return reports[-1].bytes_after

    if fp8:
        return reports, convert_checkpoint(source, out, dit_writer=write_dit)
    for path in sorted(source.rglob("*")):
        inside = any(folder == path or folder in path.parents for folder in dit_folders)
        if path.is_file() and not inside:
            link_or_copy(path, out / path.relative_to(source))
    sizes = {
        f"dit:{folder.relative_to(source)}": write_dit(folder, out / folder.relative_to(source))
        for folder in dit_folders
    }
    return reports, sizes
