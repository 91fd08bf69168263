"""The durable job store: one SQLite file (WAL mode) holding every job the app was asked to run.

Contract: `JobStore.open(folder)` opens (or makes) `folder/h3-jobs.sqlite3` and checks it: a file that is not a
store, a corrupt one or one that cannot be written raises `StoreError` with one sentence (the app's start-up
error; never a silent reset). A row is written before its job is queued and at each change of state, so after a
crash the store says what was queued, what was running (`attempts` counts the starts) and what finished.
`unfinished()` lists what recovery must look at. Thread-safe: one connection behind a lock.

Danger: owners and ids come from clients; they only ever reach SQL as bound parameters.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

STORE_NAME = "h3-jobs.sqlite3"
SCHEMA_VERSION = 1
STATUSES = ("queued", "in_progress", "completed", "failed")
TERMINAL_STATUSES = ("completed", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    source TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    request TEXT NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}',
    result TEXT NOT NULL DEFAULT '{}',
    out_path TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    idempotency_key TEXT,
    body_digest TEXT,
    deleted INTEGER NOT NULL DEFAULT 0,
    expired INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created_at);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_idempotency ON jobs (owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    purpose TEXT NOT NULL,
    created_at REAL NOT NULL,
    path TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at);
"""


class StoreError(Exception):
    """The job store cannot be used; the message says why in one sentence."""


@dataclass
class JobRecord:
    id: str
    owner: str
    source: str  # "api" or "ui"
    status: str
    created_at: float
    request: dict[str, Any]  # GenerationRequest.to_dict()
    out_path: str
    progress: int = 0
    started_at: float | None = None
    completed_at: float | None = None
    attempts: int = 0
    meta: dict[str, Any] = field(
        default_factory=dict
    )  # model, seconds, size, callback_url, remixed_from, ...
    result: dict[str, Any] = field(
        default_factory=dict
    )  # video, sidecar, thumbnail, seed, geometry, timings_s
    error_code: str | None = None
    error_message: str | None = None
    idempotency_key: str | None = None
    body_digest: str | None = None
    deleted: bool = False
    expired: bool = False

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


_JSON_COLUMNS = ("request", "meta", "result")
_COLUMNS = tuple(item.name for item in fields(JobRecord))


def _row_to_record(row: sqlite3.Row) -> JobRecord:
    values = {name: row[name] for name in _COLUMNS}
    for name in _JSON_COLUMNS:
        values[name] = json.loads(values[name])
    values["deleted"] = bool(values["deleted"])
    values["expired"] = bool(values["expired"])
    return JobRecord(**values)


def _record_values(record: JobRecord) -> dict[str, Any]:
    values = {name: getattr(record, name) for name in _COLUMNS}
    for name in _JSON_COLUMNS:
        values[name] = json.dumps(values[name], sort_keys=True)
    values["deleted"] = int(record.deleted)
    values["expired"] = int(record.expired)
    return values


@dataclass
class FileRecord:
    """A file a client uploaded to /v1/files, kept at `path` until it is deleted or expires."""

    id: str
    owner: str
    filename: str
    bytes: int
    purpose: str
    created_at: float
    path: str


_FILE_COLUMNS = tuple(item.name for item in fields(FileRecord))


