"""Prometheus metrics of the app's jobs (prometheus-client, a registry of the app's own).

h3_queue_depth and h3_jobs_running (read from the front when scraped), h3_jobs_total{task,outcome},
h3_job_seconds{phase} (each phase of the sidecar's timings, and "total"), h3_steps_per_second (the last job's
denoise), h3_api_requests_total{route,status}, h3_gpu_memory_bytes (allocated by torch on each visible GPU).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    def __init__(self, front: Any) -> None:
        self.registry = CollectorRegistry()
        queue = Gauge("h3_queue_depth", "Jobs waiting for an engine replica", registry=self.registry)
        queue.set_function(lambda: front.waiting)
        running = Gauge("h3_jobs_running", "Jobs running on an engine replica", registry=self.registry)
        running.set_function(lambda: front.running)
        self.jobs = Counter(
            "h3_jobs", "Jobs ended, by task and outcome", ["task", "outcome"], registry=self.registry
        )
        self.seconds = Histogram(
            "h3_job_seconds",
            "Seconds per job phase (total: creation to end)",
            ["phase"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.steps_per_second = Gauge(
            "h3_steps_per_second", "Denoising steps per second of the last job", registry=self.registry
        )
        self.requests = Counter(
            "h3_api_requests",
            "API requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.gpu_memory = Gauge(
            "h3_gpu_memory_bytes", "GPU memory allocated by torch", ["device"], registry=self.registry
        )

    def job_ended(self, record: Any) -> None:
        outcome = record.status if record.status == "completed" else record.error_code or "failed"
        self.jobs.labels(record.request.get("task", "?"), outcome).inc()
        timings = record.result.get("timings_s", {}) if record.status == "completed" else {}
        for phase, seconds in timings.items():
            self.seconds.labels(phase.removesuffix("_s")).observe(float(seconds))
        if record.completed_at is not None:
            self.seconds.labels("total").observe(max(0.0, record.completed_at - record.created_at))
        denoise = timings.get("denoise_s")
        steps = record.request.get("steps")
        if denoise and steps:
            self.steps_per_second.set(float(steps) / float(denoise))

    def render(self) -> bytes:
        try:
            import torch

            if torch.cuda.is_available():
                for index in range(torch.cuda.device_count()):
                    self.gpu_memory.labels(f"cuda:{index}").set(torch.cuda.memory_allocated(index))
        except Exception:  # metrics must answer whatever the GPU does
            pass
        return generate_latest(self.registry)
