"""Fused kernels for the memory-bound ops of the DiT block and the video decoder, each with a torch twin.

`kernels.reference` holds the twins: literally the model's current torch expressions, runnable anywhere, and the
definition of every op's result (including each bf16 rounding point). `kernels.triton` holds the Triton kernels
that compute the same thing in one pass over memory. Callers go through `h3engine.ops`, which picks one per call;
nothing else should import these modules directly (tests and benchmarks excepted).
"""
