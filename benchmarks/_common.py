"""What the benchmark scripts share: device labels for result file names, device synchronization, versions."""

from __future__ import annotations

import importlib.metadata
import re

import torch


def device_label(device: torch.device) -> str:
    """The device's name as a file-name fragment, e.g. NVIDIA_H200 (cpu on the CPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (host timers are meaningless without it); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def package_version(name: str) -> str | None:
    """An installed distribution's version, or None when it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
