"""Client files on disk: each API job's inputs in a folder of its own, and files uploaded once to /v1/files.

Layout under the outputs folder, per owner (`owner_key`, the folder name its results use too):
* `inputs/api/<owner>/<job id>/<name>`: a job's input files, written while its request is checked. A refused
  request's folder is removed before the answer goes out; a job's goes with the job (DELETE, retention);
  `sweep_orphans` at start removes folders no job owns (a crash between writing and recording).
* `inputs/api/<owner>/files/<file id>/<name>`: a file uploaded to POST /v1/files (its row in the job store), usable
  by id in any request of the same owner (copied into the job's folder, so deleting the file never breaks a job).
An owner's inputs together may take at most `quota_bytes` (`QuotaExceeded` before anything is written).

Danger: names come from clients: a stored file keeps a sanitised base name only, inside its own folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from h3engine.media.formats import safe_file_name
from h3engine.runtime.messages import size_text
from h3engine.serving.store import FileRecord, JobRecord, JobStore, now

logger = logging.getLogger(__name__)

INPUTS_FOLDER = "inputs"
API_INPUTS = Path(INPUTS_FOLDER) / "api"
FILES_FOLDER = "files"
FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
JOB_ID = re.compile(r"^video_[0-9a-f]{24}$")
DEFAULT_QUOTA_BYTES = 4 * 1024**3


class QuotaExceeded(Exception):
    """An owner's inputs would pass the quota; the message says by how much and what to delete."""


def owner_key(owner: str) -> str:
    """The folder name of an owner's files (results and inputs): a digest, never the owner's own text."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


def new_job_id() -> str:
    return "video_" + secrets.token_hex(12)


def write_input(folder: Path, name: str, data: bytes | Path) -> Path:
    """`data` (bytes, or a file to copy) as `folder/<safe name>` (a new name when taken: "-2", "-3" before the
    suffix), written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    base = Path(safe_file_name(name))
    target, number = folder / base.name, 1
    while target.exists():
        number += 1
        target = folder / f"{base.stem}-{number}{base.suffix}"
    partial = folder / f".{target.name}.{secrets.token_hex(4)}.partial"
    try:
        if isinstance(data, Path):
            shutil.copyfile(data, partial)
        else:
            partial.write_bytes(data)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def remove_folder(folder: Path | str | None) -> None:
    """Remove a job's or a file's folder; what cannot be removed is logged, never raised."""
    if folder is None:
        return

    def logged(function, path, error) -> None:  # noqa: ANN001
        logger.warning("could not remove %s: %s", path, error)

    if Path(folder).exists():
        shutil.rmtree(folder, onerror=logged)


def job_inputs(record: JobRecord) -> Path | None:
    """The folder of a job's input files (None for a job without uploads)."""
    folder = record.meta.get("inputs")
    return Path(folder) if folder else None


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue
    return total


class ClientFiles:
    """The API's client files under `outputs_dir`, their rows in `store`, an owner's `quota_bytes`."""

    def __init__(self, outputs_dir: Path, store: JobStore, quota_bytes: int = DEFAULT_QUOTA_BYTES) -> None:
        self.root = Path(outputs_dir) / API_INPUTS
        self.store, self.quota_bytes = store, quota_bytes

    def owner_folder(self, owner: str) -> Path:
        return self.root / owner_key(owner)

    def job_folder(self, owner: str, job_id: str) -> Path:
        return self.owner_folder(owner) / job_id

    def used_bytes(self, owner: str) -> int:
        folder = self.owner_folder(owner)
        return _folder_bytes(folder) if folder.is_dir() else 0

    def check_quota(self, owner: str, adding: int) -> None:
        """QuotaExceeded when `adding` more bytes would pass the owner's quota."""
        if adding <= 0:
            return
        used = self.used_bytes(owner)
        if used + adding > self.quota_bytes:
            raise QuotaExceeded(
                f"Your stored inputs would take {size_text(used + adding)}, over this server's limit of "
                f"{size_text(self.quota_bytes)} per owner ({size_text(used)} kept now); delete uploaded files "
                "(DELETE /v1/files/{id}) or videos you no longer need, then try again."
            )

    # --- files uploaded once (/v1/files) -----------------------------------------------------------------

    def add_file(self, owner: str, name: str, data: bytes, purpose: str) -> FileRecord:
        self.check_quota(owner, len(data))
        file_id = "file-" + secrets.token_hex(12)
        folder = self.owner_folder(owner) / FILES_FOLDER / file_id
        try:
            path = write_input(folder, name, data)
            record = FileRecord(file_id, owner, path.name, len(data), purpose, now(), str(path))
            self.store.insert_file(record)
        except BaseException:
            remove_folder(folder)
            raise
        return record

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        if not isinstance(file_id, str) or not FILE_ID.match(file_id):
            return None
        record = self.store.get_file(file_id, owner)
        return record if record is not None and Path(record.path).is_file() else None

    def delete_file(self, record: FileRecord) -> None:
        self.store.delete_file(record.id)
        remove_folder(Path(record.path).parent)

    # --- housekeeping --------------------------------------------------------------------------------------

    def expire_files(self, keep_days: float) -> int:
        """Remove files uploaded more than `keep_days` ago; how many."""
        expired = self.store.files_before(now() - keep_days * 86400)
        for record in expired:
            self.delete_file(record)
        return len(expired)

    def sweep_orphans(self) -> int:
        """Remove job folders no kept job owns, staging files, and files whose row is gone; how many folders."""
        if not self.root.is_dir():
            return 0
        jobs, file_ids, removed = self.store.job_ids(), self.store.file_ids(), 0
        for owner_folder in self.root.iterdir():
            if not owner_folder.is_dir():
                continue
            for folder in owner_folder.iterdir():
                if JOB_ID.match(folder.name) and folder.name not in jobs:
                    remove_folder(folder)
                    removed += 1
            files = owner_folder / FILES_FOLDER
            for folder in files.iterdir() if files.is_dir() else ():
                if folder.name not in file_ids:
                    remove_folder(folder)
                    removed += 1
            for partial in owner_folder.rglob(".*.partial"):
                partial.unlink(missing_ok=True)
        if removed:
            logger.info("inputs: removed %d folders no job or file owns", removed)
        return removed
