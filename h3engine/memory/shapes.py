"""The shape of a request as far as memory goes: its canvas, frames, packed rows and what its encoders see.

`request_shape(sizes, task, ...)` builds a `RequestShape` from a request's fields with the project's geometry
(h3engine.request.geometry) on a checkpoint's canvas rule, VAE and patch factors and Qwen vision rules; what the request
leaves open takes its worst case under the request limits (the prompt bound, both FL2VA keyframes,
`worst_case_references`). `reshaped` builds a variant (a shorter duration, a smaller short edge); `engine_shapes`
lists the requests an engine plans for.

Danger: h3engine.memory sits below the request layer (tests/test_house.py): the request limits come from
h3engine.request.limits, and the reference conditioning's rules it needs (reference image size, encoded video frames, the
text encoder's video sampling) from h3engine.request.geometry, where conditioning reads them too. Importing this module
imports no torch; `request_shape` does (the decoder's tiling rule).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from h3engine.checkpoint.layout import PARTITION_OF_TASK
from h3engine.errors import CheckpointError
from h3engine.request.geometry import (
    AUDIO_LATENTS_PER_SECOND,
    AUDIO_SAMPLE_RATE,
    FPS,
    MAX_ASPECT_RATIO,
    Geometry,
    canvas_rule,
    qwen_video_sampling,
    reference_image_size,
    reference_video_encode_frames,
    resolve_canvas,
    video_latent_frames,
)
from h3engine.request.limits import (
    DEFAULT_STEPS,
    MAX_DURATION_SECONDS,
    MAX_PROMPT_TOKENS,
    MAX_REFERENCES,
    MAX_REFERENCES_OF_KIND,
    MAX_SHORT_EDGE,
    MAX_TOTAL_AUDIO_SECONDS,
    MAX_TOTAL_VIDEO_SECONDS,
    MIN_CLIP_SECONDS,
)

if TYPE_CHECKING:
    from h3engine.memory.sizes import CheckpointSizes, PartitionSizes, TextEncoderDims
    from h3engine.models.video_vae import VideoVAE, VideoVAEConfig


# The number of distinct per-row timesteps M of a forward, which sizes the AdaLN tables ([M * 3, hidden] per table):
# text and target video share t_video, target audio has t_audio, visual conditions sit at 0.999, reference audio at 1.
TIMESTEP_LEVELS = {"t2va": 2, "fl2va": 3, "ref2va": 4}
# An upper bound on the tokens of one label H3 puts before a keyframe or reference ("<Picture 1>: ", a video
# block's "<0.2 seconds>"): a few BPE tokens each; 8 covers the tiny tokenizer's longer splits too.
LABEL_TOKENS = 8
# The Qwen vision block around each image or video block: <|vision_start|> ... <|vision_end|>.
VISION_BLOCK_TOKENS = 2


@dataclass(frozen=True)
class ReferenceSpec:
    """One Ref2VA reference of a planned request: an image (`aspect` W:H), a video of `seconds` (its soundtrack
    when `has_audio`; None seconds: as long as the request) on the request's canvas rule, or an audio clip."""

    kind: str  # "image" | "video" | "audio"
    seconds: float | None = None
    aspect: tuple[float, float] = (16.0, 9.0)
    has_audio: bool = True


# The prompt an engine plans for (`engine_shapes`): the official requests' prompts (2,400-4,400 characters) are under
# 1,100 tokens; a longer prompt is judged by `check_request_fits` when it comes (the bound is 8,192).
TYPICAL_PROMPT_TOKENS = 1_536
# The Ref2VA request an engine plans for (`engine_shapes`): one picture and one voice, as the official example does.
TYPICAL_REFERENCES = (ReferenceSpec("image"), ReferenceSpec("audio", seconds=5.0))


