"""Exact AdaLN tables on disk: what a DiT's modulation computes for one step's timesteps, kept between runs.

A DiT's AdaLN tables depend only on each forward's distinct timesteps (and on the AdaLN projections, the time embedder,
adapters on AdaLN, the dtype and the device that computed them), not on the request's rows: 13 B parameters read to
make a few hundred MB. `AdalnTableCache(folder, max_bytes)` keeps one safetensors file per (model, adapters, device,
step timesteps): the six tables of every block and the final layer's two, exactly as computed (loading hands back the
same bits). A step's timesteps are the key as a whole, not each value apart: a GEMM over M rows may round differently
from M GEMMs of one row, so only the same call is the same computation. Files are written atomically (staging name with
the writer's pid, then a rename) and touched on every hit; past `max_bytes` the least recently used go. An unreadable or
truncated file is removed and its tables computed again (a warning says so).

Danger: the key must name everything the tables depend on (`TableKey`); a new input to `H3DiT.modulation` belongs
there too. Only tables a device computed itself are ever handed back on that device (the device is in the key).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from h3engine.media.leftovers import process_alive

logger = logging.getLogger(__name__)

# The cache's bound by default: about eight 50-step schedules of the released DiT at two timesteps per step.
DEFAULT_MAX_BYTES = 8 << 30
FOLDER_ENV = "H3_ADALN_CACHE"
MAX_GIB_ENV = "H3_ADALN_CACHE_GIB"
_SUFFIX = ".safetensors"
_PARTIAL = ".partial"


def device_identity(device: torch.device) -> str:
    """Where tables are computed, as far as their bits go: the GPU's name and compute capability (or the CPU's
    architecture and the instruction set torch dispatches to) and the torch build (its GEMM libraries)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    else:
        where = f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"
    return f"{where}:torch{torch.__version__}"


@dataclass(frozen=True)
class TableKey:
    """What a DiT's AdaLN tables depend on besides the timesteps: the model as loaded (`model`: the checkpoint's DiT
    fingerprint, weight format and dtype), its adapters on AdaLN (`adapters`: their files' digests and strengths; ""
    for none) and the device that computes them."""

    model: str
    adapters: str
    device: str

    def step_name(self, timesteps: Tensor) -> str:
        """The file name of one step's tables: a digest of this key and the exact bits of its fp32 timesteps."""
        values = timesteps.detach().to("cpu", torch.float32).contiguous().numpy().tobytes().hex()
        text = json.dumps([self.model, self.adapters, self.device, values])
        return hashlib.sha256(text.encode()).hexdigest()

    def description(self, timesteps: Tensor) -> str:
        """What a file holds, in its metadata (checked when it is read back)."""
        values = [float(value) for value in timesteps.detach().to("cpu", torch.float32)]
        return json.dumps(
            {"model": self.model, "adapters": self.adapters, "device": self.device, "timesteps": values}
        )


@dataclass(frozen=True)
class StepTables:
    """One step's tables as stored: every block's six [M*3, hidden] tables stacked [blocks, 6, M*3, hidden] (shift,
    1 + scale, gate for attention, then for the FFN) and the final layer's [2, M, hidden] (1 + scale, shift)."""

    blocks: Tensor
    final: Tensor


class AdalnTableCache:
    """A folder of AdaLN tables, bounded by `max_bytes` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._remove_dead_partials()

    def path(self, name: str) -> Path:
        return self.folder / f"{name}{_SUFFIX}"

    def load(self, name: str, description: str) -> StepTables | None:
        """One step's tables, or None when absent or unreadable (then removed, with a warning)."""
        path = self.path(name)
        try:
            with open(path, "rb"):
                pass
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as error:
            logger.warning("AdaLN table file %s cannot be read (%s); computing its tables", path, error)
            self.misses += 1
            return None
        try:
            tensors = load_file(path)
            stored = _read_metadata(path)
            if stored != description or set(tensors) != {"blocks", "final"}:
                raise ValueError("it holds other tables than its name says")
        except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as error:
            logger.warning(
                "AdaLN table file %s is unreadable (%s): removed; its tables are computed again", path, error
            )
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        return StepTables(tensors["blocks"], tensors["final"])

    def store(self, name: str, description: str, tables: StepTables) -> None:
        """Write one step's tables atomically, then evict the least recently used files past `max_bytes`. A folder
        that cannot take it is reported, not raised: the tables were computed, the request goes on."""
        path = self.path(name)
        staging = self.folder / f".{name}.{os.getpid()}-{secrets.token_hex(6)}{_PARTIAL}"
        try:
            save_file(
                {"blocks": tables.blocks.contiguous().cpu(), "final": tables.final.contiguous().cpu()},
                staging,
                metadata={"h3_adaln_tables": description},
            )
            os.replace(staging, path)
        except OSError as error:
            staging.unlink(missing_ok=True)
            logger.warning("AdaLN tables could not be stored in %s (%s)", self.folder, error)
            return
        self.evict()

    def files(self) -> list[Path]:
        return [path for path in self.folder.glob(f"*{_SUFFIX}") if not path.name.startswith(".")]

    def size_bytes(self) -> int:
        return sum(_size(path) for path in self.files())

    def evict(self) -> list[Path]:
        """Remove the least recently used files until the folder holds at most `max_bytes`; returns what went."""
        entries = []
        for path in self.files():
            try:
                status = path.stat()
            except OSError:
                continue
            entries.append((status.st_mtime_ns, path.name, status.st_size, path))
        entries.sort()
        total = sum(size for _, _, size, _ in entries)
        removed = []
        for _, _, size, path in entries:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed.append(path)
        return removed

    def _remove_dead_partials(self) -> None:
        """Staging files of writers that were killed before their rename."""
        for path in self.folder.glob(f".*{_PARTIAL}"):
            pid = path.name.rsplit(".", 2)[-2].split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)):
                path.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_metadata(path: Path) -> str | None:
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    return (header.get("__metadata__") or {}).get("h3_adaln_tables")


# The AdaLN tables' folder inside an engine's cache folder (the default of `open_table_cache`).
ADALN_FOLDER_NAME = "adaln-tables"


def open_table_cache(setting: str | None, default_folder: Path | None) -> AdalnTableCache | None:
    """The cache an engine uses: `setting` "off" (none), a folder, or None (the `H3_ADALN_CACHE` variable, else
    `default_folder`); its bound from `H3_ADALN_CACHE_GIB` (default DEFAULT_MAX_BYTES). A default folder that cannot
    be made is reported and left out; a named one raises OSError."""
    setting = setting if setting is not None else (os.environ.get(FOLDER_ENV) or None)
    if setting is not None and setting.strip().lower() == "off":
        return None
    gib = os.environ.get(MAX_GIB_ENV, "").strip()
    max_bytes = int(float(gib) * (1 << 30)) if gib else DEFAULT_MAX_BYTES
    if setting is not None:
        return AdalnTableCache(Path(setting).expanduser(), max_bytes)
    if default_folder is None:
        return None
    try:
        return AdalnTableCache(default_folder, max_bytes)
    except OSError as error:
        logger.warning("no AdaLN table cache: %s cannot be used (%s)", default_folder, error)
        return None
