"""An HTTP request's body: read within the size limit, then parsed as a JSON object; what the
ingress does before a front end (serve_app/openai_api.py) validates the body's fields."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from serve_app.errors import APIError

# A body over the limit is read to its end, and dropped, before its 413 is sent, when it is at most
# this long: the HTTP proxy closes a connection the client asked to close (`Connection: close`:
# urllib, HTTP/1.0) once the response is sent, and closing a socket with unread data makes the
# kernel reset the connection, which discards the 413 before the client, still sending, reads it.
# A body declared longer than this gets the 413 at once (a keep-alive client still reads it).
DRAIN_MAX_BYTES = 256 << 20


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the body is larger than {limit} bytes", None, "body_too_large")


async def read_body(parts: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    """The request body from its parts as they arrive (content_length: the header, None for a
    chunked body); more than `limit` bytes, as declared or as read, raises 413 once the rest of
    the body has been read and dropped (at most DRAIN_MAX_BYTES in all; see there why)."""
    declared = int(content_length) if content_length is not None and content_length.isdigit() else None
    if declared is not None and declared > DRAIN_MAX_BYTES:
        raise body_too_large(limit)
    raw, seen = bytearray(), 0
    over = declared is not None and declared > limit
    try:
        async for part in parts:
            seen += len(part)
            if not over:
                raw += part
                over = len(raw) > limit
            if over and seen > DRAIN_MAX_BYTES:
                break
    except Exception:  # noqa: BLE001 - the client left while its oversized body was dropped: 413 all the same
        if not over:
            raise
    if over:
        raise body_too_large(limit)
    return bytes(raw)


async def drain(parts: AsyncIterator[bytes]) -> None:
    """Read and drop what is left of the body of a request refused before its body was read (401,
    404, 405), at most DRAIN_MAX_BYTES, for the reason given there: a client that asked to close
    the connection would otherwise get a reset instead of the refusal. A body already read, or a
    client gone, leaves nothing to do."""
    seen = 0
    try:
        async for part in parts:
            seen += len(part)
            if seen > DRAIN_MAX_BYTES:
                return
    except Exception:  # noqa: BLE001 - consumed already, or the client left: the refusal goes out as it is
        return


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(
            400,
            f"the body is not valid JSON: {err.__class__.__name__} at position {getattr(err, 'pos', 0)}",
            None,
            "invalid_json",
        ) from None
    except RecursionError:  # nested deeper than the parser goes (a schema, say): the client's, not a 500
        raise APIError(400, "the body nests JSON too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    return body
