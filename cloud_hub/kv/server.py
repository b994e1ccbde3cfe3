"""The hub's embedded store on its own port, speaking the Redis protocol (RESP2 and RESP3).

Why its own port and the Redis protocol: the proxies and refs travel inside task arguments and
connect from agents' workers with redis-py; serving RESP lets the same code reach the hub with
only a URL (``GET /v1/kv`` hands it out). Why not inside the HTTP API: BLPOP blocks for as long
as a Lock is held, and one command per HTTP request would cost a Pi several hundred bytes of
headers for every Queue item.

Auth: ``AUTH <user> <credential>`` (or ``HELLO 3 AUTH ...``). The credential is the hub's HMAC of
the user id: it opens that user's key space and nothing else (no task submission, no other
user's keys), so it can ride in task arguments to endpoints the user trusts. TLS: the hub's own
certificate where the API has one (``rediss://``).

Costs: data lives in the hub's memory (``kv_max_bytes``, default 256 MiB); a hub restart loses
it (refs then read as "deleted or lost", never as wrong data). Several replicas do not share it.
"""

from __future__ import annotations

import asyncio
import hmac
import hashlib
import logging
import ssl
import time
from collections import deque
from typing import Any, Awaitable, Callable

from cloud_hub.kv.keyspace import Block, Keyspace, KVError, Status

__all__ = ["KVServer", "credential"]

log = logging.getLogger("cloud_hub.kv")
_NOAUTH = ("PING", "AUTH", "HELLO", "QUIT", "CLIENT", "SELECT")
MAX_ARGS = 1_000_000
MAX_BULK = 512 << 20


def credential(secret: bytes, user: str) -> str:
    """The password that opens ``user``'s key space (and only it)."""
    return hmac.new(secret, b"kv:" + user.encode(), hashlib.sha256).hexdigest()[:40]


class _ProtocolError(Exception):
    pass


async def _read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    if not line.endswith(b"\r\n"):
        raise _ProtocolError("Protocol error: unterminated line")
    if line[:1] != b"*":  # inline command (redis-cli, telnet)
        return line.strip().split()
    try:
        n = int(line[1:-2])
    except ValueError:
        raise _ProtocolError("Protocol error: invalid multibulk length") from None
    if not 0 <= n <= MAX_ARGS:
        raise _ProtocolError("Protocol error: invalid multibulk length")
    out: list[bytes] = []
    for _ in range(n):
        hdr = await reader.readline()
        if hdr[:1] != b"$":
            raise _ProtocolError("Protocol error: expected '$'")
        try:
            size = int(hdr[1:-2])
        except ValueError:
            raise _ProtocolError("Protocol error: invalid bulk length") from None
        if not 0 <= size <= MAX_BULK:
            raise _ProtocolError("Protocol error: invalid bulk length")
        data = await reader.readexactly(size + 2)
        out.append(data[:-2])
    return out


def encode(v: Any, resp3: bool) -> bytes:
    """One reply in RESP2 or RESP3."""
    if v is None:
        return b"_\r\n" if resp3 else b"$-1\r\n"
    if isinstance(v, Status):
        return b"+" + v.encode() + b"\r\n"
    if isinstance(v, KVError):
        return b"-" + str(v).replace("\r", " ").replace("\n", " ").encode() + b"\r\n"
    if isinstance(v, bool):
        return b":%d\r\n" % int(v)
    if isinstance(v, int):
        return b":%d\r\n" % v
    if isinstance(v, str):
        v = v.encode()
    if isinstance(v, (bytes, bytearray)):
        return b"$%d\r\n%s\r\n" % (len(v), v)
    if isinstance(v, dict):
        items = b"".join(encode(k, resp3) + encode(x, resp3) for k, x in v.items())
        return (b"%%%d\r\n" % len(v) if resp3 else b"*%d\r\n" % (2 * len(v))) + items
    if isinstance(v, (set, frozenset)):
        return (b"~%d\r\n" if resp3 else b"*%d\r\n") % len(v) + b"".join(encode(x, resp3) for x in v)
    if isinstance(v, (list, tuple)):
        return b"*%d\r\n" % len(v) + b"".join(encode(x, resp3) for x in v)
    raise TypeError(f"cannot encode {type(v).__name__}")


