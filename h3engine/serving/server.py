"""What app.py starts for serving: the store (at start, before any model), the job service, webhooks, routes.

app.py opens the store itself at start (`JobStore.open`: a StoreError is one line). `start_serving(...)` recovers the
store's unfinished jobs onto the front and returns a `ServingRuntime` whose `routes()` go to Gradio's FastAPI app
and whose `stop_taking()` / `close()` bracket the front's shutdown (jobs that shutdown cancels stay queued).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3engine.engine.lora.library import LoraLibrary
from h3engine.serving.api import routes
from h3engine.serving.inputs import DEFAULT_QUOTA_BYTES
from h3engine.serving.jobs import Limits, VideoJobs
from h3engine.serving.metrics import Metrics
from h3engine.serving.options import ServingOptions
from h3engine.serving.retention import Retention
from h3engine.serving.service import ApiSettings, Serving, is_loopback
from h3engine.serving.store import JobRecord, JobStore
from h3engine.serving.videos import video_object
from h3engine.serving.webhooks import Webhooks

logger = logging.getLogger(__name__)


@dataclass
class ServingRuntime:
    jobs: VideoJobs
    serving: Serving
    webhooks: Webhooks
    retention: Retention | None

    def routes(self) -> list[Any]:
        return routes(self.serving)

    def stop_taking(self) -> None:
        self.jobs.stop_taking()

    def close(self) -> None:
        if self.retention is not None:
            self.retention.close()
        self.jobs.close()
        self.webhooks.close()
        self.jobs.store.close()


def start_serving(
    front: Any,
    store: JobStore,
    outputs_dir: Path,
    options: ServingOptions,
    host: str,
    max_body_bytes: int,
    queue_size: int,
    max_inputs_bytes: int = DEFAULT_QUOTA_BYTES,
    library: LoraLibrary | None = None,
    shared_history: bool = False,
    share: bool = False,
) -> ServingRuntime:
    """`share`: a public share link forwards to the loopback bind, so keyless /v1 is off then too."""
    webhooks = Webhooks(options.webhook_secret)
    metrics = Metrics(front)

    def on_end(record: JobRecord) -> None:
        metrics.job_ended(record)
        url = record.meta.get("callback_url")
        if url and record.source == "api":
            kind = "video.completed" if record.status == "completed" else "video.failed"
            webhooks.send(
                url, {"type": kind, "created_at": int(record.completed_at or 0), "data": video_object(record)}
            )

    limits = Limits(max_queue=options.max_queue or queue_size, per_owner=options.max_jobs_per_owner)
    jobs = VideoJobs(
        front, store, outputs_dir, limits, on_end, shared=shared_history, inputs_quota=max_inputs_bytes
    )
    settings = ApiSettings(
        keys=options.api_keys,
        loopback=is_loopback(host) and not share,
        max_body_bytes=max_body_bytes,
        webhook_url=options.webhook_url,
    )
    serving = Serving(jobs, settings, metrics, library, ready=lambda: getattr(front, "ready", True))
    jobs.start()
    retention = None
    if options.keep_days is not None or options.max_outputs_gb is not None:
        retention = Retention(store, options.keep_days, options.max_outputs_gb, jobs.inputs)
        retention.start()
    if not settings.keys and not settings.loopback:
        where = "a public share link" if share else f"the address {host}"
        logger.warning("/v1 is off: the app is reachable through %s and no --api-key was given", where)
    return ServingRuntime(jobs, serving, webhooks, retention)
