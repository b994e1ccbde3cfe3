"""The data of the hub's embedded store: a Redis subset, per user, with expiry and a byte budget.

Why a Redis subset and not a new API: the multiprocessing proxies and refs already speak Redis
through redis-py. A hub without Redis serves the same commands (cloud_hub.kv.server), so the
same proxies and refs work against it with only their URL changed, and one set of tests proves
both. Pure logic: no sockets, no clock of its own (``clock`` is injected), so it is unit-tested
directly. The server holds blocked ``BLPOP``/``BLMOVE`` callers; this module only says which
lists grew (and, for ``BLMOVE``, which non-blocking command to retry when one did).

Per-user scoping: every user has a separate key space; no command names another user's key.
Expiry: lazy on access plus :meth:`Keyspace.sweep`, as Redis does. Budget: ``max_bytes`` over all
users and ``max_value_bytes`` per value; a write that would pass either is refused whole
(``OOM ...``) and changes nothing.

Server-side scripts: there is no Lua here. ``EVAL`` runs only the mesh's own two scripts (a
bounded semaphore release and a barrier arrival, cloud_hub.client.multiprocessing.synchronize),
recognised by their SHA-1 and run natively; any other script is a clear error. The Queue's
at-least-once ``get`` needs none: ``MULTI`` with ``LMOVE``, or ``BLMOVE`` (which blocks as
``BLPOP`` does, and inside ``MULTI`` does not, as in Redis).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["KVError", "Keyspace", "Block", "Status", "SCRIPTS"]


class KVError(Exception):
    """An error reply; the message starts with its Redis code (ERR, WRONGTYPE, OOM, NOSCRIPT)."""


class Status(str):
    """A simple-string reply (``+OK``), as opposed to a bulk string."""


@dataclass(frozen=True)
class Block:
    """BLPOP or BLMOVE found every list empty: the server parks the caller on ``keys`` until
    ``timeout``. ``retry``: the non-blocking command to run for the caller when one of ``keys``
    grows (its reply, if not nil, is the caller's); None: BLPOP's ``[key, LPOP key]``."""

    keys: tuple[bytes, ...]
    timeout: float  # seconds; 0 = for ever
    retry: tuple[bytes, ...] | None = None


@dataclass
class _Entry:
    value: Any  # bytes | deque[bytes] | dict[bytes, bytes] | set[bytes]
    expires: float | None = None


@dataclass
class _User:
    keys: dict[bytes, _Entry] = field(default_factory=dict)


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _scripts() -> dict[str, str]:
    from cloud_hub.client.multiprocessing.synchronize import _ARRIVE, _RELEASE

    return {_sha(_RELEASE): "release", _sha(_ARRIVE): "arrive"}


SCRIPTS: dict[str, str] = {}


def _int(b: bytes, what: str = "value") -> int:
    try:
        return int(b)
    except (TypeError, ValueError):
        raise KVError(f"ERR {what} is not an integer or out of range") from None


def _float(b: bytes) -> float:
    try:
        v = float(b)
    except (TypeError, ValueError):
        raise KVError("ERR timeout is not a float or out of range") from None
    if not math.isfinite(v) or v < 0:
        raise KVError("ERR timeout is negative")
    return v


def _size(v: Any) -> int:
    if isinstance(v, bytes):
        return len(v)
    if isinstance(v, deque) or isinstance(v, set):
        return sum(len(x) + 16 for x in v)
    if isinstance(v, dict):
        return sum(len(k) + len(x) + 32 for k, x in v.items())
    return 0


_WRITES = {b"SET", b"SETRANGE", b"RPUSH", b"LPUSH", b"LSET", b"LMOVE", b"BLMOVE",
           b"HSET", b"HSETNX", b"SADD", b"INCR", b"DECR", b"INCRBY", b"DECRBY", b"EVAL"}


class Keyspace:
    """All users' keys. ``execute(user, args)`` runs one command and returns its reply."""

    def __init__(self, *, clock: Callable[[], float], max_bytes: int = 256 << 20, max_value_bytes: int = 64 << 20) -> None:
        self.clock = clock
        self.max_bytes = max_bytes
        self.max_value_bytes = max_value_bytes
        self.used = 0
        self._users: dict[str, _User] = {}
        #: (user, key) of lists that got items since the server last looked (wakes BLPOP callers)
        self.grown: set[tuple[str, bytes]] = set()
        if not SCRIPTS:
            SCRIPTS.update(_scripts())

    # ------------------------------------------------------------------ plumbing
    def _space(self, user: str) -> dict[bytes, _Entry]:
        u = self._users.get(user)
        if u is None:
            u = self._users[user] = _User()
        return u.keys

    def _get(self, user: str, key: bytes) -> _Entry | None:
        space = self._space(user)
        e = space.get(key)
        if e is not None and e.expires is not None and e.expires <= self.clock():
            self._drop(space, key)
            return None
        return e

    def _drop(self, space: dict[bytes, _Entry], key: bytes) -> bool:
        e = space.pop(key, None)
        if e is None:
            return False
        self.used -= _size(e.value) + len(key)
        return True

    def _typed(self, user: str, key: bytes, kind: type, create: bool) -> Any:
        e = self._get(user, key)
        if e is None:
            if not create:
                return None
            e = self._space(user)[key] = _Entry(kind())
            self.used += len(key)
        elif not isinstance(e.value, kind):
            raise KVError("WRONGTYPE Operation against a key holding the wrong kind of value")
        return e.value

    def _account(self, before: int, after: int) -> None:
        self.used += after - before

    def _gc_empty(self, user: str, key: bytes) -> None:
        space = self._space(user)
        e = space.get(key)
        if e is not None and not isinstance(e.value, bytes) and not e.value:
            self._drop(space, key)

    def sweep(self, limit: int = 10_000) -> int:
        """Delete up to ``limit`` expired keys; returns how many (the server calls it each second)."""
        now, n = self.clock(), 0
        for u in self._users.values():
            for k in [k for k, e in u.keys.items() if e.expires is not None and e.expires <= now][: limit - n]:
                self._drop(u.keys, k)
                n += 1
            if n >= limit:
                break
        return n

    def dbsize(self, user: str) -> int:
        self.sweep()
        return len(self._space(user))

    # ------------------------------------------------------------------ dispatch
    def execute(self, user: str, args: list[bytes], *, may_block: bool = True) -> Any:
        """One command's reply (None, int, bytes, Status, list, dict, set or Block); a bad
        command raises :class:`KVError` and changes nothing."""
        if not args:
            raise KVError("ERR empty command")
        name = args[0].upper()
        fn = getattr(self, "c_" + name.decode("ascii", "replace").lower(), None)
        if fn is None:
            raise KVError(f"ERR unknown command '{args[0].decode('utf-8', 'replace')}' (the hub's embedded store "
                          "serves the Redis subset the mesh uses; point MESH_REDIS_URL at a Redis for more)")
        if name in _WRITES:
            incoming = sum(len(a) for a in args[1:])
            if incoming > self.max_value_bytes:
                raise KVError(f"OOM value of {incoming} bytes is over the embedded store's limit of {self.max_value_bytes} bytes")
            if self.used + incoming > self.max_bytes:
                raise KVError(f"OOM the hub's embedded store is full ({self.used} of {self.max_bytes} bytes); "
                              "nothing was written")
        try:
            if name in (b"BLPOP", b"BLMOVE"):
                return fn(user, args[1:], may_block)
            return fn(user, args[1:])
        except IndexError:
            raise KVError(f"ERR wrong number of arguments for '{name.decode().lower()}' command") from None

    # ------------------------------------------------------------------ keys
    def c_ping(self, user: str, a: list[bytes]) -> Any:
        return a[0] if a else Status("PONG")

    def c_dbsize(self, user: str, a: list[bytes]) -> int:
        return self.dbsize(user)

    def c_del(self, user: str, a: list[bytes]) -> int:
        if not a:
            raise IndexError
        space = self._space(user)
        return sum(1 for k in a if self._get(user, k) is not None and self._drop(space, k))

    def c_keys(self, user: str, a: list[bytes]) -> list[bytes]:
        """Keys matching a glob (for inspection and tests; a user's own keys only)."""
        import fnmatch

        pat = a[0].decode("utf-8", "surrogateescape")
        return [k for k in list(self._space(user)) if self._get(user, k) is not None
                and fnmatch.fnmatchcase(k.decode("utf-8", "surrogateescape"), pat)]

    def c_type(self, user: str, a: list[bytes]) -> Status:
        e = self._get(user, a[0])
        kinds = {bytes: "string", deque: "list", dict: "hash", set: "set"}
        return Status("none" if e is None else kinds[type(e.value)])

    def c_exists(self, user: str, a: list[bytes]) -> int:
        if not a:
            raise IndexError
        return sum(1 for k in a if self._get(user, k) is not None)

    def c_expire(self, user: str, a: list[bytes]) -> int:
        return self._expire(user, a[0], _int(a[1]) * 1000, a[2:])

    def c_pexpire(self, user: str, a: list[bytes]) -> int:
        return self._expire(user, a[0], _int(a[1]), a[2:])

    def _expire(self, user: str, key: bytes, ms: int, opts: list[bytes] = ()) -> int:  # type: ignore[assignment]
        """Redis 7's EXPIRE, with its NX / XX / GT / LT options (a key without expiry counts as an
        infinite one for GT and LT, as in Redis)."""
        e = self._get(user, key)
        if e is None:
            return 0
        flags = {bytes(o).upper() for o in opts}
        if not flags <= {b"NX", b"XX", b"GT", b"LT"}:
            raise KVError("ERR Unsupported option " + b" ".join(sorted(flags)).decode(errors="replace"))
        new = self.clock() + ms / 1000
        cur = e.expires
        if (b"NX" in flags and cur is not None) or (b"XX" in flags and cur is None) \
                or (b"GT" in flags and (cur is None or new <= cur)) or (b"LT" in flags and cur is not None and new >= cur):
            return 0
        if ms <= 0:
            self._drop(self._space(user), key)
        else:
            e.expires = new
        return 1

    def c_ttl(self, user: str, a: list[bytes]) -> int:
        ms = self.c_pttl(user, a)
        return ms if ms < 0 else int(round(ms / 1000))

    def c_pttl(self, user: str, a: list[bytes]) -> int:
        e = self._get(user, a[0])
        if e is None:
            return -2
        if e.expires is None:
            return -1
        return max(0, int((e.expires - self.clock()) * 1000))

    # ------------------------------------------------------------------ strings
    def c_get(self, user: str, a: list[bytes]) -> bytes | None:
        e = self._get(user, a[0])
        if e is None:
            return None
        if not isinstance(e.value, bytes):
            raise KVError("WRONGTYPE Operation against a key holding the wrong kind of value")
        return e.value

    def c_set(self, user: str, a: list[bytes]) -> Any:
        key, value = a[0], a[1]
        expires, nx, xx, i = None, False, False, 2
        while i < len(a):
            opt = a[i].upper()
            if opt in (b"EX", b"PX"):
                n = _int(a[i + 1])
                if n <= 0:
                    raise KVError("ERR invalid expire time in 'set' command")
                expires = self.clock() + (n if opt == b"EX" else n / 1000)
                i += 2
            elif opt == b"NX":
                nx, i = True, i + 1
            elif opt == b"XX":
                xx, i = True, i + 1
            else:
                raise KVError("ERR syntax error")
        old = self._get(user, key)
        if (nx and old is not None) or (xx and old is None):
            return None
        space = self._space(user)
        if old is not None:
            self._drop(space, key)
        space[key] = _Entry(bytes(value), expires)
        self.used += len(key) + len(value)
        return Status("OK")

    def _incr(self, user: str, key: bytes, by: int) -> int:
        e = self._get(user, key)
        cur = 0 if e is None else _int(self.c_get(user, [key]) or b"0")
        n = cur + by
        blob = str(n).encode()
        if e is None:
            self._space(user)[key] = _Entry(blob)
            self.used += len(key) + len(blob)
        else:
            self._account(len(e.value), len(blob))
            e.value = blob
        return n

    def c_incr(self, user: str, a: list[bytes]) -> int:
        return self._incr(user, a[0], 1)

    def c_decr(self, user: str, a: list[bytes]) -> int:
        return self._incr(user, a[0], -1)

    def c_incrby(self, user: str, a: list[bytes]) -> int:
        return self._incr(user, a[0], _int(a[1]))

    def c_decrby(self, user: str, a: list[bytes]) -> int:
        return self._incr(user, a[0], -_int(a[1]))

    def c_getrange(self, user: str, a: list[bytes]) -> bytes:
        v = self.c_get(user, [a[0]]) or b""
        start, end = _int(a[1]), _int(a[2])
        n = len(v)
        start = max(n + start, 0) if start < 0 else start
        end = n + end if end < 0 else min(end, n - 1)
        return v[start : end + 1] if start <= end else b""

    def c_setrange(self, user: str, a: list[bytes]) -> int:
        key, off, data = a[0], _int(a[1]), a[2]
        if off < 0:
            raise KVError("ERR offset is out of range")
        if off + len(data) > self.max_value_bytes:
            raise KVError(f"OOM value would be over the embedded store's limit of {self.max_value_bytes} bytes")
        e = self._get(user, key)
        old = b"" if e is None else self.c_get(user, [key]) or b""
        new = old.ljust(off, b"\0")[:off] + data + old[off + len(data):] if len(old) > off else old.ljust(off, b"\0") + data
        if e is None:
            self._space(user)[key] = _Entry(new)
            self.used += len(key) + len(new)
        else:
            self._account(len(old), len(new))
            e.value = new
        return len(new)

    # ------------------------------------------------------------------ lists
    def _push(self, user: str, a: list[bytes], left: bool) -> int:
        if len(a) < 2:
            raise IndexError
        lst = self._typed(user, a[0], deque, True)
        for v in a[1:]:
            (lst.appendleft if left else lst.append)(bytes(v))
            self.used += len(v) + 16
        self.grown.add((user, a[0]))
        return len(lst)

    def c_rpush(self, user: str, a: list[bytes]) -> int:
        return self._push(user, a, False)

    def c_lpush(self, user: str, a: list[bytes]) -> int:
        return self._push(user, a, True)

    def _pop(self, user: str, key: bytes, left: bool) -> bytes | None:
        lst = self._typed(user, key, deque, False)
        if not lst:
            return None
        v = lst.popleft() if left else lst.pop()
        self.used -= len(v) + 16
        self._gc_empty(user, key)
        return v

    def c_lpop(self, user: str, a: list[bytes]) -> bytes | None:
        return self._pop(user, a[0], True)

    def c_rpop(self, user: str, a: list[bytes]) -> bytes | None:
        return self._pop(user, a[0], False)

    def c_blpop(self, user: str, a: list[bytes], may_block: bool = True) -> Any:
        if len(a) < 2:
            raise IndexError
        keys, timeout = a[:-1], _float(a[-1])
        for k in keys:
            v = self._pop(user, k, True)
            if v is not None:
                return [k, v]
        return Block(tuple(keys), timeout) if may_block else None

    def c_lmove(self, user: str, a: list[bytes]) -> bytes | None:
        """``LMOVE source destination LEFT|RIGHT LEFT|RIGHT``: pop from one end of ``source`` and
        push onto one end of ``destination`` in one step (the reliable-queue move); nil when
        ``source`` is empty. A bad direction or a key of another type changes nothing."""
        if len(a) != 4:
            raise KVError("ERR wrong number of arguments for 'lmove' command")
        src, dst = a[0], a[1]
        wherefrom, whereto = a[2].upper(), a[3].upper()
        if wherefrom not in (b"LEFT", b"RIGHT") or whereto not in (b"LEFT", b"RIGHT"):
            raise KVError("ERR syntax error")
        lst = self._typed(user, src, deque, False)
        if not lst:
            return None
        self._typed(user, dst, deque, False)  # WRONGTYPE before anything moves
        if src == dst:  # a rotation: the list (and its expiry) stays
            v = lst.popleft() if wherefrom == b"LEFT" else lst.pop()
            (lst.appendleft if whereto == b"LEFT" else lst.append)(v)
            self.grown.add((user, dst))
            return v
        v = self._pop(user, src, wherefrom == b"LEFT")
        assert v is not None
        self._push(user, [dst, v], whereto == b"LEFT")
        return v

    def c_blmove(self, user: str, a: list[bytes], may_block: bool = True) -> Any:
        """``BLMOVE source destination LEFT|RIGHT LEFT|RIGHT timeout``: LMOVE, or park the caller
        on ``source`` as BLPOP does (inside MULTI: LMOVE, as Redis does)."""
        if len(a) != 5:
            raise KVError("ERR wrong number of arguments for 'blmove' command")
        timeout = _float(a[4])
        v = self.c_lmove(user, a[:4])  # checks the directions and types first, whatever happens next
        if v is not None or not may_block:
            return v
        return Block((a[0],), timeout, (b"LMOVE", *a[:4]))

    def c_llen(self, user: str, a: list[bytes]) -> int:
        lst = self._typed(user, a[0], deque, False)
        return len(lst) if lst else 0

    def c_lrange(self, user: str, a: list[bytes]) -> list[bytes]:
        lst = list(self._typed(user, a[0], deque, False) or ())
        start, end, n = _int(a[1]), _int(a[2]), len(lst)
        start = max(n + start, 0) if start < 0 else start
        end = n + end if end < 0 else min(end, n - 1)
        return lst[start : end + 1] if start <= end else []

    def c_lindex(self, user: str, a: list[bytes]) -> bytes | None:
        lst = self._typed(user, a[0], deque, False) or deque()
        i = _int(a[1])
        return lst[i] if -len(lst) <= i < len(lst) else None

    def c_lset(self, user: str, a: list[bytes]) -> Status:
        lst = self._typed(user, a[0], deque, False)
        if lst is None:
            raise KVError("ERR no such key")
        i = _int(a[1])
        if not -len(lst) <= i < len(lst):
            raise KVError("ERR index out of range")
        self._account(len(lst[i]), len(a[2]))
        lst[i] = bytes(a[2])
        return Status("OK")

    def c_lrem(self, user: str, a: list[bytes]) -> int:
        lst = self._typed(user, a[0], deque, False)
        if not lst:
            return 0
        count, value = _int(a[1]), a[2]
        items = list(lst) if count >= 0 else list(reversed(lst))
        out, removed = [], 0
        for x in items:
            if x == value and (count == 0 or removed < abs(count)):
                removed += 1
                continue
            out.append(x)
        if count < 0:
            out.reverse()
        lst.clear()
        lst.extend(out)
        self.used -= removed * (len(value) + 16)
        self._gc_empty(user, a[0])
        return removed

    # ------------------------------------------------------------------ hashes
    def c_hset(self, user: str, a: list[bytes]) -> int:
        if len(a) < 3 or len(a) % 2 == 0:
            raise IndexError
        h = self._typed(user, a[0], dict, True)
        added = 0
        for f, v in zip(a[1::2], a[2::2]):
            old = h.get(f)
            self.used += len(v) - (len(old) if old is not None else -len(f) - 32)
            added += old is None
            h[bytes(f)] = bytes(v)
        return added

    def c_hsetnx(self, user: str, a: list[bytes]) -> int:
        h = self._typed(user, a[0], dict, True)
        if a[1] in h:
            return 0
        return self.c_hset(user, a[:3])

    def c_hget(self, user: str, a: list[bytes]) -> bytes | None:
        h = self._typed(user, a[0], dict, False) or {}
        return h.get(a[1])

    def c_hdel(self, user: str, a: list[bytes]) -> int:
        if len(a) < 2:
            raise IndexError
        h = self._typed(user, a[0], dict, False)
        if not h:
            return 0
        n = 0
        for f in a[1:]:
            v = h.pop(f, None)
            if v is not None:
                n += 1
                self.used -= len(f) + len(v) + 32
        self._gc_empty(user, a[0])
        return n

    def c_hgetall(self, user: str, a: list[bytes]) -> dict[bytes, bytes]:
        return dict(self._typed(user, a[0], dict, False) or {})

    def c_hlen(self, user: str, a: list[bytes]) -> int:
        return len(self._typed(user, a[0], dict, False) or {})

    def c_hexists(self, user: str, a: list[bytes]) -> int:
        return int(a[1] in (self._typed(user, a[0], dict, False) or {}))

    # ------------------------------------------------------------------ sets
    def c_sadd(self, user: str, a: list[bytes]) -> int:
        if len(a) < 2:
            raise IndexError
        s = self._typed(user, a[0], set, True)
        n = 0
        for m in a[1:]:
            if m not in s:
                s.add(bytes(m))
                self.used += len(m) + 16
                n += 1
        return n

    def c_srem(self, user: str, a: list[bytes]) -> int:
        s = self._typed(user, a[0], set, False)
        if not s:
            return 0
        n = 0
        for m in a[1:]:
            if m in s:
                s.discard(m)
                self.used -= len(m) + 16
                n += 1
        self._gc_empty(user, a[0])
        return n

    def c_smembers(self, user: str, a: list[bytes]) -> set[bytes]:
        return set(self._typed(user, a[0], set, False) or ())

    # ------------------------------------------------------------------ scripts
    def c_eval(self, user: str, a: list[bytes]) -> Any:
        script, nkeys = a[0], _int(a[1], "number of keys")
        keys, argv = a[2 : 2 + nkeys], a[2 + nkeys :]
        kind = SCRIPTS.get(hashlib.sha1(script).hexdigest())
        if kind is None:
            raise KVError("NOSCRIPT the hub's embedded store runs only the mesh's own scripts (Lock release, Barrier arrive); "
                          "use a Redis (MESH_REDIS_URL) for others")
        if kind == "release":  # bounded semaphore release: -1 if already full
            bound, ttl = _int(argv[0]), argv[1]
            n = self.c_llen(user, [keys[0]])
            if bound > 0 and n >= bound:
                return -1
            self.c_rpush(user, [keys[0], b"t"])
            self.c_expire(user, [keys[0], ttl])
            return n + 1
        # barrier arrival
        parties, ttl = _int(argv[0]), argv[1]
        if self.c_exists(user, [keys[2]]):
            return [-1, 0]
        gen = _int(self.c_get(user, [keys[1]]) or b"0")
        n = self._incr(user, keys[0], 1)
        self.c_expire(user, [keys[0], ttl])
        if n >= parties:
            self.c_set(user, [keys[0], b"0", b"EX", ttl])
            self.c_set(user, [keys[1], str(gen + 1).encode(), b"EX", ttl])
            g = keys[3] + str(gen).encode()
            if n > 1:
                self.c_rpush(user, [g] + [b"go"] * (n - 1))
                self.c_expire(user, [g, ttl])
        return [n, gen]
