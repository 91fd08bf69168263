"""The API's errors in OpenAI's shape: `ApiError(status, message, param, code)` raised anywhere in a route becomes
`{"error": {"message", "type", "param", "code"}}` with that status (`error_response`)."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse

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


class ApiError(Exception):
    """An answer other than 2xx: the HTTP status, a sentence, the field it is about and OpenAI's error code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
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
    return JSONResponse(body, status_code=error.status, headers=dict(error.headers or {}))
