"""Gradio components that hand the handlers what the browser or API client sent, for our checks to judge.

Gradio's own checks (slider range, dropdown choices, number parsing, decoding an image) would fail before the
validator runs, and reach an API client as a bare HTTP 400 or a framework error with temporary paths; the request's
own validation (ui.handlers) names the field, the user's file and what is accepted instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import gradio as gr
from gradio_client.utils import is_file_obj_with_meta

ComponentT = TypeVar("ComponentT", bound=gr.components.Component)


def as_sent(component: ComponentT) -> ComponentT:
    """The component, passing the sent value through to the handler unchanged (see the module's docstring). An
    attribute of this one object: a subclass of a Gradio component would make Gradio write a stub file beside it."""

    def unchanged(payload: Any) -> Any:
        return payload

    component.preprocess = unchanged  # type: ignore[method-assign]
    return component


@dataclass(frozen=True)
class NotAnUpload:
    """What a file input received instead of an uploaded file (ui.handlers.check_input_types refuses it)."""

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
    multiple = getattr(component, "file_count", "single") == "multiple"
    component.data_model = None

    def paths(payload: Any) -> Any:
        if payload is None:
            return None
        if multiple:
            if not isinstance(payload, list):
                return NotAnUpload(payload)
            return [_upload_path(item) for item in payload]
        return _upload_path(payload)

    component.preprocess = paths  # type: ignore[method-assign]
    return component
