"""The Python API: an `Engine` holds a checkpoint's loaded models and turns requests into MP4 files.

Contract:
* `Engine.from_checkpoint(folder, device, dtype)` detects the layout, checks every component of every partition
  (configs and safetensors headers: keys, shapes, truncation) and loads the models of the first partition, so a
  broken checkpoint fails here with the file and key named, before any request is accepted. The other partition's
  models are loaded on first use; on a GPU only one DiT partition stays resident.
* `parse_request` / `validate` never touch the models; `generate` returns float tensors; `generate_to_file` checks
  its output names before any work, then writes the MP4, the optional tensors and the JSON sidecar into staging
  files that appear under their names together, only when all are complete (h3engine.media.outputs.staged).
* Cancellation: `should_cancel` is polled between the phases (before each input file is read, before the
  conditioning encode, before the text encode, before every denoising step, after the last one) and between the
  video decoder's windows; a `True` raises GenerationCancelled and nothing is written.
* `generate` is `prepare` (validate, read the inputs, encode the conditioning: a `PreparedRequest`) and then the
  pipeline; `generate_to_file` is `generate` writing the MP4 while the video decodes (`pipeline.decode`) and then
  `write_outputs` for the rest. A worker group (h3engine.runtime.rank) calls these halves itself: its rank 0
  prepares and writes, every rank generates. The `_load_*` methods are the one place that builds each model, so a
  rank's engine swaps in its shards there.
* `memory_profile` (h3engine.placement): "resident" (default) keeps every component on the compute device;
  "low-memory" keeps them in host memory and moves each onto the device only for the phase that runs it
  (conditioning encode, text encode, denoise, decode). Either way, on a GPU the DiT's AdaLN projections (~26 GB at
  the released size) live in pinned host memory from load on: only the request's AdaLN tables need the GPU.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3engine import __version__, ops
from h3engine.checkpoint.layout import (
    PARTITION_OF_TASK,
    CanvasRules,
    CheckpointLayout,
    PartitionPaths,
    detect_layout,
)
from h3engine.checkpoint.loader import (
    ComponentSource,
    audio_vae_source,
    dit_source,
    load_text_encoder,
    video_vae_source,
)
from h3engine.checkpoint.text_encoder_files import load_tokenizer
from h3engine.conditioning import (
    EncodedConditions,
    NormalizedReference,
    encode_keyframes,
    encode_references,
    fit_keyframes,
    normalize_reference_audio,
    normalize_reference_image,
    normalize_reference_video,
)
from h3engine.errors import RequestError
from h3engine.geometry import (
    AUDIO_SAMPLE_RATE,
    FPS,
    RELEASED_SHORT_EDGE,
    Geometry,
    frames_for_duration,
    resolve_canvas,
)
from h3engine.media import inputs as media_inputs
from h3engine.media.mux import write_mp4
from h3engine.media.outputs import OutputFiles, StagedOutputs, save_tensors, staged, write_sidecar
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.ops import attention as attention_ops
from h3engine.pipeline import GenerationOutput, Models, StepEvent, check_cancelled, run_generation
from h3engine.placement import Placement
from h3engine.presentation import (
    Presentation,
    keyframe_presentation,
    load_processor,
    prompt_token_counter,
    reference_presentation,
    text_presentation,
)
from h3engine.request import (
    GenerationRequest,
    from_dict,
    resolve_aspect,
    resolve_duration_seconds,
    validate,
)
from h3engine.sampling.schedule import Schedule

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RequestError(f"--device: unknown device '{name}'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RequestError("--device: CUDA was asked for but no GPU is available")
    if device.type not in ("cpu", "cuda"):
        raise RequestError(f"--device: only cpu and cuda are supported, got '{name}'")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The DiT's compute dtype: bf16 is the released precision; fp32 is for parity checks."""
    if name is None:
        return torch.bfloat16
    if name not in DTYPES:
        raise RequestError(f"--dtype: expected bfloat16 or float32, got '{name}'")
    return DTYPES[name]


def canvas_rule(request: GenerationRequest, rules: CanvasRules) -> tuple[int, int]:
    """(short edge, area cap) of a request's target canvas, which reference videos follow as well.

    The released short edge (768) stands for the checkpoint's own canvas rule (768 for the release, the tiny
    checkpoints' 32); another short edge scales the area cap with it.
    """
    short_edge = rules.short_edge if request.short_edge == RELEASED_SHORT_EDGE else request.short_edge
    return short_edge, rules.max_pixels * short_edge**2 // rules.short_edge**2


