"""Fused kernels for the memory-bound ops of the DiT block and the video decoder, each with a torch twin.

They live in the repository's top-level `kernels/` folder and are imported as `h3engine.models.kernels.reference` (the
twins: the model's own torch expressions, the definition of every op's result, bf16 rounding points included) and
`h3engine.models.kernels.triton` (Triton kernels computing the same thing in one pass over memory). Callers go through
`h3engine.models.ops`, which picks one per call; nothing else imports these modules directly (tests and benchmarks
excepted).

Why this module: `kernels/` holds no `__init__.py`, so it never claims the top-level import name `kernels`, which
belongs to Hugging Face's `kernels` distribution (transformers imports it). Giving this module a `__path__` makes
Python look for its submodules in that folder, under this project's own name.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "kernels")]
