"""PostgreSQL for tests: a fresh schema per test in the local server's database ``test``.

The server is the machine's own (127.0.0.1:5432, trust auth; ``scripts/setup-system.sh`` starts it
when it is down). ``MESH_TEST_PG_URL`` points elsewhere. Each test gets its own schema through
libpq's ``options=-csearch_path=...``, dropped afterwards, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

BASE_URL = os.environ.get("MESH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def pg_available() -> str | None:
    """None when usable, else why not."""
    try:
        import psycopg
    except ImportError:
        return "psycopg not installed (pip install -e '.[dev]')"
    try:
        with psycopg.connect(BASE_URL, connect_timeout=3):
            return None
    except psycopg.Error as exc:
        return f"PostgreSQL not reachable at {BASE_URL} ({exc}); ./taskw setup starts it"


@pytest.fixture
def pg_url() -> Iterator[str]:
    why = pg_available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    import psycopg

    schema = "mesh_test_" + uuid.uuid4().hex[:12]
    with psycopg.connect(BASE_URL, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in BASE_URL else "?"
    try:
        yield f"{BASE_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(BASE_URL, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")
