"""Parity of geometry, schedules, the Euler step, packing and initial noise with diffusers 0.42.1.

The reference side runs diffusers' own code: the module-level helpers of
``modular_pipelines/minimax_h3/modular_pipeline.py``, ``MiniMaxH3Scheduler``, and the real pipeline
blocks (layout, timesteps, condition noise, latents, after-denoise) executed standalone: the blocks are
chained with ``SequentialPipelineBlocks.from_blocks_dict``, turned into a ``MiniMaxH3ModularPipeline`` with
``init_pipeline()``, given their scheduler components with ``update_components``, and called with the
block inputs as keyword arguments. For the tiny canvas (VAE spatial ratio 4, latent channels 4) tiny
random VAEs are attached through a no-op block that only declares them as expected components, because
the pipeline reads the VAE ratio / channel counts / chunking from those components.

Everything structural is compared with ``torch.equal`` (bit exact), floats included.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
from diffusers.modular_pipelines import ModularPipelineBlocks, SequentialPipelineBlocks
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as reference_helpers
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareConditionLatentsStep,
    MiniMaxH3PrepareLatentsStep,
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec

from h3engine.engine.sampling.noise import draw_initial_noise, noise_condition_rows
from h3engine.engine.sampling.packing import (
    AudioReference,
    ImageReference,
    VideoReference,
    audio_latents_to_rows,
    fl2va_layout,
    patchify_video,
    ref2va_layout,
    row_timesteps,
    rows_to_audio_latents,
    t2va_layout,
    unpatchify_video,
)
from h3engine.engine.sampling.schedule import Schedule, euler_step, shifted_sigmas
from h3engine.request.geometry import (
    PRESET_ASPECT_RATIOS,
    Geometry,
    audio_latent_count,
    frames_for_duration,
    parse_aspect_ratio,
    resolve_canvas,
    snap_frames_down,
    snap_frames_up,
    video_latent_frames,
)

RELEASED_CAP = 768 * 1344

# --- reference harness ------------------------------------------------------------------------------


class _DeclareTinyVaes(ModularPipelineBlocks):
    """No-op block: makes the pipeline accept `vae` / `audio_vae` components (tiny canvas geometry)."""

    model_name = "minimax-h3"

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [
            ComponentSpec("vae", AutoencoderKLMiniMaxH3),
            ComponentSpec("audio_vae", AutoencoderKLMiniMaxH3Audio),
        ]

    def __call__(self, components, state):
        return components, state


def _tiny_vaes() -> dict[str, torch.nn.Module]:
    """docs/MODEL.md §10 tiny VAEs: spatial ratio 4 (canvas multiple 8), 4 video and 4 audio channels."""
    video_vae = AutoencoderKLMiniMaxH3(
        latent_channels=4,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 1),
        temporal_downsample_factors=(2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=2,
        latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4,
    )
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4,
        encoder_rates=(2, 2),
        latent_dim=16,
        latent_channels=4,
        num_attention_heads=2,
        decoder_dim=16,
        decoder_rates=(2, 2),
        decoder_kernel_sizes=(4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
    )
    return {"vae": video_vae, "audio_vae": audio_vae}


def _reference_pipeline(
    blocks: dict[str, ModularPipelineBlocks], *, tiny: bool, shifts: tuple[float, float] = (12.0, 3.0)
):
    if tiny:
        blocks = {"declare_tiny_vaes": _DeclareTinyVaes(), **blocks}
    pipeline = SequentialPipelineBlocks.from_blocks_dict(blocks).init_pipeline()
    components = {}
    if any(isinstance(block, MiniMaxH3SetTimestepsStep) for block in blocks.values()):
        components |= {
            "scheduler": MiniMaxH3Scheduler(shift=shifts[0]),
            "audio_scheduler": MiniMaxH3Scheduler(shift=shifts[1]),
        }
    if any(isinstance(block, MiniMaxH3PrepareConditionLatentsStep) for block in blocks.values()):
        components |= {"scheduler": MiniMaxH3Scheduler(shift=shifts[0])}
    if tiny:
        components |= _tiny_vaes()
    pipeline.update_components(**components)
    return pipeline


LAYOUT_OUTPUTS = [
    "height",
    "width",
    "num_frames",
    "num_latent_frames",
    "latent_height",
    "latent_width",
    "num_audio_latents",
    "position_ids",
    "token_tags",
    "video_indices",
    "audio_indices",
    "text_indices",
    "num_condition_video_rows",
    "num_condition_audio_rows",
    "row_timestep_plan",
]


def _text_tags(num_rows: int) -> torch.Tensor:
    """Text rows with a Qwen vision block inside (tagged video), as an FL2VA/Ref2VA prompt has."""
    tags = torch.ones(num_rows, dtype=torch.long)
    tags[2 : min(num_rows, 9)] = 0
    return tags


def _assert_layout_equal(ours, reference: dict) -> None:
    assert ours.positions.dtype == torch.float64
    assert torch.equal(ours.positions, reference["position_ids"])
    assert torch.equal(ours.tags, reference["token_tags"])
    assert torch.equal(ours.video_index, reference["video_indices"])
    assert torch.equal(ours.audio_index, reference["audio_indices"])
    assert torch.equal(ours.text_index, reference["text_indices"])
    assert ours.num_condition_video_rows == reference["num_condition_video_rows"]
    assert ours.num_condition_audio_rows == reference["num_condition_audio_rows"]


def _assert_row_timesteps_equal(layout, schedule: Schedule, plan: list) -> None:
    assert len(plan) == schedule.num_steps
    for step, (reference_timesteps, reference_index) in enumerate(plan):
        timesteps, timestep_index = row_timesteps(
            layout, schedule.video_timesteps[step], schedule.audio_timesteps[step]
        )
        assert timesteps.dtype == torch.float32 and timestep_index.dtype == torch.long
        assert torch.equal(timesteps, reference_timesteps)
        assert torch.equal(timestep_index, reference_index)


# --- geometry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aspect", "expected_width", "expected_height"),
    [
        ("21:9", 1536, 672),
        ("16:9", 1344, 768),
        ("4:3", 1024, 768),
        ("1:1", 768, 768),
        ("3:4", 768, 1024),
        ("9:16", 768, 1344),
    ],
)
def test_canvas_presets(aspect: str, expected_width: int, expected_height: int) -> None:
    assert aspect in PRESET_ASPECT_RATIOS
    aspect_w, aspect_h = parse_aspect_ratio(aspect)
    reference = reference_helpers.resolve_canvas_size(aspect_w, aspect_h, 32, 768, RELEASED_CAP)
    assert resolve_canvas(aspect_w, aspect_h) == reference == (expected_height, expected_width)


def _odd_canvas_cases() -> list[tuple[float, float, int, int, int]]:
    settings = [(32, 768, RELEASED_CAP), (8, 32, RELEASED_CAP), (32, 512, 512 * 512), (16, 1080, 1920 * 1080)]
    ratios = [
        (1, 4),
        (4, 1),
        (2.39, 1),
        (7, 3),
        (1, 3),
        (5, 4),
        (3, 2),
        (1366, 768),
        (1080, 1920),
        (1, 1.0001),
    ]
    rng = random.Random(1234)
    ratios += [(rng.uniform(0.25, 4.0), 1.0) for _ in range(200)] + [
        (rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(200)
    ]
    return [(w, h, multiple, edge, cap) for (w, h) in ratios for (multiple, edge, cap) in settings]


def test_canvas_odd_ratios_match_reference() -> None:
    for aspect_w, aspect_h, multiple, short_edge, cap in _odd_canvas_cases():
        try:
            reference = reference_helpers.resolve_canvas_size(aspect_w, aspect_h, multiple, short_edge, cap)
        except ValueError:
            with pytest.raises(ValueError, match="1:4 to 4:1"):
                resolve_canvas(aspect_w, aspect_h, multiple=multiple, short_edge=short_edge, max_pixels=cap)
            continue
        ours = resolve_canvas(aspect_w, aspect_h, multiple=multiple, short_edge=short_edge, max_pixels=cap)
        assert ours == reference, (aspect_w, aspect_h, multiple, short_edge, cap)


@pytest.mark.parametrize(("aspect_w", "aspect_h"), [(1, 5), (5, 1), (1, 4.001), (4.001, 1), (0, 1), (1, -2)])
def test_canvas_rejects_unsupported_ratios(aspect_w: float, aspect_h: float) -> None:
    with pytest.raises(ValueError):
        reference_helpers.resolve_canvas_size(aspect_w, aspect_h, 32, 768, RELEASED_CAP)
    with pytest.raises(ValueError, match="aspect ratio"):
        resolve_canvas(aspect_w, aspect_h)


def test_parse_aspect_ratio() -> None:
    assert parse_aspect_ratio(" 16:9 ") == (16.0, 9.0)
    assert parse_aspect_ratio("2.39:1") == (2.39, 1.0)
    for bad in ("auto", "16x9", "16:", ":9", "a:b", "0:1", "-1:2", "1:2:3", "inf:1"):
        with pytest.raises(ValueError):
            parse_aspect_ratio(bad)


def test_frame_arithmetic_matches_reference() -> None:
    for frames in range(1, 420):
        snapped = snap_frames_up(frames)
        assert snapped == reference_helpers.align_num_frames(frames, 17, 5)
        assert video_latent_frames(snapped) == reference_helpers.video_latent_num_frames(snapped, 17, 5)
        assert audio_latent_count(frames) == reference_helpers.audio_latent_num_frames(frames)
        if frames >= 5:
            down = snap_frames_down(frames)
            assert down <= frames < down + 17 and down % 17 == 5
        if frames % 17 != 5:
            with pytest.raises(ValueError):
                video_latent_frames(frames)
    for bad in (0, -3):
        with pytest.raises(ValueError):
            snap_frames_up(bad)
    with pytest.raises(ValueError):
        snap_frames_down(4)


@pytest.mark.parametrize(
    ("seconds", "frames", "latent_frames", "audio_latents"),
    [(4, 107, 32, 178), (5, 124, 37, 207), (8, 192, 57, 320), (10, 243, 72, 405), (15, 362, 107, 603)],
)
def test_duration_table(seconds: float, frames: int, latent_frames: int, audio_latents: int) -> None:
    assert frames_for_duration(seconds) == frames
    assert video_latent_frames(frames) == latent_frames
    assert audio_latent_count(frames) == audio_latents


def test_geometry_for_request() -> None:
    geometry = Geometry.for_request("16:9", 5.0)
    assert (geometry.height, geometry.width, geometry.frames) == (768, 1344, 124)
    assert (geometry.latent_frames, geometry.latent_h, geometry.latent_w, geometry.audio_latents) == (
        37,
        48,
        84,
        207,
    )
    assert (geometry.rows_per_frame, geometry.video_rows, geometry.audio_rows) == (1008, 37296, 414)
    assert geometry.duration == 124 / 24
    tiny = Geometry.for_request((1, 1), 5.0, short_edge=32, vae_spatial_ratio=4, patch=2)
    assert (tiny.height, tiny.width, tiny.latent_h, tiny.latent_w, tiny.video_rows) == (32, 32, 8, 8, 37 * 16)
    with pytest.raises(ValueError, match="multiples of 32"):
        Geometry.from_canvas(760, 1344, 124)
    with pytest.raises(ValueError, match="17n"):
        Geometry.from_canvas(768, 1344, 120)


# --- schedules and the Euler step ------------------------------------------------------------------

STEP_COUNTS = [2, 3, 4, 7, 10, 30, 49, 50, 51, 100, 257, 1000]
SHIFTS = [12.0, 3.0, 1.0, 0.5, 6.0, 7.3]


@pytest.mark.parametrize("shift", SHIFTS)
def test_sigma_grids_match_scheduler(shift: float) -> None:
    for num_inference_steps in STEP_COUNTS:
        scheduler = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(num_inference_steps)
        ours = shifted_sigmas(num_inference_steps, shift)
        assert ours.dtype == torch.float32 and ours[-1].item() == 0.0
        assert torch.equal(ours, scheduler.sigmas)
        assert torch.equal(1.0 - ours[:-1], scheduler.timesteps)


@pytest.mark.parametrize("num_inference_steps", STEP_COUNTS)
def test_schedule_recipes(num_inference_steps: int) -> None:
    video_scheduler, audio_scheduler = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)

    video_scheduler.set_timesteps(num_inference_steps)
    audio_scheduler.set_timesteps(num_inference_steps)
    diffusers_schedule = Schedule.build(num_inference_steps, recipe="diffusers")
    assert diffusers_schedule.num_steps == video_scheduler.num_inference_steps == num_inference_steps - 1
    assert torch.equal(diffusers_schedule.video_sigmas, video_scheduler.sigmas)
    assert torch.equal(diffusers_schedule.audio_sigmas, audio_scheduler.sigmas)
    assert torch.equal(diffusers_schedule.video_timesteps, video_scheduler.timesteps)
    assert torch.equal(diffusers_schedule.audio_timesteps, audio_scheduler.timesteps)

    # SGLang serves N steps as N forwards: the same grid one point longer.
    video_scheduler.set_timesteps(num_inference_steps + 1)
    audio_scheduler.set_timesteps(num_inference_steps + 1)
    sglang_schedule = Schedule.build(num_inference_steps, recipe="sglang")
    assert sglang_schedule.num_steps == num_inference_steps
    assert torch.equal(sglang_schedule.video_sigmas, video_scheduler.sigmas)
    assert torch.equal(sglang_schedule.audio_timesteps, audio_scheduler.timesteps)


def test_schedule_rejects_bad_requests() -> None:
    with pytest.raises(ValueError):
        Schedule.build(1, recipe="diffusers")
    with pytest.raises(ValueError):
        Schedule.build(0, recipe="sglang")
    with pytest.raises(ValueError):
        Schedule.build(10, recipe="comfy")
    with pytest.raises(ValueError):
        shifted_sigmas(10, 0.0)


@pytest.mark.parametrize("recipe", ["diffusers", "sglang"])
def test_euler_trajectory_matches_scheduler_step(recipe: str) -> None:
    """Run whole trajectories for both modalities; every intermediate state must be bit equal."""
    schedule = Schedule.build(12, recipe=recipe)
    generator = torch.Generator().manual_seed(0)
    for sigmas, timesteps, shift, width in (
        (schedule.video_sigmas, schedule.video_timesteps, 12.0, 96),
        (schedule.audio_sigmas, schedule.audio_timesteps, 3.0, 32),
    ):
        scheduler = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(sigmas.numel())
        assert torch.equal(scheduler.sigmas, sigmas)
        reference_state = torch.randn(257, width, generator=generator)
        our_state = reference_state.clone()
        for step, timestep in enumerate(timesteps):
            velocity = torch.randn(257, width, generator=generator) * 3.0
            reference_state = scheduler.step(velocity, timestep, reference_state, return_dict=False)[0]
            our_state = euler_step(our_state, velocity, timestep, sigmas[step], sigmas[step + 1])
            assert our_state.dtype == torch.float32
            assert torch.equal(our_state, reference_state), f"step {step}"
        # The final step lands on the clean estimate x + (1 - t) * v exactly (ratio 0).
        assert sigmas[-1].item() == 0.0


def test_euler_step_keeps_sigma_sources_apart() -> None:
    """Plain-float arguments give the same result, and the two-source form is not the one-source form."""
    schedule = Schedule.build(50, recipe="sglang")
    sample = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    velocity = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    differences = 0
    for step in range(schedule.num_steps):
        sigma, sigma_next = schedule.video_sigmas[step], schedule.video_sigmas[step + 1]
        timestep = schedule.video_timesteps[step]
        stepped = euler_step(sample, velocity, timestep, sigma, sigma_next)
        assert torch.equal(
            stepped, euler_step(sample, velocity, float(timestep), float(sigma), float(sigma_next))
        )
        single_source = sample + (sigma - sigma_next) * velocity
        differences += int(not torch.equal(stepped, single_source))
    assert differences > 0
    with pytest.raises(TypeError):
        euler_step(sample.bfloat16(), velocity, 0.5, 0.5, 0.25)


# --- packing ----------------------------------------------------------------------------------------


def test_patchify_and_audio_rows_match_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 4, 5, 6, 10, generator=generator)
    rows = patchify_video(latents)
    assert torch.equal(rows, patchify_video_latents(latents, (1, 2, 2)))
    assert rows.shape == (5 * 3 * 5, 16)

    audio_latents = torch.randn(2, 4, 9, generator=generator)
    audio_rows = audio_latents_to_rows(audio_latents)
    assert torch.equal(audio_rows[:9], audio_latents[0].T) and torch.equal(audio_rows[9:], audio_latents[1].T)

    # Inverse direction against diffusers' after-denoise block, with condition rows in front to drop.
    condition_video, condition_audio = (
        torch.randn(7, 16, generator=generator),
        torch.randn(4, 4, generator=generator),
    )
    pipeline = _reference_pipeline({"after": MiniMaxH3AfterDenoiseStep()}, tiny=True)
    reference = pipeline(
        latents=torch.cat([condition_video, rows]),
        audio_latents=torch.cat([condition_audio, audio_rows]),
        num_condition_video_rows=7,
        num_condition_audio_rows=4,
        num_latent_frames=5,
        latent_height=6,
        latent_width=10,
        num_audio_latents=9,
        output=["latents", "audio_latents"],
    )
    assert torch.equal(unpatchify_video(rows, 5, 6, 10), reference["latents"])
    assert torch.equal(unpatchify_video(rows, 5, 6, 10), latents)
    assert torch.equal(rows_to_audio_latents(audio_rows), reference["audio_latents"])
    assert torch.equal(rows_to_audio_latents(audio_rows), audio_latents)


def _reference_layout(geometry: Geometry, text_tags: torch.Tensor, *, tiny: bool, anchors=(), steps: int = 6):
    pipeline = _reference_pipeline(
        {"layout": MiniMaxH3PrepareLayoutStep(), "timesteps": MiniMaxH3SetTimestepsStep()}, tiny=tiny
    )
    reference = pipeline(
        text_token_tags=text_tags,
        height=geometry.height,
        width=geometry.width,
        num_frames=geometry.frames,
        keyframe_anchors=tuple(anchors),
        num_inference_steps=steps,
        output=LAYOUT_OUTPUTS,
    )
    assert (reference["height"], reference["width"], reference["num_frames"]) == (
        geometry.height,
        geometry.width,
        geometry.frames,
    )
    assert (reference["num_latent_frames"], reference["latent_height"], reference["latent_width"]) == (
        geometry.latent_frames,
        geometry.latent_h,
        geometry.latent_w,
    )
    assert reference["num_audio_latents"] == geometry.audio_latents
    return reference


def test_t2va_layout_released_canvas_matches_reference_block() -> None:
    geometry = Geometry.for_request("16:9", 5.0)
    text_tags = _text_tags(23)
    # The reference resolves its own default canvas (16:9 at 768) when height/width are not given.
    pipeline = _reference_pipeline({"layout": MiniMaxH3PrepareLayoutStep()}, tiny=False)
    default_canvas = pipeline(text_token_tags=text_tags, output=["height", "width", "num_frames"])
    assert (default_canvas["height"], default_canvas["width"], default_canvas["num_frames"]) == (
        768,
        1344,
        124,
    )

    reference = _reference_layout(geometry, text_tags, tiny=False)
    layout = t2va_layout(text_tags, geometry)
    assert layout.sequence_length == 23 + 414 + 37296 and layout.num_text_rows == 23
    assert (layout.num_target_video_rows, layout.num_target_audio_rows) == (
        geometry.video_rows,
        geometry.audio_rows,
    )
    _assert_layout_equal(layout, reference)
    _assert_row_timesteps_equal(layout, Schedule.build(6, recipe="diffusers"), reference["row_timestep_plan"])


@pytest.mark.parametrize("frames", [124, 345])
def test_t2va_layout_tiny_canvas_matches_reference_block(frames: int) -> None:
    geometry = Geometry.from_canvas(32, 32, frames, vae_spatial_ratio=4, patch=2)
    text_tags = _text_tags(11)
    reference = _reference_layout(geometry, text_tags, tiny=True, steps=9)
    layout = t2va_layout(text_tags, geometry)
    _assert_layout_equal(layout, reference)
    _assert_row_timesteps_equal(layout, Schedule.build(9, recipe="diffusers"), reference["row_timestep_plan"])


@pytest.mark.parametrize("anchors", [("first",), ("last",), ("first", "last"), ("last", "first")])
@pytest.mark.parametrize(("height", "width", "frames"), [(32, 48, 124), (40, 24, 345)])
def test_fl2va_layout_matches_reference_block(anchors, height: int, width: int, frames: int) -> None:
    geometry = Geometry.from_canvas(height, width, frames, vae_spatial_ratio=4, patch=2)
    text_tags = _text_tags(17)
    reference = _reference_layout(geometry, text_tags, tiny=True, anchors=anchors, steps=5)
    layout = fl2va_layout(text_tags, geometry, anchors)
    assert layout.num_condition_video_rows == len(anchors) * geometry.rows_per_frame
    _assert_layout_equal(layout, reference)
    _assert_row_timesteps_equal(layout, Schedule.build(5, recipe="diffusers"), reference["row_timestep_plan"])


def test_fl2va_last_anchor_released_canvas() -> None:
    geometry = Geometry.for_request("16:9", 5.0)
    text_tags = _text_tags(5)
    reference = _reference_layout(geometry, text_tags, tiny=False, anchors=("first", "last"), steps=3)
    layout = fl2va_layout(text_tags, geometry, ("first", "last"))
    _assert_layout_equal(layout, reference)
    assert layout.positions[5 + 1008, 0].item() == pytest.approx(5 + 205.0, abs=1e-12)
    with pytest.raises(ValueError, match="first"):
        fl2va_layout(text_tags, geometry, ("middle",))


REF2VA_CASES = {
    "mixed": [
        ImageReference(latent_h=12, latent_w=8),
        VideoReference(latent_frames=57, latent_h=8, latent_w=12, audio_latents=320),
        AudioReference(audio_latents=90),
        VideoReference(latent_frames=22, latent_h=6, latent_w=6),
        ImageReference(latent_h=4, latent_w=10),
    ],
    "silent_long_video": [VideoReference(latent_frames=102, latent_h=4, latent_w=4), ImageReference(4, 4)],
    "short_soundtrack": [VideoReference(latent_frames=37, latent_h=4, latent_w=8, audio_latents=100)],
}


def _reference_ref2va(text_tags: torch.Tensor, geometry: Geometry, references) -> dict:
    """diffusers' ref2va layout builder; it reads only each reference's kind / has_audio and the shapes of
    the encoded latents, so stand-in references and meta tensors are all it needs."""
    stand_ins, visual_latents, audio_rows = [], [], []
    for reference in references:
        if isinstance(reference, ImageReference):
            stand_ins.append(types.SimpleNamespace(kind="image", has_audio=False))
            visual_latents.append(torch.empty(1, 4, 1, reference.latent_h, reference.latent_w, device="meta"))
        elif isinstance(reference, AudioReference):
            stand_ins.append(types.SimpleNamespace(kind="audio", has_audio=True))
            audio_rows.append(torch.empty(2 * reference.audio_latents, 4, device="meta"))
        else:
            stand_ins.append(types.SimpleNamespace(kind="video", has_audio=reference.audio_latents > 0))
            shape = (1, 4, reference.latent_frames, reference.latent_h, reference.latent_w)
            visual_latents.append(torch.empty(shape, device="meta"))
            if reference.audio_latents:
                audio_rows.append(torch.empty(2 * reference.audio_latents, 4, device="meta"))
    built = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        text_tags,
        stand_ins,
        visual_latents,
        audio_rows,
        geometry.latent_frames,
        geometry.latent_h,
        geometry.latent_w,
        geometry.audio_latents,
        (1, 2, 2),
        2,
        2,
        0,
    )
    names = ["position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"]
    return dict(zip(names + ["num_condition_video_rows", "num_condition_audio_rows"], built, strict=True))


@pytest.mark.parametrize("case", sorted(REF2VA_CASES))
def test_ref2va_layout_matches_reference_builder(case: str) -> None:
    geometry = Geometry.from_canvas(32, 48, 243, vae_spatial_ratio=4, patch=2)
    text_tags = _text_tags(29)
    references = REF2VA_CASES[case]
    reference = _reference_ref2va(text_tags, geometry, references)
    layout = ref2va_layout(text_tags, geometry, references)
    _assert_layout_equal(layout, reference)

    # Row timesteps through diffusers' timestep block, fed the ref2va indices standalone.
    pipeline = _reference_pipeline({"timesteps": MiniMaxH3SetTimestepsStep()}, tiny=False)
    plan = pipeline(
        num_inference_steps=4,
        video_indices=reference["video_indices"],
        audio_indices=reference["audio_indices"],
        text_indices=reference["text_indices"],
        num_condition_video_rows=reference["num_condition_video_rows"],
        num_condition_audio_rows=reference["num_condition_audio_rows"],
        output="row_timestep_plan",
    )
    _assert_row_timesteps_equal(layout, Schedule.build(4, recipe="diffusers"), plan)


def test_row_timesteps_condition_levels() -> None:
    geometry = Geometry.from_canvas(32, 32, 124, vae_spatial_ratio=4, patch=2)
    layout = ref2va_layout(_text_tags(4), geometry, [AudioReference(10), ImageReference(8, 8)])
    timesteps, timestep_index = row_timesteps(layout, 0.25, 0.5)
    assert timesteps.tolist() == [0.25, 0.5, torch.tensor(0.999).item(), 1.0]
    per_row = timesteps[timestep_index]
    assert torch.all(per_row[layout.text_index] == 0.25)
    assert torch.all(per_row[layout.video_index[: layout.num_condition_video_rows]] == timesteps[2])
    assert torch.all(per_row[layout.audio_index[: layout.num_condition_audio_rows]] == 1.0)
    assert torch.all(per_row[layout.audio_index[layout.num_condition_audio_rows :]] == 0.5)

    # Tiny shifts push late video timesteps above 0.999: condition rows then follow the video timestep.
    video_shift, audio_shift = 0.0005, 0.001
    pipeline = _reference_pipeline(
        {"timesteps": MiniMaxH3SetTimestepsStep()}, tiny=False, shifts=(video_shift, audio_shift)
    )
    plan = pipeline(
        num_inference_steps=8,
        video_indices=layout.video_index,
        audio_indices=layout.audio_index,
        text_indices=layout.text_index,
        num_condition_video_rows=layout.num_condition_video_rows,
        num_condition_audio_rows=layout.num_condition_audio_rows,
        output="row_timestep_plan",
    )
    schedule = Schedule.build(8, recipe="diffusers", video_shift=video_shift, audio_shift=audio_shift)
    assert schedule.video_timesteps[-1].item() > 0.999
    _assert_row_timesteps_equal(layout, schedule, plan)


# --- initial noise ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tiny", [True, False])
def test_diffusers_noise_recipe_matches_reference_draws(tiny: bool) -> None:
    if tiny:
        geometry = Geometry.from_canvas(32, 24, 124, vae_spatial_ratio=4, patch=2)
        channels, audio_channels, condition_shapes = 4, 4, [(1, 8, 6), (3, 4, 10), (1, 8, 6)]
    else:
        geometry = Geometry.from_canvas(64, 96, 124)
        channels, audio_channels, condition_shapes = 24, 32, [(1, 4, 6)]
    seed = 20250611
    clean = [
        torch.randn(1, channels, *shape, generator=torch.Generator().manual_seed(i))
        for i, shape in enumerate(condition_shapes)
    ]
    num_condition_rows = sum(t * (h // 2) * (w // 2) for t, h, w in condition_shapes)

    pipeline = _reference_pipeline(
        {"conditions": MiniMaxH3PrepareConditionLatentsStep(), "latents": MiniMaxH3PrepareLatentsStep()},
        tiny=tiny,
    )
    reference = pipeline(
        generator=torch.Generator().manual_seed(seed),
        condition_latents=clean,
        num_condition_video_rows=num_condition_rows,
        num_latent_frames=geometry.latent_frames,
        latent_height=geometry.latent_h,
        latent_width=geometry.latent_w,
        num_audio_latents=geometry.audio_latents,
        output=["condition_rows", "latents", "audio_latents"],
    )

    noise = draw_initial_noise(
        seed,
        geometry,
        recipe="diffusers",
        condition_shapes=condition_shapes,
        video_channels=channels,
        audio_channels=audio_channels,
    )
    assert torch.equal(noise.video_rows, reference["latents"])
    assert torch.equal(noise.audio_rows, reference["audio_latents"])
    noised_conditions = torch.cat(
        [
            noise_condition_rows(patchify_video(latents), rows)
            for latents, rows in zip(clean, noise.condition_video_rows, strict=True)
        ]
    )
    assert torch.equal(noised_conditions, reference["condition_rows"])


def test_sglang_noise_recipe() -> None:
    """The SGLang streams: two independent generators for video/audio, one fresh one per condition."""
    geometry = Geometry.from_canvas(32, 32, 124, vae_spatial_ratio=4, patch=2)
    seed, shapes = 42, [(1, 8, 8), (1, 4, 12)]
    noise = draw_initial_noise(
        seed, geometry, recipe="sglang", condition_shapes=shapes, video_channels=4, audio_channels=4
    )
    expected_video = torch.randn(1, 4, 37, 8, 8, generator=torch.Generator().manual_seed(seed))
    expected_audio = torch.randn(414, 4, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(noise.video_rows, patchify_video(expected_video))
    assert torch.equal(noise.audio_rows, expected_audio)
    for (frames, height, width), rows in zip(shapes, noise.condition_video_rows, strict=True):
        drawn = torch.randn(
            1, 4, 37 + len(shapes), height, width, generator=torch.Generator().manual_seed(seed)
        )
        assert torch.equal(rows, patchify_video(drawn[:, :, :frames]))
    # Same seed, different stream from the diffusers recipe (the documented divergence).
    diffusers_noise = draw_initial_noise(
        seed, geometry, recipe="diffusers", video_channels=4, audio_channels=4
    )
    assert not torch.equal(diffusers_noise.audio_rows, noise.audio_rows)
    for bad_seed in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError):
            draw_initial_noise(bad_seed, geometry, recipe="sglang")
    with pytest.raises(ValueError):
        draw_initial_noise(1, geometry, recipe="numpy")
