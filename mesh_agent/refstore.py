"""The local tier of data refs, on an agent's workers: the producing agent's own store (memory
plus its SQLite), and the stager that copies local refs into the shared store (a Redis, or the
hub's) for consumers on other endpoints. The keys both sides meet on are in
``mesh_agent.protocol.refs``; the program's side (``put``, ``get``, asking for a staged copy) is
``cloud_hub.client.refs``. Here, not in the SDK, because a worker resumes its stagers at start
(``mesh_agent/engine/_worker.py``) and the agent does not import the hub's package.

Why a tier on the agent: a consumer on the same endpoint (the scheduler puts it there when it
can, docs/data.md "Locality") then reads the value from the SD card or from memory, and the
value never crosses a link. Why SQLite and not memory alone: a ref outlives the worker process
that put it, and the agent itself (SIGKILL, reboot): committed rows survive, so a ref is read
back as it was or reported lost, never wrong.

Staging (for devices that cannot reach each other, only the hub): a consumer elsewhere pushes
the ref's key on ``mesh:stage:<endpoint>`` in the shared store (the hub's store, or Redis) and
waits on ``<key>:ready``. A stager thread in each worker of the producing endpoint that has used
the local tier (started at its first local put or read) pops the request, copies the value to
``<key>:staged`` with the ref's remaining TTL, and answers ``ok`` or ``lost``. The data goes
producer -> hub -> consumer, once per consumer endpoint (a staged copy is reused until expiry).

Costs on a Pi: one SQLite transaction per put (WAL, ``synchronous=NORMAL``: no fsync per put,
so a power cut may lose the newest refs, which then read as lost), the value's bytes on the SD
card, up to ``MESH_REF_MEMORY_BYTES`` (16 MiB) of RSS per worker for the memory copy, and one
idle blocked connection per worker to the shared store for the stager (one round trip every
``STAGER_WAIT_S``, 240 s, while idle).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

from mesh_agent.protocol.refs import READY, STAGE_LOST, STAGE_OK, STAGED, owner_of, stage_list

__all__ = ["LocalStore", "local_store", "endpoint_id", "LocalFull", "ensure_stager", "resume_stagers", "connection"]

ENV_DATA_DIR = "MESH_ENDPOINT_DATA_DIR"  # set by the agent for its workers (mesh_agent.datasets)
ENV_ENDPOINT_ID = "MESH_ENDPOINT_ID"
#: how long one idle BLPOP of the stager blocks: one ~100-byte round trip per worker this often
#: (360 a day, about 36 KB) while it waits; a request is served at once whatever this is
STAGER_WAIT_S = 240


class LocalFull(Exception):
    """The local tier's byte budget (``MESH_REF_LOCAL_MAX_BYTES``) would be passed."""


def endpoint_id() -> str | None:
    """This process's endpoint, when it is an agent's worker."""
    return os.environ.get(ENV_ENDPOINT_ID) or None


