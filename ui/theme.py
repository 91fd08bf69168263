"""The app's look: a Gradio theme and a little CSS (passed to `launch()`, where Gradio 6 takes them)."""

from __future__ import annotations

import gradio as gr

THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="slate", radius_size="md")

CSS = """
#h3-banner { border: 1px solid #d97706; background: #fffbeb; color: #78350f; border-radius: 8px; padding: 4px 14px; }
#h3-banner * { color: #78350f; }
.h3-derived { font-size: 0.9em; opacity: 0.85; }
.h3-reference-name { margin-top: 6px; }
.h3-reference-row { gap: 6px; }
#h3-preview img { image-rendering: pixelated; }
"""
