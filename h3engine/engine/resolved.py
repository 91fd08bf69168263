"""The one request checker: `resolve_request` decides whether a request runs on a checkpoint, and what it becomes.

* `resolve_request(request, facts, media)` runs every rule of `h3engine.request.validate` (file facts through
  `media`, a `MediaFacts`: one probe a file) and, given `facts` (h3engine.checkpoint.facts, read from the
  checkpoint's headers), the checkpoint's own: the task served, the canvas multiple, the prompt's tokens, a
  step-distilled DiT's rungs and step count, each LoRA file's fit (headers only), and with the engine's memory plan
  in the facts, the memory check. It fills in the defaults (`steps`) and returns a `ResolvedRequest` or raises
  RequestError naming the field. Every door (page, HTTP API, CLI, `Engine`) resolves once and the result travels
  with the job; the engine adds only the memory check, when the front knew no plan.

Imports no torch when loaded: the CLI's first check runs before torch is imported (the checkpoint's rules import
the tokenizer and the LoRA readers on first use).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from h3engine.checkpoint.layout import distilled_step_count
from h3engine.errors import RequestError
from h3engine.media import inputs as media_inputs
from h3engine.request.checks import check_integer_range, fail
from h3engine.request.file_rules import resolve_aspect, resolve_duration_seconds
from h3engine.request.files import MediaFacts, Reference
from h3engine.request.geometry import Geometry, canvas_rule, frames_for_duration
from h3engine.request.limits import DEFAULT_STEPS
from h3engine.request.model import MAX_SEED, GenerationRequest
from h3engine.request.validate import check_cache_schedule, check_steps_for_rungs, checked_request

if TYPE_CHECKING:
    from h3engine.checkpoint.facts import CheckpointFacts


@dataclass(frozen=True)
class ResolvedRequest:
    """A request that passed `resolve_request`, with what it resolved to; the pipeline prepares from it, and it
    travels with its job to the engine (in process, to a worker group's ranks, or a split stage's)."""

    # The request with its defaults filled in (`steps`); what the job runs and its records show.
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
    # Its memory shape under the engine's plan (h3engine.memory.shapes.RequestShape; None: not checked, or no GPU
    # budget to check against).
    memory_shape: Any = None
    # The prompt's tokens under the checkpoint's tokenizer (None: not counted).
    prompt_tokens: int | None = None

    def with_seed(self, seed: int) -> ResolvedRequest:
        """The same request at another seed (the takes of one press): the seed decides nothing else."""
        check_integer_range(seed, "seed", 0, MAX_SEED)
        return replace(self, request=replace(self.request, seed=seed))

    def with_files_at(self, place: Callable[[str], str]) -> ResolvedRequest:
        """The same request naming each input file where `place` put it (a copy of the same bytes), its files'
        facts moved along, so that nothing is probed again."""
        request = self.request
        paths = {entry.path for entry in (*request.keyframes, *request.references)}
        placed = {path: place(path) for path in sorted(paths)}
        moved = replace(
            request,
            keyframes=tuple(replace(keyframe, path=placed[keyframe.path]) for keyframe in request.keyframes),
            references=tuple(
                replace(reference, path=placed[reference.path]) for reference in request.references
            ),
        )
        return replace(self, request=moved, media=self.media.moved(lambda path: placed.get(path, path)))


def new_media_facts() -> MediaFacts:
    """A `MediaFacts` that probes with h3engine.media.inputs.probe_media (looked up now, so tests can replace it)."""
    return MediaFacts(media_inputs.probe_media)


def resolve_request(
    request: GenerationRequest, facts: CheckpointFacts | None, media: MediaFacts | None = None
) -> ResolvedRequest:
    """Decide whether `request` runs on the checkpoint of `facts` and resolve it (see the module docstring); `media`
    carries the facts of files already probed for this request (a new one is made otherwise)."""
    media = new_media_facts() if media is None else media
    tokens = None
    if facts is None:
        checked = checked_request(request, media, canvas_multiple=1)
        rungs = request.rungs or None
    else:
        counter = None
        if facts.tokenizer is not None:
            from h3engine.engine.conditioning.presentation import prompt_token_counter  # imports torch

            counter = _CountingTokens(prompt_token_counter(facts.tokenizer))
        checked = checked_request(
            request, media, canvas_multiple=facts.canvas_multiple, count_prompt_tokens=counter
        )
        tokens = None if counter is None else counter.last
        rungs = _check_checkpoint_rules(request, facts)
    request = replace(request, steps=_steps(request, rungs))
    duration = checked.remix_seconds
    if duration is None:
        duration = resolve_duration_seconds(request, media)
    geometry = None if facts is None else request_geometry(request, facts, media, duration, checked.aspect)
    resolved = ResolvedRequest(
        request, tuple(checked.warnings), media, duration, geometry, rungs, None, tokens
    )
    if facts is not None and facts.memory_plan is not None:
        resolved = with_memory_check(resolved, facts.memory_plan)
    return resolved


def with_memory_check(resolved: ResolvedRequest, plan: Any) -> ResolvedRequest:
    """`resolved` with its memory shape under `plan` (an h3engine.memory MemoryPlan), or RequestError naming the
    field to change when it does not fit even with the fewest DiT layers resident. Resolved on a checkpoint."""
    if plan.sizes is None or plan.budget.gpu_bytes is None:
        return resolved  # nothing to check against (the CPU, or no planner sizes)
    from h3engine.memory.engine_plan import check_request_memory  # imports torch

    geometry = resolved.geometry
    assert geometry is not None, "resolve on the checkpoint first"
    tokens = resolved.prompt_tokens
    if tokens is None:  # a checkpoint without a tokenizer: a token is at least one byte of the prompt
        tokens = len(resolved.request.prompt.encode("utf-8"))
    shape = check_request_memory(
        plan,
        resolved.request,
        (geometry.height, geometry.width),
        tokens,
        resolved.media,
        duration_seconds=resolved.duration_seconds,
    )
    return replace(resolved, memory_shape=shape)


class _CountingTokens:
    """A prompt token counter that remembers its last count (the bound's check counts once; the memory check
    reuses that count)."""

    def __init__(self, count: Callable[[str], int]) -> None:
        self._count = count
        self.last: int | None = None

    def __call__(self, prompt: str) -> int:
        self.last = self._count(prompt)
        return self.last


def _steps(request: GenerationRequest, rungs: tuple[int, ...] | None) -> int:
    """The steps a request runs: its own, else its rungs' count (one forward a rung), else DEFAULT_STEPS."""
    if request.steps is not None:
        return request.steps
    return DEFAULT_STEPS if rungs is None else distilled_step_count(rungs, request.recipe)


