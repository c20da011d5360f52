"""Hiding secrets in text that reaches a log or an error: URLs with credentials or tokens.

Both sides use it: the hooks for the collector URL (``http://user:password@host``),
the collector for notifier URLs (a webhook URL with ``?token=...``) and for every
log line it writes (:func:`redact` is applied by a logging filter).
"""

from __future__ import annotations

import re

__all__ = ["redact"]

# scheme://user:password@host -> scheme://user:***@host
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^/\s:@]*):(?P<pw>[^/\s@]+)@")
# ?token=... &key=... (query parameters whose name says secret)
_QUERY = re.compile(
    r"(?P<head>[?&;](?:[\w.\-]*(?:token|key|secret|password|passwd|pwd|sig|signature|auth|"
    r"credential|code|session)[\w.\-]*)=)(?P<value>[^&;#\s\"'<>]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with URL passwords and secret-looking query values replaced by ``***``."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _QUERY.sub(lambda m: f"{m['head']}***", text)
