"""Globus Auth bearer tokens for the hub's REST API, next to its own API tokens.

Users of research computing sign in with their institution through Globus Auth; their apps then
send a Globus access token whose audience is this hub (a Globus confidential client registered
as the hub's resource server). The hub asks Globus about each token through globus-sdk's token
introspection and maps the identity to a hub user:

* ``globus_users`` maps a Globus username (``alice@uchicago.edu``) to a hub user name;
* otherwise, a username whose domain is in ``globus_allowed_domains`` gets the hub user of the
  same name, created on first use;
* anyone else is refused, with a message that says so.

Checks, and why: ``active`` (not revoked or expired), ``exp`` in the future, our client id in
``aud`` (a token minted for another service must not work here), and, when configured,
``globus_scope`` among the token's scopes. Answers, good or bad, are cached for
``globus_cache_s`` seconds (never past the token's expiry) keyed by the token's SHA-256, so a
busy client does not cost one Globus round trip per request and a bad token cannot make the hub
hammer Globus. Hub API tokens (``cm_...``) are never sent to Globus.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

__all__ = ["GlobusAuth", "GlobusUnavailable", "Verdict"]

log = logging.getLogger("cloud_hub.globus")

_CACHE_MAX = 10_000


class GlobusUnavailable(RuntimeError):
    """Globus Auth could not be asked (network, 5xx): the token is neither good nor bad yet."""


@dataclass(frozen=True)
class Verdict:
    user_id: str | None  # None: refused
    reason: str  # why refused, or the Globus username when accepted
    until: float  # monotonic time this verdict may be reused until


class GlobusAuth:
    """Token introspection with a small cache; ``user_for`` is what the auth dependency calls."""

    def __init__(
        self,
        client_id: str,
        client_secret: str,
        create_user: Callable[[str], Awaitable[str]],
        *,
        required_scope: str | None = None,
        allowed_domains: list[str] | None = None,
        users: dict[str, str] | None = None,
        cache_s: float = 60.0,
    ) -> None:
        import globus_sdk
        from globus_sdk.transport import RetryConfig

        self.client_id = client_id
        # The base URL comes from GLOBUS_SDK_ENVIRONMENT / GLOBUS_SDK_SERVICE_URL_AUTH when set.
        self._client = globus_sdk.ConfidentialAppAuthClient(client_id, client_secret, retry_config=RetryConfig(max_retries=2, max_sleep=2))
        self._create_user = create_user
        self._scope = required_scope
        self._domains = {d.lower().lstrip("@") for d in (allowed_domains or [])}
        self._users = {k.lower(): v for k, v in (users or {}).items()}
        self._cache_s = cache_s
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self.introspections = 0  # for tests and the status page

    async def user_for(self, token: str) -> Verdict:
        """The hub user a Globus access token stands for (``user_id`` None when refused)."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit.until > now:
            self._cache.move_to_end(key)
            return hit
        info = await asyncio.to_thread(self._introspect, token)
        verdict = await self._judge(info, now)
        self._cache[key] = verdict
        while len(self._cache) > _CACHE_MAX:
            self._cache.popitem(last=False)
        return verdict

    def _introspect(self, token: str) -> dict[str, Any]:
        import globus_sdk

        self.introspections += 1
        try:
            return dict(self._client.oauth2_token_introspect(token).data)
        except globus_sdk.GlobusAPIError as exc:
            if exc.http_status in (400, 401, 403):  # the hub's own client credentials are wrong
                log.error("Globus Auth refused the hub's client credentials: %s", exc)
                raise GlobusUnavailable(f"Globus Auth refused the hub's client ({exc.http_status}); see the hub log") from None
            raise GlobusUnavailable(f"Globus Auth error {exc.http_status}") from None
        except globus_sdk.GlobusError as exc:
            raise GlobusUnavailable(f"Globus Auth unreachable: {exc}") from None

    async def _judge(self, info: dict[str, Any], now: float) -> Verdict:
        wall = time.time()

        def refuse(reason: str) -> Verdict:
            return Verdict(None, reason, now + min(self._cache_s, 10.0))

        if not info.get("active"):
            return refuse("Globus token is not active (expired or revoked)")
        exp = float(info.get("exp") or 0)
        if exp <= wall:
            return refuse("Globus token has expired")
        aud = info.get("aud") or []
        if isinstance(aud, str):
            aud = [aud]
        if self.client_id not in aud:
            return refuse("Globus token was not issued for this hub (audience)")
        if self._scope and self._scope not in str(info.get("scope", "")).split():
            return refuse(f"Globus token lacks the scope {self._scope}")
        username = str(info.get("username") or "").lower()
        if not username:
            return refuse("Globus token carries no identity")
        name = self._users.get(username)
        if name is None and username.rpartition("@")[2] in self._domains:
            name = username
        if name is None:
            return refuse(f"Globus identity {username} is not allowed on this hub")
        uid = await self._create_user(name)
        return Verdict(uid, username, now + min(self._cache_s, exp - wall))
