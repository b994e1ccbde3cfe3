"""``Value``/``Array``/``RawValue``/``RawArray`` of the mesh against CPython's own
``multiprocessing.sharedctypes`` (issue 28 item 4): one table of typecodes and operations, each
run on both, and every answer (value, or exception type and message) must be the same. Against
a real redis-server and the hub's embedded store (the ``rs`` fixture of test_mp_proxies)."""

from __future__ import annotations

import ctypes
import multiprocessing as std
import multiprocessing.sharedctypes  # noqa: F401  (std.sharedctypes)
from typing import Any, Callable

import pytest

redis = pytest.importorskip("redis")

from cloud_hub.client import multiprocessing as mp  # noqa: E402
from tests.integration.test_mp_proxies import _child, rs  # noqa: E402,F401  (rs: the store fixture, run twice)

#: every typecode the standard library takes, and the simple ctypes types it takes as well
TYPES: list[Any] = [*std.sharedctypes.typecode_to_type, ctypes.c_bool, ctypes.c_int8, ctypes.c_uint16, ctypes.c_int64,
                    ctypes.c_uint64, ctypes.c_double, ctypes.c_char, ctypes.c_wchar]

#: per kind: an initializer (3 or more items), a replacement for 2 items, one item, and values
#: the type refuses; ints include values out of range, which wrap as in C
SAMPLES: dict[str, tuple[Any, Any, Any, list[Any]]] = {
    "c": (b"hello", b"EL", b"J", ["x", b"xy", 1.5]),
    "u": ("h\xe9llo", "EL", "J", [b"x", "xy", 1]),
    "?": ([True, 0, 2, False], [0, 1], True, []),
    "int": ([1, -2, 300, 2**40 + 7], [-1, 2**33], 200, ["x", 1.5, None]),
    "float": ([1.5, -2.25, 3.14159, 1e40], [0.1, -7.0], 2.5, ["x", None]),
}


def _kind(t: Any) -> str:
    letter = (std.sharedctypes.typecode_to_type.get(t, t) if isinstance(t, str) else t)._type_
    return letter if letter in "cu?" else ("float" if letter in "fdg" else "int")


