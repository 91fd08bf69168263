"""How a Generate press ends when no job could start, in words a person can act on.

`NotStarted(reason, title)` is what the generate handler (ui.handlers) raises to itself when a press made no job
(invalid inputs, an outputs folder that refuses writes or is full, an unexpected error): it shows
`⚠ Not started: <reason>` as the status and hands the reason to API clients as a gr.Error titled `title`.
`storage_problem(error, outputs_dir)` words an OSError met while storing the inputs or making the results folder: a
full disk with the free space left, else what the system said; never a server path (the server log has it).
`NOT_TAKEN_STATUS` is the status of a press whose generate event never ran (a full queue; ui.blocks).
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
SIZE_UNITS = ("bytes", "KB", "MB", "GB", "TB")
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


def size_text(size: int) -> str:
    """Bytes in the units the app's upload limit uses (powers of 1024): `0 bytes`, `512.0 KB`, `1.5 GB`."""
    value, unit = float(size), 0
    while value >= 1024 and unit < len(SIZE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{size} bytes" if unit == 0 else f"{value:.1f} {SIZE_UNITS[unit]}"


def free_space(folder: Path) -> int | None:
    """The bytes free on the disk holding `folder` (or its nearest existing parent); None when it cannot tell."""
    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def storage_problem(error: OSError, outputs_dir: Path) -> NotStarted:
    """An OSError from storing the inputs or making the results folder, as the reason the press made no job."""
    logger.error("could not store a job's inputs or make its results folder under %s: %s", outputs_dir, error)
    if error.errno in FULL_DISK_ERRNOS:
        free = free_space(outputs_dir)
        left = f" ({size_text(free)} free)" if free is not None else ""
        return NotStarted(
            f"the disk of the outputs folder is full{left}; free some space and try again.",
            "Disk full",
        )
    why = error.strerror or type(error).__name__
    if error.filename is not None and not Path(error.filename).is_relative_to(outputs_dir):
        return NotStarted(f"an input file could not be read ({why}); add it again.", "Input file unreadable")
    return NotStarted(
        f"the outputs folder refuses writes ({why}); the details are in the server log.",
        "Cannot write the outputs",
    )
