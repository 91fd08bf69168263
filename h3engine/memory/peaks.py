"""The peaks of a placement: device bytes per phase, and the host homes with their demotions.

`phase_peaks(models, partition, shape, working)`: per phase, the engine reserve + the cached AdaLN tables + every
model's resident bytes + the phase's moved parts and open rings + its working memory (h3engine.memory.working).
`host_plan(...)`: what waits pinned in host memory, demoted in `DEMOTIONS` order until it fits the host budget.

Danger: these mirror what h3engine.memory.placement, streaming and modulation hold: rings open only during the
phase that runs their model, FP8 layers that do not stream are dequantized on adoption, an FP8 stream image cannot
be mapped, a warm DiT partition keeps a pinned copy of its resident tensors. A change there changes the truth here
(the mirrored constants are tested; the rest is for the GPU measurements to catch). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h3engine.memory.slabs import packed_bytes
from h3engine.memory.working import FP32, adaln_cache_bytes

if TYPE_CHECKING:
    from h3engine.memory.plan import MemoryBudget, ModelPlacement
    from h3engine.memory.shapes import RequestShape
    from h3engine.memory.sizes import CheckpointSizes, PartitionSizes

# The phases of a request in order, and the `pipeline.Models` fields each one runs (what the placement holds on the
# device for it, h3engine.memory.placement).
PHASES = ("conditioning", "text_encode", "denoise", "decode")
PHASE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "conditioning": ("video_vae", "audio_vae"),
    "text_encode": ("text_encoder",),
    "denoise": ("dit",),
    "decode": ("video_vae", "audio_vae"),
}
# Phase -> the model whose layers it runs (a streamed model's ring is open during that phase only).
PHASE_LAYERS = {"text_encode": "text_encoder", "denoise": "dit", "decode": "video_vae"}
# The models whose large linears --weights fp8 stores in FP8 (the VAEs keep the released fp32). Only a streamed
# layer's host image stays FP8 (and so cannot be mapped); resident and phase-moved layers are dequantized at load.
FP8_MODELS = ("dit", "text_encoder")

# Held on every GPU engine besides weights and activations: cuBLAS / cuBLASLt workspaces (32 MiB per handle and
# stream on Hopper; the compute, AdaLN and copy streams each get one), cuDNN's convolution and attention
# workspaces (the VAE encoder's 3-D convolutions ask for hundreds of MB), Triton and FlashAttention kernel images.
ENGINE_RESERVE_BYTES = 1 << 30
# Host memory of the engine process besides its pinned homes: the interpreter, torch and its CUDA libraries'
# host-side code and data (~2 GB), transformers, the tokenizer and processor, the app's own objects.
HOST_PROCESS_BYTES = 4 << 30


# ----------------------------------------------------------------------------------------------------------------
# Device peaks
#
# What a device holds of a model's layers is unquantized: h3engine.memory.placement dequantizes the FP8 layers that
# do not stream (resident and phase-moved ones); only a streamed layer's host image is FP8, and its ring slot holds
# the dequantized layer next to an FP8 staging copy.


def ring_slot_bytes(model: str, partition: PartitionSizes) -> int:
    """One ring buffer: the largest layer as computed, plus its FP8 staging copy when the layer is stored in FP8."""
    size = partition.model(model)
    if size.largest_layer_compute != size.largest_layer:
        return size.largest_layer_compute + size.largest_layer
    return size.largest_layer


def resident_bytes(model: str, placement: ModelPlacement, partition: PartitionSizes) -> int:
    """What `model` keeps on the device for the engine's life: its resident layers (a streamed model's leading
    ones) and a resident "other" part. The DiT's AdaLN projections are not counted: on a GPU they wait on the
    host."""
    size = partition.model(model)
    held = size.other_bytes if placement.other == "resident" else 0
    if placement.layers == "resident":
        held += size.layers_compute_total
    elif placement.layers == "streamed":
        held += size.leading_compute_bytes(placement.resident_layers)
    return held


def phase_bytes(model: str, placement: ModelPlacement, partition: PartitionSizes, phase: str) -> int:
    """What `model` adds on the device while `phase` runs: its phase-moved parts and its ring (a ring opens when the
    phase that runs its layers begins: the video VAE's only in "decode", where its decoder runs)."""
    if model not in PHASE_COMPONENTS[phase]:
        return 0
    size = partition.model(model)
    held = size.other_bytes if placement.other == "phase" else 0
    if placement.layers == "phase":
        held += size.layers_compute_total
    elif placement.layers == "streamed" and PHASE_LAYERS.get(phase) == model:
        held += placement.ring_depth * ring_slot_bytes(model, partition)
    return held


def phase_peaks(
    models: Mapping[str, ModelPlacement],
    partition: PartitionSizes,
    shape: RequestShape,
    working: Mapping[str, int],
    device_type: str = "cuda",
) -> dict[str, int]:
    """Peak device bytes of each phase: the engine reserve + the AdaLN table cache + every model's resident bytes +
    the phase's models' phase-moved parts and rings + the phase's working memory."""
    resident = sum(resident_bytes(name, models[name], partition) for name in models)
    if device_type == "cpu":
        resident += partition.dit.adaln_bytes
    base = (0 if device_type == "cpu" else ENGINE_RESERVE_BYTES) + adaln_cache_bytes(
        partition, shape, device_type
    )
    return {
        phase: base
        + resident
        + sum(phase_bytes(name, models[name], partition, phase) for name in models)
        + working[phase]
        for phase in working
    }


# ----------------------------------------------------------------------------------------------------------------
# Host homes
#
# What waits in host memory (h3engine.memory.placement, streaming, modulation): a phase-moved part's pinned copy
# (always pinned: the phase copies from it), a streamed layer's image (pinned, FP8 with --weights fp8, or "mapped":
# read from the checkpoint files at each visit, which only a bf16 image can be), the AdaLN projections (pinned, FP8
# with --weights fp8, or mapped), and, when the plan keeps both DiT partitions warm, a pinned copy of the served
# DiT's resident tensors besides the whole other partition's DiT.

# Host demotions, applied in order until the pinned bytes fit the host budget: the partition not being served
# first (it only matters at a switch, which then reads the files again; the served DiT's warm copy goes with it),
# then the once-per-request streams (text encoder, video decoder), then the AdaLN projections (once per request,
# hidden under the first step), and the served DiT's layers last (every step).
DEMOTIONS = (
    ("other_partition", "mapped"),
    ("text_encoder", "mapped"),
    ("video_vae", "mapped"),
    ("adaln", "mapped"),
    ("dit", "mapped"),
)


def moved_home_bytes(model: str, placement: ModelPlacement, partition: PartitionSizes) -> int:
    """Pinned bytes of `model`'s phase-moved parts (unquantized, like what the device holds of them)."""
    size = partition.model(model)
    moved = size.other_bytes if placement.other == "phase" else 0
    if placement.layers == "phase":
        moved += size.layers_compute_total
    return moved


def streamed_home_bytes(model: str, placement: ModelPlacement, partition: PartitionSizes) -> int:
    """Bytes of `model`'s streamed layers' images as stored (FP8 values and scales with --weights fp8)."""
    if placement.layers != "streamed":
        return 0
    return partition.model(model).trailing_layers_bytes(placement.resident_layers)


def pinned_stream_bytes(model: str, placement: ModelPlacement, partition: PartitionSizes) -> int:
    """Host bytes of `model`'s streamed layers' images in a pinned home: packed into slabs (homes.packed_bytes)."""
    if placement.layers != "streamed":
        return 0
    return packed_bytes(partition.model(model).layer_bytes[placement.resident_layers :])


def dit_image_bytes(placement: ModelPlacement, partition: PartitionSizes) -> int:
    """Everything of a DiT partition kept warm on the host: resident tensors, moved parts, stream images and
    AdaLN projections."""
    return (
        resident_bytes("dit", placement, partition)
        + moved_home_bytes("dit", placement, partition)
        + pinned_stream_bytes("dit", placement, partition)
        + partition.dit.adaln_bytes
    )


def request_host_bytes(shape: RequestShape) -> int:
    """Pinned host bytes a request holds: its decoded video (h3engine.media.progressive, fp32 [F, H, W, 3])."""
    return shape.frames * shape.height * shape.width * 3 * FP32


@dataclass(frozen=True)
class HostPlan:
    homes: dict[str, str]  # model, "adaln", "other_partition" -> "none" | "pinned" | "mapped" | "disk"
    pinned: dict[str, int]  # what holds pinned (or, on the CPU, host) bytes, after the demotions
    pinned_bytes: int
    minimum_bytes: int
    fits: bool


def _mappable(model: str, placement: ModelPlacement, weights: str) -> bool:
    return placement.layers == "streamed" and not (weights == "fp8" and model in FP8_MODELS)


def _host_state(
    models: Mapping[str, ModelPlacement],
    homes: Mapping[str, str],
    sizes: CheckpointSizes,
    partition: PartitionSizes,
    shape: RequestShape,
    device_type: str,
) -> dict[str, int]:
    """Pinned bytes per holder for the homes `homes`."""
    pinned = {"process": HOST_PROCESS_BYTES + request_host_bytes(shape)}
    if device_type == "cpu":
        # The CPU's device is host memory: every weight lives there.
        pinned["models"] = sum(partition.model(name).total for name in models)
        return pinned
    for name in models:
        placement = models[name]
        pinned[name] = moved_home_bytes(name, placement, partition)
        if homes[name] == "pinned":
            pinned[name] += pinned_stream_bytes(name, placement, partition)
    pinned["adaln"] = partition.dit.adaln_bytes if homes["adaln"] == "pinned" else 0
    other = sizes.other_partition(partition.partition)
    # Only a pinned other partition is kept warm (h3engine.memory.placement); a mapped one is read from the files again
    # at a switch, like "disk" (from the page cache when it still holds them), so nothing of the served DiT waits.
    warm = other is not None and homes["other_partition"] == "pinned"
    pinned["warm_dit"] = resident_bytes("dit", models["dit"], partition) if warm else 0
    pinned["other_partition"] = (
        dit_image_bytes(models["dit"], other) if homes["other_partition"] == "pinned" and other else 0
    )
    return pinned


def host_plan(
    models: Mapping[str, ModelPlacement],
    sizes: CheckpointSizes,
    partition: PartitionSizes,
    shape: RequestShape,
    budget: MemoryBudget,
    device_type: str,
) -> HostPlan:
    """Pinned homes for everything that waits on the host, demoted in DEMOTIONS order until they fit."""
    other = sizes.other_partition(partition.partition)
    homes: dict[str, str] = {}
    for name in models:
        placement = models[name]
        homes[name] = "none" if placement.all_resident or device_type == "cpu" else "pinned"
    homes["adaln"] = "device" if device_type == "cpu" else "pinned"
    homes["other_partition"] = "pinned" if other is not None and device_type != "cpu" else "disk"

    def applicable(item: str, target: str, state: Mapping[str, str]) -> bool:
        if item == "other_partition":
            return state[item] == "pinned" if target == "mapped" else state[item] in ("pinned", "mapped")
        if item == "adaln":
            return state[item] == "pinned"
        return state[item] == "pinned" and _mappable(item, models[item], sizes.weights)

    def total(state: Mapping[str, str]) -> int:
        return sum(_host_state(models, state, sizes, partition, shape, device_type).values())

    limit = budget.host_bytes
    for item, target in DEMOTIONS:
        if limit is None or total(homes) <= limit:
            break
        if applicable(item, target, homes):
            homes[item] = target
    lowest = dict(homes)
    for item, target in DEMOTIONS:
        if applicable(item, target, lowest):
            lowest[item] = target
    pinned = _host_state(models, homes, sizes, partition, shape, device_type)
    pinned_bytes = sum(pinned.values())
    return HostPlan(homes, pinned, pinned_bytes, total(lowest), limit is None or pinned_bytes <= limit)
