"""The one resolve of a Generate press: `PressResolutions`, kept by value between the press's page events."""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.request.model import GenerationRequest


class PressResolutions:
    """The one resolve of a Generate press. The page's steps of a press (`start`, the validator, the handler) are
    separate events that each need the press's resolution; the first resolves (`resolve`: the front's) and the
    others find it, kept by value: the request at seed 0 (the seed decides nothing else) and its input files' sizes
    and change times, so a file replaced in between is resolved again. A refusal is kept too. Thread-safe."""

    KEPT = 32  # presses in flight at once, across sessions

    def __init__(self, resolve: Callable[[GenerationRequest], ResolvedRequest]) -> None:
        self._resolve = resolve
        self._kept: collections.OrderedDict[Any, ResolvedRequest | RequestError] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, request: GenerationRequest) -> ResolvedRequest:
        key = (dataclasses.replace(request, seed=0), file_stamps(request))
        try:
            hash(key)
        except (
            TypeError
        ):  # a value of the wrong type (a list for a prompt): the checker refuses it, nothing kept
            return self._resolve(request)
        with self._lock:
            outcome = self._kept.get(key)
            if outcome is not None:
                self._kept.move_to_end(key)
        if outcome is None:
            try:
                outcome = self._resolve(key[0])
            except RequestError as error:
                outcome = error
            with self._lock:
                self._kept[key] = outcome
                while len(self._kept) > self.KEPT:
                    self._kept.popitem(last=False)
        if isinstance(outcome, RequestError):
            raise outcome
        return outcome.with_seed(request.seed)


def file_stamps(request: GenerationRequest) -> tuple[tuple[str, int, int, int] | str, ...]:
    """Each input file of `request` (keyframes, references, adapters, remix sources) as (path, size, change time,
    inode), or its path alone when it cannot be read."""
    remix = request.remix
    paths = [
        *(keyframe.path for keyframe in request.keyframes),
        *(reference.path for reference in request.references),
        *(lora.path for lora in request.loras),
        *(() if remix is None else (remix.source_video, remix.source_audio, remix.video_mask_image)),
    ]
    stamps: list[tuple[str, int, int, int] | str] = []
    for path in paths:
        if not isinstance(path, str):
            continue
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            stamps.append(path)
            continue
        stamps.append((path, info.st_size, info.st_mtime_ns, info.st_ino))
    return tuple(stamps)
