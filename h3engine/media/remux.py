"""Stream copy for remixes: an MP4 of ours rewritten with a source file's video stream and our audio stream.

`copy_source_video` keeps the source's compressed video packets (no decode, no re-encode, so the frames are the
source's exactly) and our AAC packets. The source is cut by presentation time to the clip's frames: packets are
taken in decode order up to the last one shown before the cut, so a codec with B-frames may carry a few frames past
it (the audio ends at the cut). The file is replaced atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import av

from h3engine.errors import RequestError


def copy_source_video(source: str, mp4_path: Path, frames: int, fps: int) -> None:
    """Rewrite `mp4_path` (ours) with `source`'s first `frames` video frames copied and its own audio copied."""
    target = mp4_path.with_name(mp4_path.name + ".remux")
    try:
        with av.open(source) as source_file, av.open(str(mp4_path)) as ours:
            if not source_file.streams.video:
                raise RequestError("remix.source_video", "has no video stream", source)
            video_in = source_file.streams.video[0]
            audio_in = ours.streams.audio[0]
            cut = _packets_before(source_file, video_in, frames / fps - 0.5 / fps)
        with (
            av.open(source) as source_file,
            av.open(str(mp4_path)) as ours,
            av.open(str(target), mode="w", format="mp4") as out,
        ):
            video_in, audio_in = source_file.streams.video[0], ours.streams.audio[0]
            video_out = out.add_stream_from_template(video_in)
            audio_out = out.add_stream_from_template(audio_in)
            for index, packet in enumerate(source_file.demux(video_in)):
                if index >= cut:
                    break
                if packet.dts is None:
                    continue
                packet.stream = video_out
                out.mux(packet)
            for packet in ours.demux(audio_in):
                if packet.dts is None:
                    continue
                packet.stream = audio_out
                out.mux(packet)
        os.replace(target, mp4_path)
    finally:
        target.unlink(missing_ok=True)


def _packets_before(container: av.container.InputContainer, stream: av.stream.Stream, seconds: float) -> int:
    """How many packets (decode order) to take so that every frame shown before `seconds` is among them."""
    start = stream.start_time or 0
    last = 0
    for index, packet in enumerate(container.demux(stream)):
        if packet.pts is not None and float((packet.pts - start) * stream.time_base) < seconds:
            last = index + 1
    return last
