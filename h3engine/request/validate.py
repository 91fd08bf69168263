"""Whether MiniMax H3 can do what a request asks: `validate` and the request's rules.

* `GenerationRequest` is a frozen, plain-Python description of one generation (no torch, no numpy); payloads are
  read into it by h3engine.request.shapes.from_dict, which does not judge values.
* `validate` judges values: it raises `RequestError` naming the offending field (`duration_seconds`: "must be
  within [4, 15] s, got 3") and returns warnings for requests that leave the verified configuration. Rules on the
  media files (durations, soundtracks, image sizes) use the caller's probe through `MediaFacts` (one probe a file);
  without one they are skipped. The checkpoint's rules are h3engine.engine.resolved's, which calls this.
* Every number and text has an upper bound from the model's limits (the constants below say why), the prompt in
  characters here and in tokens with the checkpoint's tokenizer (`check_prompt_tokens`). Texts must be UTF-8.

Danger: every later stage trusts a validated request. A value that slips through (a NaN duration, a 2**70 step
count) turns into a crash or a hang deep inside a worker instead of a readable message, so `validate` checks types
as well as ranges and must only ever raise `RequestError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from h3engine.checkpoint.layout import TASKS, distilled_step_count, valid_dmd_steps
from h3engine.request.checks import (
    check_finite_number,
    check_integer_range,
    check_local_path,
    check_utf8,
    describe,
    fail,
)
from h3engine.request.file_rules import (
    _aspect_follows_keyframe,
    _check_prompt_labels,
    _check_reference_media,
    _checked_keyframe_sizes,
    check_duration_range,
    resolve_aspect,
)
from h3engine.request.files import Keyframe, MediaFacts, MediaProbe, Reference
from h3engine.request.geometry import (
    PRESET_ASPECT_RATIOS,
)
from h3engine.request.limits import (
    MAX_CLIP_SECONDS,
    MAX_PROMPT_TOKENS,
    MAX_REFERENCES,
    MAX_REFERENCES_OF_KIND,
    MAX_SHORT_EDGE,
)
from h3engine.request.model import (
    CACHE_PRESETS,
    KEYFRAME_POSITIONS,
    LORA_TARGET_OF_TASK,
    LORA_TARGETS,
    MAX_CANVAS_PIXELS,
    MAX_CANVAS_SIDE,
    MAX_FLOW_SHIFT,
    MAX_LORA_STRENGTH,
    MAX_LORAS,
    MAX_PROMPT_CHARACTERS,
    MAX_SEED,
    MAX_STEPS,
    MIN_FLOW_SHIFT,
    RECIPES,
    REFERENCE_KINDS,
    RELEASED_CANVAS_MULTIPLE,
    RESERVED_PROMPT_TOKENS,
    VERIFIED_SHORT_EDGE,
    EntryT,
    GenerationRequest,
    LoraChoice,
)
from h3engine.request.remix import check_remix

_LABEL_PATTERN = re.compile(r"<(?:Picture|Video|Audio) \d+>")


@dataclass(frozen=True)
class Checked:
    """What `checked_request` found on the way, so that nothing is worked out twice."""

    warnings: list[str]
    # The seconds a remix generates (None: no remix, or its files unread).
    remix_seconds: float | None = None
    # The canvas's (width, height) aspect (None: not resolved, FL2VA "auto" without its keyframe read).
    aspect: tuple[float, float] | None = None


def validate(
    request: GenerationRequest,
    media_durations: MediaProbe | None = None,
    *,
    canvas_multiple: int = RELEASED_CANVAS_MULTIPLE,
    count_prompt_tokens: Callable[[str], int] | None = None,
) -> list[str]:
    """`checked_request`'s warnings."""
    return checked_request(
        request, media_durations, canvas_multiple=canvas_multiple, count_prompt_tokens=count_prompt_tokens
    ).warnings


