"""Where each model of an engine lives, and what each phase of a request holds on the compute device.

A `Placement` carries out a memory plan (h3engine.memory.plan) for one engine. Per tensor: resident (on the device;
a warm DiT partition's only while it serves), phase (a host home copied onto the device for the phases that run its
model, `PHASE_COMPONENTS`; leaving points it home again: inference never writes weights) or streamed (a layer
visiting a ring of device buffers, h3engine.memory.streaming, opened and freed with its phase). The same modules
run the same math under every placement: outputs are bit-identical (FP8 storage aside).

`load_device(model)`: where a loader builds a model; `adopt(module, model)` hands it over after its last load-time
change; `resident_for(phase, modules)` is where a phase begins and ends; `activate(module)` makes a DiT partition
the one on the device (the other waits in pinned memory when `plan.other_partition_home` says so).

Danger: a tensor already pinned, or parked, when adopted stays where it is: its module streams it itself (the DiT's
offloaded AdaLN projections, h3engine.engine.sampling.modulation).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from h3engine.checkpoint.safetensors_io import DeferredReads, is_parked
from h3engine.errors import RequestError
from h3engine.memory.homes import dequantized, pin_in_place, quantizable
from h3engine.memory.layers import LAYER_SPECS, LayerSpec, layer_spec
from h3engine.memory.peaks import FP8_MODELS, PHASE_COMPONENTS, PHASE_LAYERS
from h3engine.memory.plan import MemoryPlan, resident_plan
from h3engine.memory.report import summary_lines
from h3engine.memory.request_plan import request_dit_plan
from h3engine.memory.shapes import RequestShape
from h3engine.memory.stream_layout import TensorRead, streamed_tensors
from h3engine.memory.streaming import LayerStream
from h3engine.memory.types import GIB, MEMORY_PROFILES, MODELS, RESIDENT, WEIGHT_FORMATS, ModelPlacement

logger = logging.getLogger(__name__)

# PHASE_COMPONENTS, PHASE_LAYERS and FP8_MODELS live with the peaks they shape (h3engine.memory.peaks).

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def check_memory_profile(name: str) -> str:
    if name not in MEMORY_PROFILES:
        raise RequestError("--memory-profile", f"expected one of {', '.join(MEMORY_PROFILES)}, got '{name}'")
    return name


def check_weights(name: str) -> str:
    if name not in WEIGHT_FORMATS:
        raise RequestError("--weights", f"expected one of {', '.join(WEIGHT_FORMATS)}, got '{name}'")
    return name


def profile_plan(profile: str, weights: str = "bf16") -> MemoryPlan:
    """The plan a profile means without a budget (no planner): resident or auto keep everything on the device,
    low-memory moves every model per phase, streamed streams every model's layers through rings of 2."""
    check_memory_profile(profile)
    check_weights(weights)
    plan = resident_plan(profile, weights)
    if profile in ("resident", "auto"):
        return plan
    if profile == "low-memory":
        moved = ModelPlacement(layers="phase", other="phase", home="pinned")
        return replace(plan, models={name: moved for name in MODELS})
    streamed = ModelPlacement(layers="streamed", other="resident", home="pinned", ring_depth=2)
    return replace(plan, models={name: streamed if name in LAYER_SPECS else RESIDENT for name in MODELS})


def _tensor_read(deferred: DeferredReads, name: str, quantize: bool) -> TensorRead:
    """How a stream reads one tensor again: its values (and their extents in the files), or, for an FP8 stream of
    files that store the weight in FP8, its values and row scales as stored."""
    if quantize and name in deferred.fp8:
        read, value_extents, scale_extents = deferred.fp8[name]
        return TensorRead(read, value_extents, scale_extents, fp8=True)
    return TensorRead(deferred.readers[name], deferred.extents.get(name))


def file_home_layers(count: int, in_files: int) -> list[bool]:
    """Which of `count` streamed layers (in visit order) read from the files when `in_files` of them do: spread
    evenly, so that the disk reads for the next file-home layer while the layers between compute."""
    in_files = max(0, min(count, in_files))
    return [(index + 1) * in_files // count > index * in_files // count for index in range(count)]


def _tensor_names(module: nn.Module) -> dict[int, str]:
    return {
        id(tensor): name
        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers())
    }


@dataclass
class _Held:
    """What the placement did with one adopted model."""

    name: str
    placement: ModelPlacement
    # (parameter or buffer, its host home) of each tensor a phase moves onto the device.
    homes: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # (parameter or buffer, its host home) of each resident tensor of a DiT partition kept warm on the host.
    warm: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    stream: LayerStream | None = None
    active: bool = True


