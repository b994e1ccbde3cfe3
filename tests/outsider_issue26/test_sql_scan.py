"""Promise 2: all SQL lives in cloud_hub/store; portable upserts; the PostgreSQL adapter maps placeholders only."""

from __future__ import annotations

import ast
import re

import pytest

from tests.outsider_issue26._util import ROOT, py_files

_SQL = re.compile(
    r"^\s*(SELECT\s.+\sFROM\s|INSERT\s+(OR\s+\w+\s+)?INTO\s|UPDATE\s+\w+\s+SET\s|DELETE\s+FROM\s|CREATE\s+(TABLE|INDEX|UNIQUE)|"
    r"ALTER\s+TABLE\s|DROP\s+TABLE\s|PRAGMA\s|BEGIN\b|WITH\s+\w+\s+AS\s*\()",
    re.I | re.S)


def _string_literals(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            yield node.lineno, text


def _docstring_lines(path) -> set[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(first.value.lineno)
    return out


# This check found two leaks (sim/emulate read the hub's SQLite file with its own SELECTs;
# cloud_hub/backup.py ran its own PRAGMAs and BEGIN): both moved into cloud_hub/store
# (store/readback.py, store/backup.py).
@pytest.mark.parametrize("pkg", ["scheduler", "mesh_agent", "fl", "cloud_hub", "sim"])
def test_no_sql_outside_the_store(pkg: str) -> None:
    bad = []
    for p in py_files(pkg):
        rel = str(p.relative_to(ROOT))
        if rel.startswith("cloud_hub/store/"):
            continue
        docs = _docstring_lines(p)
        for line, text in _string_literals(p):
            if line in docs:
                continue
            if _SQL.search(text) and not text.lstrip().upper().startswith("BEGIN") or re.match(r"^\s*BEGIN(\s+(IMMEDIATE|ISOLATION|TRANSACTION))", text, re.I):
                bad.append(f"{rel}:{line}: {text.strip()[:80]!r}")
    # the agent has its own local SQLite (mesh_agent/store.py, site_store.py): report separately, not a hub-store leak
    if pkg == "mesh_agent":
        bad = [b for b in bad if not b.startswith(("mesh_agent/store.py", "mesh_agent/site_store.py", "mesh_agent/refstore.py", "mesh_agent/gateway.py", "mesh_agent/recover.py"))]
    assert bad == [], "\n".join(bad[:40])


def test_store_sql_uses_no_sqlite_only_upserts() -> None:
    bad = []
    for p in py_files("cloud_hub/store"):
        for line, text in _string_literals(p):
            if re.search(r"\bINSERT\s+OR\s+(IGNORE|REPLACE)\b|\bREPLACE\s+INTO\b", text, re.I):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {text.strip()[:80]!r}")
    assert bad == [], bad


def test_postgres_store_has_no_regex_on_statements() -> None:
    src = (ROOT / "cloud_hub/store/postgres.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "re":
            hits.append((node.lineno, node.func.attr, ast.get_source_segment(src, node)))
    # the only allowed use: hiding a password in a URL (_safe)
    bad = [h for h in hits if "://" not in (h[2] or "")]
    assert bad == [], bad
    # and .replace( on statements other than '%' escaping
    reps = [ln for ln in src.splitlines() if re.search(r"sql\w*\.replace\(", ln) and '"%"' not in ln]
    assert reps == [], reps


@pytest.mark.parametrize("sql,params_in,expect_sql", [
    ("SELECT * FROM t WHERE a=? AND b='?x' AND c=?", None, "SELECT * FROM t WHERE a=%s AND b='?x' AND c=%s"),
    ("SELECT 'it''s ?' , ? FROM t", None, "SELECT 'it''s ?' , %s FROM t"),
    ("SELECT a::text FROM t WHERE b=:b", None, "SELECT a::text FROM t WHERE b=%(b)s"),
    ("SELECT 100 % 7, ? FROM t WHERE n LIKE 'a%'", None, "SELECT 100 %% 7, %s FROM t WHERE n LIKE 'a%%'"),
    ("SELECT \"we:ird?\" FROM t -- a ? comment: :x\nWHERE a=?", None, "SELECT \"we:ird?\" FROM t -- a ? comment: :x\nWHERE a=%s"),
    ("SELECT ?2, ?1, ?", None, "SELECT %(_2)s, %(_1)s, %(_3)s"),
    ("/* :x ? */ SELECT :abc_1, x[1:2] FROM t", None, "/* :x ? */ SELECT %(abc_1)s, x[1:2] FROM t"),
])
def test_pg_query_maps_placeholders_only(sql: str, params_in, expect_sql: str) -> None:
    from cloud_hub.store.postgres import pg_query

    assert pg_query(sql).sql == expect_sql


def test_pg_query_refuses_mixed() -> None:
    from cloud_hub.store.postgres import pg_query

    with pytest.raises(ValueError):
        pg_query("SELECT ? , :a")