def checked_request(
    request: GenerationRequest,
    media_durations: MediaProbe | None = None,
    *,
    canvas_multiple: int = RELEASED_CANVAS_MULTIPLE,
    count_prompt_tokens: Callable[[str], int] | None = None,
) -> Checked:
    """Check `request` against the task rules; return warnings, raise `RequestError` naming the field.

    `media_durations` probes a reference (keyframes are probed as image references; a plain probe is wrapped in a
    `MediaFacts`, which probes each file once) for the rules that need file facts, among them the prompt's labels
    (a `<Picture N>`, `<Video N>` or `<Audio N>` no input defines is refused: whether a video defines an
    `<Audio j>` depends on its soundtrack); without it those rules are skipped, and FL2VA's aspect "auto" stays
    unresolved until the keyframe is read. `canvas_multiple` is what an explicit width/height must be a multiple of
    (32 for the released checkpoint, smaller for tiny test checkpoints). `count_prompt_tokens` (the checkpoint's
    tokenizer, e.g. `h3engine.engine.conditioning.presentation.prompt_token_counter`) adds the token bound, checked before any file is
    probed; without it only the character bound applies.
    """
    if not isinstance(request, GenerationRequest):
        fail("request", f"must be a GenerationRequest, got {describe(request)}")
    _check_scalars(request)
    if count_prompt_tokens is not None:
        check_prompt_tokens(request.prompt, count_prompt_tokens)
    warnings = _check_canvas(request, canvas_multiple)
    keyframes = _checked_keyframes(request.keyframes)
    references = _checked_references(request.references)
    _check_conditions_for_task(request.task, keyframes, references)
    _check_duration_field(request.task, request.duration_seconds, references)
    _check_loras(request.task, request.loras)
    first_keyframe_size = remix_seconds = aspect = None
    if request.remix is not None:
        probe = None if media_durations is None else MediaFacts.of(media_durations)
        seconds, remix_warnings = check_remix(request.remix, request.task, request.duration_seconds, probe)
        warnings += remix_warnings
        remix_seconds = None if probe is None else seconds
    if media_durations is not None:
        probe = MediaFacts.of(media_durations)
        _check_reference_media(request, probe)
        first_keyframe_size = _checked_keyframe_sizes(request, probe)
        _check_prompt_labels(request, probe)
    if first_keyframe_size is not None or not _aspect_follows_keyframe(request):
        aspect = resolve_aspect(request, first_keyframe_size)
    return Checked(warnings, remix_seconds, aspect)


def _check_scalars(request: GenerationRequest) -> None:
    if not isinstance(request.task, str) or request.task not in TASKS:
        fail("task", f"must be one of {', '.join(TASKS)}, got {describe(request.task)}")
    if not isinstance(request.prompt, str) or not request.prompt.strip():
        fail("prompt", f"must be a non-empty string, got {describe(request.prompt)}")
    _check_prompt_characters(request.prompt)
    for token in RESERVED_PROMPT_TOKENS:
        if token in request.prompt:
            fail(
                "prompt",
                f"must not contain the reserved token {token}: the engine places vision blocks itself",
            )
    if not isinstance(request.recipe, str) or request.recipe not in RECIPES:
        fail("recipe", f"must be one of {', '.join(RECIPES)}, got {describe(request.recipe)}")
    check_integer_range(request.seed, "seed", 0, MAX_SEED)
    # The diffusers scheduler spends N grid points on N-1 forwards, so one step would generate nothing.
    minimum_steps = 2 if request.recipe == "diffusers" else 1
    if request.steps is not None:  # None: filled in when the request is resolved (h3engine.engine.resolved)
        check_integer_range(request.steps, "steps", minimum_steps, MAX_STEPS)
    _check_rungs(request)
    _check_cache(request.cache, bool(request.rungs))
    for field in ("flow_shift", "audio_flow_shift"):
        value = getattr(request, field)
        check_finite_number(value, field)
        if value <= 0:
            fail(field, f"must be positive, got {describe(value)}")
        if not MIN_FLOW_SHIFT <= value <= MAX_FLOW_SHIFT:
            fail(
                field,
                f"must be within [{MIN_FLOW_SHIFT:g}, {MAX_FLOW_SHIFT:g}] (released: 12 video, 3 audio), "
                f"got {describe(value)}",
            )


