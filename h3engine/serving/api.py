"""The HTTP routes beside Gradio: `/v1/videos` and `/v1/files` (OpenAI's shapes), `/metrics`, `/healthz`, `/readyz`.

`Serving.routes()` are Starlette routes that app.py hands to Gradio's FastAPI app (`app_kwargs["routes"]`), so
they run in the app's own server, before Gradio's routes. Errors are OpenAI's shape, `{"error": {"message",
"type", "param", "code"}}`, with 400 (a field, named; `body` for an unreadable one), 401 (keys), 404 (no such job
or file of yours, no such route), 409 (an Idempotency-Key reused with another body; content not ready), 413 (body
over `--max-body-size`), 429 (queue full, too many jobs of yours: Retry-After; inputs over the owner's quota), 503
(the outputs folder refuses writes: the page's sentence). Requests are judged by the one checker on the front
(`front.check`), off the event loop. A request's files (uploads, data: URLs, ids of /v1/files) are written into
the job's own inputs folder while it is checked, and that folder is removed when the request is refused. With API
keys each key sees only its own jobs and files; without, /v1 answers only on a loopback bind.

Danger: everything here comes from clients: bodies are read up to the limit before parsing, ids go to SQL bound.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Mount, Route

from h3engine.errors import RequestError
from h3engine.lora.library import LoraLibrary
from h3engine.media.formats import accepted_text, kind_of_suffix
from h3engine.request.shapes import from_dict
from h3engine.runtime.messages import outputs_refuse_writes
from h3engine.serving.inputs import FILE_ID, QuotaExceeded, new_job_id, remove_folder, safe_file_name
from h3engine.serving.jobs import (
    LOCAL_OWNER,
    Refused,
    VideoJobs,
    job_files,
    write_spritesheet,
    write_thumbnail,
)
from h3engine.serving.metrics import CONTENT_TYPE, Metrics
from h3engine.serving.store import FileRecord, JobRecord
from h3engine.serving.videos import (
    FILE_FIELDS,
    FILE_VALUE_RULE,
    ApiFieldError,
    Built,
    Upload,
    api_message,
    api_param,
    copy_inputs,
    request_from_fields,
    video_object,
)

logger = logging.getLogger(__name__)

LIST_LIMIT_MAX = 100
SSE_KEEPALIVE_S = 15.0
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
_LIST_FIELDS = ("references", "rungs", "loras")
FILE_PURPOSES = ("user_data", "vision")
_DATA_URL = re.compile(r"^data:([\w/+.-]+)?(;base64)?,(.*)$", re.DOTALL)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(error: ApiError) -> JSONResponse:
    body = {
        "error": {
            "message": error.message,
            "type": _ERROR_TYPES.get(error.status, "server_error"),
            "param": error.param,
            "code": error.code,
        }
    }
    return JSONResponse(body, status_code=error.status, headers=error.headers)


@dataclass(frozen=True)
class ApiSettings:
    keys: tuple[str, ...] = ()
    loopback: bool = True  # the app binds a loopback address: /v1 may answer without keys
    max_body_bytes: int = 200 * 1024**2
    webhook_url: str | None = None


def owner_of_key(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


class Serving:
    """The API's state: the job service, the settings, the metrics and readiness."""

    def __init__(
        self,
        jobs: VideoJobs,
        settings: ApiSettings,
        metrics: Metrics,
        library: LoraLibrary | None = None,
        ready: Any = None,
    ) -> None:
        self.jobs, self.settings, self.metrics = jobs, settings, metrics
        self.library = library or LoraLibrary(None)
        self.ready = ready  # a callable: models loaded and warm-up done

    # --- helpers -----------------------------------------------------------------------------------------

    def owner(self, request: Request) -> str:
        keys = self.settings.keys
        if keys:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise ApiError(
                    401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="missing_api_key"
                )
            for key in keys:
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    return owner_of_key(key)
            raise ApiError(401, "Incorrect API key.", code="invalid_api_key")
        if not self.settings.loopback:
            raise ApiError(
                401,
                "This server has no API keys and is not bound to a loopback address: start it with --api-key.",
                code="api_keys_required",
            )
        return LOCAL_OWNER

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
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

    async def fields_of(self, request: Request, owner: str) -> dict[str, Any]:
        """The body's fields, JSON or multipart alike: lists from `name[]` (the SDK's form of a list), objects from
        `name[key]`, and every file field's value an `Upload` (an uploaded file, a data: URL or a file id)."""
        body = await self.read_body(request)
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
                fields[name] = self._file_values(fields[name], name, owner)
        return fields

    def _file_values(self, value: Any, name: str, owner: str) -> Any:
        """A file field's value(s) as `Upload`s: data: URLs, ids of the owner's /v1/files (bare, or as OpenAI's
        {"file_id": ...} / {"image_url": ...} objects) and uploads; other values are left for the field's check."""
        if isinstance(value, list):
            return [self._file_values(item, name, owner) for item in value]
        if isinstance(value, dict) and set(value) <= {"image_url", "file_id"} and len(value) == 1:
            value = next(iter(value.values()))
        if not isinstance(value, str):
            return value
        if value.startswith("data:"):
            return _data_url_upload(value, name)
        if FILE_ID.match(value):
            record = self.jobs.inputs.get_file(owner, value)
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

    def record_of(self, owner: str, video_id: str) -> JobRecord:
        record = self.jobs.store.get(video_id, owner)
        if record is None:
            raise ApiError(
                404, f"No video with id {video_id[:80]!r}.", param="video_id", code="video_not_found"
            )
        return record

    def file_of(self, owner: str, file_id: str) -> FileRecord:
        record = self.jobs.inputs.get_file(owner, file_id)
        if record is None:
            raise ApiError(404, f"No file with id {file_id[:80]!r}.", param="file_id", code="file_not_found")
        return record

    def video(self, record: JobRecord) -> dict[str, Any]:
        return video_object(record, self.jobs.live_of(record.id))

    async def submit(
        self,
        owner: str,
        fields: dict[str, Any],
        idempotency_key: str | None,
        meta: dict[str, Any] | None = None,
    ) -> JSONResponse:
        idempotency = None
        if idempotency_key:
            idempotency = (idempotency_key[:200], _digest(fields))
            existing = self.jobs.store.by_idempotency_key(owner, idempotency[0])
            if existing is not None:
                if existing.body_digest != idempotency[1]:
                    raise ApiError(
                        409,
                        "This Idempotency-Key was used with another request body.",
                        code="idempotency_key_reused",
                    )
                return JSONResponse(self.video(existing))
        job_id = new_job_id()
        folder = self.jobs.inputs.job_folder(owner, job_id)
        built: Built | None = None
        try:
            try:
                self.jobs.inputs.check_quota(owner, _upload_bytes(fields))
                built = await asyncio.to_thread(
                    request_from_fields, fields, folder, self.jobs.front.facts, self.library
                )
                await asyncio.to_thread(self.jobs.front.check, built.request)
            except ApiFieldError as error:
                raise ApiError(400, error.message, param=error.param, code="invalid_value") from None
            except RequestError as error:
                param = api_param(error, built, bool(fields.get("size")))
                raise ApiError(400, api_message(error, param), param=param, code="invalid_value") from None
            except QuotaExceeded as error:
                raise ApiError(429, str(error), code="inputs_quota_exceeded") from None
            except OSError as error:
                raise self._outputs_error(owner, error) from None
            meta = {**built.meta, **(meta or {})}
            if folder.is_dir():
                meta["inputs"] = str(folder)
            return await self.create(owner, built.request, meta, idempotency, job_id)
        except BaseException:
            remove_folder(folder)  # a refused request keeps nothing
            raise

    def _outputs_error(self, owner: str, error: OSError) -> ApiError:
        """A write under the outputs folder failed while taking a request: 503 with the page's sentence."""
        logger.error("could not store a request's inputs: %s", error)
        problem = self.jobs.outputs_problem(self.jobs.inputs.owner_folder(owner))
        if problem is None:
            words = outputs_refuse_writes(error.strerror or type(error).__name__)
            problem = f"{words[0].upper()}{words[1:]}"
        return ApiError(503, problem, code="outputs_unwritable")

    async def create(self, owner, request, meta, idempotency=None, job_id=None) -> JSONResponse:
        if "callback_url" not in meta and self.settings.webhook_url:
            meta = {**meta, "callback_url": self.settings.webhook_url}
        try:
            record, _new = await asyncio.to_thread(
                self.jobs.create, owner, request, meta, "api", idempotency, None, job_id
            )
        except Refused as refusal:
            headers = None if refusal.retry_after is None else {"Retry-After": str(refusal.retry_after)}
            raise ApiError(refusal.status, refusal.message, code=refusal.code, headers=headers) from None
        if (
            job_id is not None and record.id != job_id
        ):  # an Idempotency-Key's earlier job: these inputs are not used
            remove_folder(self.jobs.inputs.job_folder(owner, job_id))
        return JSONResponse(self.video(record))

    # --- the routes ------------------------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @api.exception_handler(ApiError)
        async def api_error(request: Request, error: ApiError) -> JSONResponse:
            self.metrics.requests.labels(_route_of(request), str(error.status)).inc()
            return error_response(error)

        @api.exception_handler(RequestValidationError)
        async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
            first = (error.errors() or [{}])[0]
            param = str((first.get("loc") or ["", ""])[-1])
            message = f"{param}: {first.get('msg', 'invalid value')}"
            return error_response(ApiError(400, message, param=param, code="invalid_value"))

        @api.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
            if error.status_code == 404:
                message = f"No such route: {request.method} {request.url.path}."
            elif error.status_code == 405:
                message = f"{request.url.path} does not take {request.method}."
            else:
                message = str(error.detail)
            code = {404: "unknown_url", 405: "method_not_allowed"}.get(error.status_code, "http_error")
            return error_response(ApiError(error.status_code, message, code=code))

        @api.middleware("http")
        async def count(request: Request, call_next):
            response = await call_next(request)
            if response.status_code < 400:
                self.metrics.requests.labels(_route_of(request), str(response.status_code)).inc()
            return response

        @api.post("/videos")
        async def create_video(request: Request) -> Response:
            owner = self.owner(request)
            fields = await self.fields_of(request, owner)
            return await self.submit(owner, fields, request.headers.get("idempotency-key"))

        @api.get("/videos")
        async def list_videos(
            request: Request, after: str | None = None, limit: int = 20, order: str = "desc"
        ):
            owner = self.owner(request)
            _check_page(limit, order, LIST_LIMIT_MAX)
            records = self.jobs.store.list(owner, after, limit + 1, order)
            return _page([self.video(record) for record in records[:limit]], len(records) > limit)

        @api.get("/videos/{video_id}")
        async def retrieve_video(request: Request, video_id: str):
            return self.video(self.record_of(self.owner(request), video_id))

        @api.delete("/videos/{video_id}")
        async def delete_video(request: Request, video_id: str):
            owner = self.owner(request)
            self.record_of(owner, video_id)
            try:
                await asyncio.to_thread(self.jobs.delete, owner, video_id)
            except Refused as refusal:
                raise ApiError(refusal.status, refusal.message, code=refusal.code) from None
            return {"id": video_id, "object": "video.deleted", "deleted": True}

        @api.get("/videos/{video_id}/content")
        async def video_content(request: Request, video_id: str, variant: str = "video"):
            record = self.record_of(self.owner(request), video_id)
            kinds = {
                "video": (0, "video/mp4"),
                "thumbnail": (2, "image/jpeg"),
                "spritesheet": (3, "image/jpeg"),
                "sidecar": (1, "application/json"),
            }
            if variant not in kinds:
                raise ApiError(
                    400, f"variant: must be one of {', '.join(kinds)}", param="variant", code="invalid_value"
                )
            if record.status != "completed":
                raise ApiError(409, f"The video is {record.status}, not completed.", code="video_not_ready")
            files = job_files(record)
            path = files[kinds[variant][0]]
            if record.expired or not files[0].is_file():
                raise ApiError(404, "The video's files are no longer kept.", code="video_expired")
            if not path.is_file() and variant in ("thumbnail", "spritesheet"):
                make = write_thumbnail if variant == "thumbnail" else write_spritesheet
                await asyncio.to_thread(make, files[0])
            if not path.is_file():
                raise ApiError(404, f"The video's {variant} is not kept.", code="video_expired")
            return FileResponse(path, media_type=kinds[variant][1], filename=f"{video_id}{path.suffix}")

        @api.post("/videos/{video_id}/remix")
        async def remix_video(request: Request, video_id: str):
            owner = self.owner(request)
            source = self.record_of(owner, video_id)
            fields = await self.fields_of(request, owner)
            if not isinstance(fields.get("prompt"), str):
                raise ApiError(400, "prompt: is required", param="prompt", code="invalid_value")
            job_id = new_job_id()
            folder = self.jobs.inputs.job_folder(owner, job_id)
            try:
                try:
                    generation = await asyncio.to_thread(
                        copy_inputs, replace(from_dict(source.request), prompt=fields["prompt"]), folder
                    )
                except FileNotFoundError:
                    raise ApiError(
                        409, "The source video's input files are no longer kept.", code="video_expired"
                    ) from None
                except OSError as error:
                    raise self._outputs_error(owner, error) from None
                try:
                    await asyncio.to_thread(self.jobs.front.check, generation)
                except RequestError as error:
                    param = api_param(error, None, False)
                    raise ApiError(
                        400, api_message(error, param), param=param, code="invalid_value"
                    ) from None
                meta = {key: source.meta[key] for key in ("model", "seconds") if key in source.meta}
                meta["remixed_from_video_id"] = video_id
                if folder.is_dir():
                    meta["inputs"] = str(folder)
                return await self.create(owner, generation, meta, None, job_id)
            except BaseException:
                remove_folder(folder)
                raise

        @api.post("/videos/edits")
        async def edit_video(request: Request):
            self.owner(request)
            raise ApiError(
                404,
                "Editing a video from a prompt alone is not supported by this server: remix it "
                "(POST /v1/videos/{video_id}/remix), or regenerate masked spans with video_mask / audio_mask.",
                code="unsupported_endpoint",
            )

        @api.post("/videos/extensions")
        async def extend_video(request: Request):
            """FL2VA from the last frame of a completed video (`video[id]`) or of an uploaded MP4 (`video`)."""
            owner = self.owner(request)
            fields = await self.fields_of(request, owner)
            video = fields.pop("video", None)
            settings: dict[str, Any] = {}
            meta: dict[str, Any] = {}
            if isinstance(video, Upload):
                frame = await asyncio.to_thread(last_frame_png, video.data)
            elif isinstance(video, dict) and isinstance(video.get("id"), str):
                source = self.record_of(owner, video["id"])
                if source.status != "completed" or source.expired:
                    raise ApiError(409, "Only a completed video can be extended.", code="video_not_ready")
                frame = await asyncio.to_thread(last_frame_png, job_files(source)[0].read_bytes())
                settings = {
                    key: source.request[key] for key in ("steps", "flow_shift", "audio_flow_shift", "seed")
                }
                meta = {"extended_from_video_id": source.id}
            else:
                raise ApiError(
                    400,
                    'video: give {"id": ...} of a completed video, or upload an MP4',
                    param="video",
                    code="invalid_value",
                )
            fields = {
                **settings,
                **fields,
                "task": "fl2va",
                "input_reference": Upload("last-frame.png", frame),
            }
            return await self.submit(owner, fields, request.headers.get("idempotency-key"), meta)

        @api.post("/files")
        async def upload_file(request: Request):
            """A file kept for later requests of the same owner (by id, in any file field)."""
            owner = self.owner(request)
            fields = await self.fields_of(request, owner)
            upload, purpose = fields.get("file"), fields.get("purpose", "user_data")
            if not isinstance(upload, Upload):
                raise ApiError(
                    400, "file: upload the file as multipart/form-data", param="file", code="invalid_value"
                )
            if purpose not in FILE_PURPOSES:
                raise ApiError(
                    400,
                    f"purpose: must be one of {', '.join(FILE_PURPOSES)}",
                    param="purpose",
                    code="invalid_value",
                )
            if kind_of_suffix(upload.name) is None:
                raise ApiError(
                    400,
                    f"file: cannot tell whether {safe_file_name(upload.name)!r} is an image, a video or an audio clip "
                    f"by its name; accepted: {accepted_text()}",
                    param="file",
                    code="invalid_value",
                )
            try:
                record = await asyncio.to_thread(
                    self.jobs.inputs.add_file, owner, upload.name, upload.data, purpose
                )
            except QuotaExceeded as error:
                raise ApiError(429, str(error), code="inputs_quota_exceeded") from None
            except OSError as error:
                raise self._outputs_error(owner, error) from None
            return file_object(record)

        @api.get("/files")
        async def list_files(
            request: Request,
            after: str | None = None,
            limit: int = 20,
            order: str = "desc",
            purpose: str | None = None,
        ):
            owner = self.owner(request)
            _check_page(limit, order, LIST_LIMIT_MAX)
            records = self.jobs.store.list_files(owner, after, limit + 1, order)
            data = [file_object(record) for record in records[:limit] if purpose in (None, record.purpose)]
            return _page(data, len(records) > limit)

        @api.get("/files/{file_id}")
        async def retrieve_file(request: Request, file_id: str):
            return file_object(self.file_of(self.owner(request), file_id))

        @api.get("/files/{file_id}/content")
        async def file_content(request: Request, file_id: str):
            record = self.file_of(self.owner(request), file_id)
            return FileResponse(record.path, filename=record.filename)

        @api.delete("/files/{file_id}")
        async def delete_file(request: Request, file_id: str):
            record = self.file_of(self.owner(request), file_id)
            await asyncio.to_thread(self.jobs.inputs.delete_file, record)
            return {"id": record.id, "object": "file", "deleted": True}

        @api.get("/videos/{video_id}/events")
        async def video_events(request: Request, video_id: str):
            record = self.record_of(self.owner(request), video_id)
            return StreamingResponse(
                self._events(record), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        async def metrics(request: Request) -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        async def healthz(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        async def readyz(request: Request) -> Response:
            ready = self.ready() if self.ready is not None else True
            return JSONResponse({"ready": bool(ready)}, status_code=200 if ready else 503)

        return [
            Mount("/v1", app=api),
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
        ]

    async def _events(self, record: JobRecord):
        queue = self.jobs.subscribe(record.id)
        try:
            current = self.jobs.store.get(record.id) or record
            yield _sse("video", self.video(current))
            if queue is None:
                yield _sse("done", self.video(current))
                return
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                kind = message.pop("type")
                if kind == "done":
                    yield _sse("done", message["video"])
                    return
                if kind == "deleted":
                    yield _sse("deleted", message)
                    return
                yield _sse(kind, message)
        finally:
            if queue is not None:
                self.jobs.unsubscribe(record.id, queue)


def file_object(record: FileRecord) -> dict[str, Any]:
    """OpenAI's File object of an uploaded file."""
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": int(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def _check_page(limit: int, order: str, most: int) -> None:
    if order not in ("asc", "desc"):
        raise ApiError(400, "order: must be asc or desc", param="order", code="invalid_value")
    if not 1 <= limit <= most:
        raise ApiError(400, f"limit: must be within 1-{most}", param="limit", code="invalid_value")


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _route_of(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", "other")


def _digest(fields: dict[str, Any]) -> str:
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
    (`references`) appends; anything else is a plain value (an unknown name is refused later, by name)."""
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


def _upload_bytes(fields: dict[str, Any]) -> int:
    """The bytes of every upload among `fields` (what the job's inputs folder will take)."""
    total = 0
    for value in fields.values():
        for item in value if isinstance(value, list) else [value]:
            total += len(item.data) if isinstance(item, Upload) else 0
    return total


def last_frame_png(video: bytes) -> bytes:
    """The last frame of an MP4's bytes as PNG (400 naming `video` when it has none or cannot be read)."""
    import io

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
