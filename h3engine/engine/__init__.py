"""The engine: `engine.Engine` over its pipeline, the one resolve (`resolved`), conditioning (with a request's input
files read), sampling, LoRA adapters, options, latent previews and the boundary capture."""
