"""The app's look: a Gradio theme and a little CSS (passed to `launch()`, where Gradio 6 takes them)."""

from __future__ import annotations

import gradio as gr

THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="slate", radius_size="md")

CSS = """
#h3-banner { border: 1px solid #d97706; background: #fffbeb; color: #78350f; border-radius: 8px; padding: 4px 14px; }
#h3-banner * { color: #78350f; }
.h3-derived { font-size: 0.9em; opacity: 0.85; }
.h3-ref-cards { gap: 10px; flex-wrap: wrap; }
.h3-ref-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px; gap: 6px; }
.h3-ref-card .h3-ref-labels code { font-weight: 600; }
.h3-ref-card .h3-ref-name { overflow-wrap: anywhere; font-size: 0.9em; }
.h3-ref-card .h3-ref-error, .h3-ref-card .h3-ref-error * { color: var(--error-text-color); overflow-wrap: anywhere; }
.h3-ref-thumbnail img { object-fit: contain; }
.h3-ref-buttons { gap: 4px; flex-wrap: wrap; }
#ref2va-cards .h3-ref-buttons button { flex: 0 0 auto; min-height: 34px; padding: 4px 10px; }
#h3-preview img { image-rendering: pixelated; }
"""
