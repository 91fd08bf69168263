"""One request from its input files to its MP4: inputs -> conditioning -> text -> denoise -> decode -> mux.

Contract: `prepare_request` reads a resolved request's files (h3engine.engine.resolved) and encodes its
conditioning into a `PreparedRequest` (plain CPU data, which a worker group's rank 0 hands to the other ranks);
`run_generation` is `denoise_request` (text encode, pack, denoise) then `decode` (which can write the MP4 while the
video decodes) and returns float tensors; `write_outputs` writes the MP4, the tensors and the sidecar. A worker group runs the halves itself: every
rank denoises, the VAE group decodes with `decode_on_group`. The loop follows the released recipe: one
guidance-free DiT forward per step on the whole packed sequence; conditioning rows (visual ones noised once to
t = 0.999 with the request's condition noise, reference audio clean) are re-fed unchanged; the scheduler state
stays fp32 whatever the DiT's compute dtype.

Cancellation: `should_cancel` is polled before each input file, the conditioning encode, the text encode, every
step, after the last one and between the video decoder's windows; a `True` raises `GenerationCancelled`. Each
phase runs inside `Models.resident_for(phase)` (h3engine.memory.placement: the low-memory profile moves that phase's
components onto the device and home again; the timings include those copies).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from h3engine.checkpoint.layout import CanvasRules
from h3engine.engine import trace
from h3engine.engine.conditioning.encode import (
    EncodedConditions,
    encode_keyframes,
    encode_references,
    fit_keyframes,
)
from h3engine.engine.conditioning.inputs import read_keyframe, read_reference
from h3engine.engine.conditioning.presentation import (
    Presentation,
    keyframe_presentation,
    reference_presentation,
    text_presentation,
)
from h3engine.engine.conditioning.remix import RemixPlan, plan_remix, splice_output
from h3engine.engine.conditioning.text_states import TEXT_STATES, presentation_key
from h3engine.engine.resolved import ResolvedRequest
from h3engine.engine.sampling.denoise_steps import (
    check_cancelled,
    denoise,
    initial_rows,
    layout_on,
    start_hold,
    target_latents,
)
from h3engine.engine.sampling.hold import HeldRows
from h3engine.engine.sampling.noise import draw_initial_noise
from h3engine.engine.sampling.packing import PackedLayout
from h3engine.engine.sampling.schedule import Schedule
from h3engine.engine.sampling.step_cache import CachePreset, ReduceGroups, StepCache, cache_preset
from h3engine.media.mux import write_mp4
from h3engine.media.outputs import StagedOutputs, save_tensors, sidecar_record, write_sidecar
from h3engine.media.progressive import ProgressiveFrames
from h3engine.media.remux import copy_source_video
from h3engine.memory.placement import PHASE_COMPONENTS, Placement
from h3engine.models.parallel.dit import worker_groups
from h3engine.models.parallel.groups import GroupMembership
from h3engine.models.parallel.vae import decode_video_and_audio
from h3engine.request.geometry import FPS, Geometry
from h3engine.request.model import GenerationRequest


@dataclass(frozen=True)
class StepEvent:
    step: int
    total: int
    elapsed_s: float
    # The generated video rows after this step (fp32, on the compute device); for previews. Do not modify.
    video_rows: torch.Tensor | None = None


@dataclass
class GenerationOutput:
    video: torch.Tensor  # [F, H, W, 3] float32 in [0, 1]
    audio: torch.Tensor  # [2, N] float32 in [-1, 1], 32 kHz
    video_latents: torch.Tensor  # [C, T, h, w] normalized latents after denoising
    audio_latents: torch.Tensor  # [2, C, A] normalized latents after denoising
    timings: dict[str, float] = field(default_factory=dict)
    # The step cache's preset and forwards computed / skipped (h3engine.engine.sampling.step_cache); None: cache "off".
    step_cache: dict[str, Any] | None = None


@dataclass
class Models:
    """The loaded components one partition needs.

    A rank of a worker group holds only what it runs: its shards of the DiT and the text encoder, the video VAE on
    VAE-group ranks (None elsewhere) and the audio VAE on rank 0 (None elsewhere).
    """

    dit: torch.nn.Module
    video_vae: torch.nn.Module | None
    audio_vae: torch.nn.Module | None
    text_encoder: object
    tokenizer: object
    # The Qwen3-VL processor (image and video pixel preprocessing for keyframes and references).
    processor: object | None = None
    # SGLang's released decode recipe (fp32 weights, fp16 autocast) on a GPU at the released precision; None decodes
    # in fp32 (parity runs, the CPU).
    video_decode_autocast: torch.dtype | None = None
    # The engine's memory profile (the default: everything resident, phases are no-ops).
    placement: Placement = field(default_factory=Placement)

    @property
    def spatial_factors(self) -> tuple[int, int]:
        """(VAE spatial ratio, DiT patch): their product is the multiple every canvas side rounds to."""
        return self.video_vae.config.spatial_compression_ratio, self.dit.config.patch_size[-1]

    def resident_for(self, phase: str) -> AbstractContextManager[None]:
        """Hold this phase's components (`placement.PHASE_COMPONENTS`) on the compute device for the block."""
        return self.placement.resident_for(phase, [getattr(self, name) for name in PHASE_COMPONENTS[phase]])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- inputs and conditioning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request with its inputs read and encoded: everything the pipeline needs besides the models.

    Plain data (CPU tensors), so a worker group's rank 0 can hand it to the other ranks as it is.
    """

    geometry: Geometry
    presentation: Presentation
    conditions: EncodedConditions
    schedule: Schedule
    seed: int
    recipe: str
    conditioning_s: float = 0.0
    # The request's step-cache preset (h3engine.engine.sampling.step_cache.PRESETS; "off": none; a benchmark may put a
    # CachePreset of its own here).
    cache: str | CachePreset = "off"
    # Target rows held at source latents (h3engine.engine.sampling.hold: remix tasks and masks); None: plain generation.
    held: HeldRows | None = None
    # A remix's sources as its output keeps them (h3engine.engine.conditioning.remix); None: not a remix.
    remix: RemixPlan | None = None


def prepare_request(
    resolved: ResolvedRequest,
    models: Models,
    canvas: CanvasRules,
    should_cancel: Callable[[], bool] | None = None,
) -> PreparedRequest:
    """Read a resolved request's input files, put them on the model's rates and `canvas`, build the text encoder's
    presentation and encode the conditioning latents (`should_cancel` is polled before each file and before the
    encode). A step-distilled DiT's rungs (`resolved.rungs`) replace the request's grid."""
    request, geometry = resolved.request, resolved.geometry
    if geometry is None:
        raise ValueError(
            "prepare_request needs a request resolved with its checkpoint's facts (it has no geometry)"
        )
    shifts = {"video_shift": request.flow_shift, "audio_shift": request.audio_flow_shift}
    if resolved.rungs is None:
        schedule = Schedule.build(request.steps, recipe=request.recipe, **shifts)
    else:
        schedule = Schedule.from_rungs(resolved.rungs, **shifts)
    with torch.inference_mode():
        started = time.perf_counter()
        presentation, conditions = _read_and_encode(resolved, geometry, models, canvas, should_cancel)
        remix = None
        if request.remix is not None:
            check_cancelled(should_cancel)
            with models.resident_for("conditioning"):
                remix = plan_remix(request.remix, geometry, models.video_vae, models.audio_vae)
        conditioning_s = time.perf_counter() - started
    return PreparedRequest(
        geometry,
        presentation,
        conditions,
        schedule,
        request.seed,
        request.recipe,
        conditioning_s,
        request.cache,
        None if remix is None else remix.held,
        remix,
    )


def _read_and_encode(
    resolved: ResolvedRequest,
    geometry: Geometry,
    models: Models,
    canvas: CanvasRules,
    should_cancel: Callable[[], bool] | None,
) -> tuple[Presentation, EncodedConditions]:
    request = resolved.request
    vae_ratio, patch = models.spatial_factors
    if request.task == "fl2va":
        images = []
        for index in range(len(request.keyframes)):
            check_cancelled(should_cancel)
            images.append(read_keyframe(request, index))
        fitted = fit_keyframes(images, geometry.height, geometry.width)
        presentation = keyframe_presentation(models.tokenizer, models.processor, request.prompt, fitted)
        anchors = [keyframe.position for keyframe in request.keyframes]
        check_cancelled(should_cancel)
        with models.resident_for("conditioning"):
            conditions = encode_keyframes(models.video_vae, fitted, anchors)
        return presentation, conditions
    if request.task == "ref2va":
        references = []
        for index in range(len(request.references)):
            check_cancelled(should_cancel)
            references.append(read_reference(resolved, index, canvas, vae_ratio * patch))
        presentation = reference_presentation(models.tokenizer, models.processor, request.prompt, references)
        check_cancelled(should_cancel)
        with models.resident_for("conditioning"):
            conditions = encode_references(models.video_vae, models.audio_vae, references)
        return presentation, conditions
    return text_presentation(models.tokenizer, request.prompt), EncodedConditions(task="t2va")


# --- text ---------------------------------------------------------------------------------------------------


def encode_presentation(models: Models, presentation: Presentation, device: torch.device) -> torch.Tensor:
    """Text-encoder states [L, hidden] of a presentation; pixel tensors enter in the encoder's dtype, as in the
    reference, so that the vision tower sees the same values at either precision."""
    encoder_dtype = next(models.text_encoder.parameters()).dtype
    vision_inputs = {
        name: value.to(device, encoder_dtype) if name.startswith("pixel_") else value.to(device)
        for name, value in presentation.vision_inputs.items()
    }
    return models.text_encoder.encode(presentation.input_ids.to(device), **vision_inputs)


# --- denoise ------------------------------------------------------------------------------------------------


@dataclass
class DenoisedLatents:
    """A request's generated latents after the last step: normalized, on the compute device."""

    video_latents: torch.Tensor  # [1, C, T, h, w]
    audio_latents: torch.Tensor  # [2, C, A]
    timings: dict[str, float]
    # The step cache's record (`StepCache.record`); None for cache "off".
    step_cache: dict[str, Any] | None = None
    # A remix's plan: its output splices the sources in (`remix_output`); None: not a remix.
    remix: RemixPlan | None = None

    def output(
        self, video: torch.Tensor, audio: torch.Tensor, decode_timings: dict[str, float]
    ) -> GenerationOutput:
        return GenerationOutput(
            video,
            audio,
            self.video_latents[0].float().cpu(),
            self.audio_latents.float().cpu(),
            {**self.timings, **decode_timings},
            self.step_cache,
        )