class _Waiter:
    __slots__ = ("user", "keys", "fut", "reader", "retry")

    def __init__(self, user: str, keys: tuple[bytes, ...], fut: asyncio.Future[Any], reader: asyncio.StreamReader,
                 retry: tuple[bytes, ...] | None = None) -> None:
        self.user, self.keys, self.fut, self.reader, self.retry = user, keys, fut, reader, retry


class KVServer:
    """Serve a :class:`Keyspace` on ``host:port``; ``authenticate(user, password) -> bool``."""

    def __init__(self, host: str, port: int, *, secret: bytes, max_bytes: int = 256 << 20, max_value_bytes: int = 64 << 20,
                 ssl_context: ssl.SSLContext | None = None, public_host: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 task_result: Callable[[str, str], Awaitable[tuple[bool, bytes] | None]] | None = None) -> None:
        self.host, self.port, self.secret, self.ssl = host, port, secret, ssl_context
        #: (user, task id) -> (ok, serialized result) of the user's own finished task, or None:
        #: what ``MESH.RESULT`` answers (a Future passed as a task argument, docs/data.md)
        self.task_result = task_result
        self.public_host = public_host or host
        self.keys = Keyspace(clock=clock, max_bytes=max_bytes, max_value_bytes=max_value_bytes)
        self._waiters: dict[tuple[str, bytes], deque[_Waiter]] = {}
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.commands = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.ssl, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("embedded store (Redis protocol) on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5)
            except (asyncio.TimeoutError, Exception):
                pass

    def url(self, user: str) -> str:
        scheme = "rediss" if self.ssl is not None else "redis"
        return f"{scheme}://{user}:{credential(self.secret, user)}@{self.public_host}:{self.port}/0"

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.keys.sweep()

    # ------------------------------------------------------------------ one connection
    def _auth(self, user: bytes, password: bytes) -> str | None:
        u = user.decode("utf-8", "replace")
        return u if hmac.compare_digest(credential(self.secret, u).encode(), password) else None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        user: str | None = None
        resp3 = False
        multi: list[list[bytes]] | None = None
        try:
            for _ in range(1 << 62):  # a connection lives as long as its client keeps it
                try:
                    args = await _read_command(reader)
                except _ProtocolError as exc:
                    writer.write(encode(KVError(f"ERR {exc}"), resp3))
                    break
                if args is None:
                    break
                if not args:
                    continue
                name = args[0].upper().decode("ascii", "replace")
                reply: Any
                if name == "QUIT":
                    writer.write(encode(Status("OK"), resp3))
                    break
                if name == "HELLO":
                    reply, user, resp3 = self._hello(args, user, resp3)
                elif name == "AUTH":
                    u = self._auth(args[1], args[2]) if len(args) == 3 else None
                    if u is None:
                        reply = KVError("WRONGPASS invalid username-password pair or user is disabled.")
                    else:
                        user, reply = u, Status("OK")
                elif user is None and name not in _NOAUTH:
                    reply = KVError("NOAUTH Authentication required.")
                elif name == "CLIENT":
                    reply = Status("OK")
                elif name == "SELECT":
                    reply = Status("OK") if args[1:] == [b"0"] else KVError("ERR the embedded store has only DB 0")
                elif name == "PING":
                    reply = args[1] if len(args) > 1 else Status("PONG")
                elif name == "MESH.RESULT":
                    reply = await self._result(user, args)  # type: ignore[arg-type]
                elif name == "MULTI":
                    multi, reply = [], Status("OK")
                elif name == "DISCARD":
                    multi, reply = None, Status("OK") if multi is not None else KVError("ERR DISCARD without MULTI")
                elif name == "EXEC":
                    if multi is None:
                        reply = KVError("ERR EXEC without MULTI")
                    else:
                        reply = [self._run(user, c, may_block=False) for c in multi]  # type: ignore[arg-type]
                        multi = None
                elif multi is not None:
                    multi.append(args)
                    reply = Status("QUEUED")
                else:
                    reply = self._run(user, args)  # type: ignore[arg-type]
                    if isinstance(reply, Block):
                        reply = await self._block(user, reply, reader)  # type: ignore[arg-type]
                self.commands += 1
                self._wake()
                writer.write(encode(reply, resp3))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(writer)
            try:
                writer.close()
            except Exception:
                pass

    async def _result(self, user: str, args: list[bytes]) -> Any:
        """``MESH.RESULT <task id>``: [ok, data] of this user's finished task, or nil."""
        if len(args) != 2:
            return KVError("ERR wrong number of arguments for 'mesh.result' command")
        if self.task_result is None:
            return KVError("ERR this store does not serve task results")
        try:
            got = await self.task_result(user, args[1].decode("utf-8", "replace"))
        except KVError as exc:
            return exc
        return None if got is None else [int(bool(got[0])), got[1]]

    def _hello(self, args: list[bytes], user: str | None, resp3: bool) -> tuple[Any, str | None, bool]:
        proto = 2
        if len(args) > 1:
            try:
                proto = int(args[1])
            except ValueError:
                return KVError("ERR Protocol version is not an integer or out of range"), user, resp3
            if proto not in (2, 3):
                return KVError("NOPROTO unsupported protocol version"), user, resp3
        if len(args) >= 5 and args[2].upper() == b"AUTH":
            u = self._auth(args[3], args[4])
            if u is None:
                return KVError("WRONGPASS invalid username-password pair or user is disabled."), user, resp3
            user = u
        elif user is None:
            return KVError("NOAUTH HELLO must be called with the client's AUTH credentials"), user, resp3
        info = {b"server": b"mesh-hub", b"version": b"7.0.0", b"proto": proto, b"mode": b"standalone", b"role": b"master",
                b"modules": []}
        return info, user, proto == 3

    def _run(self, user: str, args: list[bytes], may_block: bool = True) -> Any:
        try:
            return self.keys.execute(user, args, may_block=may_block)
        except KVError as exc:
            return exc

    # ------------------------------------------------------------------ BLPOP, BLMOVE
    async def _block(self, user: str, b: Block, reader: asyncio.StreamReader) -> Any:
        """Park the caller until an item comes, its timeout passes, or it hangs up (then it takes
        nothing: an item is never handed to a caller that is gone)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        w = _Waiter(user, b.keys, fut, reader, b.retry)
        for k in b.keys:
            self._waiters.setdefault((user, k), deque()).append(w)
        deadline = loop.time() + b.timeout if b.timeout > 0 else None
        try:
            for _ in range(1 << 40):
                step = 1.0 if deadline is None else min(1.0, deadline - loop.time())
                if step <= 0:
                    return None
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), step)
                except asyncio.TimeoutError:
                    if reader.at_eof():
                        raise ConnectionError("client went away while blocked") from None
            return None
        finally:
            for k in b.keys:
                q = self._waiters.get((user, k))
                if q is not None:
                    try:
                        q.remove(w)
                    except ValueError:
                        pass
                    if not q:
                        del self._waiters[(user, k)]

    def _wake(self) -> None:
        """Hand items of lists that grew to the callers blocked on them, first come first served."""
        for _round in range(1000):
            grown, self.keys.grown = self.keys.grown, set()
            if not grown:
                return
            for uk in grown:
                q = self._waiters.get(uk)
                while q:
                    w = q[0]
                    if w.fut.done() or w.reader.at_eof():
                        q.popleft()
                        continue
                    if w.retry is None:  # BLPOP: [key, item]
                        v = self.keys.execute(uk[0], [b"LPOP", uk[1]])
                        reply = None if v is None else [uk[1], v]
                    else:  # BLMOVE: its LMOVE (which may grow another list: the next round wakes its waiters)
                        try:
                            reply = self.keys.execute(uk[0], list(w.retry), may_block=False)
                        except KVError as exc:  # the destination changed type while it waited
                            reply = exc
                    if reply is None:
                        break
                    q.popleft()
                    w.fut.set_result(reply)
