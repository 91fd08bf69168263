"""The Ref2VA references gallery: one ordered list of cards, one drop zone that adds files to its end.

Contract:
* `build_reference_gallery()` (ui.tabs) makes the drop zone, the hidden ordered gr.File that is the /ref2va
  endpoint's `references` parameter (a list of files, in order), and the column the cards render into.
* `wire_reference_gallery(gallery, prompt)` (ui.blocks) attaches the events: a drop appends its files; each card
  shows its `<Picture i>` / `<Video k>` / `<Audio j>` labels (ui.inputs.label_references), a thumbnail, poster
  frame and length, or player and length, the file name, and ↑ ↓ ✕ and "Insert <label>" buttons.
* `reference_preview(path)` reads a thumbnail or poster frame and a length with Pillow / PyAV, once per file (cached
  by path, size and time) and within `PREVIEW_SECONDS`; a file that does not decode gets a one-line error naming
  the file instead (refusing it is the request validation's job, not this module's).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import av
import gradio as gr
from PIL import Image, ImageOps

from h3engine.errors import RequestError
from h3engine.media.formats import FORMATS, REFERENCE_SUFFIXES
from h3engine.request.limits import MAX_REFERENCES_OF_KIND
from ui.components import as_uploaded
from ui.inputs import LabelledReference, label_references, reference_kind

THUMBNAIL_EDGE = 320  # px, the longer edge of a card's picture
PREVIEW_SECONDS = 5.0  # the most one file's preview may take to read
PREVIEW_CACHE_SIZE = 128
CARD_MIN_WIDTH = 230  # px: three cards a row beside the result column at 1400 px, one a row on a phone
_KIND_WORDS = {"image": "an image", "video": "a video clip", "audio": "an audio clip"}


class _TooSlow(Exception):
    pass


@dataclass(frozen=True)
class ReferencePreview:
    """What a card shows besides its labels and name: `picture` (an image's thumbnail, a video's poster frame),
    `seconds` (a clip's length), or `error` (one line naming the file) when the file does not decode."""

    picture: Image.Image | None = None
    seconds: float | None = None
    error: str | None = None


# --- the list operations the buttons run -------------------------------------------------------------------


def append_references(paths: list[str] | None, added: list[str] | str | None) -> list[str]:
    """The ordered list with the dropped files at its end (in the order they were dropped)."""
    if isinstance(added, str):
        added = [added]
    return [*(paths or []), *(added or [])]


def move_reference(index: int, offset: int, paths: list[str] | None) -> list[str]:
    paths = list(paths or [])
    target = index + offset
    if 0 <= index < len(paths) and 0 <= target < len(paths):
        paths[index], paths[target] = paths[target], paths[index]
    return paths


def remove_reference(index: int, paths: list[str] | None) -> list[str]:
    paths = list(paths or [])
    if 0 <= index < len(paths):
        del paths[index]
    return paths


def insert_label(label: str, prompt: str | None) -> str:
    text = (prompt or "").rstrip()
    return f"{text} {label}" if text else label


# --- previews ------------------------------------------------------------------------------------------------


def reference_preview(path: str) -> ReferencePreview:
    """The card's picture and length for one reference file (see the module's docstring)."""
    name = Path(path).name
    try:
        stat = Path(path).stat()
        kind = reference_kind(path)
    except OSError:
        return ReferencePreview(error=f"references: '{name}' is no longer on the server; add it again")
    except RequestError as error:
        return ReferencePreview(error=str(error))
    try:
        return _cached_preview(str(path), kind, stat.st_size, stat.st_mtime_ns)
    except _TooSlow:  # not cached (lru_cache keeps no exceptions): a busy moment is not the file's fault
        return _decode_error(path, kind, f"reading it took longer than {PREVIEW_SECONDS:g} s")


@functools.lru_cache(maxsize=PREVIEW_CACHE_SIZE)
def _cached_preview(path: str, kind: str, size: int, mtime_ns: int) -> ReferencePreview:
    """Raises _TooSlow past `PREVIEW_SECONDS`; `size` and `mtime_ns` are part of the cache key only (a changed
    file is read again)."""
    del size, mtime_ns
    try:
        if kind == "image":
            return ReferencePreview(picture=_image_thumbnail(path))
        return _clip_preview(path, kind, time.monotonic() + PREVIEW_SECONDS)
    except av.ExitError as error:  # FFmpeg's own timeout (av.open's) interrupted a read
        raise _TooSlow from error
    except _TooSlow:
        raise
    except Exception as error:  # noqa: BLE001 - any decoder failure becomes the card's one-line message
        return _decode_error(path, kind, _reason(error, path))


def _decode_error(path: str, kind: str, reason: str) -> ReferencePreview:
    accepted = ", ".join(FORMATS[kind].suffixes)
    return ReferencePreview(
        error=f"references: '{Path(path).name}' does not open as {_KIND_WORDS[kind]} ({reason}); "
        f"use {_KIND_WORDS[kind]} that opens ({accepted})"
    )


def _image_thumbnail(path: str) -> Image.Image:
    with Image.open(path) as image:
        image.draft("RGB", (THUMBNAIL_EDGE, THUMBNAIL_EDGE))  # JPEG: decode at a reduced size
        picture = ImageOps.exif_transpose(image).convert("RGB")
    picture.thumbnail((THUMBNAIL_EDGE, THUMBNAIL_EDGE))
    return picture


def _clip_preview(path: str, kind: str, deadline: float) -> ReferencePreview:
    with av.open(path, timeout=PREVIEW_SECONDS) as container:
        seconds = _container_seconds(container)
        streams = container.streams.video if kind == "video" else container.streams.audio
        if not streams:
            raise ValueError(f"it has no {'video' if kind == 'video' else 'audio'} stream")
        frame = _first_frame(container, streams[0], deadline)
    picture = None
    if kind == "video":
        picture = frame.to_image()
        picture.thumbnail((THUMBNAIL_EDGE, THUMBNAIL_EDGE))
    return ReferencePreview(picture=picture, seconds=seconds)


def _container_seconds(container: av.container.InputContainer) -> float | None:
    if container.duration is not None:
        return container.duration / av.time_base
    for stream in container.streams:
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
    return None


def _first_frame(
    container: av.container.InputContainer, stream: av.stream.Stream, deadline: float
) -> av.frame.Frame:
    for packet in container.demux(stream):
        if time.monotonic() > deadline:
            raise _TooSlow
        for frame in packet.decode():
            return frame
    raise ValueError("no frame decodes")


def _reason(error: Exception, path: str) -> str:
    """An exception as a short clause without the server's path to the file."""
    text = getattr(error, "strerror", None) or str(error) or type(error).__name__
    text = text.replace(path, Path(path).name).splitlines()[0].strip().rstrip(".")
    return text[:120]


def _caption(reference: LabelledReference, preview: ReferencePreview) -> str:
    name = Path(reference.path).name
    return f"{name} · {preview.seconds:.1f} s" if preview.seconds is not None else name


# --- the components and their events -------------------------------------------------------------------------


@dataclass
class ReferenceGallery:
    add: gr.File  # the drop zone: what is dropped joins the end of the list, then the zone empties
    references: gr.File  # hidden: the ordered list itself, the /ref2va `references` parameter
    cards: gr.Column  # the cards render here


def build_reference_gallery() -> ReferenceGallery:
    limits = ", ".join(f"{limit} {kind}s" for kind, limit in MAX_REFERENCES_OF_KIND.items())
    gr.Markdown(
        f"**References, in order** (at most {limits}). Each gets the label the prompt cites it by.",
        elem_id="ref2va-references-title",
    )
    references = as_uploaded(
        gr.File(
            file_count="multiple",
            file_types=list(REFERENCE_SUFFIXES),
            type="filepath",
            label="References, in order",
            visible="hidden",
            elem_id="ref2va-references",
        )
    )
    cards = gr.Column(elem_id="ref2va-cards")
    add = gr.File(
        file_count="multiple",
        file_types=list(REFERENCE_SUFFIXES),
        type="filepath",
        label="Add references: drop images, video or audio clips here, or click to choose",
        height=120,
        elem_id="ref2va-add",
    )
    return ReferenceGallery(add, references, cards)


def wire_reference_gallery(gallery: ReferenceGallery, prompt: gr.Textbox) -> None:
    """The drop zone's event and the cards (a `gr.render` of the ordered list, with each card's buttons)."""
    gallery.add.upload(
        lambda paths, added: (append_references(paths, added), None),
        inputs=[gallery.references, gallery.add],
        outputs=[gallery.references, gallery.add],
        queue=False,
        api_visibility="private",
    )
    with gallery.cards:

        @gr.render(inputs=[gallery.references])
        def reference_cards(paths: list[str] | None) -> None:
            try:
                labelled = label_references(list(paths or []))
            except RequestError as error:
                gr.Markdown(f"⚠ {error}", elem_id="ref2va-cards-error")
                return
            if not labelled:
                gr.Markdown("No references yet: drop files below.", elem_id="ref2va-cards-empty")
                return
            with gr.Row(elem_classes="h3-ref-cards"):
                for index, reference in enumerate(labelled):
                    _card(index, reference, len(labelled), gallery.references, prompt)


def _card(
    index: int, reference: LabelledReference, count: int, references: gr.File, prompt: gr.Textbox
) -> None:
    preview = reference_preview(reference.path)
    element = f"ref2va-card-{index}"
    with gr.Column(elem_classes="h3-ref-card", elem_id=element, min_width=CARD_MIN_WIDTH):
        labels = " ".join(f"`{label}`" for label in reference.labels)
        gr.Markdown(f"**{index + 1}.** {labels}", elem_classes="h3-ref-labels", elem_id=f"{element}-labels")
        if preview.error:
            gr.Markdown(f"⚠ {preview.error}", elem_classes="h3-ref-error", elem_id=f"{element}-error")
        elif reference.kind == "audio":
            gr.Audio(
                reference.path,
                type="filepath",
                interactive=False,
                show_label=False,
                buttons=[],
                elem_id=f"{element}-player",
            )
        else:
            gr.Image(
                preview.picture,
                interactive=False,
                show_label=False,
                container=False,
                buttons=[],
                height=150,
                elem_classes="h3-ref-thumbnail",
                elem_id=f"{element}-thumbnail",
            )
        gr.Markdown(_caption(reference, preview), elem_classes="h3-ref-name", elem_id=f"{element}-name")
        with gr.Row(elem_classes="h3-ref-buttons"):
            buttons = [
                ("↑ Up", "up", index > 0, functools.partial(move_reference, index, -1)),
                ("↓ Down", "down", index < count - 1, functools.partial(move_reference, index, 1)),
                ("✕ Remove", "remove", True, functools.partial(remove_reference, index)),
            ]
            for text, action, interactive, change in buttons:
                button = gr.Button(
                    text, size="sm", min_width=0, interactive=interactive, elem_id=f"{element}-{action}"
                )
                button.click(
                    change, inputs=references, outputs=references, queue=False, api_visibility="private"
                )
            for label in reference.labels:
                insert = gr.Button(f"Insert {label}", size="sm", min_width=0, elem_classes="h3-ref-insert")
                insert.click(
                    functools.partial(insert_label, label),
                    inputs=prompt,
                    outputs=prompt,
                    queue=False,
                    api_visibility="private",
                )
