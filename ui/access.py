"""Who owns a result, where it is written, and how a file reaches the one browser that asked for it.

Per owner (the default): the owner is the user who logged in (`--auth`), else the browser (a random id in the
`h3-browser` cookie that the page load sets, `BrowserCookie`), else the Gradio session (API clients); results go to
`<outputs>/users/<id>/`, `<outputs>/browsers/<id>/` or `<outputs>/sessions/<id>/` (`<id>` a SHA-256 digest, so no
name a client chooses can form a path) and History shows only the caller's folder. `--shared-history` (`AccessPolicy(shared=True)`) writes
to the outputs folder itself for everyone, as on a personal machine. The outputs folder is never served: a file a
handler returns is `publish`ed as a copy under a keyed-hash name that only the receiving session learns
(`AccessPolicy` says how copies are swept); with `--auth`, `OwnerOnlyFiles` serves a copy of a user's result to
that user alone. README "Sharing the app" describes the model.

Danger: session hashes are chosen by the client; they only ever reach the file system through a digest.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from gradio.utils import get_upload_folder

USERS_FOLDER = "users"
BROWSERS_FOLDER = "browsers"
SESSIONS_FOLDER = "sessions"
# The anonymous browser identity: set on the page load, a year long, never readable by the page's scripts.
BROWSER_COOKIE = "h3-browser"
BROWSER_COOKIE_MAX_AGE_S = 365 * 24 * 3600
_BROWSER_ID = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
OWNER_ID_CHARACTERS = 32
COPY_PREFIX = "h3-"


def owner_folder(username: str | None, session_hash: str | None, browser: str | None = None) -> Path:
    """The folder, relative to the outputs folder, of one user's (or, without a login, one browser's, else one
    session's) results."""
    if username:
        kind, name = USERS_FOLDER, username
    elif browser:
        kind, name = BROWSERS_FOLDER, browser
    else:
        kind, name = SESSIONS_FOLDER, session_hash or "no-session"
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:OWNER_ID_CHARACTERS]
    return Path(kind) / digest


