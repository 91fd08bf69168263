"""h3engine: an inference engine for MiniMax H3 joint audio-video generation."""

__version__ = "0.1.0"
