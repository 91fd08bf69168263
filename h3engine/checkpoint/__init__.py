"""Checkpoints: the released folders and their layouts, config formats and key maps (native <-> diffusers), strict
loading, the facts a request is resolved against, our tiny and placeholder checkpoints, FP8 and GGUF weights."""
