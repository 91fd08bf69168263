"""The memory planner's words, shared by every module of h3engine.memory (a leaf: it imports nothing of ours).

`ModelPlacement`: how one model is held (its repeated layers resident, moved per phase or streamed through a ring;
the rest resident or per phase; a host home for what is not resident). `MemoryBudget`: the bytes one engine may use
on its GPU and host. `PlannedComponent`: one line of a plan. The plan itself and the planner: .plan.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
# How many past noise schedules' AdaLN tables a DiT keeps on its device (h3engine.engine.sampling.modulation).
MODULATION_CACHE_SCHEDULES = 2

MEMORY_PROFILES = ("auto", "resident", "streamed", "low-memory")
WEIGHT_FORMATS = ("bf16", "fp8")
MODELS = ("text_encoder", "dit", "video_vae", "audio_vae")
LAYER_PLACEMENTS = ("resident", "phase", "streamed")
OTHER_PLACEMENTS = ("resident", "phase")
HOMES = ("none", "pinned", "mapped")


@dataclass(frozen=True)
class ModelPlacement:
    """How one model is held: its repeated layers, the rest of it, and the host home of what is not resident."""

    layers: str = "resident"  # LAYER_PLACEMENTS
    other: str = "resident"  # OTHER_PLACEMENTS
    home: str = "none"  # HOMES
    resident_layers: int = 0  # streamed: how many leading layers stay on the device
    ring_depth: int = 0  # streamed: device buffers in the ring (at least 2)
    # streamed with a pinned home: how many of the streamed layers are read from the files instead (spread evenly)
    mapped_layers: int = 0

    def __post_init__(self) -> None:
        if (
            self.layers not in LAYER_PLACEMENTS
            or self.other not in OTHER_PLACEMENTS
            or self.home not in HOMES
        ):
            raise ValueError(f"invalid model placement {self}")
        if self.layers == "streamed" and self.ring_depth < 2:
            raise ValueError(f"a streamed model needs a ring of at least 2 buffers, got {self.ring_depth}")
        if (self.layers != "resident" or self.other != "resident") and self.home == "none":
            raise ValueError(f"{self}: what is not resident needs a host home")

    @property
    def all_resident(self) -> bool:
        return self.layers == "resident" and self.other == "resident"

    def describe(self, num_layers: int | None = None) -> str:
        """In words, for logs and sidecars: "resident", "streamed (ring of 3, 12 of 52 layers resident, pinned
        home)", "moved per phase (pinned home)"... (`num_layers`: the model's, when known)."""
        if self.all_resident:
            return "resident"
        if self.layers == "streamed":
            total = f" of {num_layers}" if num_layers is not None else ""
            resident = f", {self.resident_layers}{total} layers resident" if self.resident_layers else ""
            rest = "" if self.other == "resident" else ", the rest moved per phase"
            home = f"{self.home} home"
            if self.home == "pinned" and self.mapped_layers:
                home = f"pinned home, {self.mapped_layers} layers read from the files"
            elif self.home == "mapped":
                home = "read from the files"
            return f"streamed (ring of {self.ring_depth}{resident}, {home}{rest})"
        if self.layers == "phase" and self.other == "phase":
            return f"moved per phase ({self.home} home)"
        return f"layers {self.layers}, the rest {self.other} ({self.home} home)"


RESIDENT = ModelPlacement()


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes an engine (one rank) may use on its GPU and on the host; None: no limit (the CPU)."""

    gpu_bytes: int | None
    host_bytes: int | None
    # Where each number came from, for the plan's log lines: "--gpu-memory", "H3_GPU_MEMORY", "free memory of
    # cuda:0 (79.1 GiB) less 2.0 GiB", "no GPU"...
    gpu_source: str = ""
    host_source: str = ""


@dataclass(frozen=True)
class PlannedComponent:
    """One line of a plan: a part of a model, where it lives and what it costs."""

    # e.g. "dit.layers", "dit.adaln", "dit.other", "text_encoder.layers", "dit (Ref2VA, not served)"
    name: str
    placement: str  # resident | phase | streamed | host | disk
    bytes: int  # its weights as held (layers on a device unquantized, FP8 stream images as stored)
    gpu_bytes: int  # the most it holds on the GPU at once (a streamed one: its ring and resident layers)
    host_bytes: int  # pinned host bytes it holds (a mapped home counts 0: it is the page cache)
    home: str = "none"
