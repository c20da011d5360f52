"""Bearer tokens: the one check of an ``Authorization`` header, for every side.

The collector takes a token on ingest (``POST /v1/reports``, the live-settings writes:
setting ``token``, which jobs send) and, optionally, on reads (setting ``read_token``);
both are checked here: ``Authorization: Bearer <token>``, the scheme in any case, the
token compared in constant time. An answer refusing one names :data:`REALM` in its
``WWW-Authenticate`` header (:func:`challenge`).
"""

from __future__ import annotations

import secrets

__all__ = ["REALM", "bearer_matches", "challenge"]

REALM = 'Bearer realm="trainvitals"'
"""The ``WWW-Authenticate`` challenge of a request without a token."""


def bearer_matches(header: bytes | str | None, expected: bytes | str) -> bool:
    """Whether an ``Authorization`` header's value is ``Bearer <expected>``."""
    if header is None:
        return False
    raw = header.encode() if isinstance(header, str) else header
    scheme, _, given = raw.partition(b" ")
    token = expected.encode() if isinstance(expected, str) else expected
    # compare_digest: the time taken does not tell how much of the token matched.
    return scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), token)


def challenge(header_sent: bool) -> str:
    """The ``WWW-Authenticate`` value refusing a request: :data:`REALM`, and
    ``error="invalid_token"`` when it sent a header (a wrong token, not a missing one)."""
    return REALM + (', error="invalid_token"' if header_sent else "")
