"""Input files: where uploads are kept, what kind each reference is, the labels a Ref2VA prompt can cite.

Contract:
* `InputStore(outputs_dir)` copies an input file (an upload, an example asset, an extracted frame) into
  `<outputs>/inputs/<digest>/<name>`, named by a hash of its bytes, and returns the new path. Requests are built
  from these copies, so a result's sidecar names files that outlive Gradio's upload cache: clicking the result in
  the history after a restart restores its images and clips too, and they lie in the one folder the app serves.
* `reference_kind(path)` tells image / video / audio from the file name's extension (h3engine.media.formats).
* `label_references(paths)` gives each reference its prompt labels, numbered by h3engine.request.validate.reference_labels
  (the rule validation applies to the prompt, so the rows and the check cannot disagree).
* `last_frame_png(video_path, store)` decodes the last frame of a result for "use the last frame".

Danger: file names come from users; a stored copy keeps only a sanitised base name (no folders, no leading dot),
so nothing can be written outside the inputs folder.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import av

from h3engine.errors import RequestError
from h3engine.media.formats import accepted_text, kind_of_suffix, safe_file_name
from h3engine.request.file_rules import reference_labels

INPUTS_FOLDER = "inputs"


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
    """The kind ("image", "video", "audio") the file name's suffix says (h3engine.media.formats), else RequestError."""
    kind = kind_of_suffix(path)
    if kind is None:
        raise RequestError(
            "references",
            f"cannot tell whether '{Path(path).name}' is an image, a video or an audio clip "
            f"by its name; accepted: {accepted_text()}",
        )
    return kind


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
        raise RequestError("last_result", f"{Path(video_path).name}: the previous result has no video frames")
    buffer = io.BytesIO()
    last_frame.to_image().save(buffer, format="PNG")
    return store.keep_bytes(buffer.getvalue(), f"{Path(video_path).stem}-last-frame.png")
