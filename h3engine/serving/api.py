"""The HTTP routes beside Gradio: `/v1/videos` and `/v1/files` (OpenAI's shapes), `/metrics`, `/healthz`, `/readyz`.

`routes(serving)` are Starlette routes that app.py hands to Gradio's FastAPI app (`app_kwargs["routes"]`), so they
run in the app's own server, before Gradio's routes; each handler below reads the `Serving` (h3engine.serving
.service) from its app's state. Errors are OpenAI's shape (h3engine.serving.errors): 400 (a field, named; `body` for
an unreadable one), 401 (keys), 404 (no such job or file of yours, no such route), 405, 409 (an Idempotency-Key
reused with another body; content not ready), 413 (body over `--max-body-size`), 429 (queue full, too many jobs of
yours: Retry-After; inputs over the owner's quota), 503 (the outputs folder refuses writes: the page's sentence).
Requests are judged by the one checker on the front (`front.check`), off the event loop. With API keys each key
sees only its own jobs and files; without, /v1 answers only on a loopback bind.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Mount, Route

from h3engine.errors import RequestError
from h3engine.media.formats import accepted_text, kind_of_suffix
from h3engine.request.shapes import from_dict
from h3engine.serving.bodies import last_frame_png
from h3engine.serving.errors import ApiError, error_response
from h3engine.serving.inputs import QuotaExceeded, new_job_id, remove_folder, safe_file_name
from h3engine.serving.job_images import write_spritesheet, write_thumbnail
from h3engine.serving.jobs import Refused, job_files
from h3engine.serving.metrics import CONTENT_TYPE
from h3engine.serving.service import Serving
from h3engine.serving.store import FileRecord, JobRecord
from h3engine.serving.videos import Upload, api_message, api_param, copy_inputs

LIST_LIMIT_MAX = 100
SSE_KEEPALIVE_S = 15.0
FILE_PURPOSES = ("user_data", "vision")
# variant -> (index in job_files, media type)
CONTENT_VARIANTS = {
    "video": (0, "video/mp4"),
    "thumbnail": (2, "image/jpeg"),
    "spritesheet": (3, "image/jpeg"),
    "sidecar": (1, "application/json"),
}
EDIT_UNSUPPORTED = (
    "Editing a video from a prompt alone is not supported by this server: remix it "
    "(POST /v1/videos/{video_id}/remix), or regenerate masked spans with video_mask / audio_mask."
)


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


# --- videos ---------------------------------------------------------------------------------------------------


async def create_video(request: Request) -> Response:
    serving = serving_of(request)
    owner = serving.owner(request)
    fields = await serving.fields_of(request, owner)
    return await serving.submit(owner, fields, request.headers.get("idempotency-key"))


async def list_videos(
    request: Request, after: str | None = None, limit: int = 20, order: str = "desc"
) -> Any:
    serving = serving_of(request)
    owner = serving.owner(request)
    _check_page(limit, order)
    records = serving.jobs.store.list(owner, after, limit + 1, order)
    return _page([serving.video(record) for record in records[:limit]], len(records) > limit)


async def retrieve_video(request: Request, video_id: str) -> Any:
    serving = serving_of(request)
    return serving.video(serving.record_of(serving.owner(request), video_id))


async def delete_video(request: Request, video_id: str) -> Any:
    serving = serving_of(request)
    owner = serving.owner(request)
    serving.record_of(owner, video_id)
    try:
        await asyncio.to_thread(serving.jobs.delete, owner, video_id)
    except Refused as refusal:
        raise ApiError(refusal.status, refusal.message, code=refusal.code) from None
    return {"id": video_id, "object": "video.deleted", "deleted": True}


async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    serving = serving_of(request)
    record = serving.record_of(serving.owner(request), video_id)
    if variant not in CONTENT_VARIANTS:
        raise ApiError(
            400,
            f"variant: must be one of {', '.join(CONTENT_VARIANTS)}",
            param="variant",
            code="invalid_value",
        )
    if record.status != "completed":
        raise ApiError(409, f"The video is {record.status}, not completed.", code="video_not_ready")
    files = job_files(record)
    index, media_type = CONTENT_VARIANTS[variant]
    path = files[index]
    if record.expired or not files[0].is_file():
        raise ApiError(404, "The video's files are no longer kept.", code="video_expired")
    if not path.is_file() and variant in ("thumbnail", "spritesheet"):
        make = write_thumbnail if variant == "thumbnail" else write_spritesheet
        await asyncio.to_thread(make, files[0])
    if not path.is_file():
        raise ApiError(404, f"The video's {variant} is not kept.", code="video_expired")
    return FileResponse(path, media_type=media_type, filename=f"{video_id}{path.suffix}")


async def remix_video(request: Request, video_id: str) -> Response:
    """The source's request with a new prompt, its input files copied into the new job's own folder."""
    serving = serving_of(request)
    owner = serving.owner(request)
    source = serving.record_of(owner, video_id)
    fields = await serving.fields_of(request, owner)
    if not isinstance(fields.get("prompt"), str):
        raise ApiError(400, "prompt: is required", param="prompt", code="invalid_value")
    job_id = new_job_id()
    folder = serving.jobs.inputs.job_folder(owner, job_id)
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
            raise serving.outputs_error(owner, error) from None
        try:
            resolved = await asyncio.to_thread(serving.jobs.front.resolve, generation)
        except RequestError as error:
            param = api_param(error, None, False)
            raise ApiError(400, api_message(error, param), param=param, code="invalid_value") from None
        meta = {key: source.meta[key] for key in ("model", "seconds") if key in source.meta}
        meta["remixed_from_video_id"] = video_id
        if folder.is_dir():
            meta["inputs"] = str(folder)
        return await serving.create(owner, resolved, meta, None, job_id)
    except BaseException:
        remove_folder(folder)
        raise


async def edit_video(request: Request) -> Response:
    serving_of(request).owner(request)
    raise ApiError(404, EDIT_UNSUPPORTED, code="unsupported_endpoint")


async def extend_video(request: Request) -> Response:
    """FL2VA from the last frame of a completed video (`video[id]`) or of an uploaded MP4 (`video`)."""
    serving = serving_of(request)
    owner = serving.owner(request)
    fields = await serving.fields_of(request, owner)
    video = fields.pop("video", None)
    settings: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    if isinstance(video, Upload):
        frame = await asyncio.to_thread(last_frame_png, video.data)
    elif isinstance(video, dict) and isinstance(video.get("id"), str):
        source = serving.record_of(owner, video["id"])
        if source.status != "completed" or source.expired:
            raise ApiError(409, "Only a completed video can be extended.", code="video_not_ready")
        frame = await asyncio.to_thread(last_frame_png, job_files(source)[0].read_bytes())
        settings = {key: source.request[key] for key in ("steps", "flow_shift", "audio_flow_shift", "seed")}
        meta = {"extended_from_video_id": source.id}
    else:
        raise ApiError(
            400,
            'video: give {"id": ...} of a completed video, or upload an MP4',
            param="video",
            code="invalid_value",
        )
    fields = {**settings, **fields, "task": "fl2va", "input_reference": Upload("last-frame.png", frame)}
    return await serving.submit(owner, fields, request.headers.get("idempotency-key"), meta)


async def video_events(request: Request, video_id: str) -> Response:
    serving = serving_of(request)
    record = serving.record_of(serving.owner(request), video_id)
    return StreamingResponse(
        _events(serving, record), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _events(serving: Serving, record: JobRecord) -> AsyncIterator[str]:
    queue = serving.jobs.subscribe(record.id)
    try:
        current = serving.jobs.store.get(record.id) or record
        yield _sse("video", serving.video(current))
        if queue is None:
            yield _sse("done", serving.video(current))
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
            serving.jobs.unsubscribe(record.id, queue)


# --- files ----------------------------------------------------------------------------------------------------


async def upload_file(request: Request) -> Any:
    """A file kept for later requests of the same owner (by id, in any file field)."""
    serving = serving_of(request)
    owner = serving.owner(request)
    fields = await serving.fields_of(request, owner)
    upload, purpose = fields.get("file"), fields.get("purpose", "user_data")
    if not isinstance(upload, Upload):
        raise ApiError(
            400, "file: upload the file as multipart/form-data", param="file", code="invalid_value"
        )
    if purpose not in FILE_PURPOSES:
        raise ApiError(
            400, f"purpose: must be one of {', '.join(FILE_PURPOSES)}", param="purpose", code="invalid_value"
        )
    if kind_of_suffix(upload.name) is None:
        raise ApiError(
            400,
            f"file: cannot tell whether {safe_file_name(upload.name)!r} is an image, a video or an audio clip by its "
            f"name; accepted: {accepted_text()}",
            param="file",
            code="invalid_value",
        )
    try:
        record = await asyncio.to_thread(
            serving.jobs.inputs.add_file, owner, upload.name, upload.data, purpose
        )
    except QuotaExceeded as error:
        raise ApiError(429, str(error), code="inputs_quota_exceeded") from None
    except OSError as error:
        raise serving.outputs_error(owner, error) from None
    return file_object(record)


async def list_files(
    request: Request,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
    purpose: str | None = None,
) -> Any:
    serving = serving_of(request)
    owner = serving.owner(request)
    _check_page(limit, order)
    records = serving.jobs.store.list_files(owner, after, limit + 1, order)
    data = [file_object(record) for record in records[:limit] if purpose in (None, record.purpose)]
    return _page(data, len(records) > limit)


async def retrieve_file(request: Request, file_id: str) -> Any:
    serving = serving_of(request)
    return file_object(serving.file_of(serving.owner(request), file_id))


async def file_content(request: Request, file_id: str) -> Response:
    serving = serving_of(request)
    record = serving.file_of(serving.owner(request), file_id)
    return FileResponse(record.path, filename=record.filename)


async def delete_file(request: Request, file_id: str) -> Any:
    serving = serving_of(request)
    record = serving.file_of(serving.owner(request), file_id)
    await asyncio.to_thread(serving.jobs.inputs.delete_file, record)
    return {"id": record.id, "object": "file", "deleted": True}


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


# --- errors, metrics, health ----------------------------------------------------------------------------------


async def api_error(request: Request, error: ApiError) -> JSONResponse:
    serving_of(request).metrics.requests.labels(_route_of(request), str(error.status)).inc()
    return error_response(error)


async def invalid_parameter(request: Request, error: RequestValidationError) -> JSONResponse:
    first = (error.errors() or [{}])[0]
    param = str((first.get("loc") or ["", ""])[-1])
    message = f"{param}: {first.get('msg', 'invalid value')}"
    return error_response(ApiError(400, message, param=param, code="invalid_value"))


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    if error.status_code == 404:
        message = f"No such route: {request.method} {request.url.path}."
    elif error.status_code == 405:
        message = f"{request.url.path} does not take {request.method}."
    else:
        message = str(error.detail)
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(error.status_code, "http_error")
    return error_response(ApiError(error.status_code, message, code=code))


async def count_answers(request: Request, call_next: Any) -> Response:
    response = await call_next(request)
    if response.status_code < 400:
        serving_of(request).metrics.requests.labels(_route_of(request), str(response.status_code)).inc()
    return response


# /v1: (method, path, handler), in matching order (the fixed paths before /videos/{video_id}).
V1_ROUTES = (
    ("POST", "/videos", create_video),
    ("GET", "/videos", list_videos),
    ("POST", "/videos/edits", edit_video),
    ("POST", "/videos/extensions", extend_video),
    ("GET", "/videos/{video_id}", retrieve_video),
    ("DELETE", "/videos/{video_id}", delete_video),
    ("GET", "/videos/{video_id}/content", video_content),
    ("POST", "/videos/{video_id}/remix", remix_video),
    ("GET", "/videos/{video_id}/events", video_events),
    ("POST", "/files", upload_file),
    ("GET", "/files", list_files),
    ("GET", "/files/{file_id}", retrieve_file),
    ("GET", "/files/{file_id}/content", file_content),
    ("DELETE", "/files/{file_id}", delete_file),
)


def routes(serving: Serving) -> list[BaseRoute]:
    """/v1 (its own FastAPI app, the `Serving` in its state), /metrics, /healthz and /readyz."""
    api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    api.state.serving = serving
    api.add_exception_handler(ApiError, api_error)
    api.add_exception_handler(RequestValidationError, invalid_parameter)
    api.add_exception_handler(StarletteHTTPException, http_error)
    api.middleware("http")(count_answers)
    for method, path, handler in V1_ROUTES:
        api.add_api_route(path, handler, methods=[method])

    async def metrics(request: Request) -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = serving.ready() if serving.ready is not None else True
        return JSONResponse({"ready": bool(ready)}, status_code=200 if ready else 503)

    return [
        Mount("/v1", app=api),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
    ]


def _check_page(limit: int, order: str) -> None:
    if order not in ("asc", "desc"):
        raise ApiError(400, "order: must be asc or desc", param="order", code="invalid_value")
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise ApiError(400, f"limit: must be within 1-{LIST_LIMIT_MAX}", param="limit", code="invalid_value")


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
