"""The app's look: a Gradio theme, a little CSS and the page's script (passed to `launch()`, where Gradio 6 takes them)."""

from __future__ import annotations

import gradio as gr

from h3engine.media.formats import FORMATS
from ui.notices import TOAST_SECONDS

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
/* Toasts: one at a time (the page's script hides the messages before the newest and closes older toasts, so no count
   and no list), at the bottom of the window, or at its top while the status line or Cancel would be under them (the
   script moves them): never over those two. */
.toast-wrap { top: auto !important; bottom: var(--size-3); }
.toast-wrap[data-h3-top] { top: var(--size-3) !important; bottom: auto; }
.toast-message-item[data-h3-old], .toast-separator, .toast-count, .toast-header .chevron { display: none !important; }
.toast-header { pointer-events: none; }
.toast-header .toast-close { pointer-events: auto; }
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


# A slider's number box keeps what was typed (the sliders marked h3-typed: duration, takes): Gradio's slider clamps an
# out-of-range or empty box into its range when it loses focus, which would silently run another value than the one
# typed. The canvas line and the status say what is wrong instead (ui.task_values.duration_out_of_range), and the checks
# refuse the job. Its own blur listener is on the box: the page's capturing listener runs first and stops the event.
_TYPED_NUMBERS_JS = """
    document.addEventListener("blur", (event) => {
        const box = event.target;
        if (!(box instanceof HTMLInputElement) || box.type !== "number" || !box.closest(".h3-typed")) return;
        const value = box.valueAsNumber;
        const outside = box.value === "" || value < Number(box.min) || value > Number(box.max);
        if (outside) event.stopImmediatePropagation();
    }, true);
"""

# One toast at a time. A press on the page (a button, a History row) first closes the toasts shown; a message that
# comes without one hides those before it (Gradio would stack them, and list those of one kind under a count) and
# closes the toasts of other kinds. A warning (the page's own problems: ui.notices) comes without a Gradio timer and
# is closed TOAST_SECONDS after the newest message: Gradio's timer closes a toast's whole group when its first
# message's time is up (a newer message with it), and is never cancelled. Then the toasts stay clear of the status
# line and Cancel: at the bottom of the window, or at its top while one of those would be under them. Checked as
# toasts come, as the page scrolls (the result column scrolls on its own on wide windows) or resizes, and as the page
# changes (the status may grow).
_TOASTS_JS = """
    const closeToasts = () => document.querySelectorAll(".toast-wrap [data-testid=toast-close]")
        .forEach((close) => close.click());
    document.addEventListener("click", (event) => {
        const target = event.target instanceof Element ? event.target : null;
        if (target && !target.closest(".toast-wrap") && target.closest("button, tr")) closeToasts();
    }, true);
    let closing = null;
    const newestToastOnly = () => {
        const fresh = [...document.querySelectorAll(".toast-message-item:not([data-h3-seen])")];
        if (fresh.length === 0) return;
        const newest = fresh[fresh.length - 1];
        fresh.forEach((item) => item.setAttribute("data-h3-seen", ""));
        document.querySelectorAll(".toast-message-item").forEach((item) => {
            item.toggleAttribute("data-h3-old", item !== newest);
        });
        document.querySelectorAll(".toast-item").forEach((toast) => {
            if (!toast.contains(newest)) toast.querySelector("[data-testid=toast-close]")?.click();
        });
        clearTimeout(closing);
        if (newest.classList.contains("warning")) closing = setTimeout(closeToasts, TOAST_MS);
    };
    const keptClear = () => ["#h3-status", "#h3-cancel"]
        .map((selector) => document.querySelector(selector))
        .filter((element) => element !== null)
        .map((element) => element.getBoundingClientRect());
    const clearOfStatus = () => {
        const wrap = document.querySelector(".toast-wrap");
        if (!wrap || wrap.childElementCount === 0) return;
        const kept = keptClear();
        const covers = () => {
            const box = wrap.getBoundingClientRect();
            return kept.some((area) => box.left < area.right && area.left < box.right && box.top < area.bottom
                && area.top < box.bottom);
        };
        wrap.removeAttribute("data-h3-top");
        if (covers()) {
            wrap.setAttribute("data-h3-top", "");
            if (covers()) wrap.removeAttribute("data-h3-top");
        }
    };
    const toasts = () => { newestToastOnly(); clearOfStatus(); };
    new MutationObserver(toasts).observe(document.body, { childList: true, subtree: true, characterData: true });
    document.addEventListener("scroll", clearOfStatus, { capture: true, passive: true });
    window.addEventListener("resize", clearOfStatus);
""".replace("TOAST_MS", str(TOAST_SECONDS * 1000))


def page_js(muted_media: bool) -> str:
    """The script the page runs once loaded; `muted_media`: the players start muted (the random-weight demo)."""
    parts = [_KEYFRAME_PICKERS_JS, _TYPED_NUMBERS_JS, _TOASTS_JS, _MUTED_MEDIA_JS if muted_media else ""]
    return "() => {" + "".join(parts) + "}"
