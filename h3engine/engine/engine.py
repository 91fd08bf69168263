"""The Python API: an `Engine` turns requests into MP4 files with a checkpoint's models.

Contract:
* `Engine.from_checkpoint(folder, device, dtype)` builds the `ModelStore` (h3engine.engine.model_store): every component
  of every partition checked, the first partition loaded, so a broken checkpoint fails here naming the file and
  key. A worker group's rank passes its own loader (h3engine.runtime.rank) and holds only its shards. `on_load`
  (None by default) hears each component load (h3engine.engine.model_store.LoadEvent), now and on a later first use.
* `resolve` is the one request checker (h3engine.engine.resolved) on the checkpoint's `facts`, then the memory
  check: file headers, never the models (`validate`: its warnings). `generate` is `prepare` (read the resolved
  request's inputs, encode the conditioning) then the pipeline; each takes a request or its `ResolvedRequest` (which
  any door made once and is not resolved again: one probe a file; the engine adds only its memory check). `generate_to_file` checks its output
  names, then writes the MP4, the optional tensors and the sidecar as staging files that appear together.
* `should_cancel` is polled between the phases; a request's `loras` apply to its DiT for that request only.
* Memory (h3engine.memory.engine_plan): the profile, the GPU / host budgets and the weight format become a plan
  before anything loads (`plan`, logged); a budget no plan fits, or a request too large for it, raises RequestError.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import DIFFUSERS_DIT_FOLDERS, CheckpointLayout, detect_layout
from h3engine.engine.conditioning.remix import chain_windows
from h3engine.engine.lora.adapters import (
    Adapter,
    LoraFiles,
    adapter_record,
    applied_adapters,
    apply_adapters,
    request_adapters,
    same_adapters,
)
from h3engine.engine.model_store import LoadEvent, ModelLoader, ModelStore
from h3engine.engine.pipeline import (
    GenerationOutput,
    Models,
    PreparedRequest,
    StepEvent,
    prepare_request,
    run_generation,
    write_outputs,
)
from h3engine.engine.resolved import ResolvedRequest, resolve_request, with_memory_check
from h3engine.engine.sampling.adaln_tables import ADALN_FOLDER_NAME, AdalnTableCache, open_table_cache
from h3engine.errors import RequestError
from h3engine.media.outputs import OutputFiles, checked_output_files, input_records, staged
from h3engine.memory.disk import default_cache_folder
from h3engine.memory.engine_plan import MemoryRequest, plan_memory
from h3engine.memory.placement import Placement
from h3engine.memory.plan import MemoryPlan
from h3engine.request.files import MediaFacts
from h3engine.request.geometry import Geometry
from h3engine.request.model import MAX_LORAS, GenerationRequest

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        layout: CheckpointLayout,
        device: torch.device,
        dtype: torch.dtype,
        memory: MemoryRequest | str = "auto",
        fp8_linear: bool = False,
        loader: ModelLoader | None = None,
        on_load: Callable[[LoadEvent], None] | None = None,
    ) -> None:
        """`memory`: the memory flags (a profile name: that profile under the default budgets)."""
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.memory = MemoryRequest.of(memory)
        self.placement = self._make_placement(self.memory.profile, device)
        for line in self.placement.plan_lines():
            logger.info("memory plan on %s: %s", device, line)
        self.store = ModelStore(
            layout,
            device,
            dtype,
            self.placement,
            loader or ModelLoader(),
            fp8_linear,
            on_load,
            adaln_cache=self._open_adaln_cache(),
        )
        # The checkpoint's facts and this engine's memory plan: what `resolve` (here or on a front) decides with.
        self.facts = dataclasses.replace(CheckpointFacts.from_layout(layout), memory_plan=self.plan)
        self._lora_files = LoraFiles(MAX_LORAS)

    @classmethod
    def from_checkpoint(
        cls,
        folder: str | Path | CheckpointLayout,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        memory_profile: str = "auto",
        fp8_linear: bool = False,
        on_load: Callable[[LoadEvent], None] | None = None,
        gpu_memory: str | float | None = None,
        host_memory: str | float | None = None,
        weights: str = "bf16",
        adaln_cache: str | None = None,
        disk_read_gbps: str | float | None = None,
        activation_chunks: str | int | None = None,
    ) -> Engine:
        memory = MemoryRequest(
            memory_profile,
            gpu_memory,
            host_memory,
            weights,
            adaln_cache=adaln_cache,
            disk_read_gbps=disk_read_gbps,
            activation_chunks=activation_chunks,
        )
        layout = folder if isinstance(folder, CheckpointLayout) else detect_layout(folder)
        return cls(layout, torch.device(device), dtype, memory, fp8_linear, on_load=on_load)

    def _open_adaln_cache(self) -> AdalnTableCache | None:
        """The disk cache of AdaLN tables the memory request names (RequestError for a named folder that cannot be
        used; the default folder is only left out, with a warning)."""
        try:
            return open_table_cache(self.memory.adaln_cache, default_cache_folder() / ADALN_FOLDER_NAME)
        except (OSError, ValueError) as error:
            raise RequestError("--adaln-cache", f"cannot be used ({error})") from None

    @property
    def plan(self) -> MemoryPlan:
        return self.placement.plan

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        """The memory plan's `Placement` (RequestError naming the flag for an unknown profile or weight format, or a
        budget no plan fits), made before anything loads."""
        return Placement(
            plan_memory(self.layout, device, self.dtype, self.memory, default_cache_folder()), device
        )

    def adapters_for(self, request: GenerationRequest) -> tuple[tuple[Adapter, str], ...]:
        """The request's `loras` as adapters of the DiT its task runs, with their files' sha256; each file is read
        once (`LoraFiles`) and checked against that DiT (RequestError naming `loras[i]`, the file and its first
        offending key). Validate the request first."""
        partition = self.store.partition_for(request.task)
        target = DIFFUSERS_DIT_FOLDERS.get(partition, "transformer")
        return request_adapters(request, target, self.store.dit_config(partition), self._lora_files)

    def record(self, request: GenerationRequest | None = None) -> dict[str, Any]:
        """What a sidecar says about the engine: the store's record and the adapters `request` runs with (file
        name, sha256, strength, target)."""
        adapters = self.adapters_for(request) if request is not None else ()
        return {**self.store.record(), "adapters": [adapter_record(*pair) for pair in adapters]}

    def models_for(self, request: GenerationRequest) -> Models:
        """The request's models, their DiT carrying exactly the request's adapters (none: the base model)."""
        models = self.store.models_for_task(request.task)
        wanted = tuple(adapter for adapter, _ in self.adapters_for(request))
        applied = applied_adapters(models.dit)
        if not same_adapters(applied, wanted) and (wanted or applied):
            apply_adapters(models.dit, wanted, self.device)
        return models

    def resolve(self, request: GenerationRequest, media: MediaFacts | None = None) -> ResolvedRequest:
        """Check a request against the rules, this checkpoint, its input files and the memory plan, and resolve it
        (RequestError naming the field): `resolve_request` on `facts`. `media`: the facts of files already probed
        for this request."""
        return resolve_request(request, self.facts, media)

    def validate(self, request: GenerationRequest) -> list[str]:
        """`resolve`'s warnings."""
        return list(self.resolve(request).warnings)

    def resolved(self, request: GenerationRequest | ResolvedRequest) -> ResolvedRequest:
        """A resolved request with its memory shape under this engine's plan (added when it was resolved without
        the plan, as the CLI does before the engine loads); a bare request is resolved now."""
        if not isinstance(request, ResolvedRequest):
            return self.resolve(request)
        if request.memory_shape is None:
            return with_memory_check(request, self.plan)
        return request

    def geometry_for(self, request: GenerationRequest | ResolvedRequest) -> Geometry:
        """The canvas and frame counts of a request on this checkpoint (see `resolve_request`)."""
        geometry = self.resolved(request).geometry
        assert geometry is not None  # resolved with this checkpoint's facts
        return geometry

    def prepare(
        self, request: GenerationRequest | ResolvedRequest, should_cancel: Callable[[], bool] | None = None
    ) -> PreparedRequest:
        """Resolve the request (unless it is), read its input files and encode its conditioning (RequestError naming
        the field). Its LoRA files are read whole here (their values checked; the checks read headers only), so
        that a worker group's rank 0 refuses a broken one before the other ranks apply it."""
        resolved = self.resolved(request)
        self.adapters_for(resolved.request)
        models = self.store.models_for_task(resolved.request.task)
        return prepare_request(resolved, models, self.layout.canvas, should_cancel)

    def generate(
        self,
        request: GenerationRequest | ResolvedRequest,
        on_step: Callable[[StepEvent], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        mp4_path: Path | None = None,
    ) -> tuple[GenerationOutput, Geometry]:
        """The request's video and audio tensors; with `mp4_path`, also its MP4, written while the video decodes."""
        resolved = self.resolved(request)
        if resolved.request.remix is not None and resolved.request.remix.windows > 1:
            raise RequestError("remix.windows", "chained windows write files: use generate_to_file")
        prepared = self.prepare(resolved, should_cancel)
        models = self.models_for(resolved.request)
        # This request's own plan: the DiT keeps as many layers resident as the request leaves room for.
        self.placement.prepare_request(models.dit, resolved.memory_shape)
        with torch.inference_mode():
            output = run_generation(models, prepared, self.device, on_step, should_cancel, mp4_path)
        return output, prepared.geometry

    def generate_to_file(
        self,
        request: GenerationRequest | ResolvedRequest,
        out_path: Path,
        save_tensors_path: Path | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> OutputFiles:
        """`generate` into `out_path` (MP4), its sidecar and optionally `save_tensors_path`; all or nothing appears."""
        files = checked_output_files(out_path, save_tensors_path)
        resolved = self.resolved(request)
        request = resolved.request
        if request.remix is not None and request.remix.windows > 1:
            return chain_windows(self.generate_to_file, request, files, on_step, should_cancel)
        inputs = input_records(request)
        with staged(files) as staging:
            output, geometry = self.generate(
                resolved, on_step=on_step, should_cancel=should_cancel, mp4_path=staging.files.video
            )
            write_outputs(staging, request, inputs, output, geometry, self.record(request), mp4_written=True)
            return staging.commit()