def _check_rungs(request: GenerationRequest) -> None:
    rungs = request.rungs
    if not isinstance(rungs, tuple) or not rungs:
        if rungs != ():
            fail("rungs", f"must be a list of timesteps such as [999, 750, 500, 250], got {describe(rungs)}")
        return
    if not valid_dmd_steps(list(rungs)):
        fail("rungs", f"must be strictly decreasing integers in (0, 1000], got {describe(list(rungs))}")
    if request.steps is not None:
        check_steps_for_rungs(request.steps, request.recipe, rungs, "its rungs run")


def check_steps_for_rungs(steps: Any, recipe: str, rungs: tuple[int, ...], subject: str) -> None:
    """RequestError (field `steps`) unless `steps` runs exactly `rungs`: one forward a rung, and the diffusers recipe
    counts the terminal grid point too. `subject` starts the sentence ("its rungs run", or "this checkpoint is
    step-distilled to")."""
    expected = distilled_step_count(rungs, recipe)
    if steps != expected:
        counted = (
            "" if expected == len(rungs) else "; the diffusers recipe counts the terminal grid point too"
        )
        fail(
            "steps",
            f"{subject} {expected} steps (rungs {', '.join(map(str, rungs))}{counted}), got {describe(steps)}",
        )


def _check_cache(cache: Any, distilled: bool) -> None:
    if not isinstance(cache, str) or cache not in CACHE_PRESETS:
        fail("cache", f"must be one of {', '.join(CACHE_PRESETS)}, got {describe(cache)}")
    check_cache_schedule(cache, distilled)


def check_cache_schedule(cache: str, distilled: bool) -> None:
    """Refuse a step cache on a step-distilled schedule (a Turbo adapter's rungs, a distilled checkpoint's)."""
    if cache != "off" and distilled:
        fail(
            "cache",
            f"'{cache}' is for full-step runs; a step-distilled schedule (rungs) changes too much between its few "
            "forwards to reuse one, so use cache 'off' with Turbo or a step-distilled checkpoint",
        )


def check_prompt_tokens(prompt: str, count_prompt_tokens: Callable[[str], int]) -> None:
    """Refuse a prompt longer than MAX_PROMPT_TOKENS tokens as `count_prompt_tokens` (the checkpoint's tokenizer,
    no special tokens added) counts them; the character bound is checked first, so the count stays cheap."""
    _check_prompt_characters(prompt)
    tokens = count_prompt_tokens(prompt)
    if tokens > MAX_PROMPT_TOKENS:
        fail(
            "prompt",
            f"must be at most {MAX_PROMPT_TOKENS:,} tokens of the checkpoint's tokenizer, got {tokens:,}; "
            "shorten it",
        )


def _check_prompt_characters(prompt: str) -> None:
    if len(prompt) > MAX_PROMPT_CHARACTERS:
        fail("prompt", f"must be at most {MAX_PROMPT_CHARACTERS:,} characters, got {len(prompt):,}")
    check_utf8(prompt, "prompt")