def _answer(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        v = fn()
    except AttributeError as exc:  # the message names the class, which is ours: the type must match
        return ("raises", type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 - the answer compared is the exception
        return ("raises", type(exc).__name__, str(exc))
    if isinstance(v, float) and v != v:
        return ("nan",)
    return ("ok", type(v).__name__, v)


def _script(m: Any, t: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """The same operations on module ``m`` (the stdlib or the mesh), named, with their answers."""
    init, two, one, bad = SAMPLES[_kind(t)]
    out: list[tuple[str, tuple[Any, ...]]] = []

    def rec(name: str, fn: Callable[[], Any]) -> None:
        out.append((name, _answer(fn)))

    first = init[0] if not isinstance(init, (bytes, str)) else init[:1]
    v, rv, v0 = m.Value(t, first), m.RawValue(t, first), m.Value(t)
    rec("Value(init).value", lambda: v.value)
    rec("RawValue(init).value", lambda: rv.value)
    rec("Value().value", lambda: v0.value)

    def set_value(obj: Any, x: Any) -> Any:
        obj.value = x
        return obj.value

    rec("value = one", lambda: set_value(v, one))
    rec("raw value = one", lambda: set_value(rv, one))
    for i, b in enumerate(bad):
        rec(f"Value(bad {i})", lambda b=b: m.Value(t, b).value)
        rec(f"value = bad {i}", lambda b=b: set_value(v, b))
    rec("after bad sets", lambda: v.value)

    for lock in (True, False):
        a = m.Array(t, init, lock=lock)
        z = m.Array(t, 3, lock=lock)
        tag = f"lock={lock}"
        rec(f"{tag} a[:]", lambda: a[:])
        rec(f"{tag} zeros[:]", lambda: z[:])
        rec(f"{tag} len", lambda: len(a))
        rec(f"{tag} a[0]", lambda: a[0])
        rec(f"{tag} a[-1]", lambda: a[-1])
        rec(f"{tag} a[1:3]", lambda: a[1:3])
        rec(f"{tag} a[::2]", lambda: a[::2])
        rec(f"{tag} a[::-1]", lambda: a[::-1])
        rec(f"{tag} a[3:1]", lambda: a[3:1])
        rec(f"{tag} a[99]", lambda: a[99])
        rec(f"{tag} a[-99]", lambda: a[-99])
        rec(f"{tag} list", lambda: list(a))

        def setitem(i: Any, x: Any) -> Any:
            a[i] = x
            return a[:]

        rec(f"{tag} a[0] = one", lambda: setitem(0, one))
        rec(f"{tag} a[1:3] = two", lambda: setitem(slice(1, 3), two))
        rec(f"{tag} a[::2] = (same length)", lambda: setitem(slice(None, None, 2), a[::2]))
        rec(f"{tag} a[0:2] = one item", lambda: setitem(slice(0, 2), two[:1]))
        rec(f"{tag} a[99] = one", lambda: setitem(99, one))
        for i, b in enumerate(bad):
            rec(f"{tag} a[0] = bad {i}", lambda b=b: setitem(0, b))
        rec(f"{tag} after bad sets", lambda: a[:])
        for attr in ("value", "raw"):
            rec(f"{tag} .{attr}", lambda attr=attr: getattr(a, attr))
        if _kind(t) == "c":
            rec(f"{tag} .value = b'hey'", lambda: (setattr(a, "value", b"hey"), a.raw, a.value)[1:])
            rec(f"{tag} .value = too long", lambda: setattr(a, "value", b"x" * 10))
            rec(f"{tag} .value = str", lambda: setattr(a, "value", "hey"))
            rec(f"{tag} .raw = b'ab'", lambda: (setattr(a, "raw", b"ab"), a.raw, a.value)[1:])
            rec(f"{tag} .raw = too long", lambda: setattr(a, "raw", b"x" * 10))
            rec(f"{tag} iterate .value", lambda: [bytes([c]) for c in a.value])
    rec("RawArray(init)[:]", lambda: m.RawArray(t, init)[:])
    rec("RawArray(0)[:]", lambda: m.RawArray(t, 0)[:])
    rec("Array(-1)", lambda: m.Array(t, -1))
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t if isinstance(t, str) else t.__name__)
def test_every_typecode_behaves_as_cpython(rs: Any, t: Any) -> None:  # noqa: F811  (rs: the imported fixture)
    mesh, stdlib = _script(mp, t), _script(std, t)
    assert [n for n, _ in mesh] == [n for n, _ in stdlib]
    diff = [(n, got, want) for (n, got), (_, want) in zip(mesh, stdlib) if got != want]
    assert not diff, "\n".join(f"{n}: mesh {got} != stdlib {want}" for n, got, want in diff)


def test_char_array_travels_to_another_process(rs: Any) -> None:  # noqa: F811  (rs: the imported fixture)
    s, c, r = mp.Array("c", b"hello"), mp.Value("c", b"x"), mp.RawArray("c", b"abc")
    out = _child("o0[0] = b'J'; o1.value = b'y'; o2[1:] = b'BC'; print(o0.value, o0[:], o1.value, o2.value)", rs.url, s, c, r)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["b'Jello'", "b'Jello'", "b'y'", "b'aBC'"]
    assert (s.value, c.value, r[:]) == (b"Jello", b"y", b"aBC")


def test_refused_input_stores_nothing(rs: Any) -> None:  # noqa: F811  (rs: the imported fixture)
    r = redis.Redis.from_url(rs.url)
    before = set(r.keys("*"))
    for bad in (lambda: mp.Array("c", "hello"), lambda: mp.Value("i", 1.5), lambda: mp.Array("i", ["x"]),
                lambda: mp.Value("c", b"xy"), lambda: mp.Array(ctypes.c_char_p, 2), lambda: mp.Array("?", 2)):
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(TypeError, match="bad typecode 'x': use one of 'cubBhHiIlLqQfd'"):
        mp.Value("x", 1)
    with pytest.raises(TypeError, match="not structures"):
        mp.Array(type("P", (ctypes.Structure,), {"_fields_": [("x", ctypes.c_double)]}), 2)
    with pytest.raises(ValueError, match="Array length must be >= 0"):
        mp.Array("i", -1)
    assert set(r.keys("*")) == before
