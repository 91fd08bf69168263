"""How a Generate press ends when no job could start, in words a person can act on.

`NotStarted(reason, title)` is what the generate handler (ui.handlers) raises to itself when a press made no job
(invalid inputs, an outputs folder that refuses writes or is full, an unexpected error): it shows
`⚠ Not started: <reason>` as the status and hands the reason to API clients as a gr.Error titled `title`.
`storage_problem(error, outputs_dir)` words an OSError met while storing the inputs or making the results folder: a
full disk with the free space left, else what the system said; never a server path (the server log has it).
`NOT_TAKEN_STATUS` is the status of a press whose generate event never ran (a full queue; ui.blocks).
"""

from __future__ import annotations

import logging
from pathlib import Path

from h3engine.runtime.messages import DISK_FULL_ERRNOS, disk_full_text, outputs_refuse_writes

logger = logging.getLogger(__name__)

UNEXPECTED_ERROR = "the app met an unexpected error; the details are in the server log."
# The status of a press whose generate event never ran: Gradio refused to queue it (its queue was full) or lost the
# connection (it says which in a message of its own).
NOT_TAKEN_STATUS = (
    "⚠ Not started: the app did not take the job (its queue may be full); press Generate again."
)


class NotStarted(Exception):
    """A Generate press that made no job: `reason` (a sentence, no server path) and the error's `title`."""

    def __init__(self, reason: str, title: str = "Not started") -> None:
        super().__init__(reason)
        self.reason = reason
        self.title = title


def storage_problem(error: OSError, outputs_dir: Path) -> NotStarted:
    """An OSError from storing the inputs or making the results folder, as the reason the press made no job."""
    logger.error("could not store a job's inputs or make its results folder under %s: %s", outputs_dir, error)
    if error.errno in DISK_FULL_ERRNOS:
        return NotStarted(f"{disk_full_text(outputs_dir)}; free some space and try again.", "Disk full")
    why = error.strerror or type(error).__name__
    if error.filename is not None and not Path(error.filename).is_relative_to(outputs_dir):
        return NotStarted(f"an input file could not be read ({why}); add it again.", "Input file unreadable")
    return NotStarted(outputs_refuse_writes(why), "Cannot write the outputs")