def request_geometry(
    request: GenerationRequest,
    rules: CanvasRules,
    vae_spatial_ratio: int,
    patch: int,
    first_keyframe_size: tuple[int, int] | None = None,
) -> Geometry:
    """The canvas and frame counts of a validated request, from the checkpoint's canvas rule and spatial factors.

    FL2VA with aspect "auto" follows its first listed keyframe: pass that image's upright (width, height) if it is
    already loaded, otherwise the file is probed here. A Ref2VA request without a duration takes its audio
    reference's. Model-free, so the app can show it before a job is queued.
    """
    frames = frames_for_duration(resolve_duration_seconds(request, media_inputs.probe_media))
    if request.width is not None and request.height is not None:
        height, width = request.height, request.width
    else:
        if first_keyframe_size is None and request.task == "fl2va" and request.aspect_ratio == "auto":
            info = media_inputs.probe_media(request.keyframes[0])
            first_keyframe_size = (info.width, info.height)
        short_edge, max_pixels = canvas_rule(request, rules)
        height, width = resolve_canvas(
            *resolve_aspect(request, first_keyframe_size),
            multiple=vae_spatial_ratio * patch,
            short_edge=short_edge,
            max_pixels=max_pixels,
        )
    return Geometry.from_canvas(height, width, frames, vae_spatial_ratio=vae_spatial_ratio, patch=patch)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request with its inputs read and encoded: everything the pipeline needs besides the models.

    Plain data (CPU tensors), so a worker group's rank 0 can hand it to the other ranks as it is.
    """

    partition: str
    schedule: Schedule
    geometry: Geometry
    presentation: Presentation
    conditions: EncodedConditions
    conditioning_s: float


@dataclass
class _PartitionSources:
    dit: ComponentSource
    video_vae: ComponentSource
    audio_vae: ComponentSource
    paths: PartitionPaths


class Engine:
    def __init__(
        self,
        layout: CheckpointLayout,
        device: torch.device,
        dtype: torch.dtype,
        memory_profile: str = "resident",
        fp8_linear: bool = False,
    ) -> None:
        self.placement = self._make_placement(memory_profile, device)
        self.fp8_linear = fp8_linear
        self.layout = layout
        self.device = device
        self.dtype = dtype
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
        # Loaded modules by the folder they came from: the diffusers layout shares everything but the DiT.
        self._modules: dict[tuple[str, Path], Any] = {}
        self.load_timings: dict[str, float] = {}
        first = next(iter(self._sources))
        self.models_for_partition(first)

    @classmethod
    def from_checkpoint(
        cls,
        folder: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        memory_profile: str = "resident",
        fp8_linear: bool = False,
    ) -> Engine:
        return cls(detect_layout(folder), torch.device(device), dtype, memory_profile, fp8_linear)

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        """The profile's `Placement` (RequestError naming --memory-profile for an unknown one), made before
        anything loads."""
        return Placement(memory_profile, device)

    @property
    def checkpoint_id(self) -> str:
        return f"{self.layout.kind}:{self.layout.root.resolve()}"

    def _module(self, kind: str, folder: Path, load: Callable[[], Any]) -> Any:
        key = (kind, folder)
        if key not in self._modules:
            if kind == "dit" and self.device.type == "cuda":
                # One DiT partition is ~62 GiB: drop the other one before loading this one.
                for other in [k for k in self._modules if k[0] == "dit"]:
                    del self._modules[other]
                torch.cuda.empty_cache()
            started = time.perf_counter()
            self._modules[key] = load()
            self.load_timings[f"{kind}:{folder.name}"] = time.perf_counter() - started
        return self._modules[key]

    def models_for_partition(self, partition: str) -> Models:
        sources = self._sources[partition]
        paths = sources.paths
        adopt = self.placement.adopt
        tokenizer = self._module("tokenizer", paths.tokenizer, lambda: load_tokenizer(paths.tokenizer))
        text_encoder = self._module(
            "text_encoder", paths.text_encoder, lambda: adopt(self._load_text_encoder(paths.text_encoder))
        )
        text_encoder.verify_tokenizer(tokenizer)
        processor = self._module("processor", paths.processor, lambda: load_processor(paths.processor))
        return Models(
            dit=self._module("dit", paths.dit, lambda: adopt(self._prepare_dit(self._load_dit(sources.dit)))),
            video_vae=self._module(
                "video_vae", paths.video_vae, lambda: adopt(self._load_video_vae(sources.video_vae))
            ),
            audio_vae=self._module(
                "audio_vae", paths.audio_vae, lambda: adopt(self._load_audio_vae(sources.audio_vae))
            ),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=processor,
            video_decode_autocast=torch.float16
            if self.device.type == "cuda" and self.dtype != torch.float32
            else None,
            placement=self.placement,
        )

    # The loaders build each component on `placement.load_device`: the compute device, or host memory under the
    # low-memory profile.

    def _load_text_encoder(self, folder: Path) -> H3TextEncoder:
        return load_text_encoder(folder, device=self.placement.load_device, dtype=self.dtype)

    def _load_dit(self, source: ComponentSource) -> torch.nn.Module:
        return source.load(self.placement.load_device)

    def _load_video_vae(self, source: ComponentSource) -> torch.nn.Module | None:
        return source.load(self.placement.load_device)

    def _load_audio_vae(self, source: ComponentSource) -> torch.nn.Module | None:
        return source.load(self.placement.load_device)

    def _prepare_dit(self, dit: torch.nn.Module) -> torch.nn.Module:
        """On a GPU, the DiT's AdaLN projections go to pinned host memory: `H3DiT.schedule_modulation` streams
        them to the device once per request schedule, and the placement leaves pinned tensors where they are.
        With `fp8_linear`, the blocks' linears are then quantized (h3engine.quantization; off by default: not the
        released precision)."""
        if self.device.type == "cuda":
            dit.offload_adaln()
        if self.fp8_linear:
            from h3engine.quantization import quantize_dit_linears

            quantize_dit_linears(dit)
        return dit

    def kernel_report(self) -> dict[str, str]:
        """Which attention backend and which implementation of the fused DiT ops this engine runs (h3engine.ops):
        e.g. {"attention": "fa4", "fused_ops": "triton", "attention_tiles": "192x128"} on a Hopper GPU,
        {"attention": "sdpa", "fused_ops": "reference"} on the CPU. The DiT's head size decides the attention
        choice; 128 is the released one."""
        head_dim = next(iter(self._sources.values())).dit.config.head_dim
        probe = torch.empty(1, 1, head_dim, device=self.device, dtype=self.dtype)
        report = {
            "attention": attention_ops.selected_backend(probe),
            "fused_ops": ops.implementation("swiglu", probe.view(1, head_dim)),
        }
        if report["attention"] == "fa4":
            tiles = attention_ops.fa4_tiles(probe)
            report["attention_tiles"] = "x".join(map(str, tiles["tile_mn"])) if tiles else "fa4 default"
        return report

    # --- requests ---------------------------------------------------------------------------------------

    def parse_request(self, payload: Mapping[str, Any]) -> GenerationRequest:
        return from_dict(payload)

    def _spatial_factors(self, partition: str) -> tuple[int, int]:
        """(VAE spatial ratio, DiT patch): their product is the multiple every canvas side rounds to."""
        models = self.models_for_partition(partition)
        return models.video_vae.config.spatial_compression_ratio, models.dit.config.patch_size[-1]

    def validate(self, request: GenerationRequest) -> list[str]:
        """Check a request against the rules, this checkpoint and its input files; returns warnings, raises
        RequestError (naming the field or the file)."""
        if (
            request.task in PARTITION_OF_TASK
            and PARTITION_OF_TASK[request.task] not in self.layout.partitions
        ):
            raise RequestError(f"task: this checkpoint has no partition serving '{request.task}'")
        partition = PARTITION_OF_TASK.get(request.task, next(iter(self._sources)))
        vae_ratio, patch = self._spatial_factors(partition)
        warnings = validate(
            request,
            media_inputs.probe_media,
            canvas_multiple=vae_ratio * patch,
            count_prompt_tokens=prompt_token_counter(self.layout.partitions[partition].tokenizer),
        )
        if request.task == "ref2va" and request.keyframes:
            # SGLang's schema admits them, but no reference implementation we follow lays them out next to
            # references; dropping them silently would generate something the user did not ask for.
            raise RequestError(
                "keyframes: this engine does not support keyframes together with references (ref2va)"
            )
        return warnings

    def geometry_for(
        self, request: GenerationRequest, first_keyframe_size: tuple[int, int] | None = None
    ) -> Geometry:
        """The canvas and frame counts of a validated request on this checkpoint (see `request_geometry`)."""
        vae_ratio, patch = self._spatial_factors(PARTITION_OF_TASK[request.task])
        return request_geometry(request, self.layout.canvas, vae_ratio, patch, first_keyframe_size)

    def prepare_conditioning(
        self,
        request: GenerationRequest,
        models: Models,
        should_cancel: Callable[[], bool] | None = None,
    ) -> tuple[Geometry, Presentation, EncodedConditions]:
        """Read the request's input files, put them on the model's rates and canvases, build the text encoder's
        presentation and encode the conditioning latents (`should_cancel` is polled before each file and before
        the encode)."""
        if request.task == "fl2va":
            images = []
            for keyframe in request.keyframes:
                check_cancelled(should_cancel)
                images.append(media_inputs.load_image(keyframe.path))
            geometry = self.geometry_for(request, first_keyframe_size=images[0].size)
            fitted = fit_keyframes(images, geometry.height, geometry.width)
            presentation = keyframe_presentation(models.tokenizer, models.processor, request.prompt, fitted)
            anchors = [keyframe.position for keyframe in request.keyframes]
            check_cancelled(should_cancel)
            with models.resident_for("conditioning"):
                conditions = encode_keyframes(models.video_vae, fitted, anchors)
            return geometry, presentation, conditions
        geometry = self.geometry_for(request)
        if request.task == "ref2va":
            references = []
            for index in range(len(request.references)):
                check_cancelled(should_cancel)
                references.append(self._normalized_reference(request, index, geometry))
            presentation = reference_presentation(
                models.tokenizer, models.processor, request.prompt, references
            )
            check_cancelled(should_cancel)
            with models.resident_for("conditioning"):
                conditions = encode_references(models.video_vae, models.audio_vae, references)
            return geometry, presentation, conditions
        return geometry, text_presentation(models.tokenizer, request.prompt), EncodedConditions(task="t2va")

    def _normalized_reference(
        self, request: GenerationRequest, index: int, geometry: Geometry
    ) -> NormalizedReference:
        """Reference `index` of a request, read and put on the model's rates and canvases (see conditioning).

        Audio (a clip, or a video's soundtrack) is read at its own rate and resampled here, with the reference's
        resampler, not with the loader's; a video is decoded straight onto its own canvas (per-frame LANCZOS after
        the 24 fps frame holding, as the reference resizes).
        """
        reference, field = request.references[index], f"references[{index}]"
        vae_ratio, patch = self._spatial_factors("ref2va")
        multiple = vae_ratio * patch
        # Clips and soundtracks are cut to the generated (17n+5-snapped) duration.
        max_seconds = geometry.frames / FPS
        start_seconds = reference.start_seconds or 0.0
        try:
            if reference.kind == "image":
                image = normalize_reference_image(
                    media_inputs.load_image(reference.path),
                    self.layout.canvas.reference_image_short_edge,
                    multiple,
                )
                return NormalizedReference("image", image=image)
            if reference.kind == "audio":
                source = media_inputs.read_audio_source(reference.path, start_seconds, max_seconds)
                return NormalizedReference("audio", audio=_reference_audio(source, max_seconds))
            info = media_inputs.probe_media(reference)
            short_edge, max_pixels = canvas_rule(request, self.layout.canvas)
            height, width = resolve_canvas(
                info.width, info.height, multiple=multiple, short_edge=short_edge, max_pixels=max_pixels
            )
            clip = media_inputs.load_video(
                reference.path, start_seconds, max_seconds, resize_to=(width, height)
            )
            frames = normalize_reference_video(
                clip.frames,
                FPS,
                geometry.frames,
                multiple=multiple,
                short_edge=short_edge,
                max_pixels=max_pixels,
            )
            soundtrack = None
            if clip.soundtrack is not None:
                # The loader keeps the soundtrack's window at its own rate: resampled here like a clip.
                soundtrack = _reference_audio(clip.soundtrack.source, max_seconds)
            return NormalizedReference("video", frames=frames, audio=soundtrack)
        except RequestError as error:
            raise RequestError(f"{field}: {error}") from None
        except ValueError as error:
            raise RequestError(f"{field}: {reference.path}: {error}") from None

    def schedule_for(self, request: GenerationRequest) -> Schedule:
        return Schedule.build(
            request.steps,
            recipe=request.recipe,
            video_shift=request.flow_shift,
            audio_shift=request.audio_flow_shift,
        )

    def prepare(
        self, request: GenerationRequest, should_cancel: Callable[[], bool] | None = None
    ) -> PreparedRequest:
        """Validate the request, read its input files and encode its conditioning (RequestError naming the field)."""
        self.validate(request)
        partition = self.layout.for_task(request.task).partition
        models = self.models_for_partition(partition)
        schedule = self.schedule_for(request)
        with torch.inference_mode():
            started = time.perf_counter()
            geometry, presentation, conditions = self.prepare_conditioning(request, models, should_cancel)
            conditioning_s = time.perf_counter() - started
        return PreparedRequest(partition, schedule, geometry, presentation, conditions, conditioning_s)

    def generate(
        self,
        request: GenerationRequest,
        on_step: Callable[[StepEvent], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        mp4_path: Path | None = None,
    ) -> tuple[GenerationOutput, Geometry]:
        """The request's video and audio tensors; with `mp4_path`, also its MP4, written while the video decodes."""
        prepared = self.prepare(request, should_cancel)
        with torch.inference_mode():
            output = run_generation(
                self.models_for_partition(prepared.partition),
                prepared.presentation,
                prepared.conditions,
                prepared.geometry,
                prepared.schedule,
                request.seed,
                request.recipe,
                self.device,
                on_step=on_step,
                should_cancel=should_cancel,
                mp4_path=mp4_path,
            )
        output.timings["conditioning_s"] = prepared.conditioning_s
        return output, prepared.geometry

    def generate_to_file(
        self,
        request: GenerationRequest,
        out_path: Path,
        save_tensors_path: Path | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> OutputFiles:
        """`generate` into `out_path` (MP4), its sidecar and optionally `save_tensors_path`; all or nothing appears."""
        files = checked_output_files(out_path, save_tensors_path)
        # Hashed before generating, so the sidecar names the bytes the conditioning was read from.
        inputs = input_records(request)
        with staged(files) as staging:
            output, geometry = self.generate(
                request, on_step=on_step, should_cancel=should_cancel, mp4_path=staging.files.video
            )
            self.write_outputs(request, inputs, output, geometry, staging, mp4_written=True)
            return staging.commit()

    def write_outputs(
        self,
        request: GenerationRequest,
        inputs: list[dict[str, Any]],
        output: GenerationOutput,
        geometry: Geometry,
        staging: StagedOutputs,
        mp4_written: bool = False,
    ) -> None:
        """Fill `staging`'s files: the MP4 (unless `mp4_written`: the decode already wrote it there), the tensors
        when asked for, the sidecar (which names the final video). The caller commits. `inputs` are the request's
        `input_records`."""
        if not mp4_written:
            started = time.perf_counter()
            write_mp4(staging.files.video, output.video, output.audio)
            output.timings["mux_s"] = time.perf_counter() - started
        if staging.files.tensors is not None:
            save_tensors(
                staging.files.tensors,
                {
                    "video": output.video,
                    "audio": output.audio,
                    "video_latents": output.video_latents,
                    "audio_latents": output.audio_latents,
                },
            )
        write_sidecar(
            staging.files.sidecar,
            {
                "request": request.to_dict(),
                "inputs": inputs,
                "seed": request.seed,
                "recipe": request.recipe,
                "checkpoint": self.checkpoint_id,
                "engine_version": __version__,
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "memory_profile": self.placement.profile,
                "fp8_linear": self.fp8_linear,
                "kernels": self.kernel_report(),
                "geometry": {
                    "width": geometry.width,
                    "height": geometry.height,
                    "frames": geometry.frames,
                    "fps": 24,
                    "latent_frames": geometry.latent_frames,
                    "audio_latents": geometry.audio_latents,
                },
                "timings_s": output.timings,
                "video": staging.final.video.name,
            },
        )


def checked_output_files(out_path: Path | str, save_tensors_path: Path | str | None = None) -> OutputFiles:
    """The request's output files, or RequestError naming the argument, before any work is done."""
    try:
        files = OutputFiles.beside(out_path, save_tensors_path)
    except ValueError as error:
        raise RequestError(f"out_path: {error}") from None
    problem = files.problem()
    if problem is not None:
        role, message = problem
        raise RequestError(f"{'out_path' if role == 'video' else 'save_tensors_path'}: {message}")
    return files


def _reference_audio(source: Any, max_seconds: float) -> torch.Tensor:
    """A decoded source-rate waveform (`media.inputs.SourceAudio`) -> stereo float32 at the audio VAE's rate."""
    samples = torch.from_numpy(source.samples)
    return normalize_reference_audio(samples, source.sample_rate, AUDIO_SAMPLE_RATE, max_seconds)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_records(request: GenerationRequest) -> list[dict[str, Any]]:
    """What the sidecar records about each input file: its field, role, path and the sha256 of its bytes."""
    records: list[dict[str, Any]] = [
        {"field": f"keyframes[{index}]", "position": keyframe.position, "path": keyframe.path}
        for index, keyframe in enumerate(request.keyframes)
    ]
    records += [
        {
            "field": f"references[{index}]",
            "kind": reference.kind,
            "path": reference.path,
            "start_seconds": reference.start_seconds,
        }
        for index, reference in enumerate(request.references)
    ]
    for record in records:
        try:
            record["sha256"] = _sha256(record["path"])
        except OSError as error:
            raise RequestError(f"{record['field']}: cannot read {record['path']}: {error.strerror}") from None
    return records
