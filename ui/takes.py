"""Several takes of one form: the jobs of one Generate press, followed together, and the status line they show.

`TakeSet` holds the jobs (one per seed, consecutive from the first) and folds the engine front's messages into
per-take states. `status_line` is the one status the result column shows while they run, and `final_status` the one
every ending leaves (done, cancelled, failed, a mix): the generate handler (ui.handlers) writes the status of a job
from its own messages only, so no message of an ended job can overwrite it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h3engine.errors import RequestError
from h3engine.runtime.messages import (
    JobEvent,
    JobFailed,
    JobFinished,
    JobQueued,
    JobStarted,
    PreviewFrame,
    StepProgress,
)
from h3engine.serving.jobs import JobView

MAX_TAKES = 8


def checked_takes(value: object) -> int:
    """The takes input: a whole number in 1..MAX_TAKES (a float that is whole is taken, as sliders send them)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise RequestError("takes", f"must be a whole number from 1 to {MAX_TAKES}, got {value!r}")
    if not 1 <= int(value) <= MAX_TAKES:
        raise RequestError("takes", f"must be from 1 to {MAX_TAKES}, got {int(value)}")
    return int(value)


@dataclass
class Take:
    """One job of the set and what its messages said so far."""

    number: int  # 1-based, in seed order
    handle: JobView  # the job's messages, from the job service
    status: str = "Waiting for a free engine."
    step: StepProgress | None = None
    started: JobStarted | None = None
    finished: JobFinished | None = None
    failed: JobFailed | None = None

    @property
    def ended(self) -> bool:
        return self.finished is not None or self.failed is not None

    def apply(self, event: JobEvent) -> None:
        if isinstance(event, JobQueued):
            self.status = f"Waiting for a free engine: position {event.position} in the queue."
        elif isinstance(event, JobStarted):
            self.started = event
            self.status = (
                f"Generating {event.width} × {event.height}, {event.frames} frames: encoding the prompt…"
            )
        elif isinstance(event, StepProgress):
            self.step = event
            self.status = (
                f"Denoising: step {event.step} of {event.total} · {event.elapsed_s:.1f} s elapsed · "
                f"about {event.eta_s:.0f} s left"
            )
            if event.step == event.total:
                self.status = "Decoding the video and the audio, writing the MP4…"
        elif isinstance(event, JobFinished):
            self.finished = event
            self.status = "Done."
        elif isinstance(event, JobFailed):
            self.failed = event
            self.status = self._failure_status(event)

    def _failure_status(self, event: JobFailed) -> str:
        if event.kind != "cancelled":
            return f"Failed: {event.message}"
        if self.step is not None:
            return f"Cancelled at step {self.step.step} of {self.step.total}."
        return (
            "Cancelled before it started." if self.started is None else "Cancelled while encoding the prompt."
        )


@dataclass
class TakeSet:
    takes: list[Take]
    previews: list[PreviewFrame] = field(default_factory=list)

    @classmethod
    def of(cls, views: list[JobView]) -> TakeSet:
        return cls([Take(number, view) for number, view in enumerate(views, start=1)])

    @property
    def ended(self) -> bool:
        return all(take.ended for take in self.takes)

    @property
    def finished(self) -> list[Take]:
        """The takes that made a video, in seed order."""
        return [take for take in self.takes if take.finished is not None]

    def drain(self) -> tuple[bool, PreviewFrame | None, list[Take]]:
        """Apply every waiting message: (anything changed, the newest preview, takes that finished just now)."""
        changed, preview, newly_finished = False, None, []
        for take in self.takes:
            for event in take.handle.drain():
                changed = True
                take.apply(event)
                if isinstance(event, PreviewFrame):
                    preview = event
                elif isinstance(event, JobFinished):
                    newly_finished.append(take)
        return changed, preview, newly_finished

    def current(self) -> Take:
        """The take the status is about: the first one still running, else the first still waiting, else the last."""
        pending = [take for take in self.takes if not take.ended]
        running = [take for take in pending if take.started is not None]
        return (running or pending or self.takes[-1:])[0]

    def status_line(self) -> str:
        take = self.current()
        if len(self.takes) == 1:
            return take.status
        done = len(self.finished)
        return f"Take {take.number} of {len(self.takes)} ({done} done): {take.status}"

    def progress(self) -> tuple[int, int] | None:
        """Denoising steps done over all takes, for the progress bar (None before any step)."""
        steps = [take.step for take in self.takes if take.step is not None]
        if not steps:
            return None
        total = steps[0].total * len(self.takes)
        done = sum(
            take.step.total if take.finished is not None else take.step.step if take.step is not None else 0
            for take in self.takes
        )
        return done, total

    def final_status(self, wall_s: float) -> str:
        """The status every ending leaves: what became of each take, in one line."""
        failed = [take for take in self.takes if take.failed is not None and take.failed.kind != "cancelled"]
        cancelled = [
            take for take in self.takes if take.failed is not None and take.failed.kind == "cancelled"
        ]
        if len(self.takes) == 1:
            return f"Done in {wall_s:.1f} s." if self.finished else self.takes[0].status
        parts = [f"{len(self.finished)} of {len(self.takes)} takes done in {wall_s:.1f} s"]
        if cancelled:
            parts.append(f"{len(cancelled)} cancelled")
        for take in failed:
            parts.append(f"take {take.number} failed: {take.failed.message.rstrip('.')}")
        line = "; ".join(parts) + "."
        return ("Done: " if not failed and not cancelled else "") + line