@contextlib.contextmanager
def _init_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` between this endpoint's worker processes (flock; held only
    while a worker sets up refs.sqlite3, once per worker). Without fcntl (not POSIX): no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class LocalStore:
    """refs.sqlite3 in the agent's data directory, shared by its workers, plus a per-process LRU."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "refs.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False, isolation_level=None)
        # Two workers opening the file at once (two tasks putting refs on fresh workers) raced on
        # the switch to WAL, which SQLite answers with "database is locked" at once, past the busy
        # timeout (seen 2 in 20 runs of test_data_tiers). One at a time, under a file lock.
        with _init_lock(self.path.with_name("refs.sqlite3.init-lock")):
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS refs (key TEXT PRIMARY KEY, blob BLOB NOT NULL, producer TEXT NOT NULL, "
                             "expires REAL NOT NULL, size INTEGER NOT NULL, owner TEXT NOT NULL DEFAULT '')")
            # the shared stores whose consumers may ask for these refs, until when: a restarted
            # worker resumes their stagers (resume_stagers) before any task touches refs again
            self._db.execute("CREATE TABLE IF NOT EXISTS logins (url TEXT PRIMARY KEY, until REAL NOT NULL)")
        self._mem: OrderedDict[str, tuple[bytes, float, str]] = OrderedDict()
        self._mem_bytes = 0
        self.mem_max = int(os.environ.get("MESH_REF_MEMORY_BYTES", str(16 << 20)))
        self.max_bytes = int(os.environ.get("MESH_REF_LOCAL_MAX_BYTES", str(256 << 20)))

    def _remember(self, key: str, blob: bytes, expires: float, owner: str) -> None:
        if len(blob) > self.mem_max // 4:
            return
        old = self._mem.pop(key, None)
        if old is not None:
            self._mem_bytes -= len(old[0])
        self._mem[key] = (blob, expires, owner)
        self._mem_bytes += len(blob)
        for _ in range(len(self._mem)):
            if self._mem_bytes <= self.mem_max:
                break
            _, (b, _e, _o) = self._mem.popitem(last=False)
            self._mem_bytes -= len(b)

    def put(self, key: str, blob: bytes, producer: str, expires: float, owner: str, url: str = "") -> None:
        """``owner``: the user the ref belongs to (the login of its shared-store URL); a ref
        naming another user is not read back, so a shared endpoint keeps users apart."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM refs WHERE expires <= ?", (time.time(),))
                used = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM refs").fetchone()[0]
                if used + len(blob) > self.max_bytes:
                    raise LocalFull(f"the local ref store of this endpoint holds {used} bytes; {len(blob)} more would pass "
                                    f"MESH_REF_LOCAL_MAX_BYTES={self.max_bytes}")
                self._db.execute("INSERT OR REPLACE INTO refs VALUES (?, ?, ?, ?, ?, ?)", (key, blob, producer, expires, len(blob), owner))
                if url:
                    self._db.execute("INSERT INTO logins VALUES (?, ?) ON CONFLICT(url) DO UPDATE SET until = MAX(until, excluded.until)",
                                     (url, expires))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._remember(key, blob, expires, owner)

    def get(self, key: str, owner: str) -> tuple[bytes, float] | None:
        """(blob, expires) or None; an expired row is deleted and reads as None, and another
        user's row reads as None too (it is not theirs to see)."""
        with self._lock:
            hit = self._mem.get(key)
            if hit is not None and hit[1] > time.time():
                self._mem.move_to_end(key)
                return (hit[0], hit[1]) if hit[2] == owner else None
            row = self._db.execute("SELECT blob, expires, owner FROM refs WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            if row[1] <= time.time():
                self._db.execute("DELETE FROM refs WHERE key = ?", (key,))
                return None
            self._remember(key, row[0], row[1], row[2])
            return (bytes(row[0]), float(row[1])) if row[2] == owner else None

    def delete(self, key: str, owner: str) -> None:
        with self._lock:
            old = self._mem.pop(key, None)
            if old is not None:
                self._mem_bytes -= len(old[0])
            self._db.execute("DELETE FROM refs WHERE key = ? AND owner = ?", (key, owner))


_stores: dict[tuple[int, str], LocalStore] = {}
_stores_lock = threading.Lock()


def local_store() -> LocalStore | None:
    """This worker's local tier, or None outside an agent."""
    d = os.environ.get(ENV_DATA_DIR)
    if not d or not endpoint_id():
        return None
    k = (os.getpid(), d)
    with _stores_lock:
        s = _stores.get(k)
        if s is None:
            s = _stores[k] = LocalStore(Path(d))
    return s


_stagers: dict[tuple[int, str], threading.Thread] = {}


def resume_stagers() -> int:
    """Start the stagers of every shared store that still has live local refs here (a worker
    calls it at start, in a thread, where refs.sqlite3 exists); returns how many."""
    store = local_store()
    if store is None:
        return 0
    with store._lock:
        urls = [r[0] for r in store._db.execute("SELECT url FROM logins WHERE until > ?", (time.time(),))]
    for url in urls:
        ensure_stager(url)
    return len(urls)


def ensure_stager(url: str) -> None:
    """Serve staging requests for this endpoint's local refs from ``url``'s store (one thread
    per worker process and store; daemon, blocked in BLPOP while idle)."""
    ep, store = endpoint_id(), local_store()
    if ep is None or store is None:
        return
    k = (os.getpid(), url)
    with _stores_lock:
        if k in _stagers and _stagers[k].is_alive():
            return
        t = threading.Thread(target=_stage_forever, args=(url, ep, store), daemon=True, name="mesh-ref-stager")
        _stagers[k] = t
        t.start()


def _stage_forever(url: str, ep: str, store: LocalStore) -> None:
    try:
        import redis
    except ImportError:  # no redis client on this endpoint: refs stay local, consumers elsewhere get a clear timeout
        return

    r = connection(url)
    for _ in range(1 << 40):  # for the life of this worker
        try:
            got = r.blpop([stage_list(ep)], timeout=STAGER_WAIT_S)
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(1.0)
            continue
        except Exception:  # noqa: BLE001 - a stager never takes the worker down
            time.sleep(1.0)
            continue
        if got is None:
            continue
        key = got[1].decode()
        try:
            hit = store.get(key, owner_of(url))  # only this login's refs: requests come from its own key space
            pipe = r.pipeline()
            if hit is None:
                pipe.rpush(key + READY, STAGE_LOST)
            else:
                blob, expires = hit
                pipe.set(key + STAGED, blob, px=max(1, int((expires - time.time()) * 1000)))
                pipe.rpush(key + READY, STAGE_OK)
            pipe.expire(key + READY, 120)
            pipe.execute()
        except Exception:  # noqa: BLE001
            continue


_conns: dict[tuple[int, str], Any] = {}
_conns_lock = threading.Lock()


def connection(url: str) -> Any:
    """One ``redis.Redis`` (its own pool) per process and URL; made again after a fork. The one
    connection of a process to a shared store: this module's stagers and, in the SDK, refs and
    the multiprocessing proxies (``cloud_hub.client.multiprocessing._resource``) use it."""
    key = (os.getpid(), url)
    r = _conns.get(key)
    if r is None:
        try:
            import redis
        except ImportError as exc:  # the agent's core install has no redis client
            raise ImportError("the mesh multiprocessing proxies need the 'redis' package on this machine: "
                              "pip install 'continuum-mesh[mp]' (or pip install redis)") from exc
        with _conns_lock:
            r = _conns.get(key)
            if r is None:
                # socket_timeout=None: redis-py 8 reads with a 5 s default, which broke every BLPOP
                # (Lock, Event, Queue.get) that waits longer; a dead server is still caught by
                # the connect timeout and TCP keepalive.
                r = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=None, socket_keepalive=True,
                                         health_check_interval=30)
                _conns[key] = r
    return r