def _check_canvas(request: GenerationRequest, canvas_multiple: int) -> list[str]:
    if request.short_edge is not None:
        check_integer_range(request.short_edge, "short_edge", 1, MAX_SHORT_EDGE)
    if not isinstance(request.aspect_ratio, str) or (
        request.aspect_ratio != "auto" and request.aspect_ratio not in PRESET_ASPECT_RATIOS
    ):
        fail(
            "aspect_ratio",
            f"must be 'auto' or one of {', '.join(PRESET_ASPECT_RATIOS)}, got {describe(request.aspect_ratio)}",
        )
    if request.width is None and request.height is None:
        if request.short_edge not in (None, VERIFIED_SHORT_EDGE):
            return [
                f"short_edge: {request.short_edge} is outside the verified configuration ({VERIFIED_SHORT_EDGE})"
            ]
        return []
    if request.width is None or request.height is None:
        fail(
            "width" if request.width is None else "height",
            "width and height go together; give both or neither",
        )
    for field in ("width", "height"):
        value = getattr(request, field)
        check_integer_range(value, field, canvas_multiple, MAX_CANVAS_SIDE)
        if value % canvas_multiple:
            fail(field, f"must be a multiple of {canvas_multiple}, got {value}")
    if request.width * request.height > MAX_CANVAS_PIXELS:
        fail(
            "width, height",
            f"the canvas may have at most {MAX_CANVAS_PIXELS:,} pixels (2048x3584, the area cap at the largest "
            f"short edge), got {request.width}x{request.height} = {request.width * request.height:,}",
        )
    if request.aspect_ratio != "auto":
        fail(
            "aspect_ratio",
            f"must be 'auto' when width and height are given, got {describe(request.aspect_ratio)}",
        )
    return [
        f"width, height: the explicit {request.width}x{request.height} canvas replaces aspect_ratio and "
        f"short_edge and is outside the verified configuration ({VERIFIED_SHORT_EDGE} short edge)"
    ]


def _typed_entries(entries: Any, field: str, entry_type: type[EntryT]) -> Iterator[tuple[str, EntryT]]:
    """(field name, entry) of each entry of a tuple or list, in order, each checked to be an `entry_type`."""
    if not isinstance(entries, tuple | list):
        fail(field, f"must be a tuple of {entry_type.__name__}, got {describe(entries)}")
    for index, entry in enumerate(entries):
        if not isinstance(entry, entry_type):
            fail(f"{field}[{index}]", f"must be a {entry_type.__name__}, got {describe(entry)}")
        yield f"{field}[{index}]", entry


def _checked_keyframes(keyframes: Any) -> tuple[Keyframe, ...]:
    for field, keyframe in _typed_entries(keyframes, "keyframes", Keyframe):
        check_local_path(keyframe.path, f"{field}.path")
        if not isinstance(keyframe.position, str) or keyframe.position not in KEYFRAME_POSITIONS:
            fail(f"{field}.position", f"must be 'first' or 'last', got {describe(keyframe.position)}")
    return tuple(keyframes)


def _checked_references(references: Any) -> tuple[Reference, ...]:
    for field, reference in _typed_entries(references, "references", Reference):
        if not isinstance(reference.kind, str) or reference.kind not in REFERENCE_KINDS:
            fail(
                f"{field}.kind",
                f"must be one of {', '.join(REFERENCE_KINDS)}, got {describe(reference.kind)}",
            )
        check_local_path(reference.path, f"{field}.path")
        if reference.start_seconds is not None:
            if reference.kind != "video":
                fail(f"{field}.start_seconds", f"is only allowed for video references, not {reference.kind}")
            check_finite_number(reference.start_seconds, f"{field}.start_seconds")
            if reference.start_seconds < 0:
                fail(f"{field}.start_seconds", f"must be >= 0, got {describe(reference.start_seconds)}")
            if reference.start_seconds >= MAX_CLIP_SECONDS:
                fail(
                    f"{field}.start_seconds",
                    f"must be less than {MAX_CLIP_SECONDS:g} s (a reference clip lasts at most "
                    f"{MAX_CLIP_SECONDS:g} s), got {describe(reference.start_seconds)}",
                )
    return tuple(references)


