"""The memory budget of one engine (one rank): how many bytes it may use on its GPU and in host memory.

`parse_gib(text, flag)` reads a GiB value ("24", "23.5"); anything else raises RequestError starting with `flag`.
`resolve_budget(device, gpu_memory_gib, host_memory_gib)` fills a `MemoryBudget` and says where each number came
from: the flag, else the environment (H3_GPU_MEMORY, H3_HOST_MEMORY), else the default: the GPU's free memory
(`torch.cuda.mem_get_info`) less GPU_MARGIN_BYTES, and MemAvailable of /proc/meminfo less HOST_MARGIN_BYTES. A CPU
device has no GPU budget (None: every profile is the same there), whatever the flags say.

Danger: importing this module must not import torch (the CLI checks its flags first); torch is imported only to
measure a default GPU budget. A default budget is a snapshot: measure it before the engine loads anything, or its own
weights count as used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from h3engine.errors import RequestError
from h3engine.memory.types import GIB, MemoryBudget

GPU_MEMORY_ENV = "H3_GPU_MEMORY"
HOST_MEMORY_ENV = "H3_HOST_MEMORY"

# Left free below a GPU's free memory by the default budget. The plan counts weights, ring buffers, a fixed engine
# reserve and estimated activations; it cannot see the CUDA context's later growth (kernel images of modules loaded
# lazily: cuBLASLt, cuDNN, Triton and FlashAttention kernels, tens to hundreds of MB), NCCL's buffers in a worker
# group, or the caching allocator's fragmentation over a long run of requests of different shapes (blocks that are
# free but too small for the next large activation). 2 GiB is ~1.5 % of an H200 and a fifth of a 10 GiB budget:
# enough for those, not so much that a small card loses its point.
GPU_MARGIN_BYTES = 2 * GIB

# Left free below MemAvailable by the default host budget: the operating system and other processes keep working
# memory, safetensors reads and memory-mapped homes go through the page cache (which pinned memory cannot give
# back), and the app's own processes (web server, muxing) grow during a run. Pinning the last free gigabytes makes
# the whole machine swap, not only the engine.
HOST_MARGIN_BYTES = 4 * GIB

MEMINFO_PATH = Path("/proc/meminfo")


def parse_gib(text: Any, flag: str) -> int:
    """A GiB value ("24", "23.5", 24) -> bytes; RequestError starting with `flag` for anything else."""
    try:
        value = float(str(text).strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise RequestError(flag, f"expected a number of GiB > 0, got '{text}'")
    return int(value * GIB)


def format_gib(size: int | None) -> str:
    """Bytes -> "23.5 GiB" (one decimal), None -> "no limit"."""
    return "no limit" if size is None else f"{size / GIB:.1f} GiB"


def _explicit(value: Any, flag: str, env_name: str, environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(bytes, source) of a flag value, else of the environment variable, else None."""
    if value is not None:
        return parse_gib(value, flag), flag
    if environ.get(env_name, "").strip():
        return parse_gib(environ[env_name], env_name), env_name
    return None


def _device_type(device: Any) -> str:
    """ "cuda" for "cuda", "cuda:1" or a torch.device of that type; the text before ':' otherwise."""
    return str(getattr(device, "type", device)).split(":", 1)[0]


def default_gpu_budget(device: Any) -> tuple[int | None, str]:
    """(free bytes of `device` less GPU_MARGIN_BYTES, source); (None, "no GPU") where CUDA is not there."""
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU"
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    budget = max(0, free - GPU_MARGIN_BYTES)
    return budget, f"free memory of {device} ({format_gib(free)}) less {format_gib(GPU_MARGIN_BYTES)}"


def mem_available_bytes(meminfo: Path = MEMINFO_PATH) -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the file or the line is missing (not Linux)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            parts = rest.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * 1024  # the file counts kB of 1024 bytes
    return None


def default_host_budget(meminfo: Path = MEMINFO_PATH) -> tuple[int | None, str]:
    """(MemAvailable less HOST_MARGIN_BYTES, source); (None, ...) where it cannot be read: no limit."""
    available = mem_available_bytes(meminfo)
    if available is None:
        return None, f"no limit ({meminfo} unreadable)"
    budget = max(0, available - HOST_MARGIN_BYTES)
    return budget, f"MemAvailable ({format_gib(available)}) less {format_gib(HOST_MARGIN_BYTES)}"


def resolve_budget(
    device: Any,
    gpu_memory_gib: Any = None,
    host_memory_gib: Any = None,
    environ: Mapping[str, str] | None = None,
    meminfo: Path = MEMINFO_PATH,
) -> MemoryBudget:
    """The budget of an engine on `device` ("cpu", "cuda", "cuda:1" or a torch.device), with its sources.

    `gpu_memory_gib` / `host_memory_gib` are the flags' values (None: not given, then the environment, then the
    default). Both are checked even where they do not apply (a GPU value on the CPU), so a typo is never silent.
    """
    environ = os.environ if environ is None else environ
    gpu = _explicit(gpu_memory_gib, "--gpu-memory", GPU_MEMORY_ENV, environ)
    host = _explicit(host_memory_gib, "--host-memory", HOST_MEMORY_ENV, environ)
    if _device_type(device) == "cpu":
        gpu_bytes, gpu_source = None, "cpu: no GPU budget"
    elif gpu is not None:
        gpu_bytes, gpu_source = gpu
    else:
        gpu_bytes, gpu_source = default_gpu_budget(device)
    host_bytes, host_source = host if host is not None else default_host_budget(meminfo)
    return MemoryBudget(gpu_bytes, host_bytes, gpu_source, host_source)
