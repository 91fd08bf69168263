"""Whether MiniMax H3 can do what a request asks: `validate` and the request's rules.

* `GenerationRequest` is a frozen, plain-Python description of one generation (no torch, no numpy); payloads are
  read into it by h3engine.request.shapes.from_dict, which does not judge values.
* `validate` judges values: it raises `RequestError` naming the offending field (`duration_seconds`: "must be
  within [4, 15] s, got 3") and returns warnings for requests that leave the verified configuration. Rules on the
  media files (durations, soundtracks, image sizes) use the caller's probe through `MediaFacts` (one probe a file);
  without one they are skipped. The checkpoint's rules are h3engine.request.resolved's, which calls this.
* Every number and text has an upper bound from the model's limits (the constants below say why), the prompt in
  characters here and in tokens with the checkpoint's tokenizer (`check_prompt_tokens`). Texts must be UTF-8.

Danger: every later stage trusts a validated request. A value that slips through (a NaN duration, a 2**70 step
count) turns into a crash or a hang deep inside a worker instead of a readable message, so `validate` checks types
as well as ranges and must only ever raise `RequestError`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import Any

from h3engine.checkpoint.layout import distilled_step_count, valid_dmd_steps
from h3engine.errors import RequestError, file_name
from h3engine.request.checks import (
    check_finite_number,
    check_integer_range,
    check_local_path,
    check_utf8,
    describe,
    fail,
    is_integer,
    is_number,
)
from h3engine.request.files import Keyframe, MediaFacts, MediaInfo, MediaProbe, Reference
from h3engine.request.geometry import (
    MAX_ASPECT_RATIO,
    MIN_ASPECT_RATIO,
    PRESET_ASPECT_RATIOS,
    RELEASED_MAX_PIXELS,
    RELEASED_PATCH,
    RELEASED_SHORT_EDGE,
    RELEASED_VAE_SPATIAL_RATIO,
    parse_aspect_ratio,
)
from h3engine.request.limits import (
    MAX_CLIP_SECONDS,
    MAX_DURATION_SECONDS,
    MAX_PROMPT_TOKENS,
    MAX_REFERENCES,
    MAX_REFERENCES_OF_KIND,
    MAX_SHORT_EDGE,
    MAX_TOTAL_AUDIO_SECONDS,
    MAX_TOTAL_VIDEO_SECONDS,
    MIN_CLIP_SECONDS,
    MIN_DURATION_SECONDS,
    TASKS,
)
from h3engine.request.model import EntryT, GenerationRequest, LoraChoice
from h3engine.request.remix import check_remix

KEYFRAME_POSITIONS = ("first", "last")
REFERENCE_KINDS = ("image", "video", "audio")
RECIPES = ("sglang", "diffusers")
# Step-cache presets (h3engine.engine.sampling.step_cache.PRESETS holds the knobs of each but "off"): "off" runs every
# block of every forward; "high" is the peers' conservative MiniMax-H3 setting, "fast" a more aggressive one.
CACHE_PRESETS = ("off", "high", "fast")
# The two DiTs a LoRA can target (diffusers' component names) and the one each task runs.
LORA_TARGETS = ("transformer", "transformer_ref")
LORA_TARGET_OF_TASK = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}
# peft takes any adapter weight; published adapters are used within about [-2, 2] (negative: the concept taken
# away) and far beyond that a low-rank update swamps the base model, so wider values are a typo, not a choice.
MAX_LORA_STRENGTH = 4.0
MAX_LORAS = 8  # each adds a low-rank product to every adapted linear's forward

# The only configuration MiniMax verified; other short edges run but warn.
VERIFIED_SHORT_EDGE = RELEASED_SHORT_EDGE
# Tiny test checkpoints have a smaller VAE factor and pass their own multiple to `validate`.
RELEASED_CANVAS_MULTIPLE = RELEASED_VAE_SPATIAL_RATIO * RELEASED_PATCH
# Aspect "auto" without a keyframe to follow: references never bind the target geometry.
DEFAULT_ASPECT = (16, 9)

# Qwen vision-block tokens: the engine inserts them around keyframe and reference pixels; typed into a prompt
# they would be tagged as video rows and read as an empty vision block.
RESERVED_PROMPT_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MAX_SEED = 2**63 - 1
# The labels a prompt cites its inputs by (`reference_labels`); only these three forms are checked.
_LABEL_PATTERN = re.compile(r"<(?:Picture|Video|Audio) \d+>")
# Not a model limit: a guard so that a mistyped step count or canvas becomes a message, not an hours-long run
# or an allocation failure inside a worker.
MAX_STEPS = 1000
MAX_CANVAS_SIDE = 4096
# The released area cap (768 x 1344) scaled to that short edge the way the canvas rule scales it (2048 x 3584,
# 7,340,032 pixels): no canvas may be larger, explicit width x height included.
MAX_CANVAS_PIXELS = RELEASED_MAX_PIXELS * MAX_SHORT_EDGE**2 // RELEASED_SHORT_EDGE**2
# Sigma shifts (released: 12 video, 3 audio). Within this range every fp32 sigma grid of up to MAX_STEPS steps keeps
# all its points (from ~8,300 on, a 1,000-step grid collapses near sigma 1 and the run fails after loading).
MIN_FLOW_SHIFT = 0.001
MAX_FLOW_SHIFT = 1000.0
# The prompt. The reference pipelines truncate nothing; the official prompts run to ~4,400 characters (~1,000
# tokens). 8,192 tokens keep the text encode short at the released size (Qwen3-VL-32B to layer 50: ~0.4
# PFLOP) and the text rows under a quarter of the 768p / 5 s DiT sequence; 32,768 characters bound the
# tokenizer's own work and, at ~4 characters a token, let English text reach the token bound. The bound counts the
# prompt's own tokens: the labels the engine adds stay under 200 tokens (12 labels, at most 15 s of 2 fps video
# timestamps), and the vision blocks follow from the reference limits (h3engine.request.limits).
MAX_PROMPT_CHARACTERS = 32_768
# Images (keyframes, image references), judged from the probed header before any pixel is decoded. Each side must
# span one 16-pixel patch (the video VAE's spatial factor, Qwen's vision patch); the largest picture the model
# works on is a 4:1 reference normalized to a 2048 short edge, 8192 x 2048, so no side may be longer and no image
# may hold more pixels (16,777,216, also stock Qwen3-VL's image pixel limit). Video frames share the minimum.
MIN_IMAGE_SIDE = 16
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 8192 * 2048


def validate(
    request: GenerationRequest,
    media_durations: MediaProbe | None = None,
    *,
    canvas_multiple: int = RELEASED_CANVAS_MULTIPLE,
    count_prompt_tokens: Callable[[str], int] | None = None,
) -> list[str]:
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
    first_keyframe_size = None
    if request.remix is not None:
        probe = None if media_durations is None else MediaFacts.of(media_durations)
        warnings += check_remix(request.remix, request.task, request.duration_seconds, probe)[1]
    if media_durations is not None:
        probe = MediaFacts.of(media_durations)
        _check_reference_media(request, probe)
        first_keyframe_size = _checked_keyframe_sizes(request, probe)
        _check_prompt_labels(request, probe)
    if first_keyframe_size is not None or not _aspect_follows_keyframe(request):
        resolve_aspect(request, first_keyframe_size)
    return warnings


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
    expected = distilled_step_count(rungs, request.recipe)
    if request.steps != expected:
        counted = (
            "" if expected == len(rungs) else " (the diffusers recipe counts the terminal grid point too)"
        )
        fail("steps", f"{len(rungs)} rungs run {expected} steps{counted}, got {describe(request.steps)}")


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
        _check_duration_range(duration_seconds, "duration_seconds", "")
        return
    if task != "ref2va":
        fail("duration_seconds", f"is required for task {task!r}")
    # Whether a video carries a soundtrack is only known once it is probed (`_check_reference_media`).
    kinds = [reference.kind for reference in references]
    if kinds.count("audio") > 1:
        fail("duration_seconds", "is required when several references carry audio")
    if kinds.count("audio") + kinds.count("video") == 0:
        fail("duration_seconds", "is required, or exactly one reference with audio to take the duration from")


def _check_duration_range(seconds: float, field: str, origin: str) -> None:
    if not MIN_DURATION_SECONDS <= seconds <= MAX_DURATION_SECONDS:
        fail(
            field,
            f"must be within [{MIN_DURATION_SECONDS:g}, {MAX_DURATION_SECONDS:g}] s{origin}, got {describe(seconds)}",
        )


def _probed(probe: MediaProbe, reference: Reference, field: str) -> MediaInfo:
    """The probe's facts; its RequestError (about the file) is filed under `field`."""
    try:
        return probe(reference)
    except RequestError as error:
        raise error.in_field(field) from None


