"""One error type for everything a client can cause, mapped once to HTTP and gRPC.

Messages are written for the client: bounded in length, naming the parameter to change, never a
path, address or stack trace (those go to the server's log).
"""

from __future__ import annotations

import grpc

MAX_MESSAGE_CHARS = 512

# HTTP status -> (OpenAI error type, gRPC status code)
_KINDS = {
    400: ("invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    401: ("authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    404: ("not_found_error", grpc.StatusCode.NOT_FOUND),
    413: ("invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    429: ("rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    500: ("server_error", grpc.StatusCode.INTERNAL),
    503: ("server_error", grpc.StatusCode.UNAVAILABLE),
}


class APIError(Exception):
    """An error with the status the client gets. Picklable (crosses Serve handles)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(status, message, param, code, retry_after_s)
        self.status, self.message, self.param, self.code, self.retry_after_s = (
            status,
            message,
            param,
            code,
            retry_after_s,
        )

    def __str__(self) -> str:
        return self.message

    @property
    def type(self) -> str:
        return _KINDS.get(self.status, _KINDS[500])[0]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        if self.status == 503 and self.code == "overloaded":
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        return _KINDS.get(self.status, _KINDS[500])[1]

    def body(self) -> dict:
        """The OpenAI error envelope."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def overloaded(status: int, retry_after_s: int) -> APIError:
    """503, or 429 with a Retry-After header."""
    return APIError(
        status,
        "the server is at its request bound; retry later",
        None,
        "overloaded",
        retry_after_s if status == 429 else None,
    )


def engine_failed(
    message: str = "this target replica is not serving (its engine failed); retry", retry_after_s: int | None = None
) -> APIError:
    """503 engine_failed: a target replica whose engine failed refuses a request before admitting
    anything (the default message), or the ingress found no target replica serving. The ingress
    sends a refusal of the first kind again, to another replica (`retried_elsewhere`)."""
    return APIError(503, message, None, "engine_failed", retry_after_s)


def retried_elsewhere(err: APIError) -> bool:
    """Whether `err` is engine_failed()'s 503, which the ingress retries (a 500 engine_failed, a
    round that failed while generating, is not: the request itself may have caused it)."""
    return err.status == 503 and err.code == "engine_failed"


def from_validation(err: Exception, prefix: str = "") -> APIError:
    """A pydantic ValidationError (or ValueError) -> 400 naming the first offending field."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors(include_url=False, include_context=False, include_input=False)[0]
        loc = ".".join(str(p) for p in first["loc"] if p != "body")
        param = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or None)
        msg = first["msg"].removeprefix("Value error, ")
        return APIError(400, f"{param}: {msg}" if param else msg, param, "invalid_value")
    return APIError(400, str(err), prefix.rstrip(".") or None, "invalid_value")
