"""Gradio components that hand the handlers what the browser or API client sent, for our checks to judge.

Gradio's own checks (slider range, dropdown choices, number parsing, decoding an image) would fail before the
validator runs, and reach an API client as a bare HTTP 400 or a framework error with temporary paths; the request's
own validation (ui.handlers) names the field, the user's file and what is accepted instead.

Gradio re-creates a component for a session from its constructor arguments whenever an event updates its
properties (a `gr.skip()` too: an event returning a dict skips every output it leaves out, as a restore does for the
other tabs' inputs) and preprocesses that copy from then on. So the behaviour rides on a mark among the component's
`elem_classes` (a constructor argument, so the copy has it too), which a class-level preprocess honours; unmarked
components of the same class are preprocessed as Gradio does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import gradio as gr
from gradio.data_classes import GradioModel, GradioRootModel
from gradio_client.utils import is_file_obj_with_meta

ComponentT = TypeVar("ComponentT", bound=gr.components.Component)

SENT_MARK = "h3-as-sent"
UPLOADED_MARK = "h3-as-uploaded"
_MARKED_CLASSES: set[type] = set()


def as_sent(component: ComponentT) -> ComponentT:
    """The component, passing the sent value through to the handler unchanged (see the module's docstring). A mark
    on this one object and its session copies: a subclass of a Gradio component would make Gradio write a stub file
    beside it."""
    return _marked(component, SENT_MARK)


@dataclass(frozen=True)
class NotAnUpload:
    """What a file input received instead of an uploaded file (ui.task_values.check_input_types refuses it)."""

    value: Any


def _upload_path(payload: Any) -> str | NotAnUpload:
    # Only a FileData with its meta tag went through Gradio's upload-folder check (the move to its cache).
    if is_file_obj_with_meta(payload):
        return payload["path"]
    return NotAnUpload(payload)


def as_uploaded(component: ComponentT) -> ComponentT:
    """The file component, handing the handler (and its validator) each uploaded file's path as sent, without
    decoding it: Gradio's own preprocess opens images with PIL first, and a broken file then fails as a framework
    error with temporary paths instead of our message naming the file. The upload keeps the user's file name as
    its base name. Anything but an uploaded file (a bare path, a number) comes through as `NotAnUpload`. The API
    schema stays the component's (read before its data model is taken away, which would refuse such values)."""
    component.api_info()  # cached on the component
    component.data_model = None
    return _marked(component, UPLOADED_MARK)


def _upload_paths(component: gr.components.Component, payload: Any) -> Any:
    if payload is None:
        return None
    # A session copy keeps its class's data model: Gradio hands it the upload validated into one.
    if isinstance(payload, GradioModel | GradioRootModel):
        payload = payload.model_dump()
    if getattr(component, "file_count", "single") == "multiple":
        if not isinstance(payload, list):
            return NotAnUpload(payload)
        return [_upload_path(item) for item in payload]
    return _upload_path(payload)


def _marks(component: gr.components.Component) -> list[str]:
    classes = getattr(component, "elem_classes", None)
    return [classes] if isinstance(classes, str) else list(classes or [])


def _marked(component: ComponentT, mark: str) -> ComponentT:
    """The component with `mark` among its elem_classes and among the constructor arguments Gradio copies it from."""
    classes = _marks(component)
    if mark not in classes:
        classes.append(mark)
    component.elem_classes = classes
    arguments = component.constructor_args  # the very dict Gradio re-creates the component from
    if not arguments:
        raise TypeError(
            f"{type(component).__name__} keeps no constructor arguments: its copies would lose {mark}"
        )
    arguments["elem_classes"] = classes
    _honour_marks(type(component))
    return component


def _honour_marks(cls: type) -> None:
    """Once per class: its preprocess passes a marked component's value through (or its uploads' paths)."""
    if cls in _MARKED_CLASSES:
        return
    _MARKED_CLASSES.add(cls)
    gradios: Callable[..., Any] = cls.preprocess

    @functools.wraps(gradios)
    def preprocess(self: gr.components.Component, payload: Any) -> Any:
        marks = _marks(self)
        if SENT_MARK in marks:
            return payload
        if UPLOADED_MARK in marks:
            return _upload_paths(self, payload)
        return gradios(self, payload)

    cls.preprocess = preprocess
