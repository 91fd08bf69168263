"""Input files: where uploads are kept, what kind each reference is, the labels a Ref2VA prompt can cite.

Contract:
* `InputStore(outputs_dir)` copies an input file (an upload, an example asset, an extracted frame) into
  `<outputs>/inputs/<digest>/<name>`, named by a hash of its bytes, and returns the new path. Requests are built
  from these copies, so a result's sidecar names files that outlive Gradio's upload cache: clicking the result in
  the history after a restart restores its images and clips too, and they lie in the one folder the app serves.
* `reference_kind(path)` tells image / video / audio from the file name's extension.
* `reference_labels(kinds, has_audio)` numbers the labels per modality in reference order, as the model was
  trained: `<Picture i>` for images, `<Video k>` for videos, `<Audio j>` for audio clips, and a video with a
  soundtrack takes an `<Audio j>` label before its `<Video k>` label.
* `last_frame_png(video_path, store)` decodes the last frame of a result for "use the last frame".

Danger: file names come from users; a stored copy keeps only a sanitised base name (no folders, no leading dot),
so nothing can be written outside the inputs folder.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import av

from h3engine.errors import RequestError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".m4v", ".webm", ".mkv", ".avi"})
AUDIO_SUFFIXES = frozenset({".wav", ".mp3", ".flac", ".ogg", ".oga", ".opus", ".m4a", ".aac"})
INPUTS_FOLDER = "inputs"
_UNSAFE_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9._ -]+")


def safe_file_name(name: str) -> str:
    cleaned = _UNSAFE_NAME_CHARACTERS.sub("_", Path(name).name).strip(" .")
    return cleaned[:120] or "file"


class InputStore:
    def __init__(self, outputs_dir: Path) -> None:
        self.folder = Path(outputs_dir) / INPUTS_FOLDER

    def keep_file(self, path: str | os.PathLike[str]) -> str:
        source = Path(path)
        digest = hashlib.sha256()
        with open(source, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return self._place(
            digest.hexdigest(), safe_file_name(source.name), lambda target: shutil.copyfile(source, target)
        )

    def keep_bytes(self, data: bytes, name: str) -> str:
        digest = hashlib.sha256(data).hexdigest()
        return self._place(digest, safe_file_name(name), lambda target: target.write_bytes(data))

    def _place(self, digest: str, name: str, write) -> str:
        final = self.folder / digest[:20] / name
        if not final.is_file():
            final.parent.mkdir(parents=True, exist_ok=True)
            # Write beside the target, then rename: two sessions storing the same file never see half of it.
            partial = final.with_name(f".{name}.{secrets.token_hex(4)}.partial")
            try:
                write(partial)
                os.replace(partial, final)
            finally:
                partial.unlink(missing_ok=True)
        return str(final)


def reference_kind(path: str | os.PathLike[str]) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    if suffix in AUDIO_SUFFIXES:
        return "audio"
    raise RequestError(
        f"references: cannot tell whether '{Path(path).name}' is an image, a video or an audio clip "
        f"(use one of {', '.join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES | AUDIO_SUFFIXES))})"
    )


def video_has_audio(path: str | os.PathLike[str]) -> bool:
    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except av.FFmpegError:
        return False


@dataclass(frozen=True)
class LabelledReference:
    path: str
    kind: str
    labels: tuple[str, ...]


def reference_labels(kinds: list[str], has_audio: list[bool]) -> list[tuple[str, ...]]:
    counters = {"Picture": 0, "Video": 0, "Audio": 0}

    def next_label(modality: str) -> str:
        counters[modality] += 1
        return f"<{modality} {counters[modality]}>"

    labels = []
    for kind, carries_audio in zip(kinds, has_audio, strict=True):
        if kind == "image":
            labels.append((next_label("Picture"),))
        elif kind == "video":
            audio = (next_label("Audio"),) if carries_audio else ()
            labels.append(audio + (next_label("Video"),))
        else:
            labels.append((next_label("Audio"),))
    return labels


def label_references(paths: list[str]) -> list[LabelledReference]:
    """Kinds and prompt labels of an ordered reference list; raises RequestError for an unknown file type."""
    kinds = [reference_kind(path) for path in paths]
    has_audio = [kind == "video" and video_has_audio(path) for kind, path in zip(kinds, paths, strict=True)]
    return [
        LabelledReference(path, kind, labels)
        for path, kind, labels in zip(paths, kinds, reference_labels(kinds, has_audio), strict=True)
    ]


def last_frame_png(video_path: str | os.PathLike[str], store: InputStore) -> str:
    last_frame = None
    with av.open(str(video_path)) as container:
        for frame in container.decode(video=0):
            last_frame = frame
    if last_frame is None:
        raise RequestError(f"{Path(video_path).name}: the previous result has no video frames")
    buffer = io.BytesIO()
    last_frame.to_image().save(buffer, format="PNG")
    return store.keep_bytes(buffer.getvalue(), f"{Path(video_path).stem}-last-frame.png")
