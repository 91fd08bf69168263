"""The models' math: the DiT, the video and audio VAEs, the text encoder; the fused-op dispatch and attention,
the FP8 linears, and the pieces that split a model over GPUs (parallel)."""
