"""The PostgreSQL store maps placeholders and nothing else (issue 26 item 2): the scanner in
cloud_hub/store/postgres.py (``pg_query``), with no database."""

from __future__ import annotations

import pytest

from cloud_hub.store.postgres import PgQuery, _inserts_into_results, _params, pg_query, to_pg_sql


def test_question_marks_become_positional() -> None:
    assert pg_query("SELECT a FROM t WHERE b=? AND c IN (?, ?)") == PgQuery("SELECT a FROM t WHERE b=%s AND c IN (%s, %s)", False)


def test_nothing_but_placeholders_changes() -> None:
    sql = ("INSERT INTO memo (user_id, key) VALUES (?, ?) ON CONFLICT (user_id, key) DO UPDATE SET key=excluded.key "
           "WHERE memo.rowid > 0 AND x || '' = y")
    assert to_pg_sql(sql) == sql.replace("?", "%s")
    assert to_pg_sql("INSERT OR IGNORE INTO t VALUES (1)") == "INSERT OR IGNORE INTO t VALUES (1)", "no dialect rewriting"


def test_placeholders_inside_string_literals_are_left_alone() -> None:
    assert to_pg_sql("SELECT '?', 'a:b', ':name', '?1' FROM t WHERE x=?") == "SELECT '?', 'a:b', ':name', '?1' FROM t WHERE x=%s"
    assert to_pg_sql("SELECT 'it''s ?', ? FROM t") == "SELECT 'it''s ?', %s FROM t", "a doubled quote stays inside the literal"
    assert to_pg_sql('SELECT "odd?name" FROM t WHERE v=?') == 'SELECT "odd?name" FROM t WHERE v=%s'


def test_placeholders_inside_comments_are_left_alone() -> None:
    assert to_pg_sql("SELECT 1 -- why? see :name\nWHERE x=?") == "SELECT 1 -- why? see :name\nWHERE x=%s"
    assert to_pg_sql("SELECT /* ?, :a */ ?") == "SELECT /* ?, :a */ %s"


def test_percent_is_escaped_everywhere() -> None:
    # psycopg reads % in literals and comments too
    assert to_pg_sql("SELECT name FROM s WHERE name LIKE 'broker_hub:%' AND v % 2 = ?") == \
        "SELECT name FROM s WHERE name LIKE 'broker_hub:%%' AND v %% 2 = %s"
    assert to_pg_sql("SELECT 1 -- 100%") == "SELECT 1 -- 100%%"


def test_numbered_placeholders_become_a_mapping() -> None:
    q = pg_query("UPDATE d SET done=?1, actual=?1 - placed, run=?2 WHERE id=?3")
    assert q == PgQuery("UPDATE d SET done=%(_1)s, actual=%(_1)s - placed, run=%(_2)s WHERE id=%(_3)s", True)
    assert _params(q, (10.0, 2.0, "t1")) == {"_1": 10.0, "_2": 2.0, "_3": "t1"}
    # a plain ? after numbered ones is one more than the highest so far, as in SQLite
    assert pg_query("SELECT ?2, ?, ?1").sql == "SELECT %(_2)s, %(_3)s, %(_1)s"
    plain = pg_query("SELECT ?")
    assert _params(plain, (1,)) == (1,)


def test_named_placeholders() -> None:
    assert pg_query("SELECT * FROM t WHERE a=:a AND b=:b_2") == PgQuery("SELECT * FROM t WHERE a=%(a)s AND b=%(b_2)s", False)
    assert to_pg_sql(":first") == "%(first)s"


def test_casts_and_slices_are_not_placeholders() -> None:
    assert to_pg_sql("SELECT x::text, y::BIGINT FROM t WHERE z=?") == "SELECT x::text, y::BIGINT FROM t WHERE z=%s"
    assert to_pg_sql("SELECT a[lo:hi], a[1:2] FROM t") == "SELECT a[lo:hi], a[1:2] FROM t"


def test_mixing_named_and_positional_is_refused() -> None:
    with pytest.raises(ValueError, match="mixes named and positional"):
        pg_query("SELECT ?, :a")


def test_unterminated_literal_or_comment_is_copied() -> None:
    assert to_pg_sql("SELECT ? -- end") == "SELECT %s -- end"
    assert to_pg_sql("SELECT 'open ?") == "SELECT 'open ?"


def test_cached() -> None:
    sql = "SELECT 1 FROM t WHERE cached_probe=?"
    assert pg_query(sql) is pg_query(sql)


def test_results_lock_detection() -> None:
    assert _inserts_into_results("INSERT INTO results (task_id) VALUES (?) ON CONFLICT (task_id) DO NOTHING")
    assert _inserts_into_results("  insert into results(task_id) SELECT ?")
    assert not _inserts_into_results("INSERT INTO result_cursors (user_id, last) VALUES (?, ?)")
    assert not _inserts_into_results("UPDATE results SET user_seq=? WHERE seq=?")