def _check_reference_media(request: GenerationRequest, probe: MediaProbe) -> None:
    """The rules that need file facts: streams, clip lengths and totals, image ratios, derived duration."""
    total_seconds = {"video": 0.0, "audio": 0.0}
    for index, reference in enumerate(request.references):
        field = f"references[{index}]"
        info = _probed(probe, reference, field)
        if reference.kind == "image":
            size = _image_size(info, field, "reference image", reference.path)
            _check_image_ratio(size, field, "reference image")
            continue
        if reference.kind == "video" and not _has_size(info):
            fail(field, f"video file has no video stream: {describe(reference.path)}")
        if reference.kind == "video" and min(info.width, info.height) < MIN_IMAGE_SIDE:
            fail(
                field,
                f"video {file_name(reference.path)} frames are {info.width}x{info.height} pixels; each side must "
                f"be at least {MIN_IMAGE_SIDE}",
            )
        if reference.kind == "audio" and not info.has_audio:
            fail(field, f"audio file has no audio stream: {describe(reference.path)}")
        seconds = _clip_seconds(info, field)
        if not MIN_CLIP_SECONDS <= seconds <= MAX_CLIP_SECONDS:
            fail(
                field,
                f"{reference.kind} clip must last {MIN_CLIP_SECONDS:g}-{MAX_CLIP_SECONDS:g} s, "
                f"got {describe(seconds)} s",
            )
        if reference.start_seconds is not None and reference.start_seconds >= seconds:
            fail(
                f"{field}.start_seconds",
                f"must be less than the clip duration {seconds:g} s, got {describe(reference.start_seconds)}",
            )
        total_seconds[reference.kind] += seconds
    limits = {"video": MAX_TOTAL_VIDEO_SECONDS, "audio": MAX_TOTAL_AUDIO_SECONDS}
    for kind, total in total_seconds.items():
        if total > limits[kind]:
            fail("references", f"{kind} references may last {limits[kind]:g} s in total, got {total:g} s")
    if request.duration_seconds is None:
        seconds = resolve_duration_seconds(request, probe)
        _check_duration_range(seconds, "duration_seconds", " (taken from the reference with audio)")


