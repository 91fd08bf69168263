"""How the page's events tell a problem without Gradio's error state, and which buttons need a result.

Gradio puts every output of an event that raises into its error state: a red "Error" box over each input and player,
which stays until it is dismissed one by one and blocks typing. So no page event whose outputs are inputs or players
raises. `told_in_a_toast(handler, outputs)` wraps a light event's handler (restore, continue, show a take), whose
`ui.handlers` methods raise a gr.Error for their problems: the words go to one warning toast instead, which targets
no component, and every output is left as it was (the page shows one toast at a time, clear of the status line and
Cancel: ui.theme). `told_in_the_status(generate)` wraps a generate endpoint for the page: its last update already
put the ending's words in the status line, so its gr.Error (which API clients read) is not raised to the page.

The buttons that act on the shown result start disabled and follow its state (`result_buttons_state`, wired in
ui.blocks).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import gradio as gr

# How long a problem's toast stays (a person may close it sooner). The page's script closes it (ui.theme): Gradio's own
# timer closes a toast's whole group when its first message's time is up, and is never cancelled.
TOAST_SECONDS = 8


def left_as_they_are(outputs: int) -> Any:
    """An event's return value that changes none of its `outputs` components."""
    return gr.skip() if outputs == 1 else tuple(gr.skip() for _ in range(outputs))


def told_in_a_toast(handler: Callable[..., Any], outputs: int) -> Callable[..., Any]:
    """`handler`, telling its gr.Error in one warning toast (its title and words) and changing none of its
    `outputs` outputs then. Only for queued events: Gradio shows no toast for an event run outside the queue."""

    @functools.wraps(handler)
    def told(*arguments: Any, **keywords: Any) -> Any:
        try:
            return handler(*arguments, **keywords)
        except gr.Error as error:
            gr.Warning(str(error.message), duration=None, title=error.title)
            return left_as_they_are(outputs)

    return told


def told_in_the_status(
    generate: Callable[..., AsyncIterator[tuple[Any, ...]]],
) -> Callable[..., AsyncIterator[tuple[Any, ...]]]:
    """A generate endpoint for the page: the same updates, but a failure ends it quietly (its last update wrote
    the failure's words into the status line) instead of raising its gr.Error, which the API's endpoint keeps."""

    @functools.wraps(generate)
    async def on_the_page(*arguments: Any, **keywords: Any) -> AsyncIterator[tuple[Any, ...]]:
        try:
            async for update in generate(*arguments, **keywords):
                yield update
        except gr.Error:
            return

    return on_the_page


def result_buttons_state(last_result: str | None, buttons: int) -> tuple[gr.Button, ...]:
    """The buttons that act on the shown result: enabled while there is one."""
    return tuple(gr.Button(interactive=bool(last_result)) for _ in range(buttons))
