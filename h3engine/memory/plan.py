"""A memory plan: where each model of a checkpoint lives so that an engine's peak stays under its budget. Types: per model (`ModelPlacement`) its repeated layers are "resident" (on the device for the engine's life),
"phase" (moved onto the device for the phases that run it) or "streamed" (through a ring of `ring_depth` device
buffers filled a few layers ahead, the first `resident_layers` staying on the device); the rest is resident or phase.
What is not resident waits in a host home: "pinned" (`mapped_layers` of a streamed model's layers in the files), "mapped"
(all read again from the checkpoint files) or "none". On a GPU the DiT's AdaLN projections wait on the host
(`adaln_home`: "pinned", or "mapped" with their tables on disk); the partition not served waits in
`other_partition_home`: "pinned" (warm: a switch copies from RAM), else "mapped" / "disk" (read again).

The planner: `plan_for_shape(sizes, budget, shape, profile, device_type, context)` (`auto`: of the placements that fit,
the one losing the fewest seconds per request under h3engine.memory.cost), `plan_engine(..., shapes)` (the most
demanding shape whose plan costs little more); one request under a plan: .request_plan. Shapes: .shapes; working
memory: .working; peaks and host homes: .peaks; types: .types; words: .report.

Danger: the peaks rest on estimated activations (.working). Imports no torch (budget.py relies on it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from h3engine.memory.cost import DEFAULT_DISK_BYTES_PER_SECOND, Cost, request_cost
from h3engine.memory.peaks import (
    HostPlan,
    dit_image_bytes,
    host_plan,
    mappable,
    phase_peaks,
    pinned_stream_bytes,
    ring_slot_bytes,
)
from h3engine.memory.shapes import (
    DEFAULT_STEPS,
    ReferenceSpec,
    RequestShape,
    engine_shapes,
    partition_for_task,
    request_shape,
)
from h3engine.memory.types import (
    GIB,
    HOMES,
    MEMORY_PROFILES,
    MODELS,
    RESIDENT,
    WEIGHT_FORMATS,
    MemoryBudget,
    ModelPlacement,
    PlannedComponent,
)
from h3engine.memory.working import MODULATION_CACHE_SCHEDULES, adaln_in_flight_bytes, phase_working

if TYPE_CHECKING:
    from h3engine.memory.sizes import CheckpointSizes, PartitionSizes

# The engine-facing API (shapes and peaks re-exported from the modules that compute them).
__all__ = [
    "GIB",
    "HOMES",
    "MEMORY_PROFILES",
    "MODELS",
    "RESIDENT",
    "WEIGHT_FORMATS",
    "MemoryBudget",
    "MemoryPlan",
    "ModelPlacement",
    "PlannedComponent",
    "ReferenceSpec",
    "RequestShape",
    "engine_shapes",
    "phase_peaks",
    "plan_engine",
    "plan_for_shape",
    "request_shape",
    "resident_plan",
]


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine (one rank) holds where, and the peaks that follow for its design request."""

    profile: str  # as asked: MEMORY_PROFILES
    weights: str  # WEIGHT_FORMATS
    budget: MemoryBudget
    models: Mapping[str, ModelPlacement]  # one per MODELS entry
    adaln_home: str = "device"  # "device" (the CPU: stays with the module), "pinned" or "mapped"
    other_partition_home: str = "disk"  # "pinned", "mapped" or "disk"
    components: tuple[PlannedComponent, ...] = ()
    phase_peaks: Mapping[str, int] = field(default_factory=dict)  # predicted peak GPU bytes per phase
    peak_gpu_bytes: int = 0
    peak_host_bytes: int = 0
    bytes_per_step: int = 0  # host -> GPU bytes per DiT forward
    bytes_per_request: int = 0  # host -> GPU bytes per request besides the steps
    minimum_gpu_bytes: int = 0  # the smallest budget any plan fits the design request in
    fits: bool = True
    design_request: str = ""  # the request the peaks are for, e.g. "t2va 5 s 1344x768"
    # Added by the planner (below); defaults describe a plan made by hand.
    device_type: str = "cuda"  # "cuda" or "cpu" (on the CPU the models live in host memory: no GPU peak)
    # The partition the peaks are for (its DiT is "served"; the other one waits in its home).
    partition: str = ""
    gpu_fits: bool = True
    host_fits: bool = True
    minimum_host_bytes: int = 0  # pinned host bytes with every home demoted as far as it goes
    # Estimated activation bytes per phase (x WORKING_SAFETY).
    working: Mapping[str, int] = field(default_factory=dict)
    seconds_lost_per_request: float = 0.0  # predicted time over the all-resident plan (the cost model below)
    # The h3engine.memory.sizes.CheckpointSizes the plan was made from (for `request_peak_bytes`).
    sizes: Any = None
    shape: Any = None  # the RequestShape of `design_request`
    cost: Cost = field(default_factory=lambda: Cost())  # the design request's (h3engine.memory.cost)
    # The AdaLN cache, the disk's rate and the activation chunks the plan was made with (chunks as chosen).
    context: PlanContext = field(default_factory=lambda: PlanContext())
    host_pinned: Mapping[str, int] = field(default_factory=dict)  # pinned host bytes per holder

    @property
    def activation_chunks(self) -> int:
        return self.context.activation_chunks or 1

    @property
    def lowest_resident_layers(self) -> int:
        """The fewest DiT layers a request can keep resident: none when they can stream from their files (the
        loader keeps a reader of each resident layer), else the plan's (an FP8 image made at load from bf16 files)."""
        dit = self.models.get("dit", RESIDENT)
        if dit.layers != "streamed" or self.sizes is None:
            return dit.resident_layers
        return 0 if mappable("dit", dit, self.weights, self.sizes.files_weights) else dit.resident_layers

    @property
    def streams(self) -> bool:
        return any(model.layers == "streamed" for model in self.models.values())


