"""Request checks that run before a job is queued, without touching the models.

Contract:
* `CheckpointFacts.from_engine(engine)` captures once, at start-up, the checkpoint facts the checks need (served
  tasks, canvas rules, VAE ratio and DiT patch, tokenizer folder, each task's DMD rungs) from the engine's first
  partition (`first_partition`, whose DiT a fresh engine holds); MiniMax H3's partitions share the video VAE, the
  patch and the tokenizer, so they hold for all.
* `check_request(request, facts)` runs every rule `validate` knows (file headers through
  `media.inputs.probe_media`, the prompt's token bound) plus "does this checkpoint serve the task" and, for a
  step-distilled partition, "does the request run its rungs" (`distilled_steps` is the count to ask for), and
  whether each LoRA file fits the task's DiT and targets it (headers only, `adapters.LoraHeaders`);
  `expected_geometry(request, facts)` is `media.request_inputs.request_geometry` on those facts.

Danger: these checks exist so that the app never calls into a shared `Engine` from a request thread (on a GPU that
could load a whole DiT partition next to the one a worker uses). The engine validates again when the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from h3engine.adapters import LoraHeaders, request_adapters
from h3engine.checkpoint.layout import DIFFUSERS_DIT_FOLDERS, CanvasRules
from h3engine.engine import Engine
from h3engine.errors import RequestError
from h3engine.geometry import Geometry
from h3engine.media.inputs import probe_media
from h3engine.media.request_inputs import request_geometry
from h3engine.models.dit import DiTConfig
from h3engine.presentation import prompt_token_counter
from h3engine.request import GenerationRequest, distilled_step_count, validate
from h3engine.sampling.schedule import check_distilled_steps, effective_rungs


@dataclass(frozen=True)
class CheckpointFacts:
    tasks: tuple[str, ...]
    canvas: CanvasRules
    vae_spatial_ratio: int
    patch: int
    # The tokenizer folder of the first partition, for the prompt's token bound (None: characters only).
    tokenizer: Path | None = None
    # The rungs of each task whose DiT is step-distilled (`_minimax_h3.dmd_denoising_steps`); other tasks are absent.
    dmd_steps: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Each task's DiT as LoRA files name it ("transformer" / "transformer_ref") and its config, for the adapters' fit
    # (a task absent here has its adapters checked only when the job runs).
    lora_targets: dict[str, tuple[str, DiTConfig]] = field(default_factory=dict)
    # The partition an engine loads at start ("fl2va" or "ref2va"; None: not known).
    first_partition: str | None = None

    @property
    def canvas_multiple(self) -> int:
        return self.vae_spatial_ratio * self.patch

    @classmethod
    def from_engine(cls, engine: Engine) -> CheckpointFacts:
        # The first partition is loaded by the engine's model store, so this reads resident modules only.
        partition = engine.store.first_partition
        vae_spatial_ratio, patch = engine.store.models_for_partition(partition).spatial_factors
        return cls(
            tasks=engine.layout.tasks,
            canvas=engine.layout.canvas,
            vae_spatial_ratio=vae_spatial_ratio,
            patch=patch,
            tokenizer=engine.layout.partitions[partition].tokenizer,
            dmd_steps={
                task: rungs
                for task in engine.layout.tasks
                if (rungs := engine.layout.dmd_steps_for(task)) is not None
            },
            lora_targets={
                task: (
                    DIFFUSERS_DIT_FOLDERS.get(engine.store.partition_for(task), "transformer"),
                    engine.store.dit_config(engine.store.partition_for(task)),
                )
                for task in engine.layout.tasks
            },
            first_partition=partition,
        )

    def distilled_steps(self, task: str, recipe: str = "sglang") -> int | None:
        """The only step count `task` accepts on a step-distilled checkpoint, None where any count runs."""
        rungs = self.dmd_steps.get(task)
        return None if rungs is None else distilled_step_count(rungs, recipe)


def check_request(request: GenerationRequest, facts: CheckpointFacts) -> list[str]:
    """Raise RequestError (message starts with the field) or return the warnings of a request that will run."""
    count_tokens = None if facts.tokenizer is None else prompt_token_counter(facts.tokenizer)
    warnings = validate(
        request, probe_media, canvas_multiple=facts.canvas_multiple, count_prompt_tokens=count_tokens
    )
    if request.task not in facts.tasks:
        raise RequestError(
            f"task: this checkpoint cannot serve '{request.task}' (it serves {', '.join(facts.tasks)})"
        )
    rungs = effective_rungs(request.rungs, facts.dmd_steps.get(request.task))
    check_distilled_steps(request.steps, request.recipe, rungs)
    if request.loras and request.task in facts.lora_targets:
        target, config = facts.lora_targets[request.task]
        request_adapters(request, target, config, LoraHeaders())  # headers only: each file's fit and targets
    return warnings


def expected_geometry(request: GenerationRequest, facts: CheckpointFacts) -> Geometry:
    """The canvas and frame counts of a request that passed `check_request` (what the engine will use)."""
    return request_geometry(request, facts.canvas, facts.vae_spatial_ratio, facts.patch)
