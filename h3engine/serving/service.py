"""The API's state and its one way in: `Serving` holds the job service, settings, metrics and readiness; `owner`
tells whose request it is (a key's digest, or "local" on a loopback bind without keys); `fields_of` reads a body;
`submit` builds, checks and queues one request with its files in the job's own inputs folder (removed when the
request is refused); `create` queues a checked request. The routes (h3engine.serving.api) call these.

Danger: keys are compared in constant time; an owner is a digest of its key, never the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from h3engine.engine.lora.library import LoraLibrary
from h3engine.engine.resolved import ResolvedRequest
from h3engine.errors import RequestError
from h3engine.runtime.messages import outputs_refuse_writes
from h3engine.serving.bodies import fields_digest, fields_of, upload_bytes
from h3engine.serving.errors import ApiError
from h3engine.serving.inputs import QuotaExceeded, new_job_id, remove_folder
from h3engine.serving.jobs import LOCAL_OWNER, Refused, VideoJobs
from h3engine.serving.metrics import Metrics
from h3engine.serving.store import FileRecord, JobRecord
from h3engine.serving.videos import (
    ApiFieldError,
    Built,
    api_message,
    api_param,
    request_from_fields,
    video_object,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiSettings:
    keys: tuple[str, ...] = ()
    loopback: bool = True  # the app binds a loopback address: /v1 may answer without keys
    max_body_bytes: int = 200 * 1024**2
    webhook_url: str | None = None


def owner_of_key(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def is_loopback(host: str) -> bool:
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

    async def fields_of(self, request: Request, owner: str) -> dict[str, Any]:
        """The body's fields (h3engine.serving.bodies), file ids looked up among the owner's files."""
        return await fields_of(request, self.settings.max_body_bytes, self.jobs.inputs, owner)

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
            idempotency = (idempotency_key[:200], fields_digest(fields))
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
                self.jobs.inputs.check_quota(owner, upload_bytes(fields))
                built = await asyncio.to_thread(
                    request_from_fields, fields, folder, self.jobs.front.facts, self.library
                )
                resolved = await asyncio.to_thread(self.jobs.front.resolve, built.request)
            except ApiFieldError as error:
                raise ApiError(400, error.message, param=error.param, code="invalid_value") from None
            except RequestError as error:
                param = api_param(error, built, bool(fields.get("size")))
                raise ApiError(400, api_message(error, param), param=param, code="invalid_value") from None
            except QuotaExceeded as error:
                raise ApiError(429, str(error), code="inputs_quota_exceeded") from None
            except OSError as error:
                raise self.outputs_error(owner, error) from None
            meta = {**built.meta, **(meta or {})}
            if folder.is_dir():
                meta["inputs"] = str(folder)
            return await self.create(owner, resolved, meta, idempotency, job_id)
        except BaseException:
            remove_folder(folder)  # a refused request keeps nothing
            raise

    def outputs_error(self, owner: str, error: OSError) -> ApiError:
        """A write under the outputs folder failed while taking a request: 503 with the page's sentence."""
        logger.error("could not store a request's inputs: %s", error)
        problem = self.jobs.outputs_problem(self.jobs.inputs.owner_folder(owner))
        if problem is None:
            words = outputs_refuse_writes(error.strerror or type(error).__name__)
            problem = f"{words[0].upper()}{words[1:]}"
        return ApiError(503, problem, code="outputs_unwritable")

    async def create(
        self,
        owner: str,
        resolved: ResolvedRequest,
        meta: dict[str, Any],
        idempotency: tuple[str, str] | None = None,
        job_id: str | None = None,
    ) -> JSONResponse:
        """The job (new, or an Idempotency-Key's earlier one) as a Video object; refusals as ApiErrors."""
        if "callback_url" not in meta and self.settings.webhook_url:
            meta = {**meta, "callback_url": self.settings.webhook_url}
        try:
            record, _new = await asyncio.to_thread(
                self.jobs.create, owner, resolved, meta, "api", idempotency, None, job_id
            )
        except Refused as refusal:
            headers = None if refusal.retry_after is None else {"Retry-After": str(refusal.retry_after)}
            raise ApiError(refusal.status, refusal.message, code=refusal.code, headers=headers) from None
        if (
            job_id is not None and record.id != job_id
        ):  # an Idempotency-Key's earlier job: these inputs are not used
            remove_folder(self.jobs.inputs.job_folder(owner, job_id))
        return JSONResponse(self.video(record))
