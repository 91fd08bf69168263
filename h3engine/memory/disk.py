"""The read rate of the disk a checkpoint lives on: what layers streamed from the files cost (h3engine.memory.cost).

`disk_read_rate(checkpoint, cache_folder, given)` is `given` (`--disk-read-gbps`, GB/s) when set; else the rate
measured once per disk and kept in `cache_folder/disk-read-rates.json` (keyed by the filesystem's device id): up to
MEASURE_BYTES read with O_DIRECT (past the page cache, so a file read a moment ago does not pass for a fast disk) from
the largest weight file, in MEASURE_CHUNK_BYTES reads. A placeholder checkpoint (its data a hole: nothing to read)
or a filesystem without O_DIRECT gives the default (DEFAULT_DISK_BYTES_PER_SECOND) and says so.

Danger: a disk shared with other work reads slower than measured; a rate measured on an idle machine is the best
case. Imports no torch.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Mapping
from pathlib import Path

from h3engine.errors import RequestError
from h3engine.memory.cost import DEFAULT_DISK_BYTES_PER_SECOND

MEASURE_BYTES = 512 << 20
MEASURE_CHUNK_BYTES = 16 << 20
RATES_FILE = "disk-read-rates.json"
# O_DIRECT wants the buffer, the offset and the length aligned to the device's logical block (4096 covers them).
_ALIGNMENT = 4096


def default_cache_folder(environ: Mapping[str, str] | None = None) -> Path:
    """The engine's cache folder (AdaLN tables, measured disk rates, the app's tiny checkpoint): $H3_CACHE_DIR, else
    h3engine in $XDG_CACHE_HOME or ~/.cache."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or str(Path.home())
    base = environ.get("XDG_CACHE_HOME") or str(Path(home) / ".cache")
    return Path(environ.get("H3_CACHE_DIR") or Path(base) / "h3engine")


def keep_compile_caches_in(folder: Path) -> None:
    """Put TorchInductor's cache under `folder` (`torchinductor/`) unless the environment names one: importing
    transformers' Qwen3-VL modeling makes it, by default in the system temp folder, where nothing of ours may stay.
    Worker processes inherit it. Call before the text encoder's modules are imported (the entry points' start)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(folder) / "torchinductor"))


def parse_gbps(text: str | float, flag: str = "--disk-read-gbps") -> float:
    """ "1.9" GB/s -> bytes per second; RequestError naming `flag` for anything else."""
    try:
        value = float(str(text).strip())
    except ValueError:
        value = float("nan")
    if not value > 0 or value != value or value == float("inf"):
        raise RequestError(flag, f"expected a read rate in GB/s > 0, got '{text}'")
    return value * 1e9


def _largest_weight_file(checkpoint: Path) -> Path | None:
    files = [path for path in Path(checkpoint).rglob("*.safetensors") if path.is_file()]
    return max(files, key=lambda path: path.stat().st_size, default=None)


def _is_placeholder(path: Path) -> bool:
    """A file whose data is (mostly) a hole: fewer blocks on disk than its length (h3engine.checkpoint.placeholder)."""
    status = path.stat()
    return status.st_blocks * 512 < status.st_size // 2


def measure_read_rate(path: Path, limit: int = MEASURE_BYTES) -> float | None:
    """Bytes per second of O_DIRECT reads of up to `limit` bytes of `path` (None where O_DIRECT is refused or the
    file is too small to tell)."""
    size = path.stat().st_size
    length = min(limit, size) // MEASURE_CHUNK_BYTES * MEASURE_CHUNK_BYTES
    if length < MEASURE_CHUNK_BYTES:
        return None
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    buffer = mmap.mmap(-1, MEASURE_CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
    try:
        started = time.perf_counter()
        done = 0
        # From the file's middle: its header and the first tensors may have been read at start.
        offset = (size - length) // 2 // _ALIGNMENT * _ALIGNMENT
        while done < length:
            count = os.preadv(descriptor, [buffer], offset + done)
            if count <= 0:
                break
            done += count
        seconds = time.perf_counter() - started
    except OSError:
        return None
    finally:
        os.close(descriptor)
        buffer.close()
    return done / seconds if done and seconds > 0 else None


def disk_read_rate(
    checkpoint: str | os.PathLike[str], cache_folder: Path | None, given: float | None = None
) -> tuple[float, str]:
    """(bytes per second, where it came from) for the checkpoint's disk (see the module docstring)."""
    if given is not None:
        return given, "--disk-read-gbps"
    path = _largest_weight_file(Path(checkpoint))
    if path is None or _is_placeholder(path):
        return DEFAULT_DISK_BYTES_PER_SECOND, "default (no weight bytes on disk to measure)"
    key = str(os.stat(path).st_dev)
    rates_path = cache_folder / RATES_FILE if cache_folder is not None else None
    rates: dict[str, float] = {}
    if rates_path is not None:
        try:
            rates = {str(k): float(v) for k, v in json.loads(rates_path.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            rates = {}
        if key in rates and rates[key] > 0:
            return rates[key], f"measured earlier ({rates_path})"
    rate = measure_read_rate(path)
    if rate is None:
        return DEFAULT_DISK_BYTES_PER_SECOND, "default (the disk could not be measured)"
    if rates_path is not None:
        try:
            rates_path.parent.mkdir(parents=True, exist_ok=True)
            staging = rates_path.with_name(f".{RATES_FILE}.{os.getpid()}.partial")
            staging.write_text(json.dumps({**rates, key: rate}))
            os.replace(staging, rates_path)
        except OSError:
            pass
    return rate, f"measured now on {path.name}"