def _check_checkpoint_rules(request: GenerationRequest, facts: CheckpointFacts) -> tuple[int, ...] | None:
    """What the checkpoint decides about a request `validate` passed: its task, rungs, steps and LoRA files."""
    if request.task not in facts.tasks:
        fail("task", f"this checkpoint cannot serve '{request.task}' (it serves {', '.join(facts.tasks)})")
    rungs = effective_rungs(request.rungs, facts.dmd_steps.get(request.task))
    if rungs is not None and request.steps is not None and not request.rungs:
        check_steps_for_rungs(request.steps, request.recipe, rungs, "this checkpoint is step-distilled to")
    check_cache_schedule(request.cache, rungs is not None)
    if request.loras and request.task in facts.lora_targets:
        from h3engine.engine.lora.adapters import (  # the LoRA readers (import torch)
            LoraHeaders,
            request_adapters,
        )
        from h3engine.engine.sampling.pdd import check_pdd_request

        target, config = facts.lora_targets[request.task]
        adapters = request_adapters(request, target, config, LoraHeaders())  # headers only: fit and targets
        # A PDD adapter's recipe: its strength, shifts, steps on its grid, no rungs or cache.
        check_pdd_request(request, _steps(request, rungs), rungs, [(a.lora, a.strength) for a, _ in adapters])
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


def request_geometry(
    request: GenerationRequest,
    facts: CheckpointFacts,
    media: MediaFacts,
    seconds: float | None = None,
    aspect: tuple[float, float] | None = None,
) -> Geometry:
    """The canvas and frame counts of a request that passed `validate`, `seconds` long (None: its own duration, or
    its reference's), on the checkpoint of
    `facts`: an explicit width x height, else its aspect (`aspect` when `validate` worked it out; FL2VA "auto": the
    first listed keyframe's upright size, from `media`) under the checkpoint's canvas rule at the request's short
    edge (None: the rule's own); a remix with a source video and aspect "auto" takes the source's."""
    factors = {"vae_spatial_ratio": facts.vae_spatial_ratio, "patch": facts.patch}
    if seconds is None:
        seconds = resolve_duration_seconds(request, media)
    if request.width is not None and request.height is not None:
        return Geometry.from_canvas(request.height, request.width, frames_for_duration(seconds), **factors)
    source_size = None if request.remix is None else remix_source_size(request, media)
    if source_size is None and aspect is None:
        first_keyframe_size = None
        if request.task == "fl2va" and request.keyframes:
            try:
                info = media(request.keyframes[0])
            except RequestError as error:
                raise error.in_field("keyframes[0]") from None
            first_keyframe_size = (info.width, info.height)
        aspect = resolve_aspect(request, first_keyframe_size)
    short_edge, max_pixels = canvas_rule(request.short_edge, facts.canvas.short_edge, facts.canvas.max_pixels)
    return Geometry.for_request(
        source_size or aspect, seconds, short_edge=short_edge, max_pixels=max_pixels, **factors
    )


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