@dataclass
class AccessPolicy:
    """Where an owner's results go, and the published copies through which a browser gets them.

    Serving: `publish` copies a file into Gradio's upload cache under a folder named by a keyed hash of its path,
    with a key drawn at start; Gradio serves that copy at `/gradio_api/file=<copy>`, a URL no one can derive from the
    result's name. `sweep(age)` deletes the copies older than `age` (all of them with None): app.py calls it at exit,
    and `publish` itself every `sweep_every_s`, for copies older than `max_age_s` (Gradio's `delete_cache` tracks
    only the files of the components as built, not these copies). The originals stay in the outputs folder.
    """

    outputs_dir: Path
    shared: bool = False
    # Where published copies go; default Gradio's upload cache (GRADIO_TEMP_DIR), the folder it serves them from.
    serve_dir: Path | None = None
    max_age_s: float = 24 * 3600
    sweep_every_s: float = 3600
    # A Gradio cache this process alone uses (app.own_gradio_cache): `sweep` ages out every file in it, the preview
    # images Gradio writes for us included.
    owned_cache: Path | None = None
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    _published: set[Path] = field(default_factory=set, repr=False)
    # A copy's folder -> the owner folder ("users/<digest>") of a logged-in user's result it copies.
    _user_copies: dict[Path, str] = field(default_factory=dict, repr=False)
    _swept_at: float = field(default_factory=time.monotonic, repr=False)

    def results_dir(self, request: Any) -> Path:
        """The caller's results folder (`request` is the event's gr.Request; None outside an event)."""
        if self.shared:
            return self.outputs_dir
        username = getattr(request, "username", None)
        session_hash = getattr(request, "session_hash", None)
        return self.outputs_dir / owner_folder(username, session_hash, browser_id(request))

    def publish(self, path: str | os.PathLike[str]) -> str:
        """A copy of `path` that Gradio serves, under a name only this process can compute; made once per path."""
        source = Path(path).resolve()
        tag = hmac.new(self._key, str(source).encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
        if time.monotonic() - self._swept_at > self.sweep_every_s:
            self.sweep(self.max_age_s)
        folder = Path(self.serve_dir or get_upload_folder()).resolve() / f"{COPY_PREFIX}{tag[:40]}"
        target = folder / source.name
        owner = self._user_of(source)
        if owner is not None:
            self._user_copies[folder] = owner
        if target.is_file():
            # Gradio's delete_cache ages files by their ctime: a copy handed out again is fresh.
            os.utime(target)
            return str(target)
        folder.mkdir(parents=True, exist_ok=True)
        self._published.add(folder)
        partial = folder / f".{source.name}.{secrets.token_hex(4)}.partial"
        try:
            shutil.copyfile(source, partial)  # a copy, not a link: touching it must not touch the original
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return str(target)

    def _user_of(self, source: Path) -> str | None:
        """ "users/<digest>" when `source` is a logged-in user's file in the outputs folder, else None."""
        try:
            parts = source.relative_to(Path(self.outputs_dir).resolve()).parts
        except ValueError:
            return None
        return f"{parts[0]}/{parts[1]}" if len(parts) > 2 and parts[0] == USERS_FOLDER else None

    def user_of_copy(self, path: str | os.PathLike[str]) -> str | None:
        """The owner folder of the user whose result the published copy at `path` is (None: not a user's)."""
        try:
            folder = Path(path).resolve().parent
        except (OSError, ValueError):
            return None
        return self._user_copies.get(folder)

    def sweep(self, max_age_s: float | None) -> None:
        """Delete the copies this process published whose last hand-out is older than `max_age_s` (None: all)."""
        self._swept_at = time.monotonic()
        for folder in list(self._published):
            for copy in folder.glob("*"):
                if max_age_s is None or time.time() - copy.stat().st_ctime > max_age_s:
                    copy.unlink(missing_ok=True)
            if not folder.is_dir() or not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
                self._published.discard(folder)
        if self.owned_cache is not None and max_age_s is not None:
            for path in self.owned_cache.rglob("*"):
                if path.is_file() and time.time() - path.stat().st_ctime > max_age_s:
                    path.unlink(missing_ok=True)


def browser_id(request: Any) -> str | None:
    """The caller's `h3-browser` cookie when it is one this app could have set (None otherwise)."""
    try:
        headers = getattr(request, "headers", None)
        header = headers.get("cookie") if headers is not None and hasattr(headers, "get") else None
    except Exception:  # a gr.Request outside an HTTP request has no headers
        return None
    if not isinstance(header, str):
        return None
    cookies = SimpleCookie()
    try:
        cookies.load(header)
    except CookieError:
        return None
    morsel = cookies.get(BROWSER_COOKIE)
    value = morsel.value if morsel is not None else None
    return value if value and _BROWSER_ID.match(value) else None


class BrowserCookie:
    """ASGI middleware: the page itself (GET /) sets a random `h3-browser` cookie on a browser that has none, so
    that its History outlives page reloads and restarts. Other routes (the API, gradio_client) are untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "GET" or scope.get("path") not in ("/", ""):
            await self.app(scope, receive, send)
            return
        header = b"; ".join(value for name, value in scope.get("headers", []) if name == b"cookie")
        if f"{BROWSER_COOKIE}=".encode() in header:
            await self.app(scope, receive, send)
            return
        cookie = (
            f"{BROWSER_COOKIE}={secrets.token_urlsafe(32)}; Max-Age={BROWSER_COOKIE_MAX_AGE_S}; Path=/; "
            "HttpOnly; SameSite=Lax"
        ).encode()

        async def send_with_cookie(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 200:
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)


class OwnerOnlyFiles:
    """ASGI middleware for `--auth`: a published copy of a logged-in user's result (Gradio's `/file=` routes) is
    served to that user only; anyone else, logged in or not, gets 404 as for a file that is not there. Copies of
    other owners' results (browsers, sessions) stay served to whoever holds their unguessable URL."""

    def __init__(self, app: Any, access: AccessPolicy) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if "/file=" in path:
            owner = self.access.user_of_copy(unquote(path.split("/file=", 1)[1]))
            if owner is not None and owner != _caller_folder(scope):
                await send(
                    {"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]}
                )
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)


def _caller_folder(scope: dict[str, Any]) -> str | None:
    """The owner folder of the user logged in on this request (Gradio's login cookie), None when nobody is."""
    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or cookie_id is None:
        return None
    header = b"; ".join(value for name, value in scope.get("headers", []) if name == b"cookie").decode(
        "latin-1"
    )
    cookies = SimpleCookie()
    try:
        cookies.load(header)
    except CookieError:
        return None
    for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
        morsel = cookies.get(name)
        username = tokens.get(morsel.value) if morsel is not None else None
        if username:
            return owner_folder(username, None).as_posix()
    return None
