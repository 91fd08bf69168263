"""The engine: `engine.Engine` over its pipeline, conditioning, sampling, LoRA adapters and options."""