def reference_labels(kinds: Sequence[str], has_audio: Sequence[bool]) -> list[tuple[str, ...]]:
    """The prompt labels of each Ref2VA reference, in reference order, numbered per modality as the model was
    trained (h3engine.engine.conditioning.presentation.reference_presentation): `<Picture i>` for an image, `<Video k>` for a video,
    `<Audio j>` for an audio clip, and a video carrying audio (`has_audio`) takes an `<Audio j>` before its
    `<Video k>`."""
    counters = {"Picture": 0, "Video": 0, "Audio": 0}

    def next_label(modality: str) -> str:
        counters[modality] += 1
        return f"<{modality} {counters[modality]}>"

    labels = []
    for kind, carries_audio in zip(kinds, has_audio, strict=True):
        if kind == "image":
            labels.append((next_label("Picture"),))
        elif kind == "video":
            audio = (next_label("Audio"),) if carries_audio else ()
            labels.append(audio + (next_label("Video"),))
        else:
            labels.append((next_label("Audio"),))
    return labels


def _defined_labels(request: GenerationRequest, probe: MediaProbe) -> tuple[str, tuple[str, ...]]:
    """What defines the labels of `request`'s task, and those labels in order."""
    if request.task == "fl2va":
        return "the keyframes", tuple(
            f"<Picture {number}>" for number in range(1, len(request.keyframes) + 1)
        )
    if request.task != "ref2va":
        return f"task {request.task!r}", ()
    kinds = [reference.kind for reference in request.references]
    has_audio = [
        kind == "audio" or (kind == "video" and probe(ref).has_audio)
        for kind, ref in zip(kinds, request.references, strict=True)
    ]
    labels = reference_labels(kinds, has_audio)
    return "the references", tuple(label for entry in labels for label in entry)


def _check_prompt_labels(request: GenerationRequest, probe: MediaProbe) -> None:
    """Refuse a prompt citing a `<Picture N>`, `<Video N>` or `<Audio N>` that no input defines (other tags, such
    as `<Subject 1>` or `[Shot 1]`, are free text to the model)."""
    source, defined = _defined_labels(request, probe)
    cited = dict.fromkeys(match.group(0) for match in _LABEL_PATTERN.finditer(request.prompt))
    undefined = [label for label in cited if label not in defined]
    if not undefined:
        return
    defines = f"{source} define {', '.join(defined)}" if defined else f"{source} defines no labels"
    if not defined and request.task == "t2va":
        defines += " (labels cite fl2va keyframes or ref2va references)"
    fail("prompt", f"cites {', '.join(undefined)}, which no input defines: {defines}")


