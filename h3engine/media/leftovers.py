"""What a killed run leaves behind, and how the next start finds and removes it.

A SIGKILL (or a power cut) skips every `finally`: staging files stay in the outputs folder, and the worker runtime's
rendezvous folder and the warm-up folder stay in the temp folder. Each of those names carries the id of the process
that made it (`.NAME.PID-TOKEN.partial`, `h3-workers-PID-*`, `h3-warm-up-PID-*`, `h3-gradio-PID-*`), so a start removes exactly the
ones whose process is gone and never a live writer's (another app on the same folder, a CLI run next to it). A worker
group that was killed removes its ranks' staging files at once (`remove_staging_files_of`).
A sidecar-less MP4 under the front's stamped naming (`YYYYmmdd-HHMMSS-TASK-JOBID.mp4`) can only come from a commit
cut between its two renames; it is removed too. Files of any other name are never touched.

Danger: process ids are reused. A leftover whose id now belongs to an unrelated live process is kept until a later
start; that errs on the side of keeping files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from h3engine.media.outputs import MP4_SUFFIX, PARTIAL_SUFFIX, SIDECAR_SUFFIX

logger = logging.getLogger(__name__)

# `.NAME.PID-TOKEN.partial`, as outputs._new_partial_path names staging files (NAME may itself be one).
_PARTIAL_NAME = re.compile(r"^\..+\.(?P<pid>\d+)-[0-9a-f]{12}" + re.escape(PARTIAL_SUFFIX) + "$")
# The engine front's default output names (h3engine.runtime.front.stamped_output_name).
STAMPED_OUTPUT_NAME = re.compile(
    r"^\d{8}-\d{6}-(t2va|fl2va|ref2va)-[0-9a-f]{8}" + re.escape(MP4_SUFFIX) + "$"
)
WORKER_FOLDER_PREFIX = "h3-workers-"
WARM_UP_FOLDER_PREFIX = "h3-warm-up-"
GRADIO_FOLDER_PREFIX = "h3-gradio-"  # the app's own Gradio cache when GRADIO_TEMP_DIR is not set


def owned_temp_folder(prefix: str) -> Path:
    """A new folder in the temp folder whose name says which process made it (see `remove_dead_temp_folders`)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_output_leftovers(folder: Path) -> list[Path]:
    """Remove the staging files of dead writers and sidecar-less stamped MP4s in `folder` and the folders below it;
    return what went."""
    removed = []
    for path in sorted(folder.rglob("*")):
        match = _PARTIAL_NAME.match(path.name)
        dead_partial = match is not None and not process_alive(int(match["pid"]))
        unpaired = STAMPED_OUTPUT_NAME.match(path.name) and not path.with_suffix(SIDECAR_SUFFIX).exists()
        if (dead_partial or unpaired) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    _report(removed, f"in {folder}")
    return removed


def remove_staging_files_of(pids: Iterable[int], folders: Iterable[Path]) -> list[Path]:
    """Remove the staging files that the processes `pids` (ended: killed ranks) left directly in `folders`; return
    what went."""
    pids = set(pids)
    removed = []
    for folder in set(folders):
        for path in sorted(folder.glob(f".*{PARTIAL_SUFFIX}")):
            match = _PARTIAL_NAME.match(path.name)
            if match is None or int(match["pid"]) not in pids or not path.is_file():
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as error:  # the next start tries again; the group's ending must go on
                logger.warning("could not remove %s: %s", path, error)
                continue
            removed.append(path)
    _report(removed, "of killed ranks")
    return removed


def remove_dead_temp_folders(prefix: str) -> list[Path]:
    """Remove `PREFIX-PID-*` folders of the temp folder whose process is gone; return what went."""
    removed = []
    pattern = re.compile(re.escape(prefix) + r"(?P<pid>\d+)-")
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        match = pattern.match(path.name)
        if match is not None and path.is_dir() and not process_alive(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    _report(removed, f"in {tempfile.gettempdir()}")
    return removed


def _report(removed: list[Path], where: str) -> None:
    if removed:
        names = ", ".join(path.name for path in removed[:5]) + (" ..." if len(removed) > 5 else "")
        logger.warning("removed %d leftover(s) of a stopped run %s: %s", len(removed), where, names)
