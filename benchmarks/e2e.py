"""One whole 768p / 5 s T2VA request at the released size with random weights, on one device, through our pipeline.

What runs is the engine's own code: `pipeline.encode_presentation` (the released-size Qwen3-VL text encoder),
`pipeline.denoise_request` and `pipeline.decode` with the engine's precision rules, writing the MP4 while the video
decodes. No checkpoint is read: every model is built on meta and filled with random tensors through the loaders'
own `ComponentSource.load`. By default each model lives only for its phase; `--resident` keeps all of them, as the
engine's resident profile does. Phases are host timers between device synchronizations, each DiT step is timed on
the device's clock; by default the times are a warm server's (`--no-warmup`: this process's first calls;
`--warm-up-run`: after the app's warm-up). `--timed-steps K` times the first K steps and extrapolates. The
method in full: benchmarks/NOTES.md ("End to end: method").

    python -m benchmarks.e2e --timed-steps 3                                # GPU, released size, JSON to results
    python -m benchmarks.e2e --tiny --device cpu --steps 4 --output-dir /tmp   # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

from benchmarks._common import RESULTS_DIR, device_label, package_version, synchronize
from benchmarks.adapters import random_block_adapter
from h3engine.checkpoint import audio_vae_keys, video_vae_keys
from h3engine.checkpoint.dit_keys import random_native_tensor
from h3engine.checkpoint.loader import ComponentSource
from h3engine.checkpoint.placeholder import RELEASED_TEXT_ENCODER_CONFIG
from h3engine.checkpoint.text_encoder_files import build_tiny_tokenizer, tiny_text_encoder_config
from h3engine.checkpoint.tiny import TINY_CANVAS
from h3engine.engine.conditioning.encode import EncodedConditions
from h3engine.engine.conditioning.presentation import Presentation, text_presentation
from h3engine.engine.lora.adapters import Adapter, apply_adapters
from h3engine.engine.lora.library import TURBO_TABLE
from h3engine.engine.pipeline import (
    DenoisedLatents,
    Models,
    PreparedRequest,
    StepEvent,
    decode,
    denoise_request,
    encode_presentation,
)
from h3engine.engine.sampling.modulation import clear_modulation_cache, offload_adaln
from h3engine.engine.sampling.schedule import RELEASED_AUDIO_SHIFT, RELEASED_VIDEO_SHIFT, Schedule
from h3engine.media import mux
from h3engine.models.audio_vae import AudioVAE, AudioVAEConfig
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig
from h3engine.request.geometry import Geometry
from h3engine.runtime.front import WARM_UP_REQUEST

RECIPE = "sglang"  # the serving recipe: N forwards for N steps
ASPECT = "16:9"
DEFAULT_PROMPT = (
    "A red fox runs across a snowy field at dawn while the camera slowly pans to the left; "
    "the wind hisses through the grass and a crow calls twice in the distance."
)


@dataclass(frozen=True)
class Configs:
    name: str
    text_encoder: Qwen3VLConfig
    dit: DiTConfig
    video_vae: VideoVAEConfig
    audio_vae: AudioVAEConfig
    geometry: Geometry


def configs_for(tiny: bool, seconds: float) -> Configs:
    if tiny:
        dit = DiTConfig.tiny()
        video_vae = VideoVAEConfig.tiny()
        text_encoder = Qwen3VLConfig.from_dict(tiny_text_encoder_config(text_dim=dit.text_dim))
        canvas = {
            "short_edge": TINY_CANVAS["canvas_short_edge"],
            "max_pixels": TINY_CANVAS["canvas_max_pixels"],
        }
        name = "tiny"
    else:
        dit = DiTConfig.released()
        video_vae = VideoVAEConfig.released()
        text_encoder = Qwen3VLConfig.from_dict(RELEASED_TEXT_ENCODER_CONFIG)
        canvas = {}
        name = "released"
    geometry = Geometry.for_request(
        ASPECT,
        seconds,
        vae_spatial_ratio=video_vae.spatial_compression_ratio,
        patch=dit.patch_size[-1],
        **canvas,
    )
    audio_vae = AudioVAEConfig.tiny() if tiny else AudioVAEConfig.released()
    return Configs(name, text_encoder, dit, video_vae, audio_vae, geometry)


# --------------------------------------------------------------------------------------------------------------
# Random models


class InMemoryWeights:
    """Stands in for a component's safetensors files inside `ComponentSource`: `check` receives the shapes the
    module declares, `tensor` hands out one tensor per key (`draw(key, shape)`)."""

    def __init__(self, draw: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
        self._draw = draw
        self._shapes: dict[str, tuple[int, ...]] = {}

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self._shapes = shapes

    def tensor(self, key: str) -> torch.Tensor:
        return self._draw(key, self._shapes[key])


def _same_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return state


def _load_random(
    name: str,
    config: Any,
    build: Callable[[], torch.nn.Module],
    weights: InMemoryWeights,
    device: torch.device,
) -> torch.nn.Module:
    """Through the loaders' own `ComponentSource.load`: meta build, per-key tensors, strict assign, computed
    buffers rebuilt, eval, no grad."""
    source = ComponentSource(name, config, build, weights, _same_names, _same_names)
    return source.load(device)


def build_dit(config: DiTConfig, device: torch.device, seed: int) -> H3DiT:
    """bf16 with the released fp32 islands (the engine's default dtype), drawn on `device`; on a GPU the AdaLN
    projections then go to pinned host memory, as `Engine` loads the DiT."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = InMemoryWeights(lambda key, shape: random_native_tensor(key, shape, config, generator))
    dit = _load_random("random DiT", config, lambda: H3DiT(config, dtype=torch.bfloat16), weights, device)
    if device.type == "cuda":
        offload_adaln(dit)  # as the engine does on a GPU: the projections stream from pinned host memory
    return dit


def _from_state(state: dict[str, torch.Tensor]) -> InMemoryWeights:
    return InMemoryWeights(lambda key, shape: state[key])


def build_video_vae(config: VideoVAEConfig, device: torch.device, seed: int) -> VideoVAE:
    state = video_vae_keys.random_native_state(config, seed)
    return _load_random("random video VAE", config, lambda: VideoVAE(config), _from_state(state), device)


def build_audio_vae(config: AudioVAEConfig, device: torch.device, seed: int) -> AudioVAE:
    state = audio_vae_keys.random_native_state(config, seed)
    return _load_random("random audio VAE", config, lambda: AudioVAE(config), _from_state(state), device)


def _random_text_encoder_tensor(
    key: str, shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    if "norm" in key and key.endswith(".weight"):
        values = 1.0 + 0.1 * noise
    elif key.endswith(".bias"):
        values = 0.1 * noise
    elif key.endswith("embed_tokens.weight"):
        values = 0.5 * noise
    else:
        values = noise / math.sqrt(math.prod(shape[1:]))
    return values.to(dtype)


def build_text_encoder(
    config: Qwen3VLConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> H3TextEncoder:
    """`H3TextEncoder` built the way `load_text_encoder` builds it, with random tensors drawn on `device`."""
    with torch.device("meta"):
        encoder = H3TextEncoder(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {
        key: _random_text_encoder_tensor(key, tuple(tensor.shape), generator, dtype)
        for key, tensor in encoder.state_dict().items()
    }
    encoder.load_state_dict(state, strict=True, assign=True)
    del state
    # The rotary tables are computed, not stored: the same rebuild (and meta check) `load_text_encoder` runs.
    encoder.rebuild_computed_buffers(device)
    return encoder.eval().requires_grad_(False)


class EncodedText:
    """The text encoder's place inside `denoise_request` once the real encoder has run (and, by default, been
    freed): it hands back the states the real one computed, so the denoise still runs the pipeline's own code."""

    def __init__(self, states: torch.Tensor) -> None:
        self._states = states

    def parameters(self) -> Iterator[torch.Tensor]:
        yield self._states

    def encode(self, input_ids: torch.Tensor, **vision_inputs: torch.Tensor) -> torch.Tensor:
        return self._states


# --------------------------------------------------------------------------------------------------------------
# Request pieces


def benchmark_presentation(prompt: str, text_rows: int) -> tuple[Presentation, int]:
    """The T2VA presentation of `prompt` with the tiny tokenizer, its ids tiled or cut to `text_rows` rows (0: as
    tokenized); returns it and the prompt's own token count."""
    presentation = text_presentation(build_tiny_tokenizer(), prompt)
    prompt_tokens = presentation.num_rows
    if text_rows == 0 or text_rows == prompt_tokens:
        return presentation, prompt_tokens
    repeats = -(-text_rows // prompt_tokens)
    fitted = Presentation(
        input_ids=presentation.input_ids.repeat(1, repeats)[:, :text_rows],
        row_tags=presentation.row_tags.repeat(repeats)[:text_rows],
    )
    return fitted, prompt_tokens


@dataclass(frozen=True, eq=False)
class SchedulePrefix(Schedule):
    """The first steps of a Schedule: its grid cut after some point. It does not end at sigma 0, which is the one
    check of `Schedule` it leaves out."""

    def __post_init__(self) -> None:
        if self.video_sigmas.numel() != self.audio_sigmas.numel():
            raise ValueError("video and audio grids of a schedule prefix must have the same length")


def first_steps(schedule: Schedule, count: int) -> Schedule:
    if count == schedule.num_steps:
        return schedule
    return SchedulePrefix(schedule.video_sigmas[: count + 1], schedule.audio_sigmas[: count + 1])


def free_device_memory(device: torch.device) -> None:
    """Give a dropped model's device memory back (a CPU run has nothing to measure, so it skips the collection)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


class StepTimer:
    """Each DiT step's time on the device's own clock, through the pipeline's hooks: a step starts at the last
    `should_cancel` poll before it (`before_step`; the pipeline polls between its other phases too) and ends at
    the `on_step` call that follows it (`after_step`)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._last_poll: Any = None
        self._starts: list[Any] = []
        self._ends: list[Any] = []

    def _mark(self) -> Any:
        if self._device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def before_step(self) -> bool:
        self._last_poll = self._mark()
        return False  # never cancels

    def after_step(self, event: StepEvent) -> None:
        self._starts.append(self._last_poll)
        self._ends.append(self._mark())

    def seconds(self) -> list[float]:
        synchronize(self._device)
        if self._device.type != "cuda":
            return [end - start for start, end in zip(self._starts, self._ends, strict=True)]
        return [start.elapsed_time(end) / 1000.0 for start, end in zip(self._starts, self._ends, strict=True)]


class Measurements:
    """Seconds (host timer between device synchronizations) and peak device memory of named spans."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        self.resident_gib: dict[str, float] = {}

    def _allocated_gib(self) -> float:
        return torch.cuda.memory_allocated(self._device) / 2**30

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        on_gpu = self._device.type == "cuda"
        synchronize(self._device)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self._device)
            allocated_before = self._allocated_gib()
        started = time.perf_counter()
        yield
        synchronize(self._device)
        self.seconds[name] = time.perf_counter() - started
        if on_gpu:
            self.peak_gib[name] = torch.cuda.max_memory_allocated(self._device) / 2**30
            self.resident_gib[name] = self._allocated_gib() - allocated_before


def denoise_estimate(
    step_seconds: list[float],
    outside_steps_s: float,
    measured_s: float,
    steps: int,
    warm: bool,
    warm_first_step_s: float | None = None,
) -> tuple[float, str]:
    """The denoise time of all `steps` from the timed ones, and how it was made. Warm: the first step is the
    warm-up (kernel compilation, autotuning, library set-up, paid once per process), the others give the rate; a
    warm request's own first step (`warm_first_step_s`, from `warm_repeat`), when measured, stands in for it, since
    the AdaLN tables are built while that step runs. Cold: this process's own time, the first step counted once."""
    if warm and warm_first_step_s is not None:
        return (
            outside_steps_s + warm_first_step_s + statistics.fmean(step_seconds[1:]) * (steps - 1),
            "denoise_outside_steps_s + warm_repeat's first step (tables built alongside) + step_mean_after_first_s "
            "x (steps - 1) (the request's own first step is the warm-up)",
        )
    if warm:
        return (
            outside_steps_s + statistics.fmean(step_seconds[1:]) * steps,
            "denoise_outside_steps_s + step_mean_after_first_s x steps (the first step is the warm-up)",
        )
    if len(step_seconds) == steps:
        return measured_s, "measured: every step, the first one cold"
    if len(step_seconds) == 1:
        return outside_steps_s + step_seconds[
            0
        ] * steps, "denoise_outside_steps_s + the one (cold) step x steps"
    return (
        outside_steps_s + step_seconds[0] + statistics.fmean(step_seconds[1:]) * (steps - 1),
        "denoise_outside_steps_s + the cold first step + step_mean_after_first_s x (steps - 1)",
    )


def tensor_summary(tensor: torch.Tensor) -> dict[str, Any]:
    values = tensor.detach().float()
    return {
        "shape": list(tensor.shape),
        "finite": bool(torch.isfinite(values).all().item()),
        "std": values.std().item(),
        "min": values.min().item(),
        "max": values.max().item(),
    }


def parameter_count(module: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


# --------------------------------------------------------------------------------------------------------------
# The run


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny configs and canvas (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--steps", type=int, default=50, help="steps of the schedule (sglang recipe: forwards)"
    )
    parser.add_argument(
        "--timed-steps",
        type=int,
        default=None,
        help="run only the first K steps and extrapolate the denoise time from their mean (default: all)",
    )
    parser.add_argument(
        "--text-rows",
        type=int,
        default=512,
        help="text rows the prompt's ids are tiled or cut to (0: as tokenized)",
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="requested duration (snapped to 17n+5 frames)"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the request")
    parser.add_argument("--resident", action="store_true", help="build every model first and keep them all")
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="report first-call times (JIT, autotuning, library set-up) instead of a warm server's",
    )
    parser.add_argument(
        "--repeat-steps",
        type=int,
        default=None,
        help="after the request's steps, time the first K steps of a second request on the warm DiT with its AdaLN "
        "tables rebuilt ('warm_repeat' in the JSON; default min(2, --steps); 0: skip)",
    )
    parser.add_argument(
        "--warm-up-run",
        action="store_true",
        help="with --resident: before the request, run the app's warm-up (h3engine.runtime.front.WARM_UP_REQUEST: "
        "its duration at this canvas, one step, decoded) and report its time ('warm_up_run_s'); with --no-warmup "
        "the request's first-call times then show what the warm-up leaves",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="run the DiT with a random adapter of this rank on every block linear (benchmarks.adapters; 0: none)",
    )
    parser.add_argument(
        "--turbo",
        action="store_true",
        help="the Turbo preset's table (h3engine.engine.lora.library.TURBO_TABLE: 8 steps, flow shifts 6 / 3) instead of "
        "--steps and the released shifts",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.shifts = {"video_shift": RELEASED_VIDEO_SHIFT, "audio_shift": RELEASED_AUDIO_SHIFT}
    if args.turbo:
        args.steps = TURBO_TABLE.steps
        args.shifts = {"video_shift": TURBO_TABLE.flow_shift, "audio_shift": TURBO_TABLE.audio_flow_shift}
    if args.warm_up_run and not args.resident:
        parser.error("--warm-up-run needs --resident (it runs on the models the request then uses)")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.timed_steps is not None and not 1 <= args.timed_steps <= args.steps:
        parser.error(f"--timed-steps must be in [1, --steps = {args.steps}], got {args.timed_steps}")
    if args.warmup and min(args.steps, args.timed_steps or args.steps) < 2:
        parser.error("the first timed step is the DiT's warm-up: time at least 2 steps, or pass --no-warmup")
    if args.repeat_steps is None:
        args.repeat_steps = min(2, args.steps)
    if not 0 <= args.repeat_steps <= args.steps:
        parser.error(f"--repeat-steps must be in [0, --steps = {args.steps}], got {args.repeat_steps}")
    if not args.seconds > 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    if args.text_rows < 0:
        parser.error(f"--text-rows must be >= 0, got {args.text_rows}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is available here (use --tiny --device cpu for the smoke test)")
    return args


def run_app_warm_up(
    resident: dict[str, torch.nn.Module],
    args: argparse.Namespace,
    device: torch.device,
    video_decode_autocast: torch.dtype | None,
    presentation: Presentation,
) -> float:
    """What the app's warm-up runs (`WARM_UP_REQUEST`: its duration at this canvas, its steps, decoded), on the
    resident models; the seconds it took."""
    geometry = configs_for(args.tiny, WARM_UP_REQUEST.duration_seconds).geometry
    models = Models(
        dit=resident["dit"],
        video_vae=resident["video_vae"],
        audio_vae=resident["audio_vae"],
        text_encoder=resident["text_encoder"],
        tokenizer=None,
        video_decode_autocast=video_decode_autocast,
    )
    schedule = Schedule.build(WARM_UP_REQUEST.steps, recipe=RECIPE)
    started = time.perf_counter()
    with torch.inference_mode():
        prepared = PreparedRequest(
            geometry, presentation, EncodedConditions(task="t2va"), schedule, args.seed, RECIPE
        )
        latents = denoise_request(models, prepared, device)
        decode(models, latents.video_latents, latents.audio_latents)
    synchronize(device)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """The request, measured; returns the result record and the path it belongs at."""
    device = torch.device(args.device)
    configs = configs_for(args.tiny, args.seconds)
    geometry = configs.geometry
    # The engine's precision rules (ModelStore.models_for_partition): bf16 models, fp16-autocast video
    # decode on a GPU.
    dtype = torch.bfloat16
    video_decode_autocast = torch.float16 if device.type == "cuda" else None
    schedule = Schedule.build(args.steps, recipe=RECIPE, **args.shifts)
    timed_steps = args.timed_steps or schedule.num_steps
    extrapolated = timed_steps < schedule.num_steps
    presentation, prompt_tokens = benchmark_presentation(args.prompt, args.text_rows)
    vocab_size = configs.text_encoder.text_config.vocab_size
    if int(presentation.input_ids.max()) >= vocab_size:
        raise ValueError(
            f"the tokenizer gave id {int(presentation.input_ids.max())}, the encoder has {vocab_size} rows"
        )
    conditions = EncodedConditions(task="t2va")
    layout = conditions.layout(presentation.row_tags, geometry)
    print(
        f"{configs.name}: {geometry.width}x{geometry.height}, {geometry.frames} frames; rows: "
        f"{layout.num_text_rows} text + {layout.num_target_audio_rows} audio + {layout.num_target_video_rows} video "
        f"= {layout.sequence_length}; {timed_steps} of {schedule.num_steps} steps; "
        f"{'resident' if args.resident else 'one model at a time'}",
        flush=True,
    )

    builds, phases, first_calls = Measurements(device), Measurements(device), Measurements(device)
    parameters: dict[str, int] = {}
    stats: dict[str, dict[str, Any]] = {}

    def build(name: str, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        with torch.no_grad(), builds.span(name):
            module = make()
        parameters[name] = parameter_count(module)
        print(f"built {name} in {builds.seconds[name]:.1f} s", flush=True)
        return module

    def build_encoder() -> H3TextEncoder:
        return build_text_encoder(configs.text_encoder, device, dtype, args.seed)

    def build_diffusion() -> H3DiT:
        dit = build_dit(configs.dit, device, args.seed)
        if args.lora_rank:
            lora = random_block_adapter(configs.dit, args.lora_rank, args.seed)
            apply_adapters(dit, [Adapter(lora, 1.0, "transformer")], device)
        return dit

    def build_vaes() -> tuple[torch.nn.Module, torch.nn.Module]:
        return (
            build("video_vae", lambda: build_video_vae(configs.video_vae, device, args.seed)),
            build("audio_vae", lambda: build_audio_vae(configs.audio_vae, device, args.seed)),
        )

    resident: dict[str, torch.nn.Module] = {}
    if args.resident:
        resident["text_encoder"] = build("text_encoder", build_encoder)
        resident["dit"] = build("dit", build_diffusion)
        resident["video_vae"], resident["audio_vae"] = build_vaes()

    warm_up_run_s = None
    if args.warm_up_run:
        warm_up_run_s = run_app_warm_up(resident, args, device, video_decode_autocast, presentation)
        print(f"warm-up run in {warm_up_run_s:.1f} s", flush=True)

    encoder = resident["text_encoder"] if args.resident else build("text_encoder", build_encoder)
    encoder_attention = encoder.model.config._attn_implementation
    encode_models = Models(dit=None, video_vae=None, audio_vae=None, text_encoder=encoder, tokenizer=None)
    if args.warmup:
        with torch.inference_mode(), first_calls.span("text_encode"):
            encode_presentation(encode_models, presentation, device)
    with torch.inference_mode(), phases.span("text_encode"):
        text_states = encode_presentation(encode_models, presentation, device)
    stats["text_states"] = tensor_summary(text_states)
    del encoder, encode_models
    free_device_memory(device)

    dit = resident["dit"] if args.resident else build("dit", build_diffusion)
    denoise_models = Models(
        dit=dit, video_vae=None, audio_vae=None, text_encoder=EncodedText(text_states), tokenizer=None
    )

    def denoise_steps(models: Models, step_count: int, timer: StepTimer) -> DenoisedLatents:
        """The request's first `step_count` steps, each timed by `timer`."""
        with torch.inference_mode():
            prepared = PreparedRequest(
                geometry, presentation, conditions, first_steps(schedule, step_count), args.seed, RECIPE
            )
            return denoise_request(
                models, prepared, device, on_step=timer.after_step, should_cancel=timer.before_step
            )

    timer = StepTimer(device)
    with phases.span("denoise_request"):
        latents = denoise_steps(denoise_models, timed_steps, timer)
    step_seconds = timer.seconds()
    warm_repeat = None
    if args.repeat_steps:
        # A second request's first steps on the now warm DiT, its AdaLN tables rebuilt (as for a new schedule):
        # what a warm server's request pays around its first step, the tables' streaming included.
        clear_modulation_cache(dit)
        repeat_timer = StepTimer(device)
        repeat = denoise_steps(denoise_models, args.repeat_steps, repeat_timer)
        repeat_seconds = repeat_timer.seconds()
        warm_repeat = {
            "adaln_tables": "rebuilt (the DiT's table cache cleared first)",
            "step_s": repeat_seconds,
            "denoise_outside_steps_s": repeat.timings["denoise_s"] - sum(repeat_seconds),
        }
        del repeat
    del denoise_models
    stats["video_latents"] = tensor_summary(latents.video_latents)
    stats["audio_latents"] = tensor_summary(latents.audio_latents)
    del dit
    free_device_memory(device)

    video_vae, audio_vae = (resident["video_vae"], resident["audio_vae"]) if args.resident else build_vaes()
    decode_models = Models(
        dit=None,
        video_vae=video_vae,
        audio_vae=audio_vae,
        text_encoder=None,
        tokenizer=None,
        video_decode_autocast=video_decode_autocast,
    )
    if args.warmup:
        # One decode window (every tile shape of the full decode) and the whole audio.
        window = configs.video_vae.latents_per_clip + configs.video_vae.window_overlap_latents
        with torch.inference_mode(), first_calls.span("decode_one_window"):
            decode(decode_models, latents.video_latents[:, :, :window], latents.audio_latents)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = (
        f"e2e_{device_label(device)}_{datetime.date.today().strftime('%Y%m%d')}{'_tiny' if args.tiny else ''}"
        f"{f'_{args.steps}steps' if args.steps != 50 else ''}{f'_lora{args.lora_rank}' if args.lora_rank else ''}"
        f"{'_turbo' if args.turbo else ''}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        # A partly denoised clip is muxed for its time only; the file is kept when every step ran. The engine's
        # path: the MP4 is written while the video decodes (pipeline.decode with a path).
        mp4_path = (args.output_dir if not extrapolated else Path(scratch)) / f"{stem}.mp4"
        with torch.inference_mode(), phases.span("decode_and_mux"):
            video, audio, decode_timings = decode(
                decode_models, latents.video_latents, latents.audio_latents, mp4_path
            )
    stats["video"] = tensor_summary(video)
    stats["audio"] = tensor_summary(audio)

    pipeline_denoise_s = latents.timings["denoise_s"]
    denoise_outside_steps_s = pipeline_denoise_s - sum(step_seconds)
    denoise_s, denoise_definition = denoise_estimate(
        step_seconds,
        denoise_outside_steps_s,
        pipeline_denoise_s,
        schedule.num_steps,
        args.warmup,
        warm_repeat["step_s"][0] if warm_repeat is not None and args.warmup else None,
    )
    if args.warmup:
        first_calls.seconds["dit_first_step"] = step_seconds[0]
    denoise_prep_s = phases.seconds["denoise_request"] - pipeline_denoise_s
    request_s = phases.seconds["text_encode"] + denoise_prep_s + denoise_s + phases.seconds["decode_and_mux"]
    peaks = {**{f"build_{k}": v for k, v in builds.peak_gib.items()}, **phases.peak_gib}
    result = {
        "benchmark": "e2e",
        "config": configs.name,
        "task": "t2va",
        "requested_seconds": args.seconds,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "flash_attn_4": package_version("flash-attn-4"),
        "environment": {name: os.environ.get(name) for name in ("H3_ATTENTION", "H3_KERNELS")},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seed": args.seed,
        "order": "resident (every model built first, all kept)"
        if args.resident
        else "one model at a time: encoder, encode, free; DiT, denoise, free; VAEs, decode; mux",
        "weights": "random: DiT (dit_keys.random_native_tensor) and text encoder drawn on the device, VAEs from "
        "their random_native_state recipes; built on meta and assigned, no checkpoint read",
        "precision": {
            "text_encoder": "bfloat16",
            "text_encoder_attention": encoder_attention,
            "dit": "bfloat16 with the released fp32 islands",
            "video_decode": "fp32 weights under float16 autocast"
            if video_decode_autocast is not None
            else "float32",
            "audio_decode": "float32",
        },
        "video_decode_tiles_per_call": video_vae.decode_batch_tiles,
        "x264_thread_type": mux.ENCODER_THREAD_TYPE,
        "tokenizer": {
            "name": "tiny byte-level BPE of the tiny checkpoints (text_encoder_files.build_tiny_tokenizer)",
            "prompt": args.prompt,
            "prompt_tokens": prompt_tokens,
            "text_rows": presentation.num_rows,
            "fitted": "prompt ids tiled or cut to text_rows"
            if presentation.num_rows != prompt_tokens
            else "none",
            "max_token_id": int(presentation.input_ids.max()),
            "model_vocab_size": vocab_size,
        },
        "shapes": {
            "width": geometry.width,
            "height": geometry.height,
            "frames": geometry.frames,
            "latent_frames": geometry.latent_frames,
            "latent_h": geometry.latent_h,
            "latent_w": geometry.latent_w,
            "audio_latents_per_channel": geometry.audio_latents,
            "text_rows": layout.num_text_rows,
            "video_rows": layout.num_target_video_rows,
            "audio_rows": layout.num_target_audio_rows,
            "sequence_rows": layout.sequence_length,
            "text_hidden": int(text_states.shape[-1]),
        },
        "parameters": parameters,
        "schedule": {
            "recipe": RECIPE,
            "steps": schedule.num_steps,
            "timed_steps": timed_steps,
            "flow_shifts": [args.shifts["video_shift"], args.shifts["audio_shift"]],
            "turbo_preset": args.turbo,
        },
        "lora_rank": args.lora_rank,
        "extrapolated": extrapolated,
        "build_s": builds.seconds,
        "phases_s": {
            "text_encode": phases.seconds["text_encode"],
            "denoise_prep": denoise_prep_s,
            "denoise_timed": pipeline_denoise_s,
            "audio_decode": decode_timings["audio_decode_s"],
            "video_decode": decode_timings["video_decode_s"],
            "mux_overlapped": decode_timings["mux_s"],
            "mux_after_decode": decode_timings["mux_after_decode_s"],
            "decode_and_mux": phases.seconds["decode_and_mux"],
        },
        "step_s": step_seconds,
        "step_mean_s": statistics.fmean(step_seconds),
        "step_mean_after_first_s": statistics.fmean(step_seconds[1:]) if len(step_seconds) > 1 else None,
        "denoise_s": denoise_s,
        "denoise_outside_steps_s": denoise_outside_steps_s,
        "warm_repeat": warm_repeat,
        "denoise_definition": denoise_definition,
        "request_s": request_s,
        "request_definition": "text_encode + denoise_prep + denoise_s + decode_and_mux (no model builds; the MP4 is "
        "written while the video decodes, mux_after_decode is what the writer took after the last window)",
        "warmup": args.warmup,
        "first_call_s": first_calls.seconds or None,
        "warm_up_run_s": warm_up_run_s,
        "peak_gpu_memory_gib": max(peaks.values()) if peaks else None,
        "peak_gpu_memory_gib_by_span": peaks or None,
        "model_gpu_memory_gib": builds.resident_gib or None,
        "outputs": stats,
        "outputs_finite": all(summary["finite"] for summary in stats.values()),
        "mp4": None if extrapolated else str(mp4_path),
    }
    return result, args.output_dir / f"{stem}.json"


def main(argv: list[str] | None = None) -> Path:
    args = parse_arguments(argv)
    result, output_path = run(args)
    phases = result["phases_s"]
    peak = result["peak_gpu_memory_gib"]
    print(
        f"text encode {phases['text_encode']:.3f} s; steps {', '.join(f'{t:.3f}' for t in result['step_s'])} s; "
        f"denoise {result['denoise_s']:.1f} s ({result['denoise_definition']}); decode and mux "
        f"{phases['decode_and_mux']:.2f} s (audio {phases['audio_decode']:.2f}, video {phases['video_decode']:.2f}, "
        f"mux {phases['mux_overlapped']:.2f} of which {phases['mux_after_decode']:.2f} after the decode); "
        f"request {result['request_s']:.1f} s; peak {'-' if peak is None else f'{peak:.1f}'} GiB; "
        f"outputs finite: {result['outputs_finite']}"
    )
    output_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output_path}")
    return output_path


if __name__ == "__main__":
    main()
