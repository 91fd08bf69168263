"""A request's input files on the model's canvases and rates: its geometry and its normalized references.

Contract:
* `request_geometry(request, canvas, vae_spatial_ratio, patch)` is the canvas and frame count of a validated
  request on a checkpoint (its canvas rule and spatial factors); it probes the files it needs (an FL2VA "auto"
  aspect's first keyframe, a Ref2VA request's audio reference for its duration), so it is model-free: the app
  shows it before a job is queued, and the engine uses the same function.
* `read_reference(request, index, geometry, canvas, multiple)` reads one Ref2VA reference and normalizes it with
  h3engine.conditioning (RequestError naming `references[index]`).
"""

from __future__ import annotations

import torch

from h3engine.checkpoint.layout import CanvasRules
from h3engine.conditioning import (
    NormalizedReference,
    normalize_reference_audio,
    normalize_reference_image,
    normalize_reference_video,
)
from h3engine.errors import RequestError
from h3engine.geometry import (
    AUDIO_SAMPLE_RATE,
    FPS,
    Geometry,
    canvas_rule,
    frames_for_duration,
    resolve_canvas,
)
from h3engine.media import inputs as media_inputs
from h3engine.request import GenerationRequest, resolve_aspect, resolve_duration_seconds


def request_geometry(
    request: GenerationRequest,
    canvas: CanvasRules,
    vae_spatial_ratio: int,
    patch: int,
    first_keyframe_size: tuple[int, int] | None = None,
) -> Geometry:
    """The canvas and frame counts of a validated request, from the checkpoint's canvas rule and spatial factors.

    FL2VA with aspect "auto" follows its first listed keyframe: pass that image's upright (width, height) if it is
    already loaded, otherwise the file is probed here. A Ref2VA request without a duration takes its audio
    reference's.
    """
    seconds = resolve_duration_seconds(request, media_inputs.probe_media)
    factors = {"vae_spatial_ratio": vae_spatial_ratio, "patch": patch}
    if request.width is not None and request.height is not None:
        return Geometry.from_canvas(request.height, request.width, frames_for_duration(seconds), **factors)
    if first_keyframe_size is None and request.task == "fl2va" and request.aspect_ratio == "auto":
        info = media_inputs.probe_media(request.keyframes[0])
        first_keyframe_size = (info.width, info.height)
    short_edge, max_pixels = canvas_rule(request.short_edge, canvas.short_edge, canvas.max_pixels)
    aspect = resolve_aspect(request, first_keyframe_size)
    return Geometry.for_request(aspect, seconds, short_edge=short_edge, max_pixels=max_pixels, **factors)


def read_reference(
    request: GenerationRequest, index: int, geometry: Geometry, canvas: CanvasRules, multiple: int
) -> NormalizedReference:
    """Reference `index` of a request, read and put on the model's rates and canvases (see conditioning);
    `multiple` is the canvas multiple (VAE spatial ratio x DiT patch).

    Audio (a clip, or a video's soundtrack) is read at its own rate and resampled here, with the reference's
    resampler, not with the loader's; a video is decoded straight onto its own canvas (per-frame LANCZOS after
    the 24 fps frame holding, as the reference resizes).
    """
    reference, field = request.references[index], f"references[{index}]"
    # Clips and soundtracks are cut to the generated (17n+5-snapped) duration.
    max_seconds = geometry.frames / FPS
    start_seconds = reference.start_seconds or 0.0
    try:
        if reference.kind == "image":
            image = normalize_reference_image(
                media_inputs.load_image(reference.path), canvas.reference_image_short_edge, multiple
            )
            return NormalizedReference("image", image=image)
        if reference.kind == "audio":
            source = media_inputs.read_audio_source(reference.path, start_seconds, max_seconds)
            return NormalizedReference("audio", audio=_reference_audio(source, max_seconds))
        info = media_inputs.probe_media(reference)
        short_edge, max_pixels = canvas_rule(request.short_edge, canvas.short_edge, canvas.max_pixels)
        height, width = resolve_canvas(
            info.width, info.height, multiple=multiple, short_edge=short_edge, max_pixels=max_pixels
        )
        clip = media_inputs.load_video(reference.path, start_seconds, max_seconds, resize_to=(width, height))
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


def _reference_audio(source: media_inputs.SourceAudio, max_seconds: float) -> torch.Tensor:
    """A decoded source-rate waveform -> stereo float32 at the audio VAE's rate."""
    samples = torch.from_numpy(source.samples)
    return normalize_reference_audio(samples, source.sample_rate, AUDIO_SAMPLE_RATE, max_seconds)
