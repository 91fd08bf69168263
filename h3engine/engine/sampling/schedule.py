"""Sigma schedules and the Euler update of MiniMax H3's rectified-flow sampler.

``sigma`` is the noise fraction (1 = pure noise, 0 = clean); the DiT is conditioned on ``t = 1 - sigma`` (t = 1 is
clean, fed unscaled). Video and audio run separate schedules (shift 12 and 3) with the same number of grid points,
one DiT forward per step for both. For a request of ``num_inference_steps = N`` (docs/MODEL.md §8.1), ``"sglang"``
takes N + 1 grid points (N forwards, the README's serving path) and ``"diffusers"`` N grid points (N - 1 forwards,
as diffusers 0.42.1's ``MiniMaxH3Scheduler``, whose ``set_timesteps(N)`` counts the terminal 0). A step-distilled
checkpoint (``_minimax_h3.dmd_denoising_steps``) runs its rungs instead, as SGLang does: the positions
``rung / 1000`` and 0, each modality's shift applied to them, one forward per rung (`Schedule.from_rungs`).

Danger (bit parity): the grid is built in fp32 on the CPU in the reference's operation order (`shifted_sigmas`), and
the Euler update keeps the timestep the DiT saw apart from the grid's sigmas, one fp32 op at a time (`euler_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULE_RECIPES = ("sglang", "diffusers")

RELEASED_VIDEO_SHIFT = 12.0
RELEASED_AUDIO_SHIFT = 3.0


def shifted_sigmas(num_points: int, shift: float) -> torch.Tensor:
    """The shifted sigma grid, fp32 on the CPU: ``num_points`` (or fewer, after dedup) values from 1 to 0.

    The terminal 0 is always present: the shift maps 0 to exactly 0. ``linspace`` in fp32, then
    ``s*b / (1 + (s-1)*b)`` in fp32 in that operation order, then ``unique_consecutive``: a large N with a big
    shift collapses points near 1, so the grid may be shorter than asked.
    """
    if num_points < 2:
        raise ValueError(f"a sigma grid needs at least 2 points (start and terminal 0), got {num_points}")
    base = torch.linspace(1.0, 0.0, num_points, dtype=torch.float32, device="cpu")
    return torch.unique_consecutive(_shifted(base, shift))


def _shifted(base: torch.Tensor, shift: float) -> torch.Tensor:
    """``s*b / (1 + (s-1)*b)`` in fp32, in the reference's operation order."""
    if not shift > 0 or math.isinf(shift):
        raise ValueError(f"shift must be a positive finite number, got {shift}")
    return shift * base / (1 + (shift - 1) * base)


def rung_sigmas(rungs: tuple[int, ...], shift: float) -> torch.Tensor:
    """The grid of a step-distilled checkpoint: the positions ``rung / 1000`` then 0, fp32 on the CPU, shifted.

    SGLang (``minimax_h3_time_shift_sigmas`` with ``dmd_steps``) shifts these positions like the linspace
    of an undistilled grid, video and audio each with its own shift; no dedup (the rungs are strictly decreasing).
    """
    base = torch.tensor([rung / 1000.0 for rung in rungs] + [0.0], dtype=torch.float32, device="cpu")
    return _shifted(base, shift)


def grid_points_for(num_inference_steps: int, recipe: str) -> int:
    """How many sigma grid points a request for ``num_inference_steps`` builds under ``recipe``."""
    if recipe == "sglang":
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        return num_inference_steps + 1
    if recipe == "diffusers":
        if num_inference_steps < 2:
            raise ValueError(
                f"the diffusers recipe counts grid points, so num_inference_steps must be >= 2, "
                f"got {num_inference_steps}"
            )
        return num_inference_steps
    raise ValueError(f"unknown schedule recipe {recipe!r}; expected one of {SCHEDULE_RECIPES}")