class Placement:
    """One engine's memory plan, carried out (see the module docstring).

    `plan` may be a profile name (`profile_plan`). `transfer` makes a phase's copy of a home tensor (default: to
    the compute device, asynchronously from pinned memory); on the CPU the default returns the tensor itself.
    """

    def __init__(
        self,
        plan: MemoryPlan | str = "resident",
        compute_device: torch.device | str = "cpu",
        transfer: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.plan = profile_plan(plan) if isinstance(plan, str) else plan
        self.compute_device = torch.device(compute_device)
        self._cuda = self.compute_device.type == "cuda"
        self._transfer = transfer or (lambda tensor: tensor.to(self.compute_device, non_blocking=True))
        self._held: WeakKeyDictionary[nn.Module, _Held] = WeakKeyDictionary()
        # A DiT partition may be adopted by a background load while requests run (h3engine.engine.model_store).
        self._lock = threading.RLock()
        self.phase: str | None = None

    @property
    def profile(self) -> str:
        return self.plan.profile

    @property
    def keeps_partitions_warm(self) -> bool:
        """Whether a DiT partition that stops serving waits in host memory (a switch back reads no file)."""
        return self.plan.other_partition_home == "pinned"

    def describe(self) -> dict[str, str]:
        """Each model's placement in words, for sidecars and logs: e.g. {"dit": "streamed (ring of 3, 12 layers
        resident, pinned home)", "text_encoder": "resident", ...}."""
        return {name: self.model_placement(name).describe() for name in MODELS}

    def plan_lines(self) -> list[str]:
        """The plan in a few lines, for the log at start."""
        if isinstance(self.plan, MemoryPlan):
            return summary_lines(self.plan)
        return [
            f"{self.plan.profile}: " + "; ".join(f"{name} {text}" for name, text in self.describe().items())
        ]

    def out_of_memory_message(self) -> str:
        """One sentence for a job that ran out of GPU memory: the budget, and what to change."""
        budget = self.plan.budget
        if budget.gpu_bytes is None:
            limit = "no budget was set"
        else:
            limit = f"the budget was {budget.gpu_bytes / GIB:.1f} GiB ({budget.gpu_source})"
        return (
            f"The GPU ran out of memory during this job ({self.compute_device}, memory profile {self.plan.profile}, "
            f"{limit}): set --gpu-memory to what the GPU really has free so that the plan streams more "
            "(python -m h3engine plan-memory shows the plan), ask for a shorter or smaller video, or free the GPU "
            "of other work."
        )

    def model_placement(self, model: str) -> ModelPlacement:
        return self.plan.models.get(model, RESIDENT)

    def load_device(self, model: str) -> torch.device:
        """Where a loader builds `model`: the compute device when all of it stays there, else host memory."""
        if self.model_placement(model).all_resident and not (model == "dit" and self.keeps_partitions_warm):
            return self.compute_device
        return torch.device("cpu")

    # --- adopting a loaded model --------------------------------------------------------------------------------

    def deferred_reads(
        self, model: str, meta_module: Callable[[], nn.Module], layers: bool = True
    ) -> DeferredReads | None:
        """What a loader of `model` should leave unread (`meta_module` builds the model on `meta` to name them): the
        tensors of its streamed layers (their home is filled layer by layer from the files, or is the files themselves;
        not with `layers` False) and, on a GPU, the DiT's AdaLN weights when they wait in the mapped files. A streamed
        DiT's resident layers are read as usual and remembered (a reader each): a larger request may stream them.
        None: nothing to defer."""
        placement = self.model_placement(model)
        streamed = layers and placement.layers == "streamed"
        mapped_adaln = model == "dit" and self._cuda and self.plan.adaln_home == "mapped"
        if not streamed and not mapped_adaln:
            return None
        with torch.device("meta"):
            module = meta_module()
        names = _tensor_names(module)
        keys, remember = set(), set()
        spec = layer_spec(model, module)
        if streamed and spec is not None:
            for index, layer in enumerate(spec.layers):
                found = {names[id(tensor)] for _, _, tensor in streamed_tensors(spec, layer)}
                if index >= placement.resident_layers:
                    keys |= found
                elif model == "dit":
                    remember |= found
        if mapped_adaln:
            # A community file's quantized projection (StoredLinear) waits there as its bytes and scale.
            adaln_tensors = (
                "adaln_proj.linear.weight",
                "adaln_proj.linear.quantized",
                "adaln_proj.linear.scale",
            )
            keys |= {name for name in names.values() if name.endswith(adaln_tensors)}
        return DeferredReads(keys, remember)

    def adopt(
        self,
        module: ModuleT | None,
        model: str,
        deferred: DeferredReads | None = None,
        files_fp8: bool = False,
        activate: bool = True,
    ) -> ModuleT | None:
        """Carry out the plan for a freshly loaded `model` (None: a model this rank does not hold; a model without
        parameters: a share another stage group holds); returns it. `deferred`: the reads the loader left for the
        mapped home of its streamed layers. `files_fp8`: the files store its large linears in FP8 (a converted
        checkpoint): what loaded is already their dequantized values, FP8 images come from the files as stored.
        `activate` False: a DiT stays in its host home (loaded in the background) until `activate`."""
        if module is None or next(module.parameters(), None) is None:
            return module
        placement = self.model_placement(model)
        quantize = self.plan.weights == "fp8" and model in FP8_MODELS
        held = _Held(model, placement)
        spec = layer_spec(model, module)
        streamed: set[int] = set()
        layer_tensors: dict[
            int, str
        ] = {}  # id(tensor) -> "resident" or "phase", for the layers' streamed parts
        if spec is not None:
            first_streamed = placement.resident_layers if placement.layers == "streamed" else len(spec.layers)
            for index, layer in enumerate(spec.layers):
                for _, _, tensor in streamed_tensors(spec, layer):
                    if quantize and not files_fp8 and quantizable(tensor) and index < first_streamed:
                        tensor.data = dequantized(tensor.data)
                    if index >= first_streamed:
                        streamed.add(id(tensor))
                    else:
                        layer_tensors[id(tensor)] = "resident" if placement.layers != "phase" else "phase"
            if streamed:
                held.stream = self._stream(module, model, spec, first_streamed, placement, quantize, deferred)
        resident, moved = [], []
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if id(tensor) in streamed or is_parked(tensor) or (self._cuda and tensor.data.is_pinned()):
                continue  # streamed by its layer's ring, or offloaded on purpose (the module streams it itself)
            kind = layer_tensors.get(id(tensor), placement.other)
            (resident if kind == "resident" else moved).append(tensor)
        if moved:
            if self._cuda:
                pin_in_place(moved)
            held.homes = [(tensor, tensor.data) for tensor in moved]
        if model == "dit" and self.keeps_partitions_warm and resident:
            if self._cuda:
                pin_in_place(resident)
            held.warm = [(tensor, tensor.data) for tensor in resident]
            held.active = False
        else:
            for tensor in resident:
                if tensor.device != self.compute_device:
                    tensor.data = tensor.data.to(self.compute_device)
        with self._lock:
            self._held[module] = held
        if model == "dit" and activate:
            self.activate(module)
        return module

    def _stream(
        self,
        module: nn.Module,
        model: str,
        spec: LayerSpec,
        first: int,
        placement: ModelPlacement,
        quantize: bool,
        deferred: DeferredReads | None,
    ) -> LayerStream:
        """The ring of `model`'s layers from `first` on: its home filled from the loader's deferred reads (or the
        loaded values), or the mapped files themselves."""
        readers = None
        if deferred is not None and deferred.readers:
            names = _tensor_names(module)
            per_layer = [
                [names[id(tensor)] for _, _, tensor in streamed_tensors(spec, layer)] for layer in spec.layers
            ]
            # Readers of every layer when the loader remembered the resident ones (they may stream later), else of
            # the streamed ones.
            covered = (
                per_layer if all(name in deferred.readers for name in per_layer[0]) else per_layer[first:]
            )
            readers = [[_tensor_read(deferred, name, quantize) for name in layer] for layer in covered]
        count = len(spec.layers) - first
        in_files = file_home_layers(count, count if placement.home == "mapped" else placement.mapped_layers)
        # An FP8 image can come from the files only where they store it so (a converted checkpoint).
        files_hold_fp8 = readers is not None and (
            not quantize or any(read.fp8 for layer in readers for read in layer)
        )
        if any(in_files) and (readers is None or not files_hold_fp8):
            logger.warning(
                "%s: its layers cannot be read from the checkpoint files here (%s); they wait in host memory instead",
                model,
                "FP8 weights are made at load" if quantize else "this checkpoint layout renames them",
            )
            in_files = [False] * count
        elif any(in_files):
            logger.warning(
                "%s: %d of its %d streamed layers are read from the checkpoint files at every visit (the host budget "
                "holds no copy of them), by reader threads a few layers ahead: as fast as the disk allows",
                model,
                sum(in_files),
                count,
            )
        return LayerStream(
            spec,
            first,
            self.compute_device,
            placement.ring_depth,
            quantize=quantize,
            readers=readers,
            mapped=in_files,
        )

    # --- DiT partitions -----------------------------------------------------------------------------------------

    def activate(self, module: nn.Module) -> None:
        """Make `module` (an adopted DiT) the partition on the device: the one active before goes back to its host
        home first, so the device never holds both."""
        with self._lock:
            held = self._held.get(module)
            if held is None or held.active and not held.warm:
                return
            for other in list(self._held.values()):
                if other is not held and other.name == held.name and other.active:
                    self._deactivate(other)
            if not held.active:
                for tensor, home in held.warm:
                    tensor.data = self._transfer(home)
                held.active = True

    def deactivate(self, module: nn.Module) -> None:
        """Send an adopted DiT back to its host home (a plan that keeps both partitions warm)."""
        held = self._held.get(module)
        if held is not None and held.warm and held.active:
            self._deactivate(held)

    def _deactivate(self, held: _Held) -> None:
        if held.stream is not None:
            held.stream.close()
        for tensor, home in held.warm:
            tensor.data = home
        held.active = False
        if self._cuda:
            torch.cuda.empty_cache()

    def forget(self, module: nn.Module) -> None:
        """A model being dropped: remove its ring and hooks (its pinned images go with it)."""
        held = self._held.pop(module, None)
        if held is not None and held.stream is not None:
            held.stream.remove()

    def stream_of(self, module: nn.Module) -> LayerStream | None:
        held = self._held.get(module)
        return None if held is None else held.stream

    def prepare_request(self, dit: nn.Module, shape: RequestShape | None) -> None:
        """Re-plan for one request of `shape` (None: nothing to plan, e.g. the CPU), between requests: the DiT keeps
        the most leading layers resident that this request leaves room for on the GPU (fewer for a long request,
        more again for a short one), the rest streaming from their homes. The log says what changed."""
        stream = self.stream_of(dit)
        if shape is None or stream is None or self.plan.sizes is None:
            return
        resident, depth = request_dit_plan(self.plan, shape, stream.lowest_resident)
        if (resident, depth) != (stream.first, stream.ring_depth):
            logger.info(
                "memory: %s keeps %d DiT layers resident on %s with a ring of %d (the previous request: %d, ring "
                "of %d)",
                shape.label,
                resident,
                self.compute_device,
                depth,
                stream.first,
                stream.ring_depth,
            )
            stream.set_resident_layers(resident)
            stream.ring_depth = depth
            if self._cuda:
                torch.cuda.empty_cache()

    # --- phases -------------------------------------------------------------------------------------------------

    @contextmanager
    def resident_for(self, phase: str, modules: Iterable[nn.Module | None]) -> Iterator[None]:
        """Hold `modules` (a phase's components; None entries are skipped) on the compute device for the block.

        Entering copies each phase-moved tensor's home to the compute device (`transfer`) and opens the ring of the
        model whose layers the phase runs; leaving points every such tensor back at its home, closes the rings and
        empties the CUDA cache. Tensors a module makes during a phase and keeps outside its parameters and buffers
        (cached AdaLN tables) stay where they were made.
        """
        if phase not in PHASE_COMPONENTS:
            raise ValueError(f"unknown phase '{phase}', expected one of {', '.join(PHASE_COMPONENTS)}")
        present = [self._held[module] for module in modules if module is not None and module in self._held]
        present = [held for held in present if held.homes or held.stream is not None]
        if not present:
            yield
            return
        if self.phase is not None:
            raise RuntimeError(f"phase '{phase}' entered while '{self.phase}' holds the device")
        self.phase = phase
        try:
            for held in present:
                for tensor, home in held.homes:
                    tensor.data = self._transfer(home)
                if held.stream is not None and PHASE_LAYERS.get(phase) == held.name:
                    held.stream.open()
            yield
        finally:
            # Also after a failed copy (out of memory): every tensor goes home, moved yet or not.
            for held in present:
                for tensor, home in held.homes:
                    tensor.data = home
                if held.stream is not None:
                    held.stream.close()
            self.phase = None
            if self._cuda:
                torch.cuda.empty_cache()
