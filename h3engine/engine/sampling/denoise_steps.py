"""A request's denoising loop (`denoise`, which h3engine.engine.pipeline runs between the text encode and the
decode) and its pieces.

`initial_rows` packs the condition rows before the seed's noise; `start_hold` puts a remix's held rows on the device,
or gives `NO_HOLD`, whose methods hand their input back, so the loop reads the same with or without a hold.
`DenoiseSteps` does the request-static work once (every step's row timesteps, the AdaLN tables of the schedule, the
DiT layout of each distinct per-row timestep index) and then runs one step at a time: a guidance-free DiT forward on
the whole packed sequence, then the Euler update of the target rows. Condition rows are re-fed unchanged; the rows
stay fp32 whatever the DiT's compute dtype. `target_latents` reads the generated latents back out of the rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from h3engine.engine import trace
from h3engine.engine.conditioning.encode import EncodedConditions
from h3engine.engine.sampling.hold import ActiveHold, HeldRows
from h3engine.engine.sampling.modulation import schedule_modulation
from h3engine.engine.sampling.noise import InitialNoise, noise_condition_rows
from h3engine.engine.sampling.packing import (
    PackedLayout,
    patchify_video,
    row_timesteps,
    rows_to_audio_latents,
    unpatchify_video,
)
from h3engine.engine.sampling.pdd import StepHeads
from h3engine.engine.sampling.schedule import Schedule, euler_step
from h3engine.engine.sampling.step_cache import StepCache
from h3engine.errors import GenerationCancelled
from h3engine.models.parallel.dit import modality_rows
from h3engine.request.geometry import Geometry


def check_cancelled(should_cancel: Callable[[], bool] | None) -> None:
    """Raise GenerationCancelled when `should_cancel` says so (a None never cancels)."""
    if should_cancel is not None and should_cancel():
        raise GenerationCancelled("generation cancelled")


# Where a request's AdaLN tables came from (h3engine.engine.sampling.modulation.ScheduleModulation.source) -> the timing
# that records their seconds; the sidecar's "adaln_tables" says "computed" or "cache" from it.
ADALN_TIMING = {
    "computed": "adaln_tables_computed_s",
    "cache": "adaln_tables_cached_s",
    "memory": "adaln_tables_cached_s",
}


class NoHold:
    """The hold of a request that keeps no rows at a source (`ActiveHold`'s methods, each handing its input back)."""

    def row_timesteps(
        self,
        layout: PackedLayout,
        plain: tuple[torch.Tensor, torch.Tensor],
        video: tuple[float, float],
        audio: tuple[float, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return plain

    def start(self, video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return video, audio

    def inputs(
        self, video: torch.Tensor, audio: torch.Tensor, first_video: int, first_audio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return video, audio

    def velocities(self, video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return video, audio

    def restore(self, video: torch.Tensor, audio: torch.Tensor, first_video: int, first_audio: int) -> None:
        pass


NO_HOLD = NoHold()
# What the loop holds: a remix's rows on the device (h3engine.engine.sampling.hold), or nothing.
Hold = ActiveHold | NoHold


def pack_condition_rows(
    conditions: EncodedConditions, noise: InitialNoise, patch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The leading (condition) video and audio rows, fp32 CPU, in packed order: visual conditions noised to
    t = 0.999 with the request's condition noise, reference audio clean."""
    video_rows = [noise.video_rows[:0]] + [
        noise_condition_rows(patchify_video(latents, patch), noise_rows)
        for latents, noise_rows in zip(conditions.visual_latents, noise.condition_video_rows, strict=True)
    ]
    audio_rows = [noise.audio_rows[:0]] + [rows.to(torch.float32) for rows in conditions.audio_rows]
    return torch.cat(video_rows), torch.cat(audio_rows)


def initial_rows(
    conditions: EncodedConditions, noise: InitialNoise, layout: PackedLayout, patch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed video and audio rows the first step reads, on `device`: the condition rows, then the seed's noise.
    RuntimeError when the conditioning does not pack into the rows the layout reserves for it."""
    condition_video_rows, condition_audio_rows = pack_condition_rows(conditions, noise, patch)
    if condition_video_rows.shape[0] != layout.num_condition_video_rows or (
        condition_audio_rows.shape[0] != layout.num_condition_audio_rows
    ):
        raise RuntimeError(
            f"the layout reserves {layout.num_condition_video_rows} video / {layout.num_condition_audio_rows} audio "
            f"condition rows, the conditioning packs into {condition_video_rows.shape[0]} / "
            f"{condition_audio_rows.shape[0]}"
        )
    if trace.active() is not None:
        trace.record_request_start(condition_video_rows, condition_audio_rows, noise, layout)
    video_rows = torch.cat([condition_video_rows, noise.video_rows]).to(device)
    audio_rows = torch.cat([condition_audio_rows, noise.audio_rows]).to(device)
    return video_rows, audio_rows


def start_hold(
    held: HeldRows | None,
    noise: InitialNoise,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    layout: PackedLayout,
    device: torch.device,
) -> Hold:
    """`held` on the device with its kept target rows put into `video_rows` / `audio_rows` (in place); `NO_HOLD`
    when the request holds no rows (plain generation)."""
    if held is None:
        return NO_HOLD
    hold = ActiveHold(held, noise.video_rows, noise.audio_rows, device)
    first_video, first_audio = layout.num_condition_video_rows, layout.num_condition_audio_rows
    video_rows[first_video:], audio_rows[first_audio:] = hold.start(
        video_rows[first_video:], audio_rows[first_audio:]
    )
    return hold


def target_latents(
    video_rows: torch.Tensor, audio_rows: torch.Tensor, layout: PackedLayout, geometry: Geometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated rows after the last step as latents: video [1, C, T, h, w], audio [2, C, A] (normalized)."""
    video_latents = unpatchify_video(
        video_rows[layout.num_condition_video_rows :],
        geometry.latent_frames,
        geometry.latent_h,
        geometry.latent_w,
        geometry.patch,
    )
    audio_latents = rows_to_audio_latents(audio_rows[layout.num_condition_audio_rows :])
    return video_latents, audio_latents


def layout_on(layout: PackedLayout, device: torch.device) -> PackedLayout:
    """The layout's index and position tensors on the compute device (done once per request)."""
    return dataclasses.replace(
        layout,
        tags=layout.tags.to(device),
        positions=layout.positions.to(device),
        video_index=layout.video_index.to(device),
        audio_index=layout.audio_index.to(device),
        text_index=layout.text_index.to(device),
    )


class DenoiseSteps:
    """The steps of `schedule` on one request's packed rows (`layout` on the compute device), one `run` each.

    Made before the loop: every step's row timesteps (CPU, with the hold's put in), the AdaLN tables of the whole
    schedule (`modulation`, cached on the DiT per schedule) and, as the steps come, the RoPE tables and row indices
    of each distinct per-row timestep index (it changes only where two modalities' timesteps coincide, e.g. both 0
    at the first step). `step_cache` runs each forward's blocks (it may skip the middle ones); None runs them all.
    """

    def __init__(
        self,
        dit: torch.nn.Module,
        text_states: torch.Tensor,
        layout: PackedLayout,
        schedule: Schedule,
        step_cache: StepCache | None,
        hold: Hold,
        device: torch.device,
    ) -> None:
        self.dit, self.text_states, self.schedule = dit, text_states, schedule
        self.step_cache, self.hold, self.device = step_cache, hold, device
        self.first_video = layout.num_condition_video_rows
        self.first_audio = layout.num_condition_audio_rows
        self.step_rows = [
            hold.row_timesteps(
                layout,
                row_timesteps(
                    layout, float(schedule.video_timesteps[step]), float(schedule.audio_timesteps[step])
                ),
                (float(schedule.video_timesteps[step]), float(schedule.video_sigmas[step])),
                (float(schedule.audio_timesteps[step]), float(schedule.audio_sigmas[step])),
            )
            for step in range(schedule.num_steps)
        ]
        self.modulation = schedule_modulation(dit, [timesteps for timesteps, _ in self.step_rows], device)
        # A PDD adapter's blended interval heads, one set a step (none without one).
        self.heads = StepHeads(dit, schedule)
        # Per-row timestep index (CPU bytes) -> (that index on the device, its prepared DiT layout).
        self.packed_layouts: dict[bytes, tuple[torch.Tensor, object]] = {}
        # What the DiT reads of the request's rows besides the timestep index, in its argument order.
        self.row_layout = (
            layout.tags,
            layout.positions,
            layout.video_index,
            layout.audio_index,
            layout.text_index,
        )

    def packed_layout(self, step: int) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(the step's timesteps (CPU), its per-row timestep index on the device, the DiT layout of that index)."""
        timesteps, timestep_index = self.step_rows[step]
        index_key = timestep_index.numpy().tobytes()
        if index_key not in self.packed_layouts:
            timestep_index = timestep_index.to(self.device, non_blocking=True)
            self.packed_layouts[index_key] = (
                timestep_index,
                self.dit.prepare_layout(timestep_index, *self.row_layout),
            )
        return (timesteps, *self.packed_layouts[index_key])

    def run(self, step: int, video_rows: torch.Tensor, audio_rows: torch.Tensor) -> None:
        """Step `step`: one DiT forward on the packed rows, then the Euler update of the target rows (in place)."""
        first_video, first_audio, schedule = self.first_video, self.first_audio, self.schedule
        timesteps, timestep_index, packed_layout = self.packed_layout(step)
        # "off" passes nothing more: the call it always was.
        cached = {}
        if self.step_cache is not None:
            self.step_cache.use_rows(*modality_rows(packed_layout))
            cached = {"blocks_runner": self.step_cache.run}
        video_input, audio_input = self.hold.inputs(video_rows, audio_rows, first_video, first_audio)
        with self.heads.armed(step):
            video_velocity, audio_velocity = self.dit(
                video_input,
                audio_input,
                self.text_states,
                timesteps.to(self.device, non_blocking=True),
                timestep_index,
                *self.row_layout,
                layout=packed_layout,
                modulation=self.modulation[step],
                **cached,
            )
        # The DiT's velocities are fp32, so `float()` hands back the same tensors.
        video_velocity, audio_velocity = self.hold.velocities(
            video_velocity[first_video:].float(), audio_velocity[first_audio:].float()
        )
        video_rows[first_video:] = euler_step(
            video_rows[first_video:],
            video_velocity,
            schedule.video_timesteps[step],
            schedule.video_sigmas[step],
            schedule.video_sigmas[step + 1],
        )
        audio_rows[first_audio:] = euler_step(
            audio_rows[first_audio:],
            audio_velocity,
            schedule.audio_timesteps[step],
            schedule.audio_sigmas[step],
            schedule.audio_sigmas[step + 1],
        )
        self.hold.restore(video_rows, audio_rows, first_video, first_audio)
        if trace.active() is not None:
            generated = (first_video, first_audio)
            trace.record_step(
                step, schedule.num_steps, generated, video_velocity, audio_velocity, video_rows, audio_rows
            )


def denoise(
    dit: torch.nn.Module,
    text_states: torch.Tensor,
    layout: PackedLayout,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    schedule: Schedule,
    on_step: Callable[[int, float], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    step_cache: StepCache | None = None,
    hold: Hold = NO_HOLD,
    timings: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every step of the schedule on the packed rows; returns the final (video_rows, audio_rows), fp32.
    `on_step(steps done, seconds since the first step began)` follows each step; `should_cancel` is polled before
    each. `step_cache` runs each forward's blocks (it may skip the middle ones); None runs them all, as always.
    `hold` keeps some target rows at source latents (h3engine.engine.sampling.hold); `NO_HOLD` is the plain loop.
    `timings` gets the seconds the AdaLN tables took, under a name that says whether any were computed
    (`ADALN_TIMING`); tables computed here go to the DiT's disk cache once the last step has used them."""
    steps = DenoiseSteps(dit, text_states, layout, schedule, step_cache, hold, video_rows.device)
    if timings is not None:
        timings[ADALN_TIMING[steps.modulation.source]] = steps.modulation.seconds
    started = time.perf_counter()
    for step in range(schedule.num_steps):
        check_cancelled(should_cancel)
        steps.run(step, video_rows, audio_rows)
        if on_step is not None:
            on_step(step + 1, time.perf_counter() - started)
    steps.modulation.persist()
    return video_rows, audio_rows