@dataclass(frozen=True, eq=False)
class Schedule:
    """The paired video/audio sigma grids of one request (fp32, CPU, terminal 0 included).

    Step ``i`` (``0 <= i < num_steps``) runs one DiT forward with video rows at ``video_timesteps[i]`` and
    audio rows at ``audio_timesteps[i]``, then moves each modality from ``sigmas[i]`` to ``sigmas[i + 1]``.
    """

    video_sigmas: torch.Tensor
    audio_sigmas: torch.Tensor

    def __post_init__(self) -> None:
        for name, sigmas in (("video", self.video_sigmas), ("audio", self.audio_sigmas)):
            if sigmas.dtype != torch.float32 or sigmas.ndim != 1 or sigmas.numel() < 2:
                raise ValueError(f"{name} sigmas must be a 1-D fp32 tensor with >= 2 points")
            if sigmas[-1].item() != 0.0:
                raise ValueError(f"{name} sigmas must end at 0, got {sigmas[-1].item()}")
        # One forward serves both modalities, so a grid that dedup shortened for one modality only
        # would leave the other one unfinished; the released step counts never get near this.
        if self.video_sigmas.numel() != self.audio_sigmas.numel():
            raise ValueError(
                f"video and audio grids differ in length ({self.video_sigmas.numel()} vs "
                f"{self.audio_sigmas.numel()}): too many steps for these shifts"
            )

    @classmethod
    def build(
        cls,
        num_inference_steps: int,
        *,
        recipe: str,
        video_shift: float = RELEASED_VIDEO_SHIFT,
        audio_shift: float = RELEASED_AUDIO_SHIFT,
    ) -> Schedule:
        num_points = grid_points_for(num_inference_steps, recipe)
        return cls(shifted_sigmas(num_points, video_shift), shifted_sigmas(num_points, audio_shift))

    @classmethod
    def from_rungs(
        cls,
        rungs: tuple[int, ...],
        *,
        video_shift: float = RELEASED_VIDEO_SHIFT,
        audio_shift: float = RELEASED_AUDIO_SHIFT,
    ) -> Schedule:
        """The grids of a step-distilled checkpoint: ``len(rungs)`` forwards on its rungs (see `rung_sigmas`)."""
        return cls(rung_sigmas(rungs, video_shift), rung_sigmas(rungs, audio_shift))

    @property
    def num_steps(self) -> int:
        """Number of DiT forwards."""
        return self.video_sigmas.numel() - 1

    @property
    def video_timesteps(self) -> torch.Tensor:
        """fp32 ``1 - sigma`` for every step (the terminal sigma gets no forward)."""
        return 1.0 - self.video_sigmas[:-1]

    @property
    def audio_timesteps(self) -> torch.Tensor:
        return 1.0 - self.audio_sigmas[:-1]


def _fp32_scalar(value: float | torch.Tensor) -> torch.Tensor:
    """The value rounded to an fp32 scalar on the CPU (the schedule lives there)."""
    return torch.as_tensor(value, dtype=torch.float32).cpu()


def euler_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    timestep: float | torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
) -> torch.Tensor:
    """One Euler (eta = 0) step of the generated rows, in fp32; returns the new sample.

    ``velocity`` is the DiT's data-ward prediction, so the clean estimate is ``x0 = x + (1 - t) * v``
    (plus sign); the new sample is the blend ``r * x + (1 - r) * x0`` with ``r = sigma_next / sigma``.
    ``timestep`` must be the value the DiT was conditioned on and ``sigma``/``sigma_next`` the grid values
    For sigma < 0.5, ``1 - (1 - sigma)`` is not exact in fp32, so folding both into one
    ``x + (sigma_next - sigma) * -v`` changes the result. Each multiply/add is a separate fp32 op, as in eager
    PyTorch: do not ``torch.compile`` it (a fused multiply-add rounds once instead of twice and breaks parity).
    """
    if sample.dtype != torch.float32:
        raise TypeError(f"the sampler state must stay fp32, got {sample.dtype}")
    velocity = velocity.to(torch.float32)
    # The scalar arithmetic runs in fp32 on the CPU (IEEE: the same bits as on the GPU) and enters the GPU ops as
    # Python numbers, so a step copies nothing to the device and never waits for it.
    noise_fraction = (1 - _fp32_scalar(timestep)).item()
    clean_estimate = sample + noise_fraction * velocity
    ratio = _fp32_scalar(sigma_next) / _fp32_scalar(sigma)
    return ratio.item() * sample + (1.0 - ratio).item() * clean_estimate
