"""The hub accepts Globus Auth tokens (introspected through globus-sdk) next to its own API tokens.

Globus is a fake on 127.0.0.1 (tests/fakes/globus_api.py); globus-sdk and the hub are real.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from tests.fakes.globus_api import FakeGlobus

pytest.importorskip("globus_sdk")
pytestmark = pytest.mark.integration

HUB_CLIENT, HUB_SECRET, SCOPE = "hub-client-id", "hub-secret", "https://auth.globus.org/scopes/hub-client-id/all"


def _token(username: str, *, aud: str = HUB_CLIENT, scope: str = SCOPE, active: bool = True, exp_in: float = 3600) -> dict:
    return {"active": active, "sub": f"id-{username}", "username": username, "aud": [aud], "scope": scope,
            "exp": int(time.time() + exp_in), "client_id": "some-app"}


@pytest.fixture
def globus(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGlobus]:
    fake = FakeGlobus(clients={HUB_CLIENT: HUB_SECRET}).start()
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    yield fake
    fake.stop()


@pytest.fixture
def hub(tmp_path: Path, globus: FakeGlobus) -> Iterator[HubThread]:
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="ops",
                    globus_client_id=HUB_CLIENT, globus_client_secret=HUB_SECRET, globus_scope=SCOPE,
                    globus_allowed_domains=["uni.edu"], globus_users={"carol@lab.org": "carol"})
    with HubThread(cfg) as h:
        yield h


def _get(hub: HubThread, token: str) -> httpx.Response:
    return httpx.get(f"{hub.url}/v1/endpoints", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_globus_tokens_map_to_hub_users_and_are_cached(hub: HubThread, globus: FakeGlobus) -> None:
    globus.tokens.update({"g-alice": _token("alice@uni.edu"), "g-carol": _token("carol@lab.org")})
    for _ in range(3):
        assert _get(hub, "g-alice").status_code == 200
    assert globus.count("/v2/oauth2/token/introspect") == 1, "answers are cached"
    assert _get(hub, "g-carol").status_code == 200
    # the identity is a hub user like any other: an endpoint token it creates is its own
    r = httpx.post(f"{hub.url}/v1/enrollment-tokens", json={}, headers={"Authorization": "Bearer g-alice"})
    assert r.status_code == 201
    users = {u for (u,) in hub.hub.store._conn().execute("SELECT name FROM users")}  # noqa: SLF001
    assert {"alice@uni.edu", "carol", "ops"} <= users
    # hub API tokens still work and never reach Globus
    before = globus.count("/v2/oauth2/token/introspect")
    assert _get(hub, hub.token).status_code == 200
    assert _get(hub, "cm_not-a-real-token").status_code == 401
    assert globus.count("/v2/oauth2/token/introspect") == before


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        (None, "not active"),
        (_token("alice@uni.edu", active=False), "not active"),
        (_token("alice@uni.edu", exp_in=-5), "expired"),
        (_token("alice@uni.edu", aud="another-service"), "not issued for this hub"),
        (_token("alice@uni.edu", scope="openid email"), "lacks the scope"),
        (_token("mallory@evil.example"), "mallory@evil.example is not allowed"),
    ],
)
def test_bad_globus_tokens_are_refused_with_the_reason(hub: HubThread, globus: FakeGlobus, info: dict | None, reason: str) -> None:
    if info is not None:
        globus.tokens["g-bad"] = info
    users_before = hub.hub.store._conn().execute("SELECT COUNT(*) FROM users").fetchone()[0]  # noqa: SLF001
    r = _get(hub, "g-bad")
    assert r.status_code == 401 and reason in r.json()["detail"], r.text
    assert hub.hub.store._conn().execute("SELECT COUNT(*) FROM users").fetchone()[0] == users_before, "no user created"


def test_globus_outage_is_503_not_401(hub: HubThread, globus: FakeGlobus) -> None:
    globus.tokens["g-alice"] = _token("alice@uni.edu")
    globus.fail_auth = True
    r = _get(hub, "g-alice")
    assert r.status_code == 503 and "Globus Auth" in r.json()["detail"]
    globus.fail_auth = False
    assert _get(hub, "g-alice").status_code == 200, "an outage is not cached as a refusal"
