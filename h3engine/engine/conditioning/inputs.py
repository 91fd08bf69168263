"""A request's input files on the model's canvases and rates: its normalized references and keyframe images.

Contract:
* `read_reference(resolved, index, canvas, multiple)` reads one Ref2VA reference of a resolved request
  (h3engine.engine.resolved) and normalizes it with h3engine.engine.conditioning; a video's canvas follows its probed
  size (the resolved media facts: no second probe). RequestError naming `references[index]`.
* `read_keyframe(request, index)` reads one keyframe image (RequestError naming `keyframes[index]`).
"""

from __future__ import annotations

import torch
from PIL import Image

from h3engine.checkpoint.layout import CanvasRules
from h3engine.engine.conditioning.encode import (
    NormalizedReference,
    normalize_reference_audio,
    normalize_reference_image,
    normalize_reference_video,
)
from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.media import inputs as media_inputs
from h3engine.request.geometry import AUDIO_SAMPLE_RATE, FPS, canvas_rule, resolve_canvas
from h3engine.request.model import GenerationRequest


def read_keyframe(request: GenerationRequest, index: int) -> Image.Image:
    """Keyframe `index` of a request as an upright RGB image (RequestError naming `keyframes[index]`)."""
    try:
        return media_inputs.load_image(request.keyframes[index].path)
    except RequestError as error:
        raise error.in_field(f"keyframes[{index}]") from None


def read_reference(
    resolved: ResolvedRequest, index: int, canvas: CanvasRules, multiple: int
) -> NormalizedReference:
    """Reference `index` of a resolved request, read and put on the model's rates and canvases (see conditioning);
    `multiple` is the canvas multiple (VAE spatial ratio x DiT patch).

    Audio (a clip, or a video's soundtrack) is read at its own rate and resampled here, with the reference's
    resampler, not with the loader's; a video is decoded straight onto its own canvas (per-frame LANCZOS after
    the 24 fps frame holding, as the reference resizes).
    """
    request, geometry = resolved.request, resolved.geometry
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
        info = resolved.media(reference)
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
        raise error.in_field(field) from None
    except ValueError as error:
        raise RequestError(field, str(error), reference.path) from None


def _reference_audio(source: media_inputs.SourceAudio, max_seconds: float) -> torch.Tensor:
    """A decoded source-rate waveform -> stereo float32 at the audio VAE's rate."""
    samples = torch.from_numpy(source.samples)
    return normalize_reference_audio(samples, source.sample_rate, AUDIO_SAMPLE_RATE, max_seconds)
