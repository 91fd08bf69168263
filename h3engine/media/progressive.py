"""A decoded video that is still being written: lets the MP4 writer encode the first frames while the VAE decodes the
rest (`h3engine.engine.pipeline.decode_to_mp4`).

Contract
--------
`ProgressiveFrames(frame_count, height, width)` holds a float32 host tensor [F, H, W, 3] (`frames`) written front
to back by one producer with `append`; `frames[i]` read through `ProgressiveFrames[i]` waits until frame i is
written. `fail(error)` ends the writing early: every waiting and later read raises `FramesUnavailable` naming the
producer's error. Shape, dtype and ndim answer at once, so `write_mp4` can validate the layout before the first
frame exists. On a CUDA machine the host tensor is pinned (the device-to-host copies run at full speed).

Danger
------
A reader waits for as long as the producer takes: a producer must end with all frames appended or with `fail`
(`pipeline.decode_to_mp4` calls `fail` on any exception, KeyboardInterrupt included).
"""

from __future__ import annotations

import threading

import torch


class FramesUnavailable(RuntimeError):
    """A frame was read from a video whose producer failed."""


class ProgressiveFrames:
    def __init__(self, frame_count: int, height: int, width: int) -> None:
        self.frames = torch.empty(
            (frame_count, height, width, 3), dtype=torch.float32, pin_memory=torch.cuda.is_available()
        )
        self._written = 0
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    @property
    def shape(self) -> torch.Size:
        return self.frames.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.frames.dtype

    @property
    def ndim(self) -> int:
        return self.frames.ndim

    def __len__(self) -> int:
        return self.frames.shape[0]

    @property
    def written(self) -> int:
        """Frames appended so far."""
        return self._written

    def append(self, frames: torch.Tensor) -> None:
        """Copy the next frames [n, H, W, 3] (any device, any float dtype) in; readers of them wake up."""
        start = self._written
        if start + frames.shape[0] > len(self) or frames.shape[1:] != self.frames.shape[1:]:
            raise ValueError(
                f"cannot append frames of shape {tuple(frames.shape)} after {start} of {tuple(self.frames.shape)}"
            )
        self.frames[start : start + frames.shape[0]].copy_(frames)
        with self._changed:
            self._written = start + frames.shape[0]
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """No more frames will come: wake every reader with `FramesUnavailable`."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def __getitem__(self, index: int) -> torch.Tensor:
        if not isinstance(index, int):
            raise TypeError(f"ProgressiveFrames is indexed by one frame number, got {type(index).__name__}")
        if not 0 <= index < len(self):
            raise IndexError(f"frame {index} of {len(self)}")
        with self._changed:
            while index >= self._written:
                if self._error is not None:
                    raise FramesUnavailable(
                        f"frame {index} was never decoded: {self._error!r}"
                    ) from self._error
                self._changed.wait()
        return self.frames[index]
