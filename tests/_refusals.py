"""A refusal checked by what it is, not by its sentence: the error's class, the field at fault (`RequestError.field`)
and the file it is about (`.path`); for the API, the status, OpenAI's error `type`/`code` and `param`.

The sentence of each message is checked once, in the test of the module that makes it: there `says` names a
fragment of the problem (`RequestError.problem`, or the whole text of an error that has no field). Elsewhere a test
checks the class and the field alone, so that a reworded message breaks one test, not every door's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest

from h3engine.errors import RequestError


@contextmanager
def refused(
    kind: type[BaseException] = RequestError,
    *,
    field: str | None = None,
    path: str | os.PathLike[str] | None = None,
    names: tuple[str, ...] = (),
    says: str | None = None,
) -> Iterator[pytest.ExceptionInfo[Any]]:
    """`with refused(RequestError, field="keyframes[1]"):` the block raises exactly `kind` (not a subclass), whose
    `.field` is `field` and whose `.path` is `path` (each when given). `names`: names (a file, a tensor, a flag) the
    error's text must mention, for errors that carry no field (CheckpointError). `says`: the wording fragment the
    problem must contain, only in the test of the module that makes the message."""
    with pytest.raises(kind) as caught:
        yield caught
    error = caught.value
    assert type(error) is kind, f"{type(error).__name__} raised, {kind.__name__} expected: {error}"
    if field is not None:
        assert error.field == field, f"field {error.field!r}, {field!r} expected: {error}"
    if path is not None:
        assert error.path == os.fspath(path), f"path {error.path!r}, {os.fspath(path)!r} expected: {error}"
    text = str(error)
    for name in names:
        assert name in text, f"{name!r} not named: {text}"
    if says is not None:
        problem = error.problem if isinstance(error, RequestError) else text
        assert says in problem, f"{says!r} not in the problem: {problem}"


def api_refused(
    body: Mapping[str, Any],
    param: str | None,
    *,
    code: str | None = "invalid_value",
    error_type: str = "invalid_request_error",
) -> Mapping[str, Any]:
    """Checks an OpenAI error object (`{"error": {...}}` or its inside) by its `type`, `code` and `param`; returns the
    inside. The status code is the caller's to check (it comes with the response)."""
    error = body.get("error", body)
    assert (error["type"], error["code"], error["param"]) == (error_type, code, param), error
    return error


def ui_refused(error: BaseException, parameter: str) -> str:
    """A Gradio API client's ValidationError ("1 parameter(s) failed validation:" then "- <parameter>: <shown>"):
    checks that it marks `parameter`, and it alone; returns what the page shows under that input."""
    header, *lines = str(error).split("\n")
    assert header == "1 parameter(s) failed validation:" and len(lines) == 1, error
    name, _, shown = lines[0].removeprefix("- ").partition(": ")
    assert name == parameter, f"{name!r} marked, {parameter!r} expected: {error}"
    return shown


def cli_refused(stderr: str, field: str) -> str:
    """The command line's refusal, one line `error: <field>: <problem>` on stderr: checks that it names `field`;
    returns the problem."""
    assert stderr.startswith(f"error: {field}: ") and stderr.count("\n") == 1, stderr
    return stderr.removeprefix(f"error: {field}: ").rstrip("\n")
