"""What a checkpoint decides about requests, read from its headers: `CheckpointFacts`.

`CheckpointFacts.from_layout(layout)` reads the config files and the DiTs' headers (their AdaLN form), never weight
data: the tasks served, the canvas rule, the video VAE's spatial ratio and the DiT's patch, the tokenizer folder, each
task's DMD rungs and each task's DiT as LoRA files name it (a pruned one decides which AdaLN updates fit). The CLI reads them before any model loads; an engine reads the same (`Engine.facts`) and
a worker group's rank 0 sends them to the front. The one request checker (h3engine.engine.resolved) takes them.
MiniMax H3's partitions share the video VAE, the patch and the tokenizer, so the first partition's hold for all.
Picklable: plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3engine.checkpoint.layout import (
    DIFFUSERS_DIT_FOLDERS,
    PARTITION_OF_TASK,
    CanvasRules,
    CheckpointLayout,
    distilled_step_count,
)
from h3engine.checkpoint.loader import read_dit_config, read_video_vae_config_of
from h3engine.models.dit_config import DiTConfig


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
    # The engine's memory plan (h3engine.memory.plan.MemoryPlan), so that a front checks a request's memory before
    # queueing it; None: read from the files alone, no plan yet.
    memory_plan: Any = None

    @property
    def canvas_multiple(self) -> int:
        """What every canvas side is a multiple of: the VAE's spatial ratio times the DiT's patch."""
        return self.vae_spatial_ratio * self.patch

    @classmethod
    def from_layout(cls, layout: CheckpointLayout) -> CheckpointFacts:
        """The facts of a detected checkpoint, from its config files and headers (CheckpointError naming a file)."""
        first_partition = next(iter(layout.partitions))
        first = layout.partitions[first_partition]
        dit_configs = {
            partition: read_dit_config(layout, paths) for partition, paths in layout.partitions.items()
        }
        return cls(
            tasks=layout.tasks,
            canvas=layout.canvas,
            vae_spatial_ratio=read_video_vae_config_of(layout, first).spatial_compression_ratio,
            patch=dit_configs[first_partition].patch_size[-1],
            tokenizer=first.tokenizer,
            dmd_steps={
                task: rungs for task in layout.tasks if (rungs := layout.dmd_steps_for(task)) is not None
            },
            lora_targets={
                task: (
                    DIFFUSERS_DIT_FOLDERS.get(PARTITION_OF_TASK[task], "transformer"),
                    dit_configs[PARTITION_OF_TASK[task]],
                )
                for task in layout.tasks
            },
            first_partition=first_partition,
        )

    @classmethod
    def from_engine(cls, engine: Any) -> CheckpointFacts:
        """The facts an `h3engine.engine.engine.Engine` read at start (`engine.facts`)."""
        return engine.facts

    def distilled_steps(self, task: str, recipe: str = "sglang") -> int | None:
        """The only step count `task` accepts on a step-distilled checkpoint, None where any count runs."""
        rungs = self.dmd_steps.get(task)
        return None if rungs is None else distilled_step_count(rungs, recipe)