# A plan that also fits the largest requests is chosen when it costs each request at most this many seconds more than
# the plan for the default request (what a 5 s request pays so that 15 s ones can run without a restart); a dearer one
# is not, and larger requests are refused one by one with what would fit (`check_request_fits`).
LONGER_REQUESTS_ALLOWANCE_S = 2.0


def resident_plan(profile: str = "resident", weights: str = "bf16") -> MemoryPlan:
    """Everything on the compute device (the CPU's plan, and `resident` where it fits)."""
    return MemoryPlan(
        profile=profile,
        weights=weights,
        budget=MemoryBudget(None, None, "no limit", "no limit"),
        models={name: RESIDENT for name in MODELS},
    )


# Ring depths tried for a streamed model, deepest (most copy-ahead) first.
RING_DEPTHS = (3, 2)
# Activation chunks of a plan under a GPU budget when `--activation-chunks` is auto (h3engine.models.dit_chunks): the
# DiT's working set near its floor; what that frees holds more resident layers, which move fewer bytes per step.
AUTO_ACTIVATION_CHUNKS = 8


@dataclass(frozen=True)
class PlanContext:
    """What shapes a plan besides the budget, the sizes and the request: where AdaLN tables come from, the disk's
    read rate and the DiT's activation chunks."""

    device_type: str = "cuda"
    adaln_cache: bool = False  # AdaLN tables kept on disk: the projections wait in the files
    adaln_cached: bool = (
        True  # the cache holds the planned request's tables (else its first request computes them)
    )
    disk_bytes_per_second: float = DEFAULT_DISK_BYTES_PER_SECOND
    activation_chunks: int | None = None  # None: auto (AUTO_ACTIVATION_CHUNKS under a GPU budget); 1: off

    def chunks(self, budget: MemoryBudget, models: Mapping[str, ModelPlacement]) -> int:
        """The DiT's activation chunks under a plan of `models`: as asked, else (auto) AUTO_ACTIVATION_CHUNKS for a
        streamed DiT under a GPU budget and none for a resident one (whose numbers stay those of the one forward)."""
        if self.activation_chunks is not None:
            return self.activation_chunks
        streams = models["dit"].layers == "streamed"
        return AUTO_ACTIVATION_CHUNKS if streams and self.device_type != "cpu" and budget.gpu_bytes else 1

    @property
    def kept_schedules(self) -> int:
        """Schedules whose AdaLN tables stay on the GPU between requests: none with the disk cache (it serves a repeat
        from the page cache), else MODULATION_CACHE_SCHEDULES."""
        return 0 if self.adaln_cache else MODULATION_CACHE_SCHEDULES


