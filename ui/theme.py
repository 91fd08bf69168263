"""The app's look: a Gradio theme, a little CSS and the page's script (passed to `launch()`, where Gradio 6 takes them)."""

from __future__ import annotations

import gradio as gr

from h3engine.media.formats import FORMATS

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
#h3-status { scroll-margin-top: 12px; }
.h3-caption { font-size: 0.85em; opacity: 0.8; margin-bottom: -6px; }
/* Wide windows: the result column stays in view while the inputs scroll, so the status, progress and preview are
   where the eyes are when Generate is pressed. Narrow ones stack it under the tab (ui.blocks scrolls to it). */
@media (min-width: 1024px) {
  #h3-result-column { position: sticky; top: 8px; align-self: flex-start; max-height: calc(100vh - 16px);
                      overflow-y: auto; }
}
"""

# Outside CSS (which Gradio scopes to inside its container): the container hides its overflow, which would make it
# the scroller the sticky result column holds to; `clip` cuts the same and scrolls nothing.
HEAD = "<style>@media (min-width: 1024px) { .gradio-container { overflow: clip !important; } }</style>"

# Gradio's image picker offers any image (accept="image/*"): the keyframe boxes offer only what is accepted.
_KEYFRAME_PICKERS_JS = """
    const accepted = "ACCEPTED";
    const restrict = () => document.querySelectorAll("#fl2va-first input[type=file], #fl2va-last input[type=file]")
        .forEach((input) => { if (input.accept !== accepted) input.accept = accepted; });
    restrict();
    new MutationObserver(restrict).observe(document.body, { childList: true, subtree: true });
""".replace("ACCEPTED", ",".join(FORMATS["image"].suffixes))

# The random-weight demo's sound is full-scale noise: each player starts muted whenever it loads a file (the player
# sets its own muted state as it mounts, so this runs as the file loads; a person can still unmute).
_MUTED_MEDIA_JS = """
    const mute = (event) => {
        if (event.target instanceof HTMLMediaElement) event.target.muted = true;
    };
    for (const name of ["loadstart", "loadedmetadata"]) document.addEventListener(name, mute, true);
"""


def page_js(muted_media: bool) -> str:
    """The script the page runs once loaded; `muted_media`: the players start muted (the random-weight demo)."""
    return "() => {" + _KEYFRAME_PICKERS_JS + (_MUTED_MEDIA_JS if muted_media else "") + "}"
