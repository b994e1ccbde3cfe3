"""The site's content-addressed blob store on the LAN: how FL models and updates move between a
site gateway and its devices without crossing the uplink (docs/sites.md, "Hierarchical FL").

Why a store and not frames: a device's update must reach its *gateway*, not the hub, and the
round's global model must come down the uplink once per site, not once per device. Both are
content-addressed, like function bodies (item 3): a blob's key is the SHA-256 of its bytes, the
store computes it itself on ``PUT`` and every reader checks it on ``GET``. So integrity needs no
login: the key a device fetches is in its hub-signed task, the key of its update is in its own
signed result, and whoever answers cannot substitute bytes without the hash failing. The blobs
live in the gateway's own SQLite queue, in the same ``functions`` table that caches function
bodies (one content-addressed cache per site; the agent's ``prune`` ages them out).

The wire is deliberately tiny (stdlib only; a device's worker and the gateway's worker speak it):
request ``op`` (4 bytes: ``PUT `` or ``GET ``) + length (8 bytes, big endian) + payload (the blob,
or the 64 hex digits of a key); answer status (1 byte: 0 ok, 1 not found, 2 refused) + length +
payload (the key, the blob, or the reason). One request per connection.

What an unauthenticated LAN peer can do: read blobs whose key it knows (the LAN is plaintext
anyway, docs/sites.md "Security model") and store blobs, bounded in size (``max_blob``) and in
total (``max_bytes`` of blobs stored over the LAN; the oldest go first), so it cannot fill the SD.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import struct
import time
from collections import OrderedDict
from typing import Optional, Tuple

__all__ = ["SiteStore", "SiteStoreError", "put_blob", "get_blob", "parse_address", "MAX_BLOB", "SITE_STORE_FILE"]

log = logging.getLogger("mesh_agent.site_store")

MAX_BLOB = 64 * 1024 * 1024
#: A device's agent writes its site store's address (from the hub's welcome) to this file in its
#: data directory; its tasks' workers read it to find shared data refs on the LAN (cloud_hub.client.refs).
SITE_STORE_FILE = "site-store"
_HDR = struct.Struct(">4sQ")
_ANS = struct.Struct(">BQ")
OK, NOT_FOUND, REFUSED = 0, 1, 2


class SiteStoreError(RuntimeError):
    """The site store is unreachable, refused a blob, or answered bytes that are not the key's."""


def parse_address(addr: str) -> Tuple[str, int]:
    """``host:port`` -> (host, port); a clear error for anything else."""
    if not isinstance(addr, str) or addr.count(":") != 1:
        raise SiteStoreError(f"not a site store address (host:port): {addr!r}")
    host, port = addr.rsplit(":", 1)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SiteStoreError(f"not a site store address (host:port): {addr!r}")
    return host, int(port)


def _is_key(key: str) -> bool:
    return isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)


