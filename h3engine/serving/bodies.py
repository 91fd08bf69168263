"""What a request's body says: its bytes (`read_body`, up to the limit), its fields (`fields_of`, JSON or multipart
alike) with every file field's value an `Upload` (an uploaded file, a data: URL or the id of a file of /v1/files),
a digest of them for Idempotency-Key (`fields_digest`), and the last frame of an uploaded clip (`last_frame_png`).

Danger: all of it comes from clients: bodies are read up to the limit before parsing; a file id reaches only the
asking owner's files; remote URLs are never fetched.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile

from h3engine.serving.errors import ApiError
from h3engine.serving.inputs import FILE_ID, ClientFiles
from h3engine.serving.videos import FILE_FIELDS, FILE_VALUE_RULE, Upload

# Fields a repeated multipart file part appends to (curl's `-F input_reference=@a -F input_reference=@b`).
_LIST_FIELDS = ("input_reference", "references", "rungs", "loras")
_DATA_URL = re.compile(r"^data:([\w/+.-]+)?(;base64)?,(.*)$", re.DOTALL)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 past `limit` bytes (the header's length first, then as it streams)."""
    too_large = ApiError(
        413, f"The request body is larger than the limit ({limit} bytes).", code="request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # starlette's form() and json() read this cached body
    return body


async def fields_of(request: Request, limit: int, files: ClientFiles, owner: str) -> dict[str, Any]:
    """The body's fields, JSON or multipart alike: lists from `name[]` (the SDK's form of a list), objects from
    `name[key]`, and every file field's value an `Upload` (an uploaded file, a data: URL or a file id)."""
    body = await read_body(request, limit)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        try:
            form = await request.form(max_files=64, max_fields=256)
        except (ValueError, KeyError) as error:  # starlette's MultiPartException is a ValueError's kin
            raise ApiError(
                400,
                f"body: not readable multipart/form-data ({error})",
                param="body",
                code="invalid_body",
            ) from None
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                value = Upload(value.filename or key, await value.read())
            _place_form_value(fields, key, value)
    else:
        try:
            text = body.decode("utf-8") if body else "{}"
        except UnicodeDecodeError as error:
            raise ApiError(
                400,
                f"body: not valid UTF-8 (byte 0x{body[error.start]:02x} at position {error.start}); send UTF-8 "
                "JSON or multipart/form-data",
                param="body",
                code="invalid_json",
            ) from None
        try:
            fields = json.loads(text)
        except ValueError as error:
            raise ApiError(
                400,
                f"body: neither JSON nor multipart/form-data ({error})",
                param="body",
                code="invalid_json",
            ) from None
        if not isinstance(fields, dict):
            raise ApiError(400, "body: must be a JSON object", param="body", code="invalid_json")
    for name in (*FILE_FIELDS, "video"):
        if name in fields:
            fields[name] = file_values(fields[name], name, files, owner)
    return fields


def file_values(value: Any, name: str, files: ClientFiles, owner: str) -> Any:
    """A file field's value(s) as `Upload`s: data: URLs, ids of the owner's /v1/files (bare, or as OpenAI's
    {"file_id": ...} / {"image_url": ...} objects) and uploads; other values are left for the field's check."""
    if isinstance(value, list):
        return [file_values(item, name, files, owner) for item in value]
    if isinstance(value, dict) and set(value) <= {"image_url", "file_id"} and len(value) == 1:
        value = next(iter(value.values()))
    if not isinstance(value, str):
        return value
    if value.startswith("data:"):
        return _data_url_upload(value, name)
    if FILE_ID.match(value):
        record = files.get_file(owner, value)
        if record is None:
            raise ApiError(404, f"{name}: no file with id {value!r}", param=name, code="file_not_found")
        try:
            return Upload(record.filename, Path(record.path).read_bytes())
        except OSError:
            raise ApiError(
                404, f"{name}: the file {value!r} is no longer kept", param=name, code="file_not_found"
            ) from None
    if re.match(r"^(https?|ftp)://", value):
        raise ApiError(
            400,
            f"{name}: remote URLs are not fetched; {FILE_VALUE_RULE}",
            param=name,
            code="invalid_value",
        )
    return value


def fields_digest(fields: dict[str, Any]) -> str:
    """A digest of the fields (uploads by their bytes), for Idempotency-Key."""

    def plain(value: Any) -> Any:
        if isinstance(value, Upload):
            return {"upload": hashlib.sha256(value.data).hexdigest(), "name": value.name}
        if isinstance(value, list):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return hashlib.sha256(json.dumps(plain(fields), sort_keys=True, default=str).encode()).hexdigest()


_MEDIA_SUFFIXES = {
    "image/png": ".png",
    "image/jpeg": ".jpg",
    "image/webp": ".webp",
    "audio/wav": ".wav",
    "audio/x-wav": ".wav",
    "audio/wave": ".wav",
    "audio/mpeg": ".mp3",
    "audio/flac": ".flac",
    "video/mp4": ".mp4",
    "video/quicktime": ".mov",
    "video/webm": ".webm",
}


def _data_url_upload(value: str, name: str) -> Upload:
    """A data: URL's bytes, named `<field><suffix of its media type>` (the suffix tells a reference's kind)."""
    match = _DATA_URL.match(value)
    if match is None:
        raise ApiError(400, f"{name}: not a valid data: URL", param=name, code="invalid_value")
    media_type, is_base64, payload = match.groups()
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else payload.encode()
    except (binascii.Error, ValueError):
        raise ApiError(
            400, f"{name}: the data URL is not valid base64", param=name, code="invalid_value"
        ) from None
    return Upload(f"{name}{_MEDIA_SUFFIXES.get(media_type or '', '.bin')}", data)


def _place_form_value(fields: dict[str, Any], key: str, value: Any) -> None:
    """One multipart item into `fields`: `name[]` appends to a list, `name[][key]` sets a key of the list's last
    object (a new one when that key is already set), `name[key]` a key of an object, a repeated file field
    (`input_reference`, `references`) appends; anything else is a plain value (an unknown name is refused later, by name)."""
    match = re.match(r"^(\w+)(\[\])?(?:\[(\w+)\])?$", key)
    if match is None:
        fields[key] = value
        return
    name, is_list, member = match.groups()
    if is_list or (name in _LIST_FIELDS and isinstance(value, Upload)):
        entries = fields.get(name)
        entries = fields[name] = (
            entries if isinstance(entries, list) else [] if entries is None else [entries]
        )
        if member is None:
            entries.append(value)
        else:
            if not entries or not isinstance(entries[-1], dict) or member in entries[-1]:
                entries.append({})
            entries[-1][member] = value
    elif member is not None:
        target = fields.get(name)
        fields[name] = target = target if isinstance(target, dict) else {}
        target[member] = value
    else:
        fields[name] = value


def upload_bytes(fields: dict[str, Any]) -> int:
    """The bytes of every upload among `fields` (what the job's inputs folder will take)."""
    total = 0
    for value in fields.values():
        for item in value if isinstance(value, list) else [value]:
            total += len(item.data) if isinstance(item, Upload) else 0
    return total


def last_frame_png(video: bytes) -> bytes:
    """The last frame of an MP4's bytes as PNG (400 naming `video` when it has none or cannot be read)."""
    import av

    last = None
    try:
        with av.open(io.BytesIO(video)) as container:
            for frame in container.decode(video=0):
                last = frame
    except (av.FFmpegError, ValueError, IndexError):
        last = None
    if last is None:
        raise ApiError(
            400, "video: the clip has no readable video frames", param="video", code="invalid_value"
        )
    buffer = io.BytesIO()
    last.to_image().save(buffer, format="PNG")
    return buffer.getvalue()
