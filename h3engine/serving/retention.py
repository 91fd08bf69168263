"""Retention: `--keep-days` and `--max-outputs-gb` remove the oldest results' files and mark their records expired.

`Retention.sweep()` runs at start and then every `SWEEP_EVERY_S` on a thread of its own: completed jobs older than
the age limit lose their MP4, sidecar, thumbnail, spritesheet and input files, failed ones their input files, and
files uploaded to /v1/files that long ago go; then, oldest first, more results go while the kept results take more
than the size limit. A record stays (status completed, `expired` true); its content answers 404.
"""

from __future__ import annotations

import logging
import threading
import time

from h3engine.serving.inputs import ClientFiles, job_inputs, remove_folder
from h3engine.serving.jobs import job_files
from h3engine.serving.store import JobStore, now

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 3600.0


class Retention:
    def __init__(
        self,
        store: JobStore,
        keep_days: float | None,
        max_outputs_gb: float | None,
        inputs: ClientFiles | None = None,
    ) -> None:
        self.store, self.keep_days, self.max_outputs_gb = store, keep_days, max_outputs_gb
        self.inputs = inputs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="h3-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:
                logger.exception("retention sweep failed")
            self._stop.wait(SWEEP_EVERY_S)

    def sweep(self) -> int:
        """Expire what the limits say; how many results were removed."""
        records = self.store.completed_outputs()
        removed = 0
        kept = []
        for record in records:
            if self.keep_days is not None and record.completed_at is not None:
                if time.time() - record.completed_at > self.keep_days * 86400:
                    self._expire(record)
                    removed += 1
                    continue
            kept.append(record)
        if self.max_outputs_gb is not None:
            sizes = [
                sum(path.stat().st_size for path in job_files(record) if path.is_file()) for record in kept
            ]
            total, limit = sum(sizes), self.max_outputs_gb * 1024**3
            for record, size in zip(kept, sizes, strict=True):
                if total <= limit:
                    break
                self._expire(record)
                total -= size
                removed += 1
        if self.keep_days is not None:
            for record in self.store.terminal_before(now() - self.keep_days * 86400):
                remove_folder(job_inputs(record))  # a failed job's inputs (a completed one's went above)
            if self.inputs is not None:
                self.inputs.expire_files(self.keep_days)
        if removed:
            logger.info("retention: removed the files of %d old results", removed)
        return removed

    def _expire(self, record) -> None:
        for path in job_files(record):
            path.unlink(missing_ok=True)
        remove_folder(job_inputs(record))
        self.store.update(record.id, expired=True)