class SiteStore:
    """The gateway's side: an asyncio TCP server over the gateway's :class:`AgentStore`."""

    def __init__(self, store: object, host: str, port: int, *, max_blob: int = MAX_BLOB, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.store, self.host, self.port = store, host, port
        self.max_blob, self.max_bytes = int(max_blob), int(max_bytes)
        self._server: Optional[asyncio.base_events.Server] = None
        self._lan: "OrderedDict[str, int]" = OrderedDict()  # keys stored over the LAN -> size, oldest first
        self.stats = {"puts": 0, "gets": 0, "put_bytes": 0, "get_bytes": 0, "refused": 0, "evicted": 0}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def put(self, blob: bytes) -> str:
        """Store ``blob`` under its SHA-256 (idempotent) and return the key."""
        key = hashlib.sha256(blob).hexdigest()
        await self.store._many("INSERT OR IGNORE INTO functions (id, body, stored_at) VALUES (?, ?, ?)",  # type: ignore[attr-defined]
                               [(key, blob, time.time())])
        return key

    async def get(self, key: str) -> Optional[bytes]:
        have = await self.store.function_bodies([key])  # type: ignore[attr-defined]
        return have.get(key)

    async def _evict(self) -> None:
        total = sum(self._lan.values())
        while total > self.max_bytes and len(self._lan) > 1:
            key, size = self._lan.popitem(last=False)
            total -= size
            # never a body a queued task still needs (a device-put blob could collide only by SHA-256)
            await self.store._many("DELETE FROM functions WHERE id=? AND id NOT IN (SELECT DISTINCT function_id FROM tasks)",  # type: ignore[attr-defined]
                                   [(key,)])
            self.stats["evicted"] += 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            op, n = _HDR.unpack(await asyncio.wait_for(reader.readexactly(_HDR.size), 30))
            blob: bytes | None
            if op == b"PUT ":
                if n > self.max_blob:
                    self.stats["refused"] += 1
                    await _answer(writer, REFUSED, f"blob of {n} bytes is over the site store's limit of {self.max_blob}".encode())
                    return
                blob = await asyncio.wait_for(reader.readexactly(n), 300)
                key = await self.put(blob)
                if key not in self._lan:
                    self._lan[key] = len(blob)
                    await self._evict()
                self.stats["puts"] += 1
                self.stats["put_bytes"] += len(blob)
                await _answer(writer, OK, key.encode())
            elif op == b"GET " and n == 64:
                key = (await asyncio.wait_for(reader.readexactly(64), 30)).decode("ascii", "replace")
                blob = await self.get(key) if _is_key(key) else None
                if blob is None:
                    await _answer(writer, NOT_FOUND, f"no blob {key[:64]!r} at this site".encode())
                    return
                self.stats["gets"] += 1
                self.stats["get_bytes"] += len(blob)
                await _answer(writer, OK, blob)
            else:
                self.stats["refused"] += 1
                await _answer(writer, REFUSED, b"unknown request")
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, struct.error):
            pass
        except Exception as exc:  # a full disk, a closed store: the peer gets the reason, the gateway goes on
            log.warning("site store request failed: %s", exc)
            with contextlib.suppress(Exception):
                await _answer(writer, REFUSED, f"site store error: {exc}".encode()[:1000])
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()


async def _answer(writer: asyncio.StreamWriter, status: int, payload: bytes) -> None:
    writer.write(_ANS.pack(status, len(payload)) + payload)
    await writer.drain()


def _request(addr: str, op: bytes, payload: bytes, timeout_s: float) -> Tuple[int, bytes]:
    host, port = parse_address(addr)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(_HDR.pack(op, len(payload)) + payload)
            head = _recv(s, _ANS.size)
            status, n = _ANS.unpack(head)
            if n > MAX_BLOB + 1024:
                raise SiteStoreError(f"site store at {addr} announced {n} bytes")
            return status, _recv(s, n)
    except OSError as exc:
        raise SiteStoreError(f"site store at {addr}: {exc}") from None


def _recv(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise SiteStoreError("site store closed the connection early")
        buf += chunk
    return bytes(buf)


def put_blob(addr: str, blob: bytes, timeout_s: float = 60.0) -> str:
    """Store ``blob`` at the site store ``addr``; return its key (checked against our own hash)."""
    status, payload = _request(addr, b"PUT ", bytes(blob), timeout_s)
    if status != OK:
        raise SiteStoreError(f"site store at {addr} refused the blob: {payload.decode(errors='replace')}")
    key = hashlib.sha256(blob).hexdigest()
    if payload.decode(errors="replace") != key:
        raise SiteStoreError(f"site store at {addr} answered key {payload[:64]!r}, not the blob's {key}")
    return key


def get_blob(addr: str, key: str, timeout_s: float = 60.0) -> bytes:
    """The blob with SHA-256 ``key`` from the site store ``addr``, checked: a store (or anyone on
    the LAN) that answers other bytes gets an error, never a model."""
    if not _is_key(key):
        raise SiteStoreError(f"not a blob key (64 hex digits): {key!r}")
    status, payload = _request(addr, b"GET ", key.encode(), timeout_s)
    if status != OK:
        raise SiteStoreError(f"site store at {addr}: {payload.decode(errors='replace')}")
    if hashlib.sha256(payload).hexdigest() != key:
        raise SiteStoreError(f"site store at {addr} answered bytes whose SHA-256 is not {key}")
    return payload
