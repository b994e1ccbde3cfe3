"""Memoization keys (mesh_agent/protocol/memo.py): which calls count as the same call. Pure, no hub."""

from __future__ import annotations

import socket
import threading

import pytest

from mesh_agent.protocol.memo import MemoKeyError, bound_arguments, canonical, memo_key

FID = "a" * 64


def f(x: object, y: int = 2, *rest: object, verbose: bool = False, **extra: object) -> None:
    return None


def key(*args: object, ignore: tuple[str, ...] = (), env: object = None, fid: str = FID, **kwargs: object) -> str:
    return memo_key(fid, bound_arguments(f, args, kwargs), ignore, env)


def test_the_same_call_spelled_differently_has_one_key() -> None:
    assert key(7) == key(x=7) == key(7, 2) == key(x=7, y=2)  # defaults count
    assert key({"a": 1, "b": 2}) == key({"b": 2, "a": 1})
    assert key({3, 1, 2}) == key({2, 3, 1})
    assert key(7, extra1=1, extra2=2) == key(7, extra2=2, extra1=1)


def test_different_calls_have_different_keys() -> None:
    assert len({key(1), key(1.0), key(True), key("1"), key(b"1"), key([1]), key((1,)), key(None)}) == 8
    assert key(7) != key(7, 3) != key(7, 2, "more")
    assert key(7) != key(7, fid="b" * 64), "another function body is another function"
    assert key(7, env={"pip": ["numpy==2.1"]}) != key(7) != key(7, env={"pip": ["numpy==2.2"]})
    assert key(7, env={"env_vars": {"A": "1", "B": "2"}}) == key(7, env={"env_vars": {"B": "2", "A": "1"}})


def test_ignore_for_cache_leaves_named_arguments_out() -> None:
    assert key(7, verbose=True, ignore=("verbose",)) == key(7, verbose=False, ignore=("verbose",))
    assert key(7, verbose=True) != key(7, verbose=False)
    assert key(1, ignore=("x",)) == key(2, ignore=("x",)), "positional arguments are ignored by their parameter name"


def test_numpy_arrays_hash_by_dtype_shape_and_bytes() -> None:
    np = pytest.importorskip("numpy")
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert canonical(a) == canonical(np.ascontiguousarray(a.T).T)  # same values, another memory layout
    assert canonical(a) != canonical(a.astype(np.int32)) and canonical(a) != canonical(a.reshape(3, 2))
    assert canonical(np.float64(1.5)) != canonical(1.5)


def test_without_a_signature_positions_and_keywords_are_used() -> None:
    assert bound_arguments(None, (1, 2), {"k": 3}) == [("#0", 1), ("#1", 2), ("k", 3)]
    assert bound_arguments(f, (), {"nope": 1, "x": 1}) == [("x", 1), ("y", 2), ("verbose", False), ("nope", 1)]  # **extra takes it
    assert bound_arguments(lambda x: x, (1, 2), {}) == [("#0", 1), ("#1", 2)], "a call that does not bind: positions"


def test_arguments_that_cannot_be_hashed_are_named_in_the_error() -> None:
    with pytest.raises(MemoKeyError) as info:
        key(threading.Lock())
    assert "argument 'x'" in str(info.value) and "cannot be pickled" in str(info.value) and "ignore_for_cache=['x']" in str(info.value)
    s = socket.socket()
    try:
        with pytest.raises(MemoKeyError, match="argument 'y'"):
            key(1, s)
    finally:
        s.close()
    with pytest.raises(MemoKeyError, match="consumed by the call"):
        key(i for i in range(3))
    deep: list[object] = []
    deep.append(deep)
    with pytest.raises(MemoKeyError, match="deeper than"):
        key(deep)
    with pytest.raises(MemoKeyError, match="environment spec"):
        key(1, env={"lock": threading.Lock()})
    assert key(threading.Lock(), ignore=("x",)) == key(None, ignore=("x",)), "an ignored argument is never hashed"
