"""The console over plain HTTP against a real hub (real SQLite file, real uvicorn): access control,
sessions, bad input, per-user scoping and the event stream. No browser needed here."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest

from cloud_hub.client import Client
from cloud_hub.config import HubConfig
from cloud_hub.console import live as live_mod
from cloud_hub.server import HubThread
from tests.waiting import wait_for

PAGES = ["/console", "/console/", "/console/endpoints", "/console/endpoints/ep-000000000000", "/console/tasks",
         "/console/tasks?state=failed", "/console/tasks/0123abcd", "/console/functions", "/console/scheduler",
         "/console/fl", "/console/fl/flr-000000000000"]


def station(x: int) -> int:
    return x + 1


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubThread]:
    """One hub for the module (tests use their own users where they change state)."""
    cfg = HubConfig(db_path=tmp_path_factory.mktemp("console-http") / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="demo")
    h = HubThread(cfg).start()
    try:
        yield h
    finally:
        h.stop()


def _db(h: HubThread) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{h.cfg.db_path}?mode=ro", uri=True)


def _sessions(h: HubThread) -> int:
    with _db(h) as db:
        return db.execute("SELECT COUNT(*) FROM console_sessions").fetchone()[0]


def _sign_in(h: HubThread, token: str) -> httpx.Client:
    c = httpx.Client(base_url=h.url, follow_redirects=False, timeout=30)
    r = c.post("/console/login", data={"token": token})
    assert r.status_code == 303, r.text
    return c


def _csrf(c: httpx.Client) -> str:
    html = c.get("/console/functions").text
    return html.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def _token_for(h: HubThread, user: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "token", "create", "--user", user, "--db", str(h.cfg.db_path)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_every_page_and_the_stream_refuse_anonymous_access(hub: HubThread) -> None:
    with httpx.Client(base_url=hub.url, follow_redirects=False, timeout=10) as anon:
        for path in PAGES:
            r = anon.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/console/login?next="), path
            assert anon.get(path, headers={"X-Console-Live": "1"}).status_code == 401, path
            # an API token is for the REST API; the console wants its own session
            assert anon.get(path, headers={"Authorization": f"Bearer {hub.token}"}).status_code == 303, path
            assert anon.get(path, cookies={"cm_console": "forged-session-id"}).status_code == 303, path
        for cookies in ({}, {"cm_console": "forged-session-id"}, {"cm_console": "x" * 500}):
            r = anon.get("/console/events", cookies=cookies)
            assert r.status_code == 401 and "event:" not in r.text
        # the sign-in page and static assets are public (they hold nothing of anyone's)
        assert anon.get("/console/login").status_code == 200
        assert anon.get("/console/static/console.css").status_code == 200
        assert anon.get("/console/static/../api/app.py").status_code == 404


def test_bad_sign_ins_are_refused_and_store_nothing(hub: HubThread) -> None:
    before = _sessions(hub)
    with httpx.Client(base_url=hub.url, follow_redirects=False, timeout=10) as c:
        cases = [
            ({"token": "cm_wrong"}, {}, 401, "Unknown or revoked API token"),
            ({"token": "   "}, {}, 422, "Enter an API token"),
            ({}, {}, 422, "Enter an API token"),
            ({"token": "cm_" + "a" * 600}, {}, 422, "too long"),
            ({"token": hub.token}, {"Origin": "https://evil.example"}, 403, "another site"),
            ({"token": hub.token}, {"Origin": "null"}, 403, "another site"),
        ]
        for data, headers, status, message in cases:
            r = c.post("/console/login", data=data, headers=headers)
            assert r.status_code == status, (data, headers, r.text)
            assert message in r.text
            assert "set-cookie" not in r.headers
        assert _sessions(hub) == before


def test_session_cookie_sign_out_and_revocation(hub: HubThread) -> None:
    token = _token_for(hub, "carol")
    before = _sessions(hub)
    c = httpx.Client(base_url=hub.url, follow_redirects=False, timeout=10)
    r = c.post("/console/login", data={"token": token, "next": "/console/tasks"}, headers={"Origin": hub.url})
    assert r.status_code == 303 and r.headers["location"] == "/console/tasks"
    cookie = r.headers["set-cookie"]
    for attr in ("HttpOnly", "SameSite=strict", "Path=/console"):
        assert attr.lower() in cookie.lower()
    sid = c.cookies["cm_console"]
    with _db(hub) as db:
        stored = [row[0] for row in db.execute("SELECT hash FROM console_sessions s JOIN users u ON u.id=s.user_id WHERE u.name='carol'")]
    assert stored == [hashlib.sha256(sid.encode()).hexdigest()], "only the hash of the session id is stored"
    page = c.get("/console/tasks")
    assert page.status_code == 200
    for header in ("content-security-policy", "x-frame-options", "x-content-type-options"):
        assert header in page.headers
    assert "script-src 'self'" in page.headers["content-security-policy"]

    # sign-out needs the page's form token
    assert c.post("/console/logout", data={"csrf": "wrong"}).status_code == 403
    assert c.get("/console/tasks").status_code == 200
    r = c.post("/console/logout", data={"csrf": _csrf(c)})
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    assert _sessions(hub) == before
    c.cookies.set("cm_console", sid, path="/console")  # a copied cookie is dead too
    assert c.get("/console/tasks").status_code == 303

    # deleting the API token a session was opened with ends that session
    c2 = _sign_in(hub, token)
    assert c2.get("/console").status_code == 200
    with sqlite3.connect(hub.cfg.db_path) as db:
        db.execute("DELETE FROM api_tokens WHERE hash=?", (hashlib.sha256(token.encode()).hexdigest(),))
    assert c2.get("/console").status_code == 303


def test_next_parameter_is_not_an_open_redirect(hub: HubThread) -> None:
    with httpx.Client(base_url=hub.url, follow_redirects=False, timeout=10) as c:
        for target in ("https://evil.example/", "//evil.example/console", "/v1/endpoints", "/console\\@evil", ""):
            r = c.post("/console/login", data={"token": hub.token, "next": target})
            assert r.status_code == 303 and r.headers["location"] == "/console", target


def test_bad_page_parameters_get_a_clear_error(hub: HubThread) -> None:
    c = _sign_in(hub, hub.token)
    for path, message in [
        ("/console/tasks?state=exploded", "unknown task state"),
        ("/console/tasks?before=12abc", "bad page cursor"),
        ("/console/tasks?before=" + "9" * 40, "bad page cursor"),
        ("/console/endpoints/ep-000000000000?window=5y", "unknown window"),
    ]:
        r = c.get(path)
        assert r.status_code == 400 and message in r.text, path
    assert c.get("/console/endpoints/ep-000000000000").status_code == 404
    assert c.get("/console/tasks/not-a-task").status_code == 404


def test_users_see_only_their_own_endpoints_tasks_and_functions(hub: HubThread) -> None:
    alice = Client(hub.url, hub.token)
    import zmq

    enroll = httpx.post(f"{hub.url}/v1/endpoints/enroll", json={"token": alice.create_enrollment_token(), "name": "alice-pi",
                                                                "transport": "zmq", "curve_public": zmq.curve_keypair()[0].decode()})
    assert enroll.status_code == 201, enroll.text
    ep = enroll.json()["endpoint_id"]
    fid = alice.register_function(station, name="alice_station")
    tid = alice.submit(ep, fid, 1)
    alice.close()

    a = _sign_in(hub, hub.token)
    assert "alice-pi" in a.get("/console/endpoints").text
    assert "alice_station" in a.get("/console/functions").text
    assert tid in a.get("/console/tasks").text
    detail = a.get(f"/console/tasks/{tid}")
    assert detail.status_code == 200 and "queued at hub" in detail.text

    b = _sign_in(hub, _token_for(hub, "bob"))
    assert "alice-pi" not in b.get("/console/endpoints").text
    assert "alice_station" not in b.get("/console/functions").text
    assert tid not in b.get("/console/tasks").text
    assert tid not in b.get(f"/console/tasks?endpoint={ep}").text
    assert b.get(f"/console/tasks/{tid}").status_code == 404
    assert b.get(f"/console/endpoints/{ep}").status_code == 404
    snap = _first_snapshot(b)
    assert snap["endpoints"] == [] and snap["total"] == 0
    assert _first_snapshot(a)["counts"]["queued"] == 1


def _first_snapshot(c: httpx.Client) -> dict:
    with c.stream("GET", "/console/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "snapshot":
                return json.loads(line[6:])
    raise AssertionError("no snapshot")


def test_event_stream_ends_on_sign_out_and_is_bounded(hub: HubThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_mod, "RECHECK_SESSION_S", 0.2)
    c = _sign_in(hub, hub.token)
    csrf = _csrf(c)
    seen: list[str] = []
    with c.stream("GET", "/console/events") as r:
        lines = r.iter_lines()
        for line in lines:
            seen.append(line)
            if line.startswith("data: "):
                break
        other = httpx.Client(base_url=hub.url, cookies={"cm_console": c.cookies["cm_console"]}, follow_redirects=False)
        assert other.post("/console/logout", data={"csrf": csrf}).status_code == 303
        deadline = time.monotonic() + 10
        for line in lines:  # the server ends the stream; the loop ends with it
            seen.append(line)
            assert time.monotonic() < deadline
    assert seen[0] == "retry: 2000"
    assert "event: signout" in seen

    # a session holds at most MAX_STREAMS_PER_SESSION streams: a new tab's stream ends the oldest
    monkeypatch.setattr(live_mod, "MAX_STREAMS_PER_SESSION", 1)
    c = _sign_in(hub, hub.token)
    twin = httpx.Client(base_url=hub.url, cookies={"cm_console": c.cookies["cm_console"]}, timeout=30)
    with c.stream("GET", "/console/events") as old:
        old_lines = old.iter_lines()
        assert next(old_lines) == "retry: 2000"
        with twin.stream("GET", "/console/events") as new:
            new_lines = new.iter_lines()  # (a dropped line iterator would close the stream)
            assert next(new_lines) == "retry: 2000"
            rest = list(old_lines)  # ends: evicted by the newer stream
            assert all(not line.startswith("event: signout") for line in rest)

    # closed connections free their slots (noticed within about a second)
    live = hub.server.config.app.state.console_live
    deadline = time.monotonic() + 10
    while live.open_streams and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live.open_streams == 0

    # at most MAX_STREAMS in all: the next one is told to come back later
    monkeypatch.setattr(live_mod, "MAX_STREAMS", 1)
    c = _sign_in(hub, hub.token)
    with c.stream("GET", "/console/events") as first:
        assert first.status_code == 200
        first_lines = first.iter_lines()
        assert next(first_lines) == "retry: 2000"
        second = c.get("/console/events")
        assert second.status_code == 503 and "at most 1" in second.text


def test_scheduler_and_fl_pages_appear_only_with_data_and_only_for_their_owner(hub: HubThread) -> None:
    dora_token = _token_for(hub, "dora")
    dora = _sign_in(hub, dora_token)
    home = dora.get("/console").text
    assert 'href="/console/scheduler"' not in home and 'href="/console/fl"' not in home
    assert "No placement decisions yet" in dora.get("/console/scheduler").text  # a clear empty state, not an error
    assert "No federated-learning runs yet" in dora.get("/console/fl").text
    assert dora.get("/console/fl/flr-000000000000").status_code == 404
    assert dora.get("/console/scheduler?before=abc").status_code == 400

    with Client(hub.url, dora_token) as sdk:
        run = sdk.fl_create_run("dora-run", strategy="fedavg", rounds_planned=3, clients=["ep-a"], client_names={"ep-a": "pi-a"})
    wait_for(lambda: 'href="/console/fl"' in dora.get("/console").text, "the nav showing FL runs once one exists", 5, step=0.2)
    page = dora.get(f"/console/fl/{run['id']}")
    assert page.status_code == 200 and "dora-run" in page.text and "No rounds finished yet" in page.text

    erin = _sign_in(hub, _token_for(hub, "erin"))
    assert 'href="/console/fl"' not in erin.get("/console").text
    assert erin.get(f"/console/fl/{run['id']}").status_code == 404
    assert "dora-run" not in erin.get("/console/fl").text


def test_fl_run_page_shows_model_traffic_per_round(hub: HubThread) -> None:
    import numpy as np

    from fl.wire import encode_weights

    token = _token_for(hub, "fiona")
    page_client = _sign_in(hub, token)
    rec = {"round": 1, "loss": 0.5, "accuracy": 0.8, "participants": ["ep-a"], "stragglers": [], "dropped": {}, "round_time_s": 1.0,
           "extra": {"bytes_up": {"ep-a": 1843}, "bytes_down": {"ep-a": 17345}, "bytes_up_total": 1843, "bytes_down_total": 17345}}
    with Client(hub.url, token) as sdk:
        run = sdk.fl_create_run("fiona-run", strategy="fedavg", rounds_planned=2, clients=["ep-a"], config={"compression": "topk:0.25+q8"})
        sdk.fl_put_round(run["id"], 1, rec, encode_weights([np.zeros(2, np.float32)]))
    page = page_client.get(f"/console/fl/{run['id']}").text
    assert "Traffic ↑ / ↓" in page and "1.8 KiB / 16.9 KiB" in page and "uplink compression topk:0.25+q8" in page


def test_fl_run_page_shows_bytes_per_client_per_round(hub: HubThread) -> None:
    """Issue 11: the up/down figures of each client in each round, next to the round's totals;
    a secure round's masked vectors count like plain updates; a client with no update back shows a dash."""
    import re

    import numpy as np

    from fl.wire import encode_weights

    token = _token_for(hub, "gwen")
    page_client = _sign_in(hub, token)
    r1 = {"round": 1, "loss": 0.5, "accuracy": 0.8, "participants": ["ep-a", "ep-b"], "stragglers": ["ep-c"], "dropped": {},
          "round_time_s": 1.0, "extra": {"bytes_up": {"ep-a": 3072, "ep-b": 5120}, "bytes_down": {"ep-a": 20480, "ep-b": 20480, "ep-c": 20480},
                                          "bytes_up_total": 8192, "bytes_down_total": 61440}}
    r2 = {"round": 2, "loss": 0.4, "accuracy": 0.85, "participants": ["ep-a", "ep-b"], "stragglers": [], "dropped": {},
          "round_time_s": 1.0, "extra": {"secure_aggregation": True, "secagg_field_bits": 16,
                                          "bytes_up": {"ep-a": 1536, "ep-b": 1536}, "bytes_down": {"ep-a": 10240, "ep-b": 10240},
                                          "bytes_up_total": 3072, "bytes_down_total": 20480}}
    with Client(hub.url, token) as sdk:
        run = sdk.fl_create_run("gwen-run", strategy="fedavg", rounds_planned=2, clients=["ep-a", "ep-b", "ep-c"],
                                client_names={"ep-a": "alpha", "ep-b": "bravo", "ep-c": "charlie"}, config={"compression": "q8"})
        sdk.fl_put_round(run["id"], 1, r1, encode_weights([np.zeros(2, np.float32)]))
        sdk.fl_put_round(run["id"], 2, r2, encode_weights([np.zeros(2, np.float32)]))
    page = page_client.get(f"/console/fl/{run['id']}").text
    assert "8.0 KiB / 60.0 KiB" in page and "3.0 KiB / 20.0 KiB" in page  # the totals stay

    def row(rnd: int, client: str) -> str:
        block = page.split(f'data-key="traffic-{rnd}"', 1)[1].split("</details>", 1)[0]
        m = re.search(rf'<tr data-client="{client}">(.*?)</tr>', block, re.S)
        assert m, (rnd, client)
        return re.sub(r"<[^>]+>", " ", m.group(1)).split()

    assert row(1, "ep-a") == ["alpha", "3.0", "KiB", "20.0", "KiB"]
    assert row(1, "ep-b") == ["bravo", "5.0", "KiB", "20.0", "KiB"]
    assert row(1, "ep-c") == ["charlie", "–", "20.0", "KiB"]  # a straggler: sent the model, nothing back
    assert row(2, "ep-a") == ["alpha", "1.5", "KiB", "10.0", "KiB"]
    assert 'data-client="ep-c"' not in page.split('data-key="traffic-2"', 1)[1].split("</details>", 1)[0]
