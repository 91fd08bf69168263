"""The browser app's user interface (Gradio): task tabs, the shared result column and history, their handlers."""

from ui.access import AccessPolicy
from ui.blocks import UiOptions, build_ui
from ui.theme import CSS, HEAD, MUTED_MEDIA_JS, THEME

__all__ = ["CSS", "HEAD", "MUTED_MEDIA_JS", "THEME", "AccessPolicy", "UiOptions", "build_ui"]