def denoise_request(
    models: Models,
    prepared: PreparedRequest,
    device: torch.device,
    on_step: Callable[[StepEvent], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> DenoisedLatents:
    """Encode the presentation, pack the condition rows and the seed's noise, and run every step."""
    check_cancelled(should_cancel)
    text_states, text_encode_s = encode_text(models, prepared.presentation, device)
    return denoise_encoded(
        models, prepared, text_states, device, on_step, should_cancel, {"text_encode_s": text_encode_s}
    )


def encode_text(
    models: Models, presentation: Presentation, device: torch.device
) -> tuple[torch.Tensor, float]:
    """The text-encoder states of a presentation and the seconds they took (the split layout's encoder group runs
    this alone)."""
    started = time.perf_counter()
    # A rerun, a take or a new seed of the same prompt and references reads its states back (exact: the same inputs
    # on the same encoder), without the text encoder's phase.
    key = presentation_key(presentation)
    text_states = TEXT_STATES.get(models.text_encoder, key)
    if text_states is not None:
        text_states = text_states.to(device)
    else:
        with models.resident_for("text_encode"):
            text_states = encode_presentation(models, presentation, device)
            _synchronize(device)
        TEXT_STATES.put(models.text_encoder, key, text_states)
    if trace.active() is not None:
        trace.record("processor_tokens", input_ids=presentation.input_ids, **presentation.vision_inputs)
        trace.record("text_states", states=text_states)
    return text_states, time.perf_counter() - started


def denoise_encoded(
    models: Models,
    prepared: PreparedRequest,
    text_states: torch.Tensor,
    device: torch.device,
    on_step: Callable[[StepEvent], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    timings: dict[str, float] | None = None,
) -> DenoisedLatents:
    """Pack the condition rows and the seed's noise around the text states and run every step (`timings`: what the
    earlier phases took, carried into the result)."""
    conditions, geometry = prepared.conditions, prepared.geometry
    timings = {"conditioning_s": prepared.conditioning_s, **(timings or {})}
    layout = conditions.layout(prepared.presentation.row_tags, geometry)
    # The latent channel counts come from the DiT, which every rank holds (the VAEs live on some ranks only); they
    # are the VAEs' latent channels, which is what the DiT's patch projections read.
    noise = draw_initial_noise(
        prepared.seed,
        geometry,
        recipe=prepared.recipe,
        condition_shapes=conditions.visual_shapes,
        video_channels=models.dit.config.video_in_channels,
        audio_channels=models.dit.config.audio_in_channels,
    )
    video_rows, audio_rows = initial_rows(conditions, noise, layout, geometry.patch, device)
    hold = start_hold(prepared.held, noise, video_rows, audio_rows, layout, device)

    preset = cache_preset(prepared.cache)
    step_cache = None if preset is None else StepCache(preset, ReduceGroups(*worker_groups(models.dit)))
    started = time.perf_counter()
    with models.resident_for("denoise"):
        video_rows, audio_rows = denoise(
            models.dit,
            text_states,
            layout_on(layout, device),
            video_rows,
            audio_rows,
            prepared.schedule,
            None if on_step is None else _step_events(on_step, prepared.schedule, video_rows, layout),
            should_cancel,
            step_cache,
            hold,
            timings,
        )
        _synchronize(device)
    timings["denoise_s"] = time.perf_counter() - started
    check_cancelled(should_cancel)

    video_latents, audio_latents = target_latents(video_rows, audio_rows, layout, geometry)
    record = None if step_cache is None else step_cache.record()
    return DenoisedLatents(video_latents, audio_latents, timings, record, prepared.remix)


def _step_events(
    on_step: Callable[[StepEvent], None], schedule: Schedule, video_rows: torch.Tensor, layout: PackedLayout
) -> Callable[[int, float], None]:
    """`denoise`'s report after each step as a `StepEvent` to `on_step`, with the generated rows of `video_rows`
    (which the steps update in place)."""

    def report(step: int, elapsed_s: float) -> None:
        generated = video_rows[layout.num_condition_video_rows :]
        on_step(StepEvent(step=step, total=schedule.num_steps, elapsed_s=elapsed_s, video_rows=generated))

    return report


# --- decode -------------------------------------------------------------------------------------------------


def _frames_from_pixels(video_vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Decoded pixels [1, 3, F, H, W] (the VAE's space) -> frames [F, H, W, 3] in [0, 1], float32."""
    return video_vae.to_unit_range(pixels)[0].permute(1, 2, 3, 0).float()


def decode(
    models: Models,
    video_latents: torch.Tensor,
    audio_latents: torch.Tensor,
    mp4_path: Path | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Normalized latents ([1, C, T, h, w] and [2, C, A]) -> video [F, H, W, 3] in [0, 1], audio [2, N], on the host.

    With `mp4_path`, the MP4 is written while the video decodes: the audio decodes first (it is tiny), then a writer
    thread runs `write_mp4` on a `ProgressiveFrames` that each decoded window extends, so frames are encoded while
    the later windows decode. A failure on either side leaves no file (the writer's own atomic write) and raises:
    the decode's own error, or `Mp4WriteError` (caused by the writer's) when only the writer failed.
    Timings: `audio_decode_s`, `video_decode_s` (including the copies to the host), and with a file `mux_s` (the
    writer's whole run) and `mux_after_decode_s` (what it took after the last window).
    """
    timings = {}
    video_vae = models.video_vae
    with models.resident_for("decode"):
        started = time.perf_counter()
        audio = (
            models.audio_vae.decode_stereo(models.audio_vae.denormalize_latents(audio_latents)).float().cpu()
        )
        timings["audio_decode_s"] = time.perf_counter() - started
        started = time.perf_counter()
        latents = video_vae.denormalize_latents(video_latents)
        if trace.active() is not None:
            trace.record(
                "final_latents", video=latents, audio=models.audio_vae.denormalize_latents(audio_latents)
            )
        video = ProgressiveFrames(*video_vae.decoded_video_shape(latents.shape))
        writer = None if mp4_path is None else _start_mp4_writer(mp4_path, video, audio)
        try:
            for pixels in video_vae.decode_pieces(latents, autocast_dtype=models.video_decode_autocast):
                check_cancelled(should_cancel)
                video.append(_frames_from_pixels(video_vae, pixels))
        except BaseException as error:
            video.fail(error)
            if writer is not None:
                concurrent.futures.wait([writer])  # its partial file is removed before the error goes up
            raise
        decoded = time.perf_counter()
        timings["video_decode_s"] = decoded - started
    if writer is not None:
        try:
            timings["mux_s"] = writer.result()
        except Exception as error:
            raise Mp4WriteError(f"writing {mp4_path.name} failed: {error}") from error
        timings["mux_after_decode_s"] = time.perf_counter() - decoded
    if trace.active() is not None:
        trace.record("decoded_frames", frames=video.frames)
        trace.record("waveform", audio=audio)
    return video.frames, audio, timings


class Mp4WriteError(Exception):
    """The MP4 writer of `decode` failed (its error is the cause); the decoded tensors were fine."""


def _start_mp4_writer(path: Path, video: ProgressiveFrames, audio: torch.Tensor) -> concurrent.futures.Future:
    """`write_mp4(path, video, audio)` on its own thread; the future's result is the seconds it took."""

    def write() -> float:
        started = time.perf_counter()
        write_mp4(path, video, audio)
        return time.perf_counter() - started

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mp4-writer")
    future = executor.submit(write)
    executor.shutdown(wait=False)
    return future


def decode_on_group(
    models: Models,
    video_latents: torch.Tensor,
    audio_latents: torch.Tensor,
    vae_group: GroupMembership,
    mp4_path: Path | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]] | None:
    """`decode` with the video tiles split over a VAE group (h3engine.models.parallel.vae); None on all but VAE rank 0.

    Every member calls it with the same latents. Rank 0 decodes the audio while the others finish their tiles, so
    one timing, `decode_s`, covers both. A group of one is plain `decode`, which writes the MP4 at `mp4_path` while
    it decodes and polls `should_cancel` (this rank's own check, no collective) between windows; a larger group
    ignores both (the caller writes the file afterwards; its ranks vote on cancelling before the decode).
    """
    if vae_group.size == 1:
        return decode(models, video_latents, audio_latents, mp4_path, should_cancel)
    started = time.perf_counter()
    with models.resident_for("decode"):
        # Only rank 0 holds the audio VAE; the other ranks never read the audio latents.
        if models.audio_vae is not None:
            audio_latents = models.audio_vae.denormalize_latents(audio_latents)
        decoded = decode_video_and_audio(
            models.video_vae,
            models.audio_vae,
            models.video_vae.denormalize_latents(video_latents),
            audio_latents,
            vae_group,
            models.video_decode_autocast,
        )
        if decoded is None:
            return None
        pixels, waveform = decoded
        video = _frames_from_pixels(models.video_vae, pixels)
        _synchronize(video.device)
    if trace.active() is not None:
        trace.record(
            "final_latents", video=models.video_vae.denormalize_latents(video_latents), audio=audio_latents
        )
        trace.record("decoded_frames", frames=video)
        trace.record("waveform", audio=waveform.float())
    return video.cpu(), waveform.float().cpu(), {"decode_s": time.perf_counter() - started}


# --- mux and the other files --------------------------------------------------------------------------------


def write_outputs(
    staging: StagedOutputs,
    request: GenerationRequest,
    inputs: list[dict[str, Any]],
    output: GenerationOutput,
    geometry: Geometry,
    engine: dict[str, Any],
    mp4_written: bool = False,
) -> None:
    """Fill `staging`'s files: the MP4 (unless `mp4_written`: the decode already wrote it there), the tensors
    when asked for, the sidecar (which names the final video; `inputs` are the request's
    `media.outputs.input_records`, `engine` what the sidecar says about the engine). The caller commits."""
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
    record = sidecar_record(
        request, inputs, engine, geometry, output.timings, staging.final.video.name, output.step_cache
    )
    write_sidecar(staging.files.sidecar, record)


# --- the whole request --------------------------------------------------------------------------------------


def run_generation(
    models: Models,
    prepared: PreparedRequest,
    device: torch.device,
    on_step: Callable[[StepEvent], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    mp4_path: Path | None = None,
) -> GenerationOutput:
    """One prepared request of any task: the presentation and the encoded conditioning decide which one it is.
    With `mp4_path` the MP4 is written there while the video decodes (see `decode`)."""
    latents = denoise_request(models, prepared, device, on_step, should_cancel)
    if prepared.remix is not None:
        return finish_remix(models, prepared.remix, latents, mp4_path, should_cancel)
    decoded = decode(models, latents.video_latents, latents.audio_latents, mp4_path, should_cancel)
    return latents.output(*decoded)


def finish_remix(
    models: Models,
    plan: RemixPlan,
    latents: DenoisedLatents,
    mp4_path: Path | None,
    should_cancel: Callable[[], bool] | None = None,
) -> GenerationOutput:
    """Decode a remix, splice the sources the output keeps (h3engine.engine.conditioning.remix) and write its MP4 at
    `mp4_path`: v2a with the source's video stream copied, unless it asked for the decoded frames."""
    decoded = decode(models, latents.video_latents, latents.audio_latents, None, should_cancel)
    return remix_output(plan, latents.output(*decoded), mp4_path)


def remix_output(plan: RemixPlan, output: GenerationOutput, mp4_path: Path | None) -> GenerationOutput:
    """A decoded remix's output with the sources spliced in, its MP4 written at `mp4_path` (a worker group's VAE
    rank 0 calls this too)."""
    output.video, output.audio = splice_output(plan, output.video, output.audio)
    if mp4_path is not None:
        started = time.perf_counter()
        write_mp4(mp4_path, output.video, output.audio)
        if plan.copy_video_from is not None:
            copy_source_video(plan.copy_video_from, mp4_path, plan.copy_video_frames, FPS)
        output.timings["mux_s"] = time.perf_counter() - started
    return output
