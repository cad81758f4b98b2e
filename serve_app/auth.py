"""The API key check, one for HTTP and gRPC: a request is authorized when no key is set, or when
its Authorization value (the HTTP header, or the gRPC metadata `authorization`) is
`Bearer <key>`. Every route and method requires it but /health and gRPC Health/Check.

The key itself is resolved by ServeSettings.api_key_here() (serve_app/config.py), in the
ingress's own process.
"""

from __future__ import annotations

import hmac

from serve_app.errors import APIError

# What a refused client is told to send, by transport.
HTTP_HINT = "send Authorization: Bearer <key>"
GRPC_HINT = "send metadata authorization: Bearer <key>"


def authorized(value: str | None, key: str | None) -> bool:
    """Whether an Authorization value carries `key` (None: no key is set, anything passes)."""
    if key is None:
        return True
    scheme, _, token = (value or "").partition(" ")
    # compare_digest runs in time independent of where the strings differ.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def authorize(value: str | None, key: str | None, hint: str | None) -> None:
    """Raise the 401 invalid_api_key APIError unless `value` is authorized; hint: what to send,
    appended to the message (None: the message alone)."""
    if not authorized(value, key):
        message = "missing or invalid API key" + (f": {hint}" if hint else "")
        raise APIError(401, message, None, "invalid_api_key")
