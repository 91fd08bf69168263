"""Error types a user can act on.

Every error that reaches the CLI or the app as a readable message is one of these; anything else is an
internal error (exit code 1 on the CLI). A `RequestError` says which field is at fault as data (`field`), so that
an interface marks that input without reading the message.
"""

from __future__ import annotations

import os
import re

# An absolute path inside a message, quoted ('/srv/h3/outputs/inputs/job/first.png') or bare (a checkpoint file at
# the start of a CheckpointError): what `without_server_paths` shortens to its base name.
QUOTED_PATH = re.compile(r"(['\"])/[^'\"]*/([^'\"/]+)\1")
BARE_PATH = re.compile(r"(?<![\w'\":/.])/(?:[^\s'\":/]+/)+([^\s'\":/]+)")


class H3Error(Exception):
    """Base class of the errors whose message is shown to the user as it is."""


class CheckpointError(H3Error):
    """The checkpoint folder is missing, incomplete or inconsistent; the message names the file and key."""


class RequestError(H3Error):
    """The request, one of its input files or a command-line flag is invalid.

    `field` is the request field at fault as a path (`prompt`, `keyframes[1].path`, `references[0]`,
    `loras[2].strength`, `width, height` for a pair) or a flag (`--out`); an input file's problem is filed under
    the field that named the file (`keyframes[0]`, `references[2]`). The media readers know a file but not its
    field: they leave `field` empty and `in_field` files the error under the caller's. `path` is the input file
    the problem is about (None: no file). `str(error)` is the line users read: `field: 'file': problem`.
    Picklable: it crosses process boundaries to worker ranks and Ray.
    """

    def __init__(self, field: str, problem: str, path: str | os.PathLike[str] | None = None) -> None:
        path = os.fspath(path) if isinstance(path, os.PathLike) else path
        super().__init__(field, problem, path)
        self.field = field
        self.problem = problem
        self.path = path

    def __str__(self) -> str:
        parts = [self.field] if self.field else []
        if self.path is not None:
            parts.append(file_name(self.path))
        return ": ".join([*parts, self.problem])

    @classmethod
    def about_file(cls, path: str | os.PathLike[str], problem: str) -> RequestError:
        """A problem of the input file `path` where its request field is not known (`in_field` files it)."""
        return cls("", problem, path)

    def in_field(self, field: str) -> RequestError:
        """This error filed under `field` (the request field its file came from); unchanged when it already names
        that field or one inside it (`references[0].start_seconds` is inside `references[0]`)."""
        if self.field == field or self.field.startswith((f"{field}.", f"{field}[")):
            return self
        if not self.field:
            return RequestError(field, self.problem, self.path)
        return RequestError(field, f"{self.field}: {self.problem}", self.path)


class GenerationCancelled(H3Error):
    """The request was cancelled before it finished."""


def without_server_paths(text: str) -> str:
    """`text` with each absolute path, quoted or bare, by its base name."""
    return BARE_PATH.sub(r"\1", QUOTED_PATH.sub(r"\1\2\1", text))


def public_text(error: H3Error) -> str:
    """The one sentence a browser or an API client reads for `error`: its field, its file by base name and its
    problem, no server path (the server log keeps the whole error)."""
    if isinstance(error, RequestError):
        parts = [error.field] if error.field else []
        if error.path is not None:
            parts.append(file_name(os.path.basename(error.path)))
        return ": ".join([*parts, without_server_paths(error.problem)])
    return without_server_paths(str(error))


def file_name(path: object) -> str:
    """A file's path for messages: whole (as `repr`) unless it is absurdly long."""
    text = repr(os.fspath(path) if isinstance(path, os.PathLike) else path)
    return text if len(text) <= 300 else text[:297] + "..."