# ----------------------------------------------------------------------------------------------------------------
# Candidates


def _layer_options(model: str, size: Any) -> list[ModelPlacement]:
    """The placements tried for a model with layers (homes come later): resident, moved per phase, and streamed
    with its other part resident or moved, at each ring depth (the DiT's resident layers are chosen later; the
    text encoder and the video decoder keep none: the DiT's gain more, every step). The DiT's other part (patch
    projections, time embedder, norms: ~0.1 GB) stays resident when its layers stream."""
    if not size.total:
        return [RESIDENT]
    options = [RESIDENT, ModelPlacement("phase", "phase", "pinned")]
    if size.num_layers >= 2:
        others = ("resident",) if model == "dit" else ("phase", "resident")
        for other in others:
            for depth in RING_DEPTHS:
                options.append(
                    ModelPlacement("streamed", other, "pinned", ring_depth=min(depth, size.num_layers))
                )
    return options


def _audio_options(size: Any) -> list[ModelPlacement]:
    if not size.total:
        return [RESIDENT]
    return [RESIDENT, ModelPlacement("phase", "phase", "pinned")]


def _profile_candidates(profile: str, partition: PartitionSizes) -> list[dict[str, ModelPlacement]]:
    """The placements a profile considers, before the DiT's resident layers and the homes.

    `low-memory`: every model moved per phase (pinned homes). `streamed`: every model with layers streams them (other
    parts resident, as h3engine.memory.placement.profile_plan has it), a ring of 3 where it fits, else 2, no resident
    layers. `auto`: the grid of every model's options.
    """
    phase = ModelPlacement("phase", "phase", "pinned")

    def whole(size: Any, placement: ModelPlacement) -> ModelPlacement:
        return placement if size.total else RESIDENT

    if profile == "resident":
        return [{name: RESIDENT for name in MODELS}]
    if profile == "low-memory":
        return [{name: whole(partition.model(name), phase) for name in MODELS}]
    if profile == "streamed":
        candidates = []
        for depth in RING_DEPTHS:
            models = {}
            for name in MODELS:
                size = partition.model(name)
                if size.num_layers >= 2:
                    models[name] = ModelPlacement(
                        "streamed", "resident", "pinned", ring_depth=min(depth, size.num_layers)
                    )
                else:
                    models[name] = RESIDENT
            candidates.append(models)
        return candidates
    grids = {
        "dit": _layer_options("dit", partition.dit),
        "text_encoder": _layer_options("text_encoder", partition.text_encoder),
        "video_vae": _layer_options("video_vae", partition.video_vae),
        "audio_vae": _audio_options(partition.audio_vae),
    }
    return [
        dict(zip(MODELS, choice, strict=True))
        for choice in itertools.product(*(grids[name] for name in MODELS))
    ]


@dataclass(frozen=True)
class _Evaluated:
    models: dict[str, ModelPlacement]
    peaks: dict[str, int]
    peak: int
    host: HostPlan
    cost: Cost
    gpu_fits: bool
    working: dict[str, int]
    chunks: int

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host.fits

    def rank(self) -> tuple:
        """Fewest seconds lost, then fewest bytes moved (a step's bytes weigh as all steps', the disk's ten times the
        bus's), then the deeper DiT ring (more slack for a copy that runs late), then the lowest peak."""
        moved = self.cost.bytes_per_step * DEFAULT_STEPS + self.cost.bytes_per_request
        read = self.cost.disk_bytes_per_step * DEFAULT_STEPS + self.cost.disk_bytes_per_request
        return (round(self.cost.seconds, 3), moved + 10 * read, -self.models["dit"].ring_depth, self.peak)


