"""The browser app's user interface (Gradio): task tabs, the shared result column and history, their handlers."""

from ui.gradio_stubs import skip_stub_writer

skip_stub_writer()  # before gradio's first import (ui/gradio_stubs.py says why)

from ui.access import AccessPolicy  # noqa: E402
from ui.blocks import UiOptions, build_ui  # noqa: E402
from ui.theme import CSS, HEAD, THEME, page_js  # noqa: E402

__all__ = ["CSS", "HEAD", "THEME", "page_js", "AccessPolicy", "UiOptions", "build_ui"]
