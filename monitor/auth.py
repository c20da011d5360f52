"""The collector's tokens: the ingest ``token`` and the optional ``read_token``.

:func:`check_ingest_token` guards ``POST /v1/reports`` and the live-settings writes with
the ingest token (setting ``token``, which jobs send). The rest of this module is the
optional bearer token on the read endpoints (setting ``read_token``).

``GET /metrics``, ``/v1/runs``, ``/v1/alerts`` and the API docs (``/docs``,
``/redoc``, ``/openapi.json``) then need ``Authorization: Bearer <read_token>``
(Prometheus: ``authorization: {credentials_file: ...}`` in the scrape config). The
pages (``/``, ``/runs/{run}``) take it as an HTTP Basic password too (any user name),
which is what a browser asks for.
``/healthz`` and ``/readyz`` stay open for probes, the runbook pages (``/runbooks``) for
the links in notifications; ``POST /v1/reports`` and the
writes of live settings (``PUT``/``DELETE /v1/runs/{run}/settings``) have the ingest
``token``. A pure ASGI middleware: nothing is read or parsed before the check.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from trainvitals.wire.bearer import bearer_matches, challenge
from trainvitals.wire.errors import Refused

__all__ = ["ReadAuthMiddleware", "check_ingest_token", "read_protected"]

_OPEN = ("/healthz", "/readyz")


def check_ingest_token(header: str | None, expected: str | None) -> None:
    """Refuse (401, outcome ``unauthorized``) unless ``header`` is ``Bearer <expected>``;
    no token set (``expected`` None): pass."""
    if expected is None or bearer_matches(header, expected):
        return
    detail = (
        "invalid bearer token" if header is not None else "missing bearer token: send 'Authorization: Bearer <token>'"
    )
    raise Refused(
        detail, status=401, outcome="unauthorized", headers={"WWW-Authenticate": challenge(header is not None)}
    )


def read_protected(method: str, path: str) -> bool:
    """True for the requests the read token guards (everything but health and ingest)."""
    if path in _OPEN or path == "/runbooks" or path.startswith("/runbooks/"):
        return False
    if method in ("PUT", "DELETE") and path.startswith("/v1/runs/") and path.endswith("/settings"):
        return False  # a write: the route checks the ingest token
    return not (method == "POST" and path == "/v1/reports")


def _is_page(path: str) -> bool:
    """The HTML pages (:mod:`trainvitals.monitor.routes_pages`), which browsers open."""
    return path == "/" or path.startswith("/runs/")


def _basic_password(credentials: bytes) -> bytes:
    """The password of HTTP Basic credentials (``base64(user:password)``), or nothing."""
    try:
        decoded = base64.b64decode(credentials, validate=True)
    except (binascii.Error, ValueError):
        return b""
    _user, sep, password = decoded.partition(b":")
    return password if sep else b""


class ReadAuthMiddleware:
    """Answers 401 to a read request without the right bearer token."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not read_protected(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"basic":  # a browser on the pages: the token is the password
            header = b"Bearer " + _basic_password(given.strip())
        if bearer_matches(header, self._token):
            await self.app(scope, receive, send)
            return
        detail = (
            "invalid bearer token"
            if header
            else (
                "missing bearer token: this collector requires its read_token for "
                f"{scope['path']}; send 'Authorization: Bearer <read_token>'"
            )
        )
        body = json.dumps({"detail": detail}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge(bool(header)).encode()),
        ]
        if _is_page(scope["path"]):  # a browser asks for the token (as the password)
            headers.append((b"www-authenticate", b'Basic realm="trainvitals", charset="UTF-8"'))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