def resolve_duration_seconds(request: GenerationRequest, media_durations: MediaProbe | None) -> float:
    """The duration to generate: the requested one, or (Ref2VA) that of its one reference carrying audio.

    A video's soundtrack counts from the video's `start_seconds`. Expects a request that passed `validate`.
    """
    if request.duration_seconds is not None:
        return request.duration_seconds
    if media_durations is None:
        fail("duration_seconds", "is required when the reference media cannot be probed")
    with_audio = []
    for index, reference in enumerate(request.references):
        if reference.kind != "image" and media_durations(reference).has_audio:
            with_audio.append((index, reference))
    if len(with_audio) != 1:
        fail(
            "duration_seconds",
            f"is required unless exactly one reference carries audio, got {len(with_audio)}",
        )
    index, reference = with_audio[0]
    return _clip_seconds(media_durations(reference), f"references[{index}]") - (
        reference.start_seconds or 0.0
    )


def _checked_keyframe_sizes(request: GenerationRequest, probe: MediaProbe) -> tuple[int, int] | None:
    """Every keyframe must be a readable image; the first listed one's size is returned (it anchors 'auto')."""
    sizes = [
        _image_size(
            _probed(probe, Reference(kind="image", path=keyframe.path), f"keyframes[{index}]"),
            f"keyframes[{index}]",
            "keyframe image",
            keyframe.path,
        )
        for index, keyframe in enumerate(request.keyframes)
    ]
    return sizes[0] if sizes else None


def _has_size(info: MediaInfo) -> bool:
    return is_integer(info.width) and is_integer(info.height) and info.width > 0 and info.height > 0


def _image_size(info: MediaInfo, field: str, what: str, path: str) -> tuple[int, int]:
    if not _has_size(info):
        fail(field, f"{what} has no usable size, got {describe(info.width)}x{describe(info.height)}")
    width, height = info.width, info.height
    size = f"{what} {file_name(path)} is {describe(width)}x{describe(height)} pixels"
    if min(width, height) < MIN_IMAGE_SIDE:
        fail(field, f"{size}; each side must be at least {MIN_IMAGE_SIDE}")
    if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        fail(
            field,
            f"{size}; at most {MAX_IMAGE_SIDE} pixels a side and {MAX_IMAGE_PIXELS:,} pixels in all are read "
            f"(the model's largest picture is 8192x2048): downscale it",
        )
    return width, height


def _check_image_ratio(size: tuple[int, int], field: str, what: str) -> None:
    if not _ratio_is_supported(*size):
        fail(field, f"{what} ratio must be within 1:4 to 4:1, got {size[0]}x{size[1]}")


def _ratio_is_supported(width: float, height: float) -> bool:
    # Exact rational comparison: a probe may report absurd sizes, and int / int overflows a float past 1e308.
    ratio = Fraction(width) / Fraction(height)
    return Fraction(MIN_ASPECT_RATIO) <= ratio <= Fraction(MAX_ASPECT_RATIO)


def _clip_seconds(info: MediaInfo, field: str) -> float:
    seconds = info.duration_seconds
    if not is_number(seconds) or (isinstance(seconds, float) and not math.isfinite(seconds)) or seconds <= 0:
        fail(field, f"clip duration is unknown, got {describe(seconds)}")
    return seconds


def _aspect_follows_keyframe(request: GenerationRequest) -> bool:
    return request.task == "fl2va" and request.aspect_ratio == "auto" and request.width is None


def resolve_aspect(
    request: GenerationRequest, first_keyframe_size: tuple[int, int] | None
) -> tuple[float, float]:
    """The (width, height) aspect of the canvas, checked to lie within 1:4..4:1; pass it to the canvas resolver.

    An explicit width/height wins; "auto" is 16:9 for T2VA and Ref2VA (references never bind the geometry) and
    the first listed keyframe's own (width, height) for FL2VA. Expects a request that passed `validate`.
    """
    follows = ""
    if request.width is not None and request.height is not None:
        aspect, field = (request.width, request.height), "width, height"
    elif request.aspect_ratio != "auto":
        aspect, field = parse_aspect_ratio(request.aspect_ratio), "aspect_ratio"
    elif request.task == "fl2va":
        if first_keyframe_size is None:
            fail("keyframes[0]", "its image size is needed to resolve aspect_ratio 'auto'")
        aspect, field, follows = first_keyframe_size, "aspect_ratio", " ('auto' follows keyframes[0])"
    else:
        aspect, field = DEFAULT_ASPECT, "aspect_ratio"
    width, height = aspect
    if not _ratio_is_supported(width, height):
        fail(
            field,
            f"resolved ratio{follows} must be within 1:4 to 4:1, got {describe(width)}:{describe(height)}",
        )
    return width, height
