"""The one request checker: `resolve_request` decides whether a request runs on a checkpoint, and what it becomes.

* `resolve_request(request, facts, media)` runs every rule of `h3engine.request.validate` (file facts through
  `media`, a `MediaFacts`: one probe a file) and, given `facts` (h3engine.checkpoint.facts, read from the
  checkpoint's headers), the checkpoint's own: the task served, the canvas multiple, the prompt's tokens, a
  step-distilled DiT's rungs and step count, each LoRA file's fit (headers only). It returns a `ResolvedRequest`
  (warnings, duration, geometry, rungs, the media facts) or raises RequestError naming the field. The CLI, the
  engine front, `Engine` and the HTTP API all call it, so they accept the same requests; without `facts` it runs
  the rules no checkpoint decides (the CLI's first check). The engine adds its memory check on the same facts.
* `request_geometry(request, facts, media)`: the canvas and frame counts of a request that passed.

Imports no torch when loaded: the CLI's first check runs before torch is imported (the checkpoint's rules import
the tokenizer and the LoRA readers on first use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from h3engine.checkpoint.layout import distilled_step_count
from h3engine.errors import RequestError
from h3engine.media import inputs as media_inputs
from h3engine.request.checks import fail
from h3engine.request.files import MediaFacts, Reference
from h3engine.request.geometry import Geometry, canvas_rule, frames_for_duration
from h3engine.request.model import GenerationRequest
from h3engine.request.remix import check_remix
from h3engine.request.validate import check_cache_schedule, resolve_aspect, resolve_duration_seconds, validate

if TYPE_CHECKING:
    from h3engine.checkpoint.facts import CheckpointFacts


@dataclass(frozen=True)
class ResolvedRequest:
    """A request that passed `resolve_request`, with what it resolved to; the pipeline prepares from it."""

    request: GenerationRequest
    warnings: tuple[str, ...]
    # The facts of each input file, probed once; later readers (the geometry, a reference video's canvas, the
    # memory check) ask them instead of the file.
    media: MediaFacts
    # The duration to generate: the request's, or (Ref2VA) that of its one reference carrying audio.
    duration_seconds: float
    # The canvas and frame counts on the checkpoint; None when resolved without checkpoint facts.
    geometry: Geometry | None
    # The rungs it runs (its own or a step-distilled checkpoint's); None: the grid of its steps.
    rungs: tuple[int, ...] | None
    # Its memory shape under the engine's plan (h3engine.memory.shapes.RequestShape; None without a GPU budget).
    memory_shape: Any = None


def new_media_facts() -> MediaFacts:
    """A `MediaFacts` that probes with h3engine.media.inputs.probe_media (looked up now, so tests can replace it)."""
    return MediaFacts(media_inputs.probe_media)


def resolve_request(
    request: GenerationRequest, facts: CheckpointFacts | None, media: MediaFacts | None = None
) -> ResolvedRequest:
    """Decide whether `request` runs on the checkpoint of `facts` and resolve it (see the module docstring); `media`
    carries the facts of files already probed for this request (a new one is made otherwise)."""
    media = new_media_facts() if media is None else media
    if facts is None:
        warnings = validate(request, media, canvas_multiple=1)
        rungs = request.rungs or None
    else:
        from h3engine.engine.conditioning.presentation import (
            prompt_token_counter,  # the tokenizer (imports torch)
        )

        counter = None if facts.tokenizer is None else prompt_token_counter(facts.tokenizer)
        warnings = validate(
            request, media, canvas_multiple=facts.canvas_multiple, count_prompt_tokens=counter
        )
        rungs = _check_checkpoint_rules(request, facts)
    duration = resolve_duration_seconds(request, media)
    if request.remix is not None:
        duration = check_remix(request.remix, request.task, duration, media)[0]
    geometry = None if facts is None else request_geometry(request, facts, media)
    return ResolvedRequest(request, tuple(warnings), media, duration, geometry, rungs)


def _check_checkpoint_rules(request: GenerationRequest, facts: CheckpointFacts) -> tuple[int, ...] | None:
    """What the checkpoint decides about a request `validate` passed: its task, rungs, steps and LoRA files."""
    if request.task not in facts.tasks:
        fail("task", f"this checkpoint cannot serve '{request.task}' (it serves {', '.join(facts.tasks)})")
    rungs = effective_rungs(request.rungs, facts.dmd_steps.get(request.task))
    check_distilled_steps(request.steps, request.recipe, rungs)
    check_cache_schedule(request.cache, rungs is not None)
    if request.loras and request.task in facts.lora_targets:
        from h3engine.engine.lora.adapters import (  # the LoRA readers (import torch)
            LoraHeaders,
            request_adapters,
        )

        target, config = facts.lora_targets[request.task]
        request_adapters(request, target, config, LoraHeaders())  # headers only: each file's fit and targets
    return rungs


def effective_rungs(
    request_rungs: Sequence[int], checkpoint_rungs: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """The rungs a request runs: its own (a Turbo adapter's), else a step-distilled checkpoint's, else None (the
    grid of its step count). A step-distilled checkpoint runs only its own rungs (RequestError naming `rungs`)."""
    if not request_rungs:
        return checkpoint_rungs
    if checkpoint_rungs is not None and tuple(request_rungs) != checkpoint_rungs:
        fail(
            "rungs",
            f"this checkpoint is step-distilled to the rungs {', '.join(map(str, checkpoint_rungs))}, got "
            f"{', '.join(map(str, request_rungs))} (leave rungs empty to run the checkpoint's)",
        )
    return tuple(request_rungs)


def check_distilled_steps(steps: int, recipe: str, rungs: tuple[int, ...] | None) -> None:
    """RequestError (field `steps`) unless `steps` runs exactly the distilled `rungs` (None: any count)."""
    if rungs is None:
        return
    expected = distilled_step_count(rungs, recipe)
    if steps != expected:
        counted = (
            ""
            if expected == len(rungs)
            else f"; the diffusers recipe counts grid points, so ask for {expected}"
        )
        fail(
            "steps",
            f"this checkpoint is step-distilled to {len(rungs)} steps (rungs {', '.join(map(str, rungs))}), got "
            f"{steps}{counted}",
        )


def request_geometry(request: GenerationRequest, facts: CheckpointFacts, media: MediaFacts) -> Geometry:
    """The canvas and frame counts of a request that passed `validate`, on the checkpoint of `facts`: an explicit
    width x height, else its aspect (FL2VA "auto": the first listed keyframe's upright size, from `media`) under
    the checkpoint's canvas rule at the request's short edge (None: the rule's own)."""
    seconds = resolve_duration_seconds(request, media)
    source_size = None
    if request.remix is not None:
        seconds = check_remix(request.remix, request.task, seconds, media)[0]
        source_size = remix_source_size(request, media)
    factors = {"vae_spatial_ratio": facts.vae_spatial_ratio, "patch": facts.patch}
    if request.width is not None and request.height is not None:
        return Geometry.from_canvas(request.height, request.width, frames_for_duration(seconds), **factors)
    first_keyframe_size = None
    if request.task == "fl2va" and request.keyframes:
        try:
            info = media(request.keyframes[0])
        except RequestError as error:
            raise error.in_field("keyframes[0]") from None
        first_keyframe_size = (info.width, info.height)
    short_edge, max_pixels = canvas_rule(request.short_edge, facts.canvas.short_edge, facts.canvas.max_pixels)
    aspect = source_size or resolve_aspect(request, first_keyframe_size)
    return Geometry.for_request(aspect, seconds, short_edge=short_edge, max_pixels=max_pixels, **factors)


def remix_source_size(request: GenerationRequest, media: MediaFacts) -> tuple[int, int] | None:
    """A remix with a source video and aspect "auto" takes the source's upright (width, height)."""
    remix = request.remix
    if remix.source_video is None or request.aspect_ratio != "auto":
        return None
    info = media(Reference(kind="video", path=remix.source_video))
    if not 1 / 4 <= info.width / info.height <= 4:
        fail(
            "remix.source_video",
            f"its {info.width}x{info.height} frames are outside 1:4 to 4:1 (give aspect_ratio)",
        )
    return info.width, info.height
