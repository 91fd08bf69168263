"""The browser app's user interface (Gradio): task tabs, the shared result column and history, their handlers."""

from ui.access import AccessPolicy
from ui.blocks import UiOptions, build_ui
from ui.theme import CSS, HEAD, THEME, page_js

__all__ = ["CSS", "HEAD", "THEME", "page_js", "AccessPolicy", "UiOptions", "build_ui"]