def _check_loras(task: str, loras: Any) -> None:
    """Each LoRA's path names a file, its strength is within the bound and its target serves `task`; what the
    file holds is checked against the checkpoint by the engine (h3engine.engine)."""
    entries = list(_typed_entries(loras, "loras", LoraChoice))
    if len(entries) > MAX_LORAS:
        fail("loras", f"at most {MAX_LORAS} adapters per request, got {len(entries)}")
    for field, lora in entries:
        check_local_path(lora.path, f"{field}.path")
        if not os.path.isfile(lora.path):
            problem = "is a folder, not a .safetensors file" if os.path.isdir(lora.path) else "no such file"
            fail(f"{field}.path", f"{problem}: {os.path.basename(lora.path.rstrip(os.sep))!r}")
        check_finite_number(lora.strength, f"{field}.strength")
        if not -MAX_LORA_STRENGTH <= lora.strength <= MAX_LORA_STRENGTH:
            fail(
                f"{field}.strength",
                f"must be within [{-MAX_LORA_STRENGTH:g}, {MAX_LORA_STRENGTH:g}], got {describe(lora.strength)}",
            )
        if lora.target is not None and (not isinstance(lora.target, str) or lora.target not in LORA_TARGETS):
            fail(
                f"{field}.target",
                f"must be transformer, transformer_ref or null, got {describe(lora.target)}",
            )
        if lora.target is not None and lora.target != LORA_TARGET_OF_TASK[task]:
            fail(
                f"{field}.target",
                f"a {task} request runs the '{LORA_TARGET_OF_TASK[task]}' DiT, this adapter targets '{lora.target}'",
            )


def _check_conditions_for_task(
    task: str, keyframes: tuple[Keyframe, ...], references: tuple[Reference, ...]
) -> None:
    if task == "t2va":
        if keyframes:
            fail("keyframes", f"task 't2va' takes no keyframes (use 'fl2va'), got {len(keyframes)}")
        if references:
            fail("references", f"task 't2va' takes no references (use 'ref2va'), got {len(references)}")
        return
    if task == "fl2va":
        if references:
            fail("references", f"task 'fl2va' takes no references (use 'ref2va'), got {len(references)}")
        if not keyframes:
            fail("keyframes", "task 'fl2va' needs a first and/or a last keyframe, got none")
        _check_keyframe_positions(keyframes)
        return
    if keyframes:
        # SGLang's schema admits them, but no reference implementation we follow lays them out beside
        # references; dropping them silently would generate something the user did not ask for.
        fail(
            "keyframes",
            f"task 'ref2va' takes no keyframes: keyframes beside references are not supported (use 'fl2va' for "
            f"keyframes), got {len(keyframes)}",
        )
    _check_reference_set(references)


def _check_keyframe_positions(keyframes: tuple[Keyframe, ...]) -> None:
    # The released recipe knows these three keyframe layouts only, and anchors the geometry on the first listed.
    positions = tuple(keyframe.position for keyframe in keyframes)
    if positions not in ((), ("first",), ("last",), ("first", "last")):
        fail(
            "keyframes",
            f"must be a first keyframe, a last keyframe, or first then last, got {', '.join(positions)}",
        )


def _check_reference_set(references: tuple[Reference, ...]) -> None:
    if not references:
        fail("references", "task 'ref2va' needs at least one reference (use 't2va' for text only)")
    kinds = [reference.kind for reference in references]
    for kind, limit in MAX_REFERENCES_OF_KIND.items():
        if kinds.count(kind) > limit:
            fail("references", f"at most {limit} {kind} references, got {kinds.count(kind)}")
    if len(kinds) > MAX_REFERENCES:
        fail("references", f"at most {MAX_REFERENCES} references in total, got {len(kinds)}")
    if set(kinds) == {"audio"}:
        fail("references", "an audio reference needs at least one image or video reference next to it")


def _check_duration_field(task: str, duration_seconds: Any, references: tuple[Reference, ...]) -> None:
    if duration_seconds is not None:
        check_finite_number(duration_seconds, "duration_seconds")
        check_duration_range(duration_seconds, "duration_seconds", "")
        return
    if task != "ref2va":
        fail("duration_seconds", f"is required for task {task!r}")
    # Whether a video carries a soundtrack is only known once it is probed (`_check_reference_media`).
    kinds = [reference.kind for reference in references]
    if kinds.count("audio") > 1:
        fail("duration_seconds", "is required when several references carry audio")
    if kinds.count("audio") + kinds.count("video") == 0:
        fail("duration_seconds", "is required, or exactly one reference with audio to take the duration from")
