"""Request checks that run before a job is queued, without touching the models: the one checker's, on the front.

Contract:
* `CheckpointFacts` (h3engine.checkpoint.facts) are the checkpoint facts the checks need, read from its headers;
  a replica gives the front those of its engine (`Engine.facts`, sent by a worker group's rank 0).
* `check_request(request, facts)` is `h3engine.request.resolved.resolve_request` on those facts (every rule the
  engine applies but its memory check) and returns its warnings; `expected_geometry(request, facts)` the canvas and
  frame counts it resolves to (what the engine will use).

Danger: these checks exist so that the app never calls into a shared `Engine` from a request thread (on a GPU that
could load a whole DiT partition next to the one a worker uses). The engine checks again when the job runs, with
the same function.
"""

from __future__ import annotations

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.request.geometry import Geometry
from h3engine.request.model import GenerationRequest
from h3engine.request.resolved import resolve_request

__all__ = ["CheckpointFacts", "check_request", "expected_geometry"]


def check_request(request: GenerationRequest, facts: CheckpointFacts) -> list[str]:
    """Raise RequestError naming the field, or return the warnings of a request that will run."""
    return list(resolve_request(request, facts).warnings)


def expected_geometry(request: GenerationRequest, facts: CheckpointFacts) -> Geometry:
    """The canvas and frame counts of a request that passed `check_request` (what the engine will use)."""
    geometry = resolve_request(request, facts).geometry
    assert geometry is not None  # resolved with checkpoint facts
    return geometry
