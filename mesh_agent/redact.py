"""Secrets out of everything printed: log lines, error messages, reprs and tracebacks.

Why: an agent holds its HMAC key, a broker password and maybe a Globus client secret; the hub its
broker password, a metrics token and a database URL with a password. A log shipper, a support
ticket with a pasted traceback or ``print(config)`` must show none of them. Three layers:

- the config models do not show secret fields in their repr (``Field(repr=False)``) and show URLs
  with the password masked (:func:`mask_url`);
- the log formatters of :mod:`mesh_agent._logs` pass every line, traceback included, through
  :func:`redact`;
- :func:`redact` masks what can be recognised by its shape (``scheme://user:PASSWORD@``,
  ``password=...``, ``"token": "..."``, ``Bearer ...``, the hub's ``cm_``/``ce_`` tokens) and every
  secret value the process registered with :func:`register_secret` (the agent registers its key
  and broker password once its settings are loaded, the hub its own).

Stdlib only: the light agent runner imports it.
"""

from __future__ import annotations

import re
import threading
import traceback
from typing import Any

__all__ = ["MASK", "redact", "mask_url", "register_secret", "registered", "forget_secrets", "redact_value", "format_exception"]

MASK = "***"
#: Shorter values are not registered: masking a 3-letter password everywhere would garble every line.
MIN_SECRET_LEN = 6
_MAX_SECRETS = 256

_lock = threading.Lock()
_secrets: dict[str, None] = {}  # insertion-ordered set; the oldest go first past _MAX_SECRETS
_snapshot: tuple[str, ...] = ()

# scheme://user:password@host (the user may be empty: redis://:pw@host). A '/', '@' or blank ends
# the userinfo, so host:port/path never matches.
_URL_PASSWORD = re.compile(r"(?P<pre>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)(?P<pw>[^\s/@]+)@")
# password=..., mqtt_password: '...', "client_secret": "...", token=..., api_key=...
_KEY_VALUE = re.compile(
    r"(?i)(?P<key>\b[A-Za-z_]*(?:password|passwd|secret|token|api_key|apikey))(?P<sep>[\"']?\s*[:=]\s*)(?P<q>[\"']?)"
    r"(?P<val>[^\s\"',;)}\]]+)"
)
_BEARER = re.compile(r"(?i)(?P<pre>\bbearer\s+)[A-Za-z0-9._~+/=-]{8,}")
# The hub's API tokens (cm_...) and enrollment tokens (ce_...): secrets.token_urlsafe(32).
_HUB_TOKEN = re.compile(r"\b(?P<pre>c[me]_)[A-Za-z0-9_-]{20,}")
_WORDS = ("pass", "secret", "token", "api_key", "apikey")


def register_secret(*values: Any) -> None:
    """Mask these values wherever they appear in what :func:`redact` sees (None and short values are skipped)."""
    global _snapshot
    with _lock:
        for v in values:
            if isinstance(v, bytes):
                v = v.hex()
            if not isinstance(v, str) or len(v) < MIN_SECRET_LEN:
                continue
            _secrets.pop(v, None)
            _secrets[v] = None
            while len(_secrets) > _MAX_SECRETS:
                _secrets.pop(next(iter(_secrets)))
        # Longest first: a secret that contains another is masked whole.
        _snapshot = tuple(sorted(_secrets, key=len, reverse=True))


def registered() -> tuple[str, ...]:
    return _snapshot


def forget_secrets() -> None:
    """For tests."""
    global _snapshot
    with _lock:
        _secrets.clear()
        _snapshot = ()


def mask_url(url: Any) -> Any:
    """``postgresql://user:pw@host/db`` -> ``postgresql://user:***@host/db``; anything else unchanged."""
    if not isinstance(url, str) or "@" not in url:
        return url
    return _URL_PASSWORD.sub(lambda m: m["pre"] + MASK + "@", url)


def redact(text: Any) -> Any:
    """``text`` with URL passwords, ``key=value`` secrets, bearer and hub tokens and every registered
    secret masked. Non-strings are returned unchanged."""
    if not isinstance(text, str) or not text:
        return text
    for secret in _snapshot:
        if secret in text:
            text = text.replace(secret, MASK)
    if "@" in text and "://" in text:
        text = _URL_PASSWORD.sub(lambda m: m["pre"] + MASK + "@", text)
    low = text.lower()
    if any(w in low for w in _WORDS):
        text = _KEY_VALUE.sub(lambda m: m["key"] + m["sep"] + m["q"] + (m["val"] if m["val"] == MASK else MASK), text)
    if "bearer" in low:
        text = _BEARER.sub(lambda m: m["pre"] + MASK, text)
    if "c" in text and "_" in text:
        text = _HUB_TOKEN.sub(lambda m: m["pre"] + MASK, text)
    return text


def redact_value(value: Any) -> Any:
    """For reprs: strings redacted, lists/tuples of strings element by element, anything else as is."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redact_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact_value(v) for v in value)
    return value


def format_exception(exc: BaseException, *, chain: bool = True) -> str:
    """The traceback of ``exc`` as Python prints it (no local variables), redacted."""
    return redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__, chain=chain)))

