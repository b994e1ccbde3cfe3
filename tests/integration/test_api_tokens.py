"""API tokens that expire and are revoked (issue 18, item 2: "an expired or revoked token gives a
clear one-line error"): `mesh-hub token create --expires-in`, `token ls`, `token revoke`, the hub's
token cache honouring both, and the SDK's one line for each. A real hub (SQLite) in this process;
the CLI writes the same database, as an operator's shell would. Store-level behaviour on both
backends is in test_store.py."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from cloud_hub.service.hub import TOKEN_RECHECK_S
from cloud_hub.cli import app
from cloud_hub.client import AuthError, Client, Executor
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from mesh_agent.cli import enroll

pytestmark = pytest.mark.integration
runner = CliRunner()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Any]:
    with HubThread(HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*",
                             bootstrap_user="alice")) as h:
        yield h


def _cli(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return r.exit_code, r.stdout, r.stderr


def _refused(url: str, token: str, deadline_s: float) -> AuthError:
    """Poll until the hub refuses the token (a loose bound: revocation holds within TOKEN_RECHECK_S)."""
    end = time.monotonic() + deadline_s
    with Client(url, token, timeout=10) as c:
        while time.monotonic() < end:
            try:
                c.list_endpoints()
            except AuthError as exc:
                return exc
            time.sleep(0.2)
    raise AssertionError(f"the hub still accepted the token after {deadline_s} s")


def _rows(db: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as c:
        return sorted(c.execute("SELECT t.hash, t.user_id, t.name, t.created, t.expires, t.revoked FROM api_tokens t").fetchall()) + \
            sorted(c.execute("SELECT id, name FROM users").fetchall())


def test_an_expired_token_is_refused_with_one_line_saying_so(hub: Any) -> None:
    db = str(hub.cfg.db_path)
    code, out, err = _cli("token", "create", "--user", "bob", "--name", "short", "--expires-in", "4s", "--db", db)
    assert code == 0, err
    tok = out.strip()
    assert tok.startswith("cm_") and "\n" not in tok, "stdout is the token alone (scripts capture it)"
    assert "token id tk_" in err and "expires" in err
    with Client(hub.url, tok) as c:
        assert c.list_endpoints() == []  # good until it expires (and now cached by the hub)
    exc = _refused(hub.url, tok, 60)
    line = str(exc)
    assert "\n" not in line
    assert f"the hub at {hub.url} refused the token: API token tk_" in line and " expired at " in line
    assert "it expired" in line and "`mesh-hub token create`" in line and f"`mesh-hub login --url {hub.url}`" in line
    # the Executor says the same, at construction (no submit waits on a token that cannot work)
    with pytest.raises(AuthError, match="expired at .*mesh-hub login"):
        Executor(Client(hub.url, tok), endpoint_id="auto")
    # `token ls` shows it expired; the token itself is stored nowhere (only its SHA-256)
    code, out, _ = _cli("token", "ls", "--user", "bob", "--db", db)
    assert code == 0 and "short" in out and "expired" in out, out
    with sqlite3.connect(db) as c:
        assert not any(tok in str(v) for row in c.execute("SELECT * FROM api_tokens") for v in row)


def test_a_revoked_token_is_refused_on_rest_and_the_stream(hub: Any, tmp_path: Path) -> None:
    db = str(hub.cfg.db_path)
    code, out, err = _cli("token", "create", "--user", "carol", "--name", "laptop", "--db", db)
    assert code == 0, err
    tok = out.strip()
    with Client(hub.url, tok) as c:
        ep = enroll(hub.url, c.create_enrollment_token(), "pi", tmp_path / "agent.yaml", transport="zmq").endpoint_id
    ex = Executor(Client(hub.url, tok, timeout=10), endpoint_id=ep, submit_timeout_s=60)  # stream open, token cached
    try:
        first = ex.submit(abs, -1)  # accepted over the stream (no agent runs it: only its acceptance matters)
        end = time.monotonic() + 60
        while getattr(first, "task_id", None) is None and not first.done() and time.monotonic() < end:
            time.sleep(0.05)
        assert getattr(first, "task_id", None) and ex._stream is not None and ex._stream.submits >= 1
        code, out, _ = _cli("token", "ls", "--user", "carol", "--db", db)
        line = next(ln for ln in out.splitlines() if "laptop" in ln)
        tid = re.search(r"tk_[0-9a-f]{12}", line).group(0)  # type: ignore[union-attr]
        assert "good" in line, out
        code, out, err = _cli("token", "revoke", tid[:9], "--db", db)  # a unique prefix: tk_ + 6 digits
        assert code == 0 and f"revoked token {tid} (laptop)" in out, out + err
        exc = _refused(hub.url, tok, 10 * TOKEN_RECHECK_S)
        line = str(exc)
        assert "\n" not in line and f"API token {tid} was revoked at " in line and "it was revoked" in line
        assert "`mesh-hub token create`" in line and "mesh-hub login" in line
        # a submit on the Executor opened before the revocation fails with the same line, not retried for 60 s
        err_seen = ex.submit(abs, -2).exception(timeout=60)
        assert isinstance(err_seen, AuthError) and "was revoked at" in str(err_seen), err_seen
        # revoking again changes nothing
        before = _rows(hub.cfg.db_path)
        code, out, _ = _cli("token", "revoke", tid, "--db", db)
        assert code == 0 and "already revoked" in out
        assert _rows(hub.cfg.db_path) == before
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    # the other tokens still work
    with Client(hub.url, hub.token) as c:
        assert c.list_endpoints() == []


def test_bad_token_commands_say_why_and_change_nothing(hub: Any, tmp_path: Path) -> None:
    db = str(hub.cfg.db_path)
    code, out, _ = _cli("token", "create", "--user", "dave", "--db", db)
    assert code == 0
    before = _rows(hub.cfg.db_path)
    cases = [
        (("token", "create", "--user", "erin", "--expires-in", "5y", "--db", db), "is not a duration: use e.g. 90s, 30m, 12h, 30d"),
        (("token", "create", "--user", "erin", "--expires-in", "-1h", "--db", db), "is not a duration"),
        (("token", "create", "--user", "erin", "--expires-in", "", "--db", db), "is not a duration"),
        (("token", "create", "--user", "erin", "--expires-in", "0s", "--db", db), "must be more than 0"),
        (("token", "revoke", "tk_0123456789ab", "--db", db), "no API token 'tk_0123456789ab' (see `mesh-hub token ls`)"),
        (("token", "revoke", "cm_not-a-real-token", "--db", db), "no API token 'cm_not-a-real-token'"),
        (("token", "revoke", "tk_12", "--db", db), "is not a token id: give the id `mesh-hub token ls` shows"),
        (("token", "revoke", "tk_%", "--db", db), "is not a token id"),
        (("token", "ls", "--db", str(tmp_path / "nope.sqlite3")), "no such hub database"),
        (("token", "revoke", "tk_0123456789ab", "--db", str(tmp_path / "nope.sqlite3")), "no such hub database"),
    ]
    for args, message in cases:
        code, out, err = _cli(*args)
        assert code == 2 and message in " ".join((out + err).split()), (args, out, err)
    assert _rows(hub.cfg.db_path) == before, "no token revoked or made, no user made"
    assert not (tmp_path / "nope.sqlite3").exists()
    with Client(hub.url, hub.token) as c:
        assert c.list_endpoints() == []
