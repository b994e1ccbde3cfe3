"""The hub's embedded store (cloud_hub.kv): the pure key space with an injected clock, and the
real server over redis-py: per-user scoping, credentials, expiry, the byte budget, BLPOP handoff,
and bad input that changes nothing."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

from cloud_hub.kv.keyspace import Block, Keyspace, KVError, Status

redis = pytest.importorskip("redis")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_keyspace_expiry_is_exact_with_the_clock() -> None:
    c = Clock()
    ks = Keyspace(clock=c)
    assert ks.execute("u", [b"SET", b"k", b"v", b"PX", b"1500"]) == Status("OK")
    c.t += 1.4
    assert ks.execute("u", [b"GET", b"k"]) == b"v"
    assert ks.execute("u", [b"PTTL", b"k"]) == 100
    c.t += 0.2
    assert ks.execute("u", [b"GET", b"k"]) is None
    assert ks.used == 0 and ks.dbsize("u") == 0


def test_expire_takes_redis_7s_options() -> None:
    """LT only shortens (a task's copy of a program's object never keeps it alive), GT only
    lengthens, NX only where there is no expiry, XX only where there is; a key without one counts
    as an infinite expiry."""
    c = Clock()
    ks = Keyspace(clock=c)
    ks.execute("u", [b"SET", b"k", b"v"])
    assert ks.execute("u", [b"EXPIRE", b"k", b"10", b"LT"]) == 1  # none yet: infinite, so 10 s is less
    assert ks.execute("u", [b"EXPIRE", b"k", b"20", b"LT"]) == 0 and ks.execute("u", [b"TTL", b"k"]) == 10
    assert ks.execute("u", [b"EXPIRE", b"k", b"5", b"lt"]) == 1 and ks.execute("u", [b"TTL", b"k"]) == 5
    assert ks.execute("u", [b"EXPIRE", b"k", b"3", b"GT"]) == 0 and ks.execute("u", [b"EXPIRE", b"k", b"30", b"GT"]) == 1
    assert ks.execute("u", [b"EXPIRE", b"k", b"9", b"NX"]) == 0 and ks.execute("u", [b"EXPIRE", b"k", b"9", b"XX"]) == 1
    assert ks.execute("u", [b"TTL", b"k"]) == 9
    with pytest.raises(KVError):
        ks.execute("u", [b"EXPIRE", b"k", b"9", b"SOON"])
    assert ks.execute("u", [b"TTL", b"k"]) == 9  # a bad option changes nothing


def test_keyspace_users_are_separate_and_types_are_checked() -> None:
    ks = Keyspace(clock=Clock())
    ks.execute("alice", [b"RPUSH", b"q", b"1", b"2"])
    assert ks.execute("bob", [b"LLEN", b"q"]) == 0
    assert ks.execute("bob", [b"KEYS", b"*"]) == []
    with pytest.raises(KVError, match="WRONGTYPE"):
        ks.execute("alice", [b"GET", b"q"])
    assert ks.execute("alice", [b"BLPOP", b"empty", b"0"]) == Block((b"empty",), 0.0)
    assert ks.execute("alice", [b"BLPOP", b"empty", b"q", b"1"]) == [b"q", b"1"]


def test_keyspace_budget_refuses_whole_and_changes_nothing() -> None:
    ks = Keyspace(clock=Clock(), max_bytes=1000, max_value_bytes=600)
    ks.execute("u", [b"SET", b"a", b"x" * 500])
    used = ks.used
    with pytest.raises(KVError, match="OOM .* full"):
        ks.execute("u", [b"RPUSH", b"l", b"y" * 250, b"z" * 250])
    with pytest.raises(KVError, match="OOM value of 701 bytes"):
        ks.execute("u", [b"SET", b"b", b"y" * 700])
    assert ks.used == used and ks.execute("u", [b"EXISTS", b"l", b"b"]) == 0
    ks.execute("u", [b"DEL", b"a"])
    assert ks.used == 0


def test_keyspace_bad_commands_are_clear_errors() -> None:
    ks = Keyspace(clock=Clock())
    with pytest.raises(KVError, match="unknown command 'FLUSHALL'"):
        ks.execute("u", [b"FLUSHALL"])
    with pytest.raises(KVError, match="wrong number of arguments for 'get'"):
        ks.execute("u", [b"GET"])
    with pytest.raises(KVError, match="NOSCRIPT .* only the mesh's own scripts"):
        ks.execute("u", [b"EVAL", b"return 1", b"0"])
    with pytest.raises(KVError, match="not an integer"):
        ks.execute("u", [b"EXPIRE", b"k", b"soon"])
    assert ks.dbsize("u") == 0


@pytest.fixture(scope="module")
def kv() -> Iterator[object]:
    from tests.kv_thread import KVThread

    t = KVThread(max_bytes=1 << 20, max_value_bytes=256 << 10)
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.parametrize("protocol", [2, 3])
def test_server_speaks_redis_to_redis_py(kv: object, protocol: int) -> None:
    r = redis.Redis.from_url(kv.url("alice"), protocol=protocol)  # type: ignore[attr-defined]
    p = r.pipeline()
    p.set("k", b"v", ex=60).hset("h", mapping={"a": "1"}).sadd("s", "x").rpush("l", "a", "b")
    assert p.execute() == [True, 1, 1, 2]
    assert r.get("k") == b"v" and r.hgetall("h") == {b"a": b"1"} and r.smembers("s") == {b"x"}
    assert r.lrange("l", 0, -1) == [b"a", b"b"] and 0 < r.ttl("k") <= 60
    r.delete("k", "h", "s", "l")


def test_server_scopes_users_and_refuses_bad_credentials(kv: object) -> None:
    a = redis.Redis.from_url(kv.url("alice"))  # type: ignore[attr-defined]
    b = redis.Redis.from_url(kv.url("bob"))  # type: ignore[attr-defined]
    a.set("mesh:ref:secret", b"alice's")
    assert b.get("mesh:ref:secret") is None and b.keys("*") == []
    forged = kv.url("bob").replace("bob:", "alice:")  # type: ignore[attr-defined]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(forged).get("mesh:ref:secret")
    assert a.get("mesh:ref:secret") == b"alice's"
    a.delete("mesh:ref:secret")


def test_server_budget_error_reaches_the_client_and_stores_nothing(kv: object) -> None:
    r = redis.Redis.from_url(kv.url("carol"))  # type: ignore[attr-defined]
    with pytest.raises(redis.ResponseError, match="value of 307203 bytes is over the embedded store.s limit"):
        r.set("big", b"x" * (300 << 10))
    assert r.dbsize() == 0


def test_blpop_wakes_in_arrival_order_and_times_out(kv: object) -> None:
    url = kv.url("dave")  # type: ignore[attr-defined]
    got: list[object] = []

    def waiter(i: int) -> None:
        got.append((i, redis.Redis.from_url(url).blpop(["q"], timeout=30)))

    ts = [threading.Thread(target=waiter, args=(i,)) for i in range(2)]
    ts[0].start()
    r = redis.Redis.from_url(url)
    for _ in range(500):  # bounded: until the first waiter is parked
        if kv.server._waiters:  # type: ignore[attr-defined]
            break
        threading.Event().wait(0.01)
    ts[1].start()
    for _ in range(500):
        if len(kv.server._waiters.get(("dave", b"q"), ())) == 2:  # type: ignore[attr-defined]
            break
        threading.Event().wait(0.01)
    r.rpush("q", "first", "second")
    for t in ts:
        t.join(30)
    assert sorted(got) == [(0, (b"q", b"first")), (1, (b"q", b"second"))]
    assert r.blpop(["q"], timeout=0.1) is None


def test_a_refused_login_is_one_clear_error_without_retrying(kv: object) -> None:
    from cloud_hub.client import refs

    forged = kv.url("erin").replace("erin:", "erin:0")  # type: ignore[attr-defined]
    with pytest.raises(ConnectionError, match="refused this login") as e:
        refs.Store(forged).put(b"x")
    assert "erin:0" not in str(e.value)  # the credential is not printed
    assert redis.Redis.from_url(kv.url("erin")).dbsize() == 0  # type: ignore[attr-defined]


def _raw(kv: object, payload: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", kv.server.port), timeout=10) as s:  # type: ignore[attr-defined]
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        for _ in range(100):  # bounded: until the server closes
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def test_bad_wire_input_is_an_error_reply_and_changes_nothing(kv: object) -> None:
    before = kv.server.keys.used  # type: ignore[attr-defined]
    assert _raw(kv, b"SET k v\r\n").startswith(b"-NOAUTH")  # no login: nothing runs
    assert _raw(kv, b"*2\r\n$3\r\nGET\r\n$x\r\n").startswith(b"-ERR Protocol error")
    assert _raw(kv, b"*999999999\r\n").startswith(b"-ERR Protocol error: invalid multibulk length")
    user, cred = "frank", kv.url("frank").split("//", 1)[1].split("@")[0].split(":")[1]  # type: ignore[attr-defined]
    login = b"*3\r\n$4\r\nAUTH\r\n$5\r\nfrank\r\n$40\r\n" + cred.encode() + b"\r\n"
    out = _raw(kv, login + b"*2\r\n$6\r\nSELECT\r\n$1\r\n1\r\n" + b"*1\r\n$11\r\nMESH.RESULT\r\n")
    assert out.startswith(b"+OK\r\n-ERR the embedded store has only DB 0\r\n-ERR wrong number of arguments for 'mesh.result'"), out
    assert kv.server.keys.used == before and kv.server.keys.dbsize(user) == 0  # type: ignore[attr-defined]


# ------------------------------------------------------------------ LMOVE / BLMOVE (the reliable queue's move)
def test_keyspace_lmove_moves_one_item_and_bad_arguments_change_nothing() -> None:
    c = Clock()
    ks = Keyspace(clock=c)
    ks.execute("u", [b"RPUSH", b"q", b"a", b"b", b"c"])
    used = ks.used
    assert ks.execute("u", [b"LMOVE", b"q", b"p", b"LEFT", b"RIGHT"]) == b"a"
    assert ks.execute("u", [b"LMOVE", b"q", b"p", b"right", b"left"]) == b"c"
    assert ks.execute("u", [b"LRANGE", b"p", b"0", b"-1"]) == [b"c", b"a"]
    assert ks.execute("u", [b"LRANGE", b"q", b"0", b"-1"]) == [b"b"]
    assert ks.used == used + len(b"p")  # the moved bytes are counted once, plus the new key
    # a rotation keeps the list and its expiry
    ks.execute("u", [b"EXPIRE", b"p", b"10"])
    assert ks.execute("u", [b"LMOVE", b"p", b"p", b"LEFT", b"RIGHT"]) == b"c"
    assert ks.execute("u", [b"LRANGE", b"p", b"0", b"-1"]) == [b"a", b"c"] and ks.execute("u", [b"TTL", b"p"]) == 10
    # the last item out deletes the source list, as Redis does; an empty source moves nothing
    assert ks.execute("u", [b"LMOVE", b"q", b"p", b"LEFT", b"LEFT"]) == b"b"
    assert ks.execute("u", [b"EXISTS", b"q"]) == 0
    assert ks.execute("u", [b"LMOVE", b"q", b"p", b"LEFT", b"LEFT"]) is None
    # bad arguments: an error, and both lists as they were
    ks.execute("u", [b"RPUSH", b"q", b"x"])
    ks.execute("u", [b"SET", b"s", b"string"])
    before, used = (ks.execute("u", [b"LRANGE", b"q", b"0", b"-1"]), ks.execute("u", [b"LRANGE", b"p", b"0", b"-1"])), ks.used
    with pytest.raises(KVError, match="WRONGTYPE"):
        ks.execute("u", [b"LMOVE", b"q", b"s", b"LEFT", b"RIGHT"])
    with pytest.raises(KVError, match="WRONGTYPE"):
        ks.execute("u", [b"LMOVE", b"s", b"p", b"LEFT", b"RIGHT"])
    with pytest.raises(KVError, match="syntax error"):
        ks.execute("u", [b"LMOVE", b"q", b"p", b"UP", b"RIGHT"])
    with pytest.raises(KVError, match="wrong number of arguments for 'lmove'"):
        ks.execute("u", [b"LMOVE", b"q", b"p", b"LEFT"])
    with pytest.raises(KVError, match="wrong number of arguments for 'blmove'"):
        ks.execute("u", [b"BLMOVE", b"q", b"p", b"LEFT", b"RIGHT", b"1", b"extra"])
    with pytest.raises(KVError, match="timeout is negative"):
        ks.execute("u", [b"BLMOVE", b"q", b"p", b"LEFT", b"RIGHT", b"-1"])
    with pytest.raises(KVError, match="timeout is not a float"):
        ks.execute("u", [b"BLMOVE", b"q", b"p", b"LEFT", b"RIGHT", b"soon"])
    assert (ks.execute("u", [b"LRANGE", b"q", b"0", b"-1"]), ks.execute("u", [b"LRANGE", b"p", b"0", b"-1"])) == before
    assert ks.used == used and ks.execute("u", [b"GET", b"s"]) == b"string"


def test_keyspace_blmove_blocks_like_blpop_and_not_inside_multi() -> None:
    ks = Keyspace(clock=Clock())
    ks.execute("u", [b"RPUSH", b"q", b"a"])
    assert ks.execute("u", [b"BLMOVE", b"q", b"p", b"LEFT", b"RIGHT", b"0"]) == b"a"
    ks.grown.clear()
    # empty: the server parks the caller on the source, to retry the LMOVE when it grows
    parked = Block((b"q",), 1.5, (b"LMOVE", b"q", b"p", b"LEFT", b"RIGHT"))
    assert ks.execute("u", [b"BLMOVE", b"q", b"p", b"LEFT", b"RIGHT", b"1.5"]) == parked
    assert ks.execute("u", [b"BLMOVE", b"q", b"p", b"LEFT", b"RIGHT", b"0"], may_block=False) is None  # in MULTI
    assert ks.execute("u", [b"LRANGE", b"p", b"0", b"-1"]) == [b"a"] and not ks.grown


def test_blmove_wakes_moves_chains_and_times_out(kv: object) -> None:
    url = kv.url("gina")  # type: ignore[attr-defined]
    got: dict[str, object] = {}

    def waiter(name: str, fn: object) -> None:
        got[name] = fn(redis.Redis.from_url(url))  # type: ignore[operator]

    def parked(key: bytes, n: int) -> None:
        for _ in range(500):  # bounded: until the waiters are parked
            if len(kv.server._waiters.get(("gina", key), ())) == n:  # type: ignore[attr-defined]
                return
            threading.Event().wait(0.01)
        raise AssertionError(f"{n} waiter(s) on {key!r} never parked")

    # one BLMOVE waits on q (into p); a BLPOP waits on p: one push on q reaches both, in turn
    ts = [threading.Thread(target=waiter, args=("move", lambda r: r.blmove("q", "p", 30, "LEFT", "RIGHT")))]
    ts[0].start()
    parked(b"q", 1)
    ts.append(threading.Thread(target=waiter, args=("pop", lambda r: r.blpop(["p"], timeout=30))))
    ts[1].start()
    parked(b"p", 1)
    r = redis.Redis.from_url(url)
    r.rpush("q", "item")
    for t in ts:
        t.join(30)
    assert got == {"move": b"item", "pop": (b"p", b"item")}
    assert r.blmove("q", "p", 0.1, "LEFT", "RIGHT") is None and r.exists("q", "p") == 0
    # in a transaction BLMOVE does not block, as in Redis
    assert r.pipeline(transaction=True).blmove("q", "p", 0, "LEFT", "RIGHT").rpush("x", "1").execute() == [None, 1]
    # the destination changed type while the caller waited: it gets the error, the item stays
    t = threading.Thread(target=waiter, args=("typed", lambda r: _error(lambda: r.blmove("q", "s", 30, "LEFT", "RIGHT"))))
    t.start()
    parked(b"q", 1)
    r.set("s", "now a string")
    r.rpush("q", "kept")
    t.join(30)
    assert "WRONGTYPE" in str(got["typed"]) and r.lrange("q", 0, -1) == [b"kept"]
    r.delete("q", "s", "x")


def _error(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except redis.ResponseError as exc:
        return exc