def _with_homes(models: Mapping[str, ModelPlacement], host: HostPlan) -> dict[str, ModelPlacement]:
    """Each placement with its chosen home ("none" for what is all resident) and its file-home layers."""
    return {
        name: replace(
            placement,
            home="none" if placement.all_resident else host.homes[name],
            mapped_layers=host.file_layers.get(name, 0) if host.homes[name] == "pinned" else 0,
        )
        for name, placement in models.items()
    }


def _evaluate(
    models: Mapping[str, ModelPlacement],
    sizes: CheckpointSizes,
    partition: PartitionSizes,
    shape: RequestShape,
    budget: MemoryBudget,
    context: PlanContext,
    most_resident: bool = True,
) -> _Evaluated:
    """Peaks, homes and cost of a placement; a streamed DiT first gets the most leading resident layers that fit
    (`most_resident`; none otherwise)."""
    device_type = context.device_type
    gpu_limit = None if device_type == "cpu" else budget.gpu_bytes
    chunks = context.chunks(budget, models)
    working = phase_working(
        partition, shape, sizes.share, sizes.weights, device_type, chunks, context.adaln_cache
    )
    kept = context.kept_schedules
    models = dict(models)
    dit = models["dit"]
    if dit.layers == "streamed" and most_resident:
        models["dit"] = replace(
            dit,
            resident_layers=most_resident_layers(
                models, partition, shape, working, gpu_limit, device_type, kept
            ),
        )
        if models["dit"].resident_layers >= partition.dit.num_layers:
            models["dit"] = RESIDENT
    peaks = phase_peaks(models, partition, shape, working, device_type, kept)
    peak = max(peaks.values())
    host = host_plan(models, sizes, partition, shape, budget, device_type, context.adaln_cache)
    models = _with_homes(models, host)
    cost = request_cost(
        models,
        host.homes,
        partition,
        shape,
        sizes.share,
        device_type,
        context.disk_bytes_per_second,
        context.adaln_cache and context.adaln_cached,
    )
    return _Evaluated(
        models, peaks, peak, host, cost, gpu_limit is None or peak <= gpu_limit, working, chunks
    )


def most_resident_layers(
    models: Mapping[str, ModelPlacement],
    partition: PartitionSizes,
    shape: RequestShape,
    working: Mapping[str, int],
    gpu_limit: int | None,
    device_type: str,
    kept_schedules: int,
) -> int:
    """How many leading DiT layers fit resident beside everything else of a streamed DiT's plan (all of them without a
    limit): resident layers add to every phase alike, so the room is the limit less the highest phase without them."""
    size = partition.dit
    if gpu_limit is None:
        return size.num_layers
    without = {**models, "dit": replace(models["dit"], resident_layers=0)}
    room = gpu_limit - max(
        phase_peaks(without, partition, shape, working, device_type, kept_schedules).values()
    )
    count = 0
    while count < size.num_layers and size.leading_compute_bytes(count + 1) <= room:
        count += 1
    return count


def minimum_gpu_bytes(
    sizes: CheckpointSizes,
    partition: PartitionSizes,
    shape: RequestShape,
    budget: MemoryBudget,
    context: PlanContext,
) -> int:
    """The smallest peak any placement reaches for this request: no resident DiT layers, the shallowest rings."""
    peaks = []
    for models in _profile_candidates("auto", partition):
        shallow = {
            name: replace(placement, ring_depth=min(RING_DEPTHS))
            if placement.layers == "streamed"
            else placement
            for name, placement in models.items()
        }
        # The chunks a budget would get (an unlimited one gets none under auto).
        evaluated = _evaluate(shallow, sizes, partition, shape, budget, context, most_resident=False)
        peaks.append(evaluated.peak)
    return min(peaks, default=0)


# ----------------------------------------------------------------------------------------------------------------
# Plans


