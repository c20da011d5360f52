"""Reading a ``POST /v1/reports`` body: content type, bounded read, bounded gzip
inflate, JSON parse, and an error description that names the field (the token is
checked before, :func:`trainvitals.monitor.auth.check_ingest_token`).

No routing here: :func:`read_body` returns the body's JSON bytes (inflated) and
:func:`parse_batch` validates them into a :class:`~trainvitals.monitor.decode.WireBatch`
(the wire schema's rules, :mod:`~trainvitals.monitor.decode`); both raise
:class:`BodyRefused`, which
carries the HTTP status, the ``outcome`` label counted in
``trainvitals_collector_reports_total`` and the ``detail`` shown to the client.
The wire format is described in ``docs/wire.md``.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from typing import Any

from starlette.requests import ClientDisconnect, Request

from trainvitals.monitor.decode import WireBatch, decode_batch
from trainvitals.monitor.settings import Settings
from trainvitals.wire.errors import Refused

__all__ = ["MAX_NUMBER_CHARS", "BodyRefused", "load_json", "parse_batch", "read_batch", "read_body"]

MAX_NUMBER_CHARS = 40  # characters of one JSON number in a small body (settings); more is refused


class BodyRefused(Refused):
    """A body the collector will not ingest: HTTP status, outcome label, detail, headers."""

    def __init__(self, status: int, outcome: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail, status=status, outcome=outcome, headers=headers)


async def read_batch(request: Request, settings: Settings) -> WireBatch:
    """Read, inflate and validate the request's body; raise :class:`BodyRefused`."""
    return parse_batch(await read_body(request, settings))


async def read_body(request: Request, settings: Settings) -> bytes:
    """Check the content type, read and inflate the request's body (JSON bytes); raise
    :class:`BodyRefused`.

    Limits from ``settings``: ``max_body_bytes`` (as sent) and
    ``max_decompressed_bytes`` (after gzip), both in bytes; the body must arrive
    within ``body_timeout_seconds`` (408 otherwise: a trickling client does not
    hold a connection for ever).
    """
    check_content_type(request)
    body = await read_limited(request, settings.max_body_bytes, settings.body_timeout_seconds)
    return inflate(request, body, settings.max_decompressed_bytes)


async def read_limited(request: Request, limit: int, timeout: float) -> bytes:
    """The body as sent: 413 past ``limit`` bytes (declared or while reading), 408 when it
    has not arrived within ``timeout`` seconds, 400 when the client went away."""
    try:
        return await asyncio.wait_for(read_bounded(request, limit), timeout)
    except asyncio.TimeoutError:
        raise BodyRefused(408, "invalid", f"body not received within {timeout:g} s") from None
    except ClientDisconnect:
        raise BodyRefused(400, "invalid", "the client disconnected before sending the body") from None


class _LongNumber:
    """A JSON number with more digits than any setting takes (kept out of float()/int())."""

    __slots__ = ("digits",)

    def __init__(self, text: str) -> None:
        self.digits = len(text)


def _number(text: str) -> Any:
    if len(text) > MAX_NUMBER_CHARS:
        return _LongNumber(text)
    return float(text) if any(c in text for c in ".eE") else int(text)


_OPEN, _CLOSE = b"[{", b"]}"
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _depth(body: bytes) -> int:
    """How deep arrays and objects nest in ``body`` (strings skipped)."""
    bare = _STRING.sub(b"", body)
    depth = deepest = 0
    for byte in bare.translate(None, bytes(b for b in range(256) if b not in b"[]{}")):
        depth += 1 if byte in _OPEN else -1
        deepest = max(deepest, depth)
    return deepest


def load_json(body: bytes, max_depth: int = 8) -> Any:
    """Parse a small JSON body with bounds: 400 when it is not JSON or nests deeper than
    ``max_depth`` (parsers recurse per level), 422 naming the field where a number has
    more than :data:`MAX_NUMBER_CHARS` characters (never an overflow inside a validator)."""
    if _depth(body) > max_depth:
        raise BodyRefused(400, "invalid", f"body nests arrays/objects deeper than {max_depth} levels")
    try:
        data = json.loads(body, parse_int=_number, parse_float=_number, parse_constant=_constant)
    except ValueError as exc:
        raise BodyRefused(400, "invalid", f"body is not JSON: {exc}") from None
    where = _long_number(data, "")
    if where is not None:
        path, n = where
        raise BodyRefused(
            422, "invalid", f"{path or 'body'}: a number of {n} characters is out of range (at most {MAX_NUMBER_CHARS})"
        )
    return data


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _long_number(value: Any, path: str) -> tuple[str, int] | None:
    if isinstance(value, _LongNumber):
        return path, value.digits
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _long_number(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_content_type(request: Request) -> None:
    """Refuse (415) anything but JSON, plain or gzip-encoded."""
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = repr(ctype) if ctype else "none"
        raise BodyRefused(415, "unsupported_media", f"Content-Type {shown} not supported; send application/json")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", ""):
        raise BodyRefused(
            415,
            "unsupported_media",
            f"Content-Encoding {encoding!r} not supported; send gzip or no encoding",
        )


async def read_bounded(request: Request, limit: int) -> bytes:
    """The body as sent, refused (413) past ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BodyRefused(400, "invalid", f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise BodyRefused(413, "too_large", f"body of {size} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():  # chunked bodies declare no length
        total += len(chunk)
        if total > limit:
            raise BodyRefused(413, "too_large", f"body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def inflate(request: Request, body: bytes, limit: int) -> bytes:
    """Decode a gzip body, refused (413) past ``limit`` inflated bytes (a gzip bomb)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding != "gzip":
        return body
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # 16+: gzip header and trailer
    try:
        out = inflater.decompress(body, limit)
        if inflater.unconsumed_tail:
            raise BodyRefused(
                413,
                "too_large",
                f"gzip body inflates past the limit of {limit} bytes (max_decompressed_bytes)",
            )
        out += inflater.flush()
    except zlib.error as exc:
        raise BodyRefused(400, "bad_gzip", f"body is not valid gzip: {exc}") from None
    if len(out) > limit:
        raise BodyRefused(413, "too_large", f"gzip body inflates past the limit of {limit} bytes")
    if not inflater.eof:
        raise BodyRefused(400, "bad_gzip", "body is not valid gzip: truncated stream")
    if inflater.unused_data:
        raise BodyRefused(400, "bad_gzip", "body is not valid gzip: trailing data after the stream")
    return out


def parse_batch(body: bytes) -> WireBatch:
    """Validate JSON bytes as a wire body: 400 for bad JSON, 422 naming the bad field."""
    return decode_batch(body)  # BodyInvalid is a Refused: 400 or 422
