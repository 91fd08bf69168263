"""The remix flags of `generate`: `--task v2a|a2v|extend`, the sources, the masks (h3engine.request.remix).

`--task v2a --source-video FILE` (new sound; `--decoded-video` writes the VAE's frames instead of copying the
source's stream), `--task a2v --source-audio FILE` (new video), `--task extend --source-video FILE --duration S
[--overlap-frames N] [--windows K]`; on any of them or on t2va: `--video-mask START-END[,...]` (seconds regenerated,
`--video-mask-image FILE`: white regenerates) and `--audio-mask START-END[,...]`. They become the request's `remix`.
"""

from __future__ import annotations

import argparse
from typing import Any

from h3engine.errors import RequestError

REMIX_TASKS = ("v2a", "a2v", "extend")


def add_remix_flags(generate: argparse.ArgumentParser) -> None:
    group = generate.add_argument_group("remix (v2a, a2v, extend, masks; unverified on the released weights)")
    group.add_argument("--source-video", default=None, help="v2a / extend / masks: the video kept")
    group.add_argument("--source-audio", default=None, help="a2v / audio masks: the audio kept")
    group.add_argument(
        "--decoded-video", action="store_true", help="v2a: write decoded frames, not a stream copy"
    )
    group.add_argument(
        "--overlap-frames", type=int, default=None, help="extend: frames held (17k+5, default 22)"
    )
    group.add_argument("--windows", type=int, default=None, help="extend: windows chained (default 1)")
    group.add_argument(
        "--video-mask", default=None, metavar="START-END[,...]", help="seconds of video regenerated"
    )
    group.add_argument("--video-mask-image", default=None, help="image whose white region is regenerated")
    group.add_argument(
        "--audio-mask", default=None, metavar="START-END[,...]", help="seconds of audio regenerated"
    )


def remix_payload(args: argparse.Namespace, task: str) -> dict[str, Any] | None:
    """The request's `remix` from the flags (None when no remix flag is given); `task` is `--task`'s value."""
    mode = task if task in REMIX_TASKS else None
    values = {
        "source_video": args.source_video,
        "source_audio": args.source_audio,
        "video_mask_image": args.video_mask_image,
        "overlap_frames": args.overlap_frames,
        "windows": args.windows,
        "video_mask": args.video_mask,
        "audio_mask": args.audio_mask,
    }
    given = {name: value for name, value in values.items() if value is not None}
    if args.decoded_video:
        given["decoded_video"] = True
    if mode is None and not given:
        return None
    if mode is None and task != "t2va":
        flag = "--" + next(iter(given)).replace("_", "-")
        raise RequestError(flag, f"remix flags run on t2va, v2a, a2v or extend, not on task {task!r}")
    return {"mode": mode, **given}
