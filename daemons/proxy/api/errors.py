"""The error a client caused or must hear about, as an OpenAI-style JSON body (``ApiError``)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the client caused or must hear about; becomes an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        # A streamed error has no HTTP status of its own: the code says what happened (e.g. "timeout").
        self.code = code or {504: "timeout"}.get(status)
        self.type = type_ or {400: "invalid_request_error", 404: "not_found_error",
                              409: "invalid_request_error"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