class JobStore:
    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self.path = path

    @classmethod
    def open(cls, folder: Path, flag: str = "--state-dir") -> JobStore:
        path = Path(folder) / STORE_NAME
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(path, check_same_thread=False, timeout=10, isolation_level=None)
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"{flag}: cannot open the job store {path} ({error})") from None
        try:
            connection.row_factory = sqlite3.Row
            check = connection.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {check}")
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot use WAL mode here (got {mode})")
            connection.execute("PRAGMA synchronous=NORMAL")
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, this app reads {SCHEMA_VERSION}")
            connection.executescript(_SCHEMA)
            connection.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            # A write that must reach the file: an unwritable store fails here, at start, not at the first job.
            connection.execute("BEGIN IMMEDIATE")
            connection.execute("COMMIT")
        except sqlite3.Error as error:
            connection.close()
            raise StoreError(
                f"{flag}: the job store {path} cannot be used ({error}); fix its permissions, or move it away "
                "to start with an empty one"
            ) from None
        return cls(connection, path)

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def _execute(self, sql: str, parameters: Iterable[Any] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._connection.execute(sql, parameters).fetchall()

    def insert(self, record: JobRecord) -> None:
        values = _record_values(record)
        names = ", ".join(values)
        marks = ", ".join(f":{name}" for name in values)
        self._execute(f"INSERT INTO jobs ({names}) VALUES ({marks})", values)

    def update(self, job_id: str, **changes: Any) -> None:
        for name in _JSON_COLUMNS:
            if name in changes:
                changes[name] = json.dumps(changes[name], sort_keys=True)
        for name in ("deleted", "expired"):
            if name in changes:
                changes[name] = int(changes[name])
        unknown = set(changes) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job columns: {sorted(unknown)}")
        assignments = ", ".join(f"{name} = :{name}" for name in changes)
        self._execute(f"UPDATE jobs SET {assignments} WHERE id = :id", {**changes, "id": job_id})

    def get(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The job (None when absent, deleted, or another owner's)."""
        rows = self._execute("SELECT * FROM jobs WHERE id = ? AND deleted = 0", (job_id,))
        if not rows:
            return None
        record = _row_to_record(rows[0])
        return record if owner is None or record.owner == owner else None

    def by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        rows = self._execute("SELECT * FROM jobs WHERE owner = ? AND idempotency_key = ?", (owner, key))
        return _row_to_record(rows[0]) if rows else None

    def list(
        self,
        owner: str,
        after: str | None = None,
        limit: int = 20,
        order: str = "desc",
        source: str | None = None,
    ) -> list[JobRecord]:
        """An owner's jobs by creation time (`order` "asc" or "desc"), starting after the job `after`."""
        sql = "SELECT * FROM jobs WHERE owner = ? AND deleted = 0"
        parameters: list[Any] = [owner]
        if source is not None:
            sql += " AND source = ?"
            parameters.append(source)
        return [
            _row_to_record(row) for row in self._page("jobs", sql, parameters, owner, after, limit, order)
        ]

    def _page(
        self,
        table: str,
        sql: str,
        parameters: list[Any],
        owner: str,
        after: str | None,
        limit: int,
        order: str,
    ) -> list[sqlite3.Row]:
        """`sql`'s rows of `table` by creation time ("asc" or "desc"), starting after the owner's row `after`."""
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        if after is not None:
            anchor = self._execute(
                f"SELECT created_at, id FROM {table} WHERE id = ? AND owner = ?", (after, owner)
            )
            if anchor:
                sql += f" AND (created_at, id) {compare} (?, ?)"
                parameters = [*parameters, anchor[0]["created_at"], anchor[0]["id"]]
        return self._execute(
            f"{sql} ORDER BY created_at {direction}, id {direction} LIMIT ?", [*parameters, limit]
        )

    def unfinished(self) -> list[JobRecord]:
        """Jobs not yet completed or failed (deleted ones too: their files may still need removing), oldest first."""
        rows = self._execute(
            "SELECT * FROM jobs WHERE status IN ('queued', 'in_progress') ORDER BY created_at, id"
        )
        return [_row_to_record(row) for row in rows]

    def completed_outputs(self) -> list[JobRecord]:
        """Completed jobs whose files are still kept, oldest first (retention's candidates)."""
        rows = self._execute(
            "SELECT * FROM jobs WHERE status = 'completed' AND expired = 0 AND deleted = 0 "
            "ORDER BY completed_at, id"
        )
        return [_row_to_record(row) for row in rows]

    def count(self, owner: str | None = None, statuses: tuple[str, ...] = ("queued", "in_progress")) -> int:
        marks = ", ".join("?" for _ in statuses)
        sql = f"SELECT COUNT(*) FROM jobs WHERE deleted = 0 AND status IN ({marks})"
        parameters: list[Any] = list(statuses)
        if owner is not None:
            sql += " AND owner = ?"
            parameters.append(owner)
        return int(self._execute(sql, parameters)[0][0])

    # --- uploaded files (/v1/files) -----------------------------------------------------------------------------

    def insert_file(self, record: FileRecord) -> None:
        values = {name: getattr(record, name) for name in _FILE_COLUMNS}
        marks = ", ".join(f":{name}" for name in values)
        self._execute(f"INSERT INTO files ({', '.join(values)}) VALUES ({marks})", values)

    def get_file(self, file_id: str, owner: str) -> FileRecord | None:
        """The owner's file (None when absent or another owner's)."""
        rows = self._execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return FileRecord(**{name: rows[0][name] for name in _FILE_COLUMNS}) if rows else None

    def list_files(
        self, owner: str, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> list[FileRecord]:
        """An owner's files by upload time (`order` "asc" or "desc"), starting after the file `after`."""
        rows = self._page("files", "SELECT * FROM files WHERE owner = ?", [owner], owner, after, limit, order)
        return [FileRecord(**{name: row[name] for name in _FILE_COLUMNS}) for row in rows]

    def files_before(self, created_before: float) -> list[FileRecord]:
        """Every owner's files uploaded before `created_before` (retention's candidates)."""
        rows = self._execute(
            "SELECT * FROM files WHERE created_at < ? ORDER BY created_at", (created_before,)
        )
        return [FileRecord(**{name: row[name] for name in _FILE_COLUMNS}) for row in rows]

    def delete_file(self, file_id: str) -> None:
        self._execute("DELETE FROM files WHERE id = ?", (file_id,))

    def file_ids(self) -> set[str]:
        return {row["id"] for row in self._execute("SELECT id FROM files")}

    def job_ids(self) -> set[str]:
        """The ids of every job not deleted (what an inputs folder may belong to)."""
        return {row["id"] for row in self._execute("SELECT id FROM jobs WHERE deleted = 0")}

    def terminal_before(self, ended_before: float) -> list[JobRecord]:
        """Jobs that ended (completed or failed) before `ended_before`, not deleted, oldest first."""
        rows = self._execute(
            "SELECT * FROM jobs WHERE status IN ('completed', 'failed') AND deleted = 0 AND completed_at < ? "
            "ORDER BY completed_at, id",
            (ended_before,),
        )
        return [_row_to_record(row) for row in rows]


def now() -> float:
    return time.time()