def plan_for_shape(
    sizes: CheckpointSizes,
    budget: MemoryBudget,
    shape: RequestShape,
    profile: str = "auto",
    device_type: str = "cuda",
    context: PlanContext | None = None,
) -> MemoryPlan:
    """The plan of `profile` for requests of `shape` under `budget`, on a "cuda" or "cpu" engine (`context`: the
    AdaLN cache, the disk's rate, the activation chunks; its device_type is `device_type`).

    `auto` takes, among the placements that fit (GPU and host), the one losing the fewest seconds per request (the
    cost model, h3engine.memory.cost), then the one moving the fewest bytes, then the lowest peak; none fitting, the
    lowest peak (fits=False). On the CPU, or without a GPU budget, `auto` is the all-resident plan (so is every
    profile on the CPU: the device is the host). `resident`, `low-memory` and `streamed` place as
    `_profile_candidates` says and report whether that fits.
    """
    if profile not in MEMORY_PROFILES:
        raise ValueError(f"profile must be one of {', '.join(MEMORY_PROFILES)}, got {profile!r}")
    context = replace(context or PlanContext(), device_type=device_type)
    partition = partition_for_task(sizes, shape.task)
    effective = profile
    if device_type == "cpu" or (budget.gpu_bytes is None and profile == "auto"):
        effective = "resident"
    # Only `auto` fills the room left with resident DiT layers; `streamed` keeps none.
    evaluated = [
        _evaluate(models, sizes, partition, shape, budget, context, most_resident=effective == "auto")
        for models in _profile_candidates(effective, partition)
    ]
    fitting = [candidate for candidate in evaluated if candidate.fits]
    if effective == "streamed":
        chosen = fitting[0] if fitting else min(evaluated, key=lambda candidate: candidate.peak)
    elif fitting:
        chosen = min(fitting, key=_Evaluated.rank)
    else:
        chosen = min(evaluated, key=lambda candidate: (candidate.peak, candidate.rank()))
    minimum = 0 if device_type == "cpu" else minimum_gpu_bytes(sizes, partition, shape, budget, context)
    return _plan_of(chosen, profile, sizes, partition, shape, budget, minimum, context)


def _plan_of(
    chosen: _Evaluated,
    profile: str,
    sizes: CheckpointSizes,
    partition: PartitionSizes,
    shape: RequestShape,
    budget: MemoryBudget,
    minimum: int,
    context: PlanContext,
) -> MemoryPlan:
    homes = chosen.host.homes
    cpu = context.device_type == "cpu"
    return MemoryPlan(
        profile=profile,
        weights=sizes.weights,
        budget=budget,
        models=chosen.models,
        adaln_home="device" if cpu else homes["adaln"],
        other_partition_home=homes["other_partition"],
        components=_components(chosen, sizes, partition, context.device_type),
        phase_peaks=dict(chosen.peaks),
        peak_gpu_bytes=0 if cpu else chosen.peak,
        # On the CPU the working memory is host memory too.
        peak_host_bytes=chosen.host.pinned_bytes + (max(chosen.working.values()) if cpu else 0),
        bytes_per_step=chosen.cost.bytes_per_step,
        bytes_per_request=chosen.cost.bytes_per_request,
        minimum_gpu_bytes=minimum,
        fits=chosen.fits,
        design_request=shape.label,
        device_type=context.device_type,
        partition=partition.partition,
        gpu_fits=chosen.gpu_fits,
        host_fits=chosen.host.fits,
        minimum_host_bytes=chosen.host.minimum_bytes,
        working=dict(chosen.working),
        seconds_lost_per_request=chosen.cost.seconds,
        sizes=sizes,
        shape=shape,
        cost=chosen.cost,
        context=replace(context, activation_chunks=chosen.chunks),
        host_pinned=dict(chosen.host.pinned),
    )


_PARTITION_NAMES = {"fl2va": "FL2VA", "ref2va": "Ref2VA"}