@dataclass(frozen=True)
class RequestShape:
    """The sizes of one request that fix its memory: canvas, frames, the packed rows and what the encoders see.

    Built by `request_shape` from the request's fields with the project's own geometry (h3engine.request.geometry, the
    conditioning and presentation rules); `arguments` are that call's keyword arguments, so that a variant (a
    shorter duration, a smaller short edge) can be rebuilt.
    """

    task: str
    height: int
    width: int
    frames: int
    latent_frames: int
    latent_h: int
    latent_w: int
    audio_latents: int
    patch: int
    text_rows: int  # text-encoder tokens = the DiT's text rows (vision blocks included)
    condition_video_rows: int = 0
    condition_audio_rows: int = 0
    vision_patches: int = (
        0  # Qwen vision-tower patches (before the 2x2 merge) of every keyframe and reference
    )
    vision_tokens: int = 0  # the merged vision tokens among the text rows
    steps: int = DEFAULT_STEPS
    timestep_levels: int = 2
    encode_pixels: int = (
        0  # frames x height x width of the largest visual condition (encoded whole, on the GPU)
    )
    encode_clip_frames: int = (
        0  # frames one encoder pass sees (17: a video clip, 1: an image; 0: nothing encoded)
    )
    encode_tile: tuple[int, int] = (0, 0)  # pixels (h, w) of one encoder tile
    encode_audio_samples: int = 0  # samples per channel of the longest audio condition
    decode: DecodeShape | None = None
    # A step cache other than "off" (h3engine.engine.sampling.step_cache): the residuals it holds count.
    step_cache: bool = False
    arguments: Mapping[str, Any] = field(default_factory=dict)

    @property
    def video_rows(self) -> int:
        return self.latent_frames * (self.latent_h // self.patch) * (self.latent_w // self.patch)

    @property
    def audio_rows(self) -> int:
        return 2 * self.audio_latents

    @property
    def total_video_rows(self) -> int:
        return self.video_rows + self.condition_video_rows

    @property
    def total_audio_rows(self) -> int:
        return self.audio_rows + self.condition_audio_rows

    @property
    def sequence_rows(self) -> int:
        """The packed sequence's length: text + condition blocks + target audio + target video."""
        return self.text_rows + self.total_video_rows + self.total_audio_rows

    @property
    def duration_seconds(self) -> float:
        return float(self.arguments.get("duration_seconds", 0.0))

    @property
    def label(self) -> str:
        seconds = self.arguments.get("duration_seconds")
        duration = f"{seconds:g} s " if seconds is not None else ""
        return (
            f"{self.task} {duration}{self.width}x{self.height} ({self.frames} frames), {self.text_rows:,} text rows, "
            f"{self.sequence_rows:,} rows in all"
        )


def worst_case_references(duration_seconds: float) -> tuple[ReferenceSpec, ...]:
    """The Ref2VA references that make the longest sequence the request checker accepts (h3engine.request limits):
    every image reference it allows, at the widest ratio (4:1, normalized to the reference short edge: the most rows
    and vision tokens), then videos with sound, then audio clips, each at most as long as the request (references
    are cut to it) and the clips within their total lengths."""
    references = [ReferenceSpec("image", aspect=(MAX_ASPECT_RATIO, 1.0))] * MAX_REFERENCES_OF_KIND["image"]
    for kind, total in (("video", MAX_TOTAL_VIDEO_SECONDS), ("audio", MAX_TOTAL_AUDIO_SECONDS)):
        count = 0
        while (
            len(references) < MAX_REFERENCES
            and count < MAX_REFERENCES_OF_KIND[kind]
            and total >= MIN_CLIP_SECONDS
        ):
            seconds = min(duration_seconds, total)
            references.append(ReferenceSpec(kind, seconds=seconds))
            total -= seconds
            count += 1
    return tuple(references)


def request_shape(
    sizes: CheckpointSizes,
    task: str = "t2va",
    *,
    duration_seconds: float = 5.0,
    aspect_ratio: str | tuple[float, float] = "16:9",
    short_edge: int | None = None,
    text_tokens: int | None = None,
    keyframes: Sequence[str] = ("first", "last"),
    references: Sequence[ReferenceSpec] | None = None,
    steps: int = DEFAULT_STEPS,
    step_cache: bool = False,
) -> RequestShape:
    """The shape of a request on this checkpoint (its canvas rule, VAE and patch factors, tokenizer's vision rules).

    Left out, the request's variable parts take their worst case under the request limits: `text_tokens` the prompt
    bound (h3engine.request.limits.MAX_PROMPT_TOKENS), FL2VA both keyframes, Ref2VA `worst_case_references`. `short_edge`
    None is the checkpoint's own canvas rule (768 for the release). ValueError for a geometry the resolver refuses.
    """
    arguments = {
        "task": task,
        "duration_seconds": duration_seconds,
        "aspect_ratio": aspect_ratio,
        "short_edge": short_edge,
        "text_tokens": text_tokens,
        "keyframes": tuple(keyframes),
        "references": None if references is None else tuple(references),
        "steps": steps,
        "step_cache": step_cache,
    }
    partition = partition_for_task(sizes, task)
    video_config = partition.video_config
    vae_ratio, patch = video_config.spatial_compression_ratio, partition.dit_config.patch_size[-1]
    rule_short_edge, max_pixels = canvas_rule(short_edge, sizes.canvas.short_edge, sizes.canvas.max_pixels)
    geometry = Geometry.for_request(
        aspect_ratio,
        duration_seconds,
        short_edge=rule_short_edge,
        max_pixels=max_pixels,
        vae_spatial_ratio=vae_ratio,
        patch=patch,
    )
    tally = _ConditionTally(
        partition.text_dims, video_config, MAX_PROMPT_TOKENS if text_tokens is None else text_tokens
    )
    if task == "fl2va":
        for _ in keyframes:
            # One latent frame on the target canvas, and the fitted keyframe's image block in the text.
            tally.condition_video += geometry.rows_per_frame
            tally.image_block(geometry.height, geometry.width)
            tally.visual_condition(1, geometry.height, geometry.width)
    elif task == "ref2va":
        clip_seconds = geometry.frames / FPS  # references are cut to the generated length
        chosen = worst_case_references(clip_seconds) if references is None else tuple(references)
        for reference in chosen:
            seconds = min(clip_seconds if reference.seconds is None else reference.seconds, clip_seconds)
            if reference.kind == "image":
                tally.reference_image(reference, sizes.canvas.reference_image_short_edge, vae_ratio, patch)
            else:
                tally.reference_clip(
                    reference, seconds, geometry.frames, (rule_short_edge, max_pixels), vae_ratio, patch
                )
    elif task != "t2va":
        raise ValueError(f"unknown task '{task}'")
    return _shape_of(task, geometry, tally, steps, step_cache, arguments)


def _shape_of(
    task: str,
    geometry: Geometry,
    tally: _ConditionTally,
    steps: int,
    step_cache: bool,
    arguments: dict[str, Any],
) -> RequestShape:
    """The `RequestShape` of a request of `task` on `geometry` whose conditions `tally` counted."""
    return RequestShape(
        task=task,
        height=geometry.height,
        width=geometry.width,
        frames=geometry.frames,
        latent_frames=geometry.latent_frames,
        latent_h=geometry.latent_h,
        latent_w=geometry.latent_w,
        audio_latents=geometry.audio_latents,
        patch=geometry.patch,
        text_rows=tally.text_rows,
        condition_video_rows=tally.condition_video,
        condition_audio_rows=tally.condition_audio,
        vision_patches=tally.vision_patches,
        vision_tokens=tally.vision_tokens,
        steps=steps,
        timestep_levels=TIMESTEP_LEVELS[task],
        encode_pixels=tally.encode_pixels,
        encode_clip_frames=tally.encode_clip,
        encode_tile=tally.encode_tile,
        encode_audio_samples=tally.encode_samples,
        decode=decode_shape(tally.video_config, geometry.latent_frames, geometry.latent_h, geometry.latent_w),
        step_cache=step_cache,
        arguments=arguments,
    )


@dataclass
class _ConditionTally:
    """What a request's keyframes and references add to its text rows, condition rows and encoder inputs, counted
    one condition at a time by `request_shape`."""

    dims: TextEncoderDims
    video_config: VideoVAEConfig
    text_rows: int
    condition_video: int = 0
    condition_audio: int = 0
    vision_patches: int = 0
    vision_tokens: int = 0
    encode_pixels: int = 0
    encode_clip: int = 0
    encode_tile: tuple[int, int] = (0, 0)
    encode_samples: int = 0

    def visual_condition(self, frames: int, height: int, width: int) -> None:
        """A visual condition the video VAE encodes: the largest sets the encoder's pixels and tile."""
        if frames * height * width > self.encode_pixels:
            self.encode_pixels = frames * height * width
            self.encode_tile = (
                min(self.video_config.tile_size, height),
                min(self.video_config.tile_size, width),
            )
        self.encode_clip = max(self.encode_clip, self.video_config.clip_length if frames > 1 else 1)

    def image_block(self, height: int, width: int) -> None:
        """An image's vision block among the text rows."""
        patches = image_vision_patches(height, width, self.dims)
        self.vision_patches += patches
        self.vision_tokens += patches // self.dims.merge**2
        self.text_rows += LABEL_TOKENS + VISION_BLOCK_TOKENS + patches // self.dims.merge**2

    def reference_image(
        self, reference: ReferenceSpec, reference_short_edge: int, vae_ratio: int, patch: int
    ) -> None:
        """A reference image, normalized to the reference short edge: its latent rows and its image block."""
        width, height = reference_image_size(
            *reference.aspect, short_edge=reference_short_edge, multiple=vae_ratio * patch
        )
        self.condition_video += (height // vae_ratio // patch) * (width // vae_ratio // patch)
        self.image_block(height, width)
        self.visual_condition(1, height, width)

    def reference_clip(
        self,
        reference: ReferenceSpec,
        seconds: float,
        target_frames: int,
        canvas: tuple[int, int],
        vae_ratio: int,
        patch: int,
    ) -> None:
        """A reference video or audio clip of `seconds` (already cut to the request): the soundtrack's audio rows and
        label, and a video's latent rows on the request's `canvas` rule (short edge, max pixels) and vision blocks."""
        latents = math.ceil(seconds * AUDIO_LATENTS_PER_SECOND)
        if reference.kind == "audio" or reference.has_audio:
            self.condition_audio += 2 * latents
            self.text_rows += LABEL_TOKENS  # "<Audio j>: "
            self.encode_samples = max(self.encode_samples, math.ceil(seconds * AUDIO_SAMPLE_RATE))
        if reference.kind != "video":
            return
        frames = min(max(1, round(seconds * FPS)), target_frames)
        short_edge, max_pixels = canvas
        height, width = resolve_canvas(
            *reference.aspect, multiple=vae_ratio * patch, short_edge=short_edge, max_pixels=max_pixels
        )
        encoded = reference_video_encode_frames(frames)
        self.condition_video += (
            video_latent_frames(encoded) * (height // vae_ratio // patch) * (width // vae_ratio // patch)
        )
        sampled = qwen_sampled_frames(frames)
        patches, blocks = video_vision_patches(sampled, height, width, self.dims)
        self.vision_patches += patches
        self.vision_tokens += patches // self.dims.merge**2
        self.text_rows += (
            LABEL_TOKENS + blocks * (LABEL_TOKENS + VISION_BLOCK_TOKENS) + patches // self.dims.merge**2
        )
        self.visual_condition(encoded, height, width)


def reshaped(sizes: CheckpointSizes, shape: RequestShape, **changes: Any) -> RequestShape:
    """`shape` built again with some of its request fields changed (e.g. `duration_seconds=9`)."""
    arguments = {**shape.arguments, **changes}
    task = arguments.pop("task")
    return request_shape(sizes, task, **arguments)


def partition_for_task(sizes: CheckpointSizes, task: str) -> PartitionSizes:
    partition = PARTITION_OF_TASK.get(task)
    if partition is None:
        raise ValueError(f"unknown task '{task}'")
    if partition not in sizes.partitions:
        raise CheckpointError(
            f"{sizes.root}: this checkpoint has no {partition} partition, so it cannot serve task '{task}' "
            f"(it has: {', '.join(sizes.partitions)})"
        )
    return sizes.partitions[partition]


def engine_shapes(sizes: CheckpointSizes) -> list[RequestShape]:
    """The requests an engine plans for, most packed rows first: for each task the checkpoint serves (T2VA; Ref2VA
    with `TYPICAL_REFERENCES`), the largest request it accepts (15 s at the largest short edge), the longest at the
    checkpoint's canvas (15 s) and the default one (5 s), each with `TYPICAL_PROMPT_TOKENS`. `plan_engine` takes the
    most demanding that fits at little more cost than the least demanding one (the last): a budget holding only a
    default T2VA request still starts, and larger requests are judged one by one (`check_request_fits`; what the
    reference limits allow at worst needs tens of GiB of activations alone)."""
    served = []
    if "fl2va" in sizes.partitions:
        served.append(("t2va", None))
    if "ref2va" in sizes.partitions:
        served.append(("ref2va", TYPICAL_REFERENCES))
    levels = (
        {"duration_seconds": MAX_DURATION_SECONDS, "short_edge": MAX_SHORT_EDGE},
        {"duration_seconds": MAX_DURATION_SECONDS},
        {},
    )
    shapes = [
        request_shape(sizes, task, references=references, text_tokens=TYPICAL_PROMPT_TOKENS, **level)
        for level in levels
        for task, references in served
    ]
    return sorted(shapes, key=lambda shape: shape.sequence_rows, reverse=True)


@functools.lru_cache(maxsize=8)
def qwen_sampled_frames(num_frames: int) -> int:
    """How many frames of a 24 fps clip the text encoder reads (h3engine.request.geometry.qwen_video_sampling)."""
    return len(qwen_video_sampling(num_frames, temporal_patch=1)[0])


def _meta_video_vae(config: VideoVAEConfig) -> VideoVAE:
    import torch

    from h3engine.models.video_vae import VideoVAE  # the decoder's own tiling rule, on the meta device

    with torch.device("meta"):
        return VideoVAE(config)


@dataclass(frozen=True)
class DecodeShape:
    """The video decoder's work for one request: its calls and the largest of them, per `VideoVAE.plan_decode`."""

    calls: int  # decoder calls (the streamed decoder's layers cross the bus once per call)
    largest_call_rows: (
        int  # token rows of the largest call (tiles x (tile tokens + register and zero tokens))
    )
    window_tile_elements: int  # decoded elements of one window's tiles before stitching (the largest window)
    window_frames: int  # pixel frames one window decodes
    call_rows: tuple[int, ...] = ()  # every call's rows (FLOPs)


def decode_shape(config: VideoVAEConfig, latent_frames: int, latent_h: int, latent_w: int) -> DecodeShape:
    """How `VideoVAE.decode` splits latents of this extent into decoder calls (the released tiling and batching)."""
    vae = _meta_video_vae(config)
    plan = vae.plan_decode((1, config.latent_channels, latent_frames, latent_h, latent_w))
    suffix_tokens = config.decoder_num_register_tokens + 1
    call_rows = []
    for batch in plan.call_batches(vae.decode_batch_tiles):
        rows = 0
        for index in batch:
            tile = plan.tiles[index]
            extent = [stop - start for start, stop in (tile.frames, tile.rows, tile.columns)]
            rows += math.prod(extent) + suffix_tokens
        call_rows.append(rows)
    window_elements = max(
        sum(math.prod(vae.decoded_tile_shape(1, tile)) for tile in plan.window_tiles(window))
        for window in range(plan.window_count)
    )
    window_frames = max(
        vae.decoded_tile_shape(1, plan.window_tiles(w)[0])[2] for w in range(plan.window_count)
    )
    return DecodeShape(len(call_rows), max(call_rows), window_elements, window_frames, tuple(call_rows))


def image_vision_patches(height: int, width: int, dims: TextEncoderDims) -> int:
    """Qwen vision patches (before the 2x2 merge) of one image of `height` x `width` pixels, as the checkpoint's
    image processor resizes it (transformers' own `smart_resize`)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    factor = dims.vision_patch * dims.merge
    resized_h, resized_w = smart_resize(
        height, width, factor=factor, min_pixels=dims.image_min_pixels, max_pixels=dims.image_max_pixels
    )
    return (resized_h // dims.vision_patch) * (resized_w // dims.vision_patch)


def video_vision_patches(
    sampled_frames: int, height: int, width: int, dims: TextEncoderDims
) -> tuple[int, int]:
    """(patches before the merge, temporal blocks) of a reference video's frames as the Qwen3-VL video processor
    resizes them (transformers' own `smart_resize`); `sampled_frames` are the 2 fps frames H3 hands it."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    factor = dims.vision_patch * dims.merge
    frames = max(sampled_frames, dims.temporal_patch)
    resized_h, resized_w = smart_resize(
        frames,
        height,
        width,
        temporal_factor=dims.temporal_patch,
        factor=factor,
        min_pixels=dims.video_min_pixels,
        max_pixels=dims.video_max_pixels,
    )
    blocks = math.ceil(frames / dims.temporal_patch)
    return blocks * (resized_h // dims.vision_patch) * (resized_w // dims.vision_patch), blocks
