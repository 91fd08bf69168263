"""The models of one checkpoint, checked at start and loaded on first use, through a loader the owner chooses.

Contract:
* `ModelStore(layout, device, dtype, placement, loader)` checks every component of every partition (configs and
  safetensors headers: keys, shapes, truncation) and loads the models of the first partition, so a broken
  checkpoint fails here with the file and key named. The other partition's models load on first use
  (`models_for_partition`); on a GPU only one DiT partition stays resident.
* The `loader` builds each component on `placement.load_device` (the compute device, or host memory under the
  low-memory profile): `ModelLoader` builds whole components (one process); a worker group's rank passes its own
  (h3engine.runtime.rank.ShardedLoader), which builds that rank's shards and skips what the rank does not run.
* On a GPU the DiT's AdaLN projections go to pinned host memory from load on (only a request's AdaLN tables need
  the GPU); with `fp8_linear` the blocks' linears are then quantized (not the released precision).
* `on_load` (None: silent) hears a `LoadEvent` as each component of a partition starts and ends loading, counted
  among those that load then; nothing below the front-ends prints (the CLI draws them, the app logs them).
* `kernel_report()` and `record()` describe what runs (the sidecar carries `record()`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3engine import __version__
from h3engine.checkpoint.layout import PARTITION_OF_TASK, CheckpointLayout, PartitionPaths, folder_fingerprint
from h3engine.checkpoint.loader import (
    ComponentSource,
    audio_vae_source,
    check_text_encoder,
    dit_source,
    load_text_encoder,
    text_encoder_skeleton,
    video_vae_source,
)
from h3engine.checkpoint.safetensors_io import DeferredReads
from h3engine.checkpoint.text_encoder_files import load_tokenizer, open_text_encoder_files
from h3engine.engine.conditioning.presentation import load_processor
from h3engine.engine.pipeline import Models
from h3engine.engine.sampling.adaln_tables import AdalnTableCache
from h3engine.engine.sampling.modulation import (
    attach_table_cache,
    offload_adaln,
    set_kept_schedules,
    store_adaln_in_fp8,
)
from h3engine.memory.placement import Placement
from h3engine.models import attention as attention_ops
from h3engine.models import ops
from h3engine.models.dit import set_activation_chunks
from h3engine.models.text_encoder import H3TextEncoder

logger = logging.getLogger(__name__)


class ModelLoader:
    """Builds each component whole, on `device` (the single-process engine's loader). The keys `deferred` wants are
    left unread (h3engine.checkpoint.safetensors_io.DeferredReads: a layer streamed from the mapped files)."""

    def text_encoder(
        self,
        folder: Path,
        device: torch.device,
        dtype: torch.dtype,
        deferred: DeferredReads | None = None,
        weights: Path | None = None,
    ) -> H3TextEncoder:
        return load_text_encoder(folder, device=device, dtype=dtype, deferred=deferred, weights=weights)

    def text_encoder_skeleton(self, folder: Path, weights: Path | None = None) -> H3TextEncoder:
        """The text encoder `text_encoder` fills, unloaded (build it on meta to name its tensors)."""
        return text_encoder_skeleton(folder, weights)[1]()

    def dit(
        self,
        source: ComponentSource,
        device: torch.device,
        dtype: torch.dtype,
        deferred: DeferredReads | None = None,
    ) -> torch.nn.Module:
        return source.load(device, deferred)

    def video_vae(
        self, source: ComponentSource, device: torch.device, deferred: DeferredReads | None = None
    ) -> torch.nn.Module | None:
        return source.load(device, deferred)

    def audio_vae(
        self, source: ComponentSource, device: torch.device, deferred: DeferredReads | None = None
    ) -> torch.nn.Module | None:
        return source.load(device, deferred)


# The components of a partition, in the order `models_for_partition` loads them.
COMPONENTS = ("tokenizer", "text_encoder", "processor", "dit", "video_vae", "audio_vae")


@dataclass(frozen=True)
class LoadEvent:
    """Component `index` of the `total` that one partition load runs starts (`seconds` None) or is loaded (`seconds`
    it took); components already held (the diffusers layout shares all but the DiT) are not counted."""

    component: str  # one of COMPONENTS
    partition: str
    index: int
    total: int
    seconds: float | None = None


@dataclass
class _PartitionSources:
    dit: ComponentSource
    video_vae: ComponentSource
    audio_vae: ComponentSource
    paths: PartitionPaths


class ModelStore:
    def __init__(
        self,
        layout: CheckpointLayout,
        device: torch.device,
        dtype: torch.dtype,
        placement: Placement,
        loader: ModelLoader,
        fp8_linear: bool = False,
        on_load: Callable[[LoadEvent], None] | None = None,
        adaln_cache: AdalnTableCache | None = None,
    ) -> None:
        self.layout = layout
        self.adaln_cache = adaln_cache
        self.device = device
        self.dtype = dtype
        self.placement = placement
        self.loader = loader
        self.fp8_linear = fp8_linear
        self.on_load = on_load
        self._sources = {
            name: _PartitionSources(
                dit=dit_source(layout, paths, dtype),
                video_vae=video_vae_source(layout, paths),
                audio_vae=audio_vae_source(layout, paths),
                paths=paths,
            )
            for name, paths in layout.partitions.items()
        }
        for sources in self._sources.values():
            sources.dit.check()
            sources.video_vae.check()
            sources.audio_vae.check()
            if sources.paths.text_encoder_weights is not None:
                check_text_encoder(sources.paths.text_encoder, sources.paths.text_encoder_weights)
        # A placeholder checkpoint (h3engine.checkpoint.placeholder) loads like any other; its outputs are noise.
        self.placeholder = any(sources.dit.files.placeholder for sources in self._sources.values())
        if self.placeholder:
            logger.warning(
                "%s holds placeholder weights: values are drawn at load, outputs are noise", layout.root
            )
        # Loaded modules by what they were loaded from: the diffusers layout shares everything but the DiT, and the
        # native layout's partitions carry identical copies of the rest (`_identity`), which load once.
        self._modules: dict[tuple[str, Path | str], Any] = {}
        self._identities: dict[Path, str] = {}
        self.load_timings: dict[str, float] = {}
        # The partition being loaded and its components not yet held (what `on_load` counts).
        self._loading: tuple[str, list[str]] = ("", [])
        self.first_partition = next(iter(self._sources))
        # The partition whose DiT is on the device (the last one a request asked for).
        self.partition_on_device: str | None = None
        # The load of the other partitions' DiTs in the background (`preload_other_partitions`) and its error.
        self._preload: threading.Thread | None = None
        self._preload_error: BaseException | None = None
        self.models_for_partition(self.first_partition)

    def preload_other_partitions(self) -> bool:
        """Load the other partitions' DiTs into their host homes in a thread of its own, when the plan keeps both
        partitions warm (the host budget holds them): the first switch then copies from host memory, like the later
        ones, instead of reading the files. A request for such a partition waits for the load to end. Returns whether
        a load started (a long-running server calls this after its start; a one-request CLI has no use for it)."""
        others = [partition for partition in self._sources if partition != self.first_partition]
        if not others or not self.placement.keeps_partitions_warm or self._preload is not None:
            return False
        self._preload = threading.Thread(
            target=self._preload_dits, args=(others,), name="partition-preload", daemon=True
        )
        self._preload.start()
        return True

    def _preload_dits(self, partitions: list[str]) -> None:
        for partition in partitions:
            sources = self._sources[partition]
            key = ("dit", self._identity("dit", sources.paths.dit_home))
            if key in self._modules:
                continue
            started = time.perf_counter()
            logger.info("loading the %s DiT in the background into host memory", partition)
            try:
                self._modules[key] = self._load_dit(sources.dit, sources.paths.dit_home, activate=False)
            except BaseException as error:  # reported to the request that needs it
                self._preload_error = error
                return
            seconds = time.perf_counter() - started
            self.load_timings[f"dit:{sources.paths.dit_home.name}"] = seconds
            logger.info("the %s DiT waits in host memory (%.1f s in the background)", partition, seconds)

    def _wait_for_preload(self, partition: str) -> None:
        """Before a partition's models are used: the background load of its DiT has ended (its error raised once)."""
        thread = self._preload
        if thread is None or partition == self.first_partition:
            return
        if thread.is_alive():
            logger.info("the %s DiT is still loading in the background: the request waits for it", partition)
            thread.join()
        error, self._preload_error = self._preload_error, None
        if error is not None:
            raise error

    def dit_config(self, partition: str) -> Any:
        """The DiT config of `partition` (h3engine.models.dit_config.DiTConfig), read at start: no model loads."""
        return self._sources[partition].dit.config

    def partition_for(self, task: str) -> str:
        """The partition serving `task` (the first one for a task no partition names)."""
        return PARTITION_OF_TASK.get(task, self.first_partition)

    def models_for_task(self, task: str) -> Models:
        return self.models_for_partition(self.partition_for(task))

    def models_for_partition(self, partition: str) -> Models:
        self._wait_for_preload(partition)
        sources = self._sources[partition]
        paths = sources.paths
        folders = [getattr(paths, f"{kind}_home", getattr(paths, kind)) for kind in COMPONENTS]
        pending = [
            kind
            for kind, folder in zip(COMPONENTS, folders, strict=True)
            if (kind, self._identity(kind, folder)) not in self._modules
        ]
        self._loading = (partition, pending)
        tokenizer = self._module("tokenizer", paths.tokenizer, lambda: load_tokenizer(paths.tokenizer))
        text_encoder = self._module(
            "text_encoder", paths.text_encoder_home, lambda: self._load_text_encoder(paths)
        )
        text_encoder.verify_tokenizer(tokenizer)
        processor = self._module("processor", paths.processor, lambda: load_processor(paths.processor))
        dit = self._module("dit", paths.dit_home, lambda: self._load_dit(sources.dit, paths.dit_home))
        self.placement.activate(dit)
        self.partition_on_device = partition
        return Models(
            dit=dit,
            video_vae=self._module(
                "video_vae", paths.video_vae_home, lambda: self._load_video_vae(sources.video_vae)
            ),
            audio_vae=self._module(
                "audio_vae", paths.audio_vae_home, lambda: self._load_audio_vae(sources.audio_vae)
            ),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=processor,
            video_decode_autocast=torch.float16
            if self.device.type == "cuda" and self.dtype != torch.float32
            else None,
            placement=self.placement,
        )

    def _identity(self, kind: str, folder: Path) -> Path | str:
        """What tells one loaded component from another: a DiT's folder (partitions differ there), the contents'
        fingerprint for the rest (h3engine.checkpoint.layout.folder_fingerprint), so that each partition's copy of
        the same text encoder, VAEs, tokenizer and processor loads once."""
        if kind == "dit":
            return folder
        if folder not in self._identities:
            self._identities[folder] = folder_fingerprint(folder)
        return self._identities[folder]

    def _module(self, kind: str, folder: Path, load: Callable[[], Any]) -> Any:
        key = (kind, self._identity(kind, folder))
        if key not in self._modules:
            if kind == "dit" and self.device.type == "cuda":
                self._make_room_for_a_dit()
            self._report(kind, None)
            started = time.perf_counter()
            self._modules[key] = load()
            seconds = time.perf_counter() - started
            self.load_timings[f"{kind}:{folder.name}"] = seconds
            self._report(kind, seconds)
        return self._modules[key]

    def _deferred(
        self, model: str, meta_module: Callable[[], torch.nn.Module], layers: bool = True
    ) -> DeferredReads | None:
        return self.placement.deferred_reads(model, meta_module, layers)

    def _load_text_encoder(self, paths: PartitionPaths) -> H3TextEncoder:
        folder, weights = paths.text_encoder, paths.text_encoder_weights
        deferred = self._deferred("text_encoder", lambda: self.loader.text_encoder_skeleton(folder, weights))
        encoder = self.loader.text_encoder(
            folder, self.placement.load_device("text_encoder"), self.dtype, deferred, weights
        )
        # Only our converted folders store FP8 row scales (a community file's FP8 is its own form, not reopened here).
        files_fp8 = weights is None and open_text_encoder_files(folder)[1].stores_fp8
        return self.placement.adopt(encoder, "text_encoder", deferred, files_fp8)

    def _load_dit(self, source: ComponentSource, folder: Path, activate: bool = True) -> torch.nn.Module:
        # FP8 linears are made from the loaded bf16 weights: their layers cannot be left unread (the AdaLN can).
        deferred = self._deferred("dit", source.build, layers=not self.fp8_linear)
        dit = self.loader.dit(source, self.placement.load_device("dit"), self.dtype, deferred)
        if self.adaln_cache is not None:
            # What its tables depend on as loaded: the files, the weight format, the dtype, and this code.
            model = f"{folder_fingerprint(folder)}:{self.placement.plan.weights}:{self.dtype}:{__version__}"
            attach_table_cache(dit, self.adaln_cache, model)
        plan = self.placement.plan
        if next(dit.parameters(), None) is not None:
            set_activation_chunks(dit, plan.activation_chunks)
            set_kept_schedules(dit, plan.context.kept_schedules)
        files_fp8 = source.files.stores_fp8
        prepared = self._prepare_dit(dit, deferred, source)
        return self.placement.adopt(prepared, "dit", deferred, files_fp8, activate)

    def _load_video_vae(self, source: ComponentSource) -> torch.nn.Module | None:
        deferred = self._deferred("video_vae", source.build) if source.read_key is not None else None
        video_vae = self.loader.video_vae(source, self.placement.load_device("video_vae"), deferred)
        return self.placement.adopt(video_vae, "video_vae", deferred)

    def _load_audio_vae(self, source: ComponentSource) -> torch.nn.Module | None:
        audio_vae = self.loader.audio_vae(source, self.placement.load_device("audio_vae"))
        return self.placement.adopt(audio_vae, "audio_vae")

    def _make_room_for_a_dit(self) -> None:
        """A DiT partition at the released size fills most of a GPU: before another one loads, the one on the device
        goes back to its host home (a plan that keeps both partitions warm) or is dropped (it loads again from the
        checkpoint when a request needs it)."""
        for other in [key for key in self._modules if key[0] == "dit"]:
            module = self._modules[other]
            if self.placement.keeps_partitions_warm:
                self.placement.deactivate(module)
            else:
                self.placement.forget(module)
                del self._modules[other]
        torch.cuda.empty_cache()

    def _report(self, kind: str, seconds: float | None) -> None:
        partition, pending = self._loading
        if self.on_load is not None and kind in pending:
            self.on_load(LoadEvent(kind, partition, pending.index(kind) + 1, len(pending), seconds))

    def _prepare_dit(
        self, dit: torch.nn.Module, deferred: DeferredReads | None, source: ComponentSource
    ) -> torch.nn.Module:
        """On a GPU, the DiT's AdaLN projections go to pinned host memory: `modulation.schedule_modulation` streams
        them to the device once per request schedule, and the placement leaves pinned tensors where they are.
        With `fp8_linear`, the blocks' linears are then quantized (h3engine.models.quantization). A DiT without parameters
        is one another stage group holds (h3engine.runtime.stages): only its config is here. Files that store the
        AdaLN projections in FP8 hand over their values and scales as stored (loading dequantized them already)."""
        if next(dit.parameters(), None) is None:
            return dit
        fp8_weights = self.placement.plan.weights == "fp8"
        files_fp8 = source.files.stores_fp8
        stored = {}
        if fp8_weights and files_fp8 and source.key_fp8 is not None:
            stored = {
                name: parts[0]
                for name, _ in dit.named_parameters()
                if name.endswith("adaln_proj.linear.weight") and (parts := source.key_fp8(name)) is not None
            }
        if self.device.type == "cuda":
            readers = deferred.readers if deferred is not None else None
            offload_adaln(dit, fp8=fp8_weights, readers=readers, stored_fp8=stored)
        elif fp8_weights and not files_fp8:
            store_adaln_in_fp8(dit)
        if self.fp8_linear:
            from h3engine.models.quantization import quantize_dit_linears

            quantize_dit_linears(dit)
        return dit

    def kernel_report(self) -> dict[str, str]:
        """Which attention backend and which implementation of the fused DiT ops run (h3engine.models.ops): e.g.
        {"attention": "fa4", "fused_ops": "triton", "attention_tiles": "192x128"} on a Hopper GPU,
        {"attention": "sdpa", "fused_ops": "reference"} on the CPU. The DiT's head size decides the attention
        choice; 128 is the released one."""
        head_dim = self._sources[self.first_partition].dit.config.head_dim
        probe = torch.empty(1, 1, head_dim, device=self.device, dtype=self.dtype)
        report = {
            "attention": attention_ops.selected_backend(probe),
            "fused_ops": ops.implementation("swiglu", probe.view(1, head_dim)),
        }
        if report["attention"] == "fa4":
            tiles = attention_ops.fa4_tiles(probe)
            report["attention_tiles"] = "x".join(map(str, tiles["tile_mn"])) if tiles else "fa4 default"
        return report

    def record(self) -> dict[str, Any]:
        """What a sidecar says about the engine that made its video."""
        return {
            "checkpoint": f"{self.layout.kind}:{self.layout.root.resolve()}",
            "engine_version": __version__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "memory_profile": self.placement.profile,
            "memory_plan": self.placement.describe(),
            "weight_format": self.placement.plan.weights,
            "fp8_linear": self.fp8_linear,
            "kernels": self.kernel_report(),
            **({"weights": "placeholder"} if self.placeholder else {}),
        }