def _components(
    chosen: _Evaluated, sizes: CheckpointSizes, partition: PartitionSizes, device_type: str
) -> tuple[PlannedComponent, ...]:
    """One line per part of each model (layers, other, AdaLN projections), and the other partition's DiT.

    `bytes` is the part as held: layers on the device unquantized, streamed layers' images as stored; `gpu_bytes`
    the most it holds on the device at once (a streamed part: its resident layers and its ring); `host_bytes` its
    pinned bytes (the served DiT's include its warm copy when both partitions stay warm)."""
    rows: list[PlannedComponent] = []
    homes, cpu = chosen.host.homes, device_type == "cpu"
    warm = chosen.host.pinned.get("warm_dit", 0) > 0
    for name in MODELS:
        placement, size = chosen.models[name], partition.model(name)
        if not size.total:
            continue
        kept_home = homes[name] == "pinned"
        if size.num_layers:
            if placement.layers == "streamed":
                resident = size.leading_compute_bytes(placement.resident_layers)
                images = size.trailing_layers_bytes(placement.resident_layers)
                held, on_gpu = (
                    resident + images,
                    resident + placement.ring_depth * ring_slot_bytes(name, partition),
                )
                in_files = placement.mapped_layers
                pinned = (pinned_stream_bytes(name, placement, partition, in_files) if kept_home else 0) + (
                    resident if name == "dit" and warm else 0
                )
            else:
                held = on_gpu = size.layers_compute_total
                pinned = held if placement.layers == "phase" or (name == "dit" and warm) else 0
            rows.append(
                PlannedComponent(
                    f"{name}.layers",
                    placement.layers,
                    held,
                    on_gpu,
                    0 if cpu else pinned,
                    _home_words(placement),
                )
            )
        pinned = size.other_bytes if placement.other == "phase" or (name == "dit" and warm) else 0
        rows.append(
            PlannedComponent(
                f"{name}.other" if size.num_layers else name,
                placement.other,
                size.other_bytes,
                size.other_bytes,
                0 if cpu else pinned,
                placement.home,
            )
        )
        if name == "dit" and size.adaln_bytes:
            if cpu:
                rows.append(
                    PlannedComponent("dit.adaln", "resident", size.adaln_bytes, size.adaln_bytes, 0, "none")
                )
            else:
                in_flight = adaln_in_flight_bytes(partition, sizes.weights, device_type)
                pinned = size.adaln_bytes if homes["adaln"] == "pinned" else 0
                rows.append(
                    PlannedComponent("dit.adaln", "host", size.adaln_bytes, in_flight, pinned, homes["adaln"])
                )
    other = sizes.other_partition(partition.partition)
    if other is not None:
        home = homes["other_partition"]
        label = _PARTITION_NAMES.get(other.partition, other.partition)
        image = dit_image_bytes(chosen.models["dit"], other) if not cpu else other.dit.total
        rows.append(
            PlannedComponent(
                f"dit ({label}, not served)",
                "disk" if home == "disk" else "host",
                image,
                0,
                chosen.host.pinned.get("other_partition", 0),
                home,
            )
        )
    return tuple(rows)


def _home_words(placement: ModelPlacement) -> str:
    """A streamed part's home: "pinned", "mapped" (the files), or "pinned+files" with some layers in the files."""
    if placement.home == "pinned" and placement.mapped_layers:
        return "pinned+files"
    return placement.home


def plan_engine(
    sizes: CheckpointSizes,
    budget: MemoryBudget,
    profile: str,
    weights: str,
    device_type: str,
    shapes: Sequence[RequestShape],
    context: PlanContext | None = None,
) -> MemoryPlan:
    """The engine's plan, `shapes` most demanding first (e.g. the largest request it accepts, then the default
    request): the plan for the most demanding shape that fits and costs each request at most
    `LONGER_REQUESTS_ALLOWANCE_S` more than the plan for the last shape that fits; requests larger than its shape
    are then judged one by one (`check_request_fits`), and each request runs with the most resident DiT layers it
    leaves room for (`request_resident_layers`). None fitting: the last one's plan (fits=False: the caller refuses to
    start, naming `minimum_gpu_bytes`). `weights` must be the format `sizes` were computed for."""
    if not shapes:
        raise ValueError("plan_engine needs at least one request shape")
    if weights != sizes.weights:
        raise ValueError(f"sizes are for {sizes.weights} weights, the plan asks for {weights}")
    plans = [plan_for_shape(sizes, budget, shape, profile, device_type, context) for shape in shapes]
    fitting = [plan for plan in plans if plan.fits]
    if not fitting:
        return plans[-1]
    baseline = fitting[-1].seconds_lost_per_request
    return next(
        plan for plan in fitting if plan.seconds_lost_per_request <= baseline + LONGER_REQUESTS_ALLOWANCE_S
    )
