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
from h3engine.memory.working import FP32, MODULATION_CACHE_SCHEDULES, adaln_cache_bytes

if TYPE_CHECKING:
    from h3engine.memory.shapes import RequestShape
    from h3engine.memory.sizes import CheckpointSizes, PartitionSizes
    from h3engine.memory.types import MemoryBudget, ModelPlacement

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
    kept_schedules: int = MODULATION_CACHE_SCHEDULES,
) -> dict[str, int]:
    """Peak device bytes of each phase: the engine reserve + the AdaLN table cache + every model's resident bytes +
    the phase's models' phase-moved parts and rings + the phase's working memory."""
    resident = sum(resident_bytes(name, models[name], partition) for name in models)
    if device_type == "cpu":
        resident += partition.dit.adaln_bytes
    base = (0 if device_type == "cpu" else ENGINE_RESERVE_BYTES) + adaln_cache_bytes(
        partition, shape, device_type, kept_schedules
    )
    return {
        phase: base
        + resident
        + sum(phase_bytes(name, models[name], partition, phase) for name in models)
        + working[phase]
        + {
            "denoise": partition.dit.dequantized_bytes,
            "text_encode": partition.text_encoder.dequantized_bytes,
        }.get(phase, 0)
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
# then the once-per-request streams (text encoder, video decoder) layer by layer, then the AdaLN projections (once per
# request, hidden under the first step), and the served DiT's streamed layers last (every step), layer by layer: a
# file-home layer is read from the disk at each visit.
DEMOTIONS = (
    ("other_partition", "mapped"),
    ("text_encoder", "mapped"),
    ("video_vae", "mapped"),
    ("adaln", "mapped"),
    ("dit", "mapped"),
)
# h3engine.memory.streaming.READ_AHEAD (a test keeps them equal): the host ring's buffers of a stream with file
# homes, each as large as its largest file-home layer, page-locked while its phase runs.
HOST_RING_BUFFERS = 2


def file_home_layers(count: int, in_files: int) -> list[bool]:
    """Which of `count` streamed layers (in visit order) read from the files when `in_files` of them do: spread
    evenly, so that the disk reads the next file-home layer while the layers between compute."""
    in_files = max(0, min(count, in_files))
    return [(index + 1) * in_files // count > index * in_files // count for index in range(count)]


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


def pinned_stream_bytes(
    model: str, placement: ModelPlacement, partition: PartitionSizes, file_layers: int = 0
) -> int:
    """Host bytes of `model`'s streamed layers' images in a pinned home (less `file_layers` of them, which read from
    the files): packed into slabs (homes.packed_bytes)."""
    if placement.layers != "streamed":
        return 0
    images = partition.model(model).layer_bytes[placement.resident_layers :]
    flags = file_home_layers(len(images), file_layers)
    return packed_bytes([image for image, in_file in zip(images, flags, strict=True) if not in_file])


def host_ring_bytes(
    model: str, placement: ModelPlacement, partition: PartitionSizes, file_layers: int
) -> int:
    """The page-locked host ring of a stream with file homes (HOST_RING_BUFFERS of its largest file-home image)."""
    if placement.layers != "streamed" or not file_layers:
        return 0
    images = partition.model(model).layer_bytes[placement.resident_layers :]
    flags = file_home_layers(len(images), file_layers)
    largest = max(image for image, in_file in zip(images, flags, strict=True) if in_file)
    return min(HOST_RING_BUFFERS, file_layers) * largest


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
    # A streamed model -> how many of its streamed layers read from the files (all of them: home "mapped").
    file_layers: dict[str, int]
    pinned: dict[str, int]  # what holds pinned (or, on the CPU, host) bytes, after the demotions
    pinned_bytes: int
    minimum_bytes: int
    fits: bool


def mappable(model: str, placement: ModelPlacement, weights: str, files_weights: str = "bf16") -> bool:
    """Whether `model`'s streamed layers can read from the files: they hold what the stream computes with (an FP8
    image made at load from bf16 files cannot)."""
    return placement.layers == "streamed" and not (
        weights == "fp8" and model in FP8_MODELS and files_weights != "fp8"
    )


def _streamed_count(model: str, placement: ModelPlacement, partition: PartitionSizes) -> int:
    return (
        partition.model(model).num_layers - placement.resident_layers if placement.layers == "streamed" else 0
    )


def _host_state(
    models: Mapping[str, ModelPlacement],
    homes: Mapping[str, str],
    file_layers: Mapping[str, int],
    sizes: CheckpointSizes,
    partition: PartitionSizes,
    shape: RequestShape,
    device_type: str,
) -> dict[str, int]:
    """Pinned bytes per holder for the homes `homes` (and the file-home layer counts `file_layers`)."""
    pinned = {"process": HOST_PROCESS_BYTES + request_host_bytes(shape)}
    if device_type == "cpu":
        # The CPU's device is host memory: every weight lives there.
        pinned["models"] = sum(partition.model(name).total for name in models)
        return pinned
    rings = [0]
    for name in models:
        placement = models[name]
        pinned[name] = moved_home_bytes(name, placement, partition)
        in_files = (
            _streamed_count(name, placement, partition) if homes[name] == "mapped" else file_layers[name]
        )
        if homes[name] in ("pinned", "mapped"):
            pinned[name] += pinned_stream_bytes(name, placement, partition, in_files)
            rings.append(host_ring_bytes(name, placement, partition, in_files))
    pinned["host_ring"] = max(rings)  # one phase streams at a time
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
    adaln_cache: bool = False,
) -> HostPlan:
    """Pinned homes for everything that waits on the host, demoted in DEMOTIONS order until they fit: a streamed
    model's layers go to the files one at a time. With `adaln_cache` the AdaLN projections wait in the files from the
    start (their tables are on disk: they are read only for a schedule the cache lacks)."""
    other = sizes.other_partition(partition.partition)
    homes: dict[str, str] = {}
    for name in models:
        placement = models[name]
        homes[name] = "none" if placement.all_resident or device_type == "cpu" else "pinned"
    if device_type == "cpu":
        homes["adaln"] = "device"
    else:
        homes["adaln"] = "mapped" if adaln_cache else "pinned"
    homes["other_partition"] = "pinned" if other is not None and device_type != "cpu" else "disk"
    file_layers = dict.fromkeys(models, 0)
    files_weights = sizes.files_weights

    def room(item: str, state: Mapping[str, str], counts: Mapping[str, int]) -> int:
        """How many demotion steps `item` has left (a streamed model: one per layer still pinned)."""
        if item in ("other_partition", "adaln"):
            return int(state[item] == "pinned")
        placement = models[item]
        if state[item] != "pinned" or not mappable(item, placement, sizes.weights, files_weights):
            return 0
        return _streamed_count(item, placement, partition) - counts[item]

    def demoted(item: str, steps: int, state: dict[str, str], counts: dict[str, int]) -> None:
        """Apply `steps` demotion steps of `item` to `state` and `counts`."""
        if item in ("other_partition", "adaln"):
            state[item] = "mapped"
            return
        counts[item] += steps
        if counts[item] == _streamed_count(item, models[item], partition):
            state[item], counts[item] = "mapped", 0

    def total(state: Mapping[str, str], counts: Mapping[str, int]) -> int:
        return sum(_host_state(models, state, counts, sizes, partition, shape, device_type).values())

    def after(item: str, steps: int, state: Mapping[str, str], counts: Mapping[str, int]) -> int:
        trial_state, trial_counts = dict(state), dict(counts)
        demoted(item, steps, trial_state, trial_counts)
        return total(trial_state, trial_counts)

    limit = budget.host_bytes
    for item, _ in DEMOTIONS:
        left = room(item, homes, file_layers)
        if limit is None or not left or total(homes, file_layers) <= limit:
            continue
        # The fewest steps that fit (each step frees host bytes), by bisection; all of them when none fits.
        low, high = 1, left
        while low < high:
            middle = (low + high) // 2
            if after(item, middle, homes, file_layers) <= limit:
                high = middle
            else:
                low = middle + 1
        demoted(item, low, homes, file_layers)
    lowest, lowest_counts = dict(homes), dict(file_layers)
    for item, _ in DEMOTIONS:
        left = room(item, lowest, lowest_counts)
        if left:
            demoted(item, left, lowest, lowest_counts)
    pinned = _host_state(models, homes, file_layers, sizes, partition, shape, device_type)
    pinned_bytes = sum(pinned.values())
    return HostPlan(
        homes,
        file_layers,
        pinned,
        pinned_bytes,
        total(lowest, lowest_counts),
        limit is None or pinned_bytes <= limit,
    )
