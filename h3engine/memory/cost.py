"""The cost model of a memory plan: the seconds a request loses against keeping everything on the GPU, the bytes it
moves over PCIe and reads from the disk, and the predicted seconds of one DiT step.

A streamed model's layers cross PCIe from their homes while the layers before them compute; its file-home layers are
read from the disk by reader threads first (h3engine.memory.streaming). The three run side by side, so a pass over a
model's layers takes max(compute, PCIe bytes / PINNED_BYTES_PER_SECOND, disk bytes / the disk's read rate) and loses
what is over the compute. A phase-moved part crosses PCIe whole each time its phase begins. AdaLN tables cost
nothing when their disk cache covers the request; otherwise each request (or, with the cache, each new schedule's
first request) reads the projections. Imports no torch.

Danger: the rates are estimates (PCIe from pinned memory, the disk's measured or given rate, the H200's effective
compute rate): the GPU runs measure the truth (benchmarks/memory_budgets.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from h3engine.memory.peaks import file_home_layers, moved_home_bytes
from h3engine.memory.working import decoder_call_flops, dit_forward_flops, text_encode_flops

if TYPE_CHECKING:
    from h3engine.memory.shapes import RequestShape
    from h3engine.memory.sizes import PartitionSizes
    from h3engine.memory.types import ModelPlacement

# Host -> GPU copy rate from pinned memory: PCIe Gen5 x16 reaches ~50 GB/s alone; half of it allows for the NUMA
# distance and the other copies sharing the link (a Gen4 gaming PC reaches ~25 GB/s).
PINNED_BYTES_PER_SECOND = 25e9
# The disk's read rate when none is measured or given: a pessimistic NVMe (the GPU machine's measured 1.9 GB/s).
DEFAULT_DISK_BYTES_PER_SECOND = 2e9
# Effective dense bf16 rate of the DiT's forward on one H200 (3.57 PFLOP in ~5.3 s); used for every model's compute
# time, which decides how much of a streamed model's copying hides under its compute.
EFFECTIVE_FLOPS_PER_SECOND = 6.7e14


@dataclass(frozen=True)
class Cost:
    """What a request costs under a plan, against everything resident on the GPU."""

    seconds: float = 0.0  # lost per request (a request whose AdaLN tables are cached)
    bytes_per_step: int = 0  # host -> GPU per DiT step
    bytes_per_request: int = 0  # host -> GPU per request besides the steps
    disk_bytes_per_step: int = 0  # read from the files per DiT step
    disk_bytes_per_request: int = 0  # read from the files per request besides the steps
    step_seconds: float = (
        0.0  # predicted seconds of one DiT step (compute, or the copies when they take longer)
    )
    compute_step_seconds: float = 0.0  # one DiT step's compute alone
    first_request_seconds: float = (
        0.0  # more on a new schedule's first request (its AdaLN tables are computed)
    )


def streamed_bytes(model: str, placement: ModelPlacement, partition: PartitionSizes) -> tuple[int, int]:
    """(PCIe bytes, disk bytes) of one pass over a streamed model's streamed layers: every streamed image crosses PCIe
    (as stored: FP8 images are smaller), and the file-home ones (`placement.mapped_layers`, spread evenly; all of them
    with a "mapped" home) are read from the disk first."""
    if placement.layers != "streamed":
        return 0, 0
    size = partition.model(model)
    images = size.layer_bytes[placement.resident_layers :]
    count = len(images) if placement.home == "mapped" else placement.mapped_layers
    flags = file_home_layers(len(images), count)
    return sum(images), sum(image for image, in_file in zip(images, flags, strict=True) if in_file)


def _pass_seconds(compute: float, pcie_bytes: int, disk_bytes: int, disk_rate: float) -> float:
    return max(compute, pcie_bytes / PINNED_BYTES_PER_SECOND, disk_bytes / disk_rate)


def request_cost(
    models: Mapping[str, ModelPlacement],
    homes: Mapping[str, str],
    partition: PartitionSizes,
    shape: RequestShape,
    share: Any,
    device_type: str,
    disk_rate: float = DEFAULT_DISK_BYTES_PER_SECOND,
    adaln_cached: bool = False,
) -> Cost:
    """The cost of one request of `shape` under `models` (their homes in `homes`; `adaln_cached`: the disk cache
    holds its AdaLN tables). Compute times are this rank's FLOPs / EFFECTIVE_FLOPS_PER_SECOND. Nothing on the CPU."""
    if device_type == "cpu":
        return Cost()
    seconds, per_request, disk_per_request = 0.0, 0, 0

    def moved(name: str, entries: int) -> None:
        nonlocal seconds, per_request
        size = moved_home_bytes(name, models[name], partition) * entries
        per_request += size
        seconds += size / PINNED_BYTES_PER_SECOND  # moved parts are always pinned

    dit = partition.dit
    compute = dit_forward_flops(partition, shape) / (share.dit_tp * share.dit_sp) / EFFECTIVE_FLOPS_PER_SECOND
    pcie, disk = streamed_bytes("dit", models["dit"], partition)
    step = _pass_seconds(compute, pcie, disk, disk_rate)
    seconds += shape.steps * (step - compute)
    # The AdaLN projections: built on a side stream under the first step from pinned memory, or read from the files.
    if homes["adaln"] == "pinned":
        adaln = max(0.0, dit.adaln_bytes / PINNED_BYTES_PER_SECOND - compute)
    else:
        adaln = dit.adaln_bytes / disk_rate
    first_request = 0.0
    if adaln_cached:
        first_request = adaln  # only a schedule the cache lacks
    else:
        seconds += adaln
        per_request += dit.adaln_bytes
        disk_per_request += 0 if homes["adaln"] == "pinned" else dit.adaln_bytes
    moved("dit", 1)

    moved("text_encoder", 1)
    pcie_te, disk_te = streamed_bytes("text_encoder", models["text_encoder"], partition)
    if pcie_te:
        te_compute = text_encode_flops(partition, shape) / share.encoder_tp / EFFECTIVE_FLOPS_PER_SECOND
        seconds += _pass_seconds(te_compute, pcie_te, disk_te, disk_rate) - te_compute
        per_request += pcie_te
        disk_per_request += disk_te

    # The VAEs' phases: decode, and conditioning for the tasks that encode.
    entries = 1 if shape.task == "t2va" else 2
    moved("video_vae", entries)
    moved("audio_vae", entries)
    pcie_vae, disk_vae = streamed_bytes("video_vae", models["video_vae"], partition)
    if pcie_vae and shape.decode is not None:
        for rows in shape.decode.call_rows:
            call = decoder_call_flops(partition, rows) / EFFECTIVE_FLOPS_PER_SECOND
            seconds += _pass_seconds(call, pcie_vae, disk_vae, disk_rate) - call
            per_request += pcie_vae
            disk_per_request += disk_vae
    return Cost(
        seconds=seconds,
        bytes_per_step=pcie,
        bytes_per_request=per_request,
        disk_bytes_per_step=disk,
        disk_bytes_per_request=disk_per_request,
        step_seconds=step,
        compute_step_seconds=compute,
        first_request_seconds=first_request,
    )
