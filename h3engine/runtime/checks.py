"""Request checks that run before a job is queued, without touching the models.

Contract:
* File facts come from `h3engine.media.inputs.probe_media`, the probe the engine's own validation uses (headers
  only; an unreadable file raises RequestError naming it).
* `CheckpointFacts.from_engine(engine)` captures, once at start-up, the few checkpoint facts the checks need
  (served tasks, canvas rules, the VAE ratio and DiT patch) from the models the engine loaded for its first
  partition. MiniMax H3's partitions share the video VAE and the DiT patch, so one partition's facts hold for all.
* `check_request(request, facts)` runs every rule `validate` knows (including the file rules) plus "does this
  checkpoint serve the task"; `expected_geometry(request, facts)` is the canvas and frame count the app shows
  next to the settings.

Danger: these checks exist so that the app never calls into a shared `Engine` from a request thread (on a GPU
that could load a 62 GiB partition next to the one a worker is using). The engine validates again when the job
runs, and its geometry (reported in `JobStarted` and the sidecar) is the authority; `expected_geometry` is the
same function (`h3engine.engine.request_geometry`) applied to the facts captured here.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3engine.checkpoint.layout import CanvasRules
from h3engine.engine import Engine, request_geometry
from h3engine.errors import RequestError
from h3engine.geometry import Geometry
from h3engine.media.inputs import probe_media
from h3engine.request import GenerationRequest, validate


@dataclass(frozen=True)
class CheckpointFacts:
    tasks: tuple[str, ...]
    canvas: CanvasRules
    vae_spatial_ratio: int
    patch: int

    @property
    def canvas_multiple(self) -> int:
        return self.vae_spatial_ratio * self.patch

    @classmethod
    def from_engine(cls, engine: Engine) -> CheckpointFacts:
        # The first partition is loaded by Engine's constructor, so this reads resident modules only.
        models = engine.models_for_partition(next(iter(engine.layout.partitions)))
        return cls(
            tasks=engine.layout.tasks,
            canvas=engine.layout.canvas,
            vae_spatial_ratio=models.video_vae.config.spatial_compression_ratio,
            patch=models.dit.config.patch_size[-1],
        )


def check_request(request: GenerationRequest, facts: CheckpointFacts) -> list[str]:
    """Raise RequestError (message starts with the field) or return the warnings of a request that will run."""
    warnings = validate(request, probe_media, canvas_multiple=facts.canvas_multiple)
    if request.task not in facts.tasks:
        raise RequestError(
            f"task: this checkpoint cannot serve '{request.task}' (it serves {', '.join(facts.tasks)})"
        )
    return warnings


def expected_geometry(request: GenerationRequest, facts: CheckpointFacts) -> Geometry:
    """The canvas and frame counts of a request that passed `check_request` (what the engine will use)."""
    return request_geometry(request, facts.canvas, facts.vae_spatial_ratio, facts.patch)
