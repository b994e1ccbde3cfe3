"""The SDK's end of ``/v1/stream``: one WebSocket to the hub that carries submits and results.

Why: over REST each batch is a POST and results come through a long poll that must be issued
again after every answer; the stream holds one connection and the hub pushes each result when it
is stored (cloud_hub/api/stream.py). Nothing about durability changes: a submit is answered
``accepted`` only after the hub committed it (the same code as REST), the Executor retries a
submit the stream lost with the same idempotency key (over the stream once it reconnects, or over
REST), and results are delivered at least once (the hub resends everything after the cursor the
client names when it reconnects) and completed once (by task id, in the Executor).

Threads: the Executor's reader thread owns the connection (connect, reconnect with backoff and
jitter, receive); the submitter thread only sends a frame and waits for its answer. While the
stream is down, the reader polls REST between reconnect attempts, so results keep flowing; a hub
that does not offer the stream (an older hub, ``stream: false``, a proxy that refuses WebSocket
upgrades) makes the Executor use REST for good.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import ssl
import threading
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from cloud_hub.client._client import AuthError, HubError, HubUnreachable
from mesh_agent.backoff import Backoff

if TYPE_CHECKING:
    from cloud_hub.client._client import Client

__all__ = ["HubStream", "StreamUnavailable", "FrameTooBig", "stream_url"]

log = logging.getLogger("cloud_hub.client")

#: Opening the stream again after it failed (mesh_agent/backoff.py): 0.1 s doubling to 5 s, times
#: 0.5-1.5, back to 0.1 s after a good connection. No bound: the reader lives until the Executor's
#: shutdown (results keep flowing over REST meanwhile).
_CONNECT_RETRY = Backoff(base=0.1, cap=5.0, jitter=(0.5, 1.5))

class Reader(Protocol):
    """What the stream needs of the Executor that reads through it (``cloud_hub.client._executor``,
    which imports this module: named here by what it does, so the import goes one way)."""

    _cursor: int

    def _reading_done(self) -> bool: ...

    def _deliver(self, rows: list[dict[str, Any]], cursor: int) -> None: ...

    def _rest_results_once(self, wait_s: float) -> None: ...


CLOSE_AUTH = 4401  # same codes as cloud_hub/api/stream.py (the SDK does not import the hub)
CLOSE_BAD_FRAME = 4400
#: What the SDK asks for in its hello: msgpack binary frames, with arguments, function bodies and
#: results as raw bytes (no base64 on either side). A hub that predates it answers without
#: ``enc``, and the stream stays JSON text.
ENCODING = "msgpack"


def _raw_batch(body: dict[str, Any]) -> dict[str, Any]:
    """A batch body as REST sends it (base64 text, so a submit can fall back to REST unchanged,
    same idempotency key) with its arguments and function bodies as raw bytes, for a msgpack stream."""
    out = dict(body)
    out["tasks"] = [{**t, "args": base64.b64decode(t["args"])} if isinstance(t.get("args"), str) else t for t in body["tasks"]]
    if body.get("functions"):
        out["functions"] = {fid: {**f, "body": base64.b64decode(f["body"])} if isinstance(f.get("body"), str) else f
                            for fid, f in body["functions"].items()}
    return out


def _decode(frame: str | bytes) -> Any:
    """A frame from the hub: text is JSON, binary is msgpack."""
    if isinstance(frame, str):
        return json.loads(frame)
    return msgpack.unpackb(frame, raw=False)


class StreamUnavailable(Exception):
    """The hub does not offer the stream (no such route, turned off, or a proxy in the way): use REST."""


class FrameTooBig(Exception):
    """This batch is bigger than the hub reads in one frame: send it over REST."""


def stream_url(url: str) -> str:
    base = url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + "/v1/stream"
    if base.startswith("http://"):
        return "ws://" + base[len("http://"):] + "/v1/stream"
    raise ValueError(f"hub URL {url!r} is neither http:// nor https://")


class _Waiter:
    __slots__ = ("event", "answer", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.answer: dict[str, Any] | None = None
        self.error: BaseException | None = None


class HubStream:
    """One stream connection (re-made after each loss) for one Executor."""

    def __init__(self, client: "Client", early: bool = False) -> None:
        self.client = client
        self.early = early  # results as the agent sends them, before the hub's commit (docs/protocol.md)
        self.url = stream_url(client.url)
        self.max_frame = 0
        self._ws: Any = None
        self._ref = 0
        self._waiting: dict[int, _Waiter] = {}
        self._lock = threading.Lock()
        self.connects = 0  # successful connections (1 + reconnects)
        self.submits = 0  # batches the hub accepted over the stream
        self.bytes_sent = 0  # frame payloads (WebSocket framing adds 6-14 B per frame, TCP/TLS more)
        self.bytes_received = 0
        self.enc = "json"  # what the hub's welcome agreed to

    @classmethod
    def first(cls, client: "Client", cursor: int, early: bool = False) -> "HubStream | None":
        """A stream with its first connection made here (so the first batch already uses it),
        None when the hub offers none. A hub that cannot be reached just now gets a stream that
        the reader connects later, with backoff."""
        s = cls(client, early)
        try:
            s._connect(cursor)
        except StreamUnavailable as exc:
            log.info("the hub at %s offers no stream (%s); using REST", client.url, exc)
            return None
        except (HubUnreachable, AuthError) as exc:
            log.warning("stream to the hub not connected yet (%s); the Executor retries it and uses REST meanwhile", exc)
        return s

    @property
    def connected(self) -> bool:
        return self._ws is not None

    # ------------------------------------------------------------------ submitter side
    def submit(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one batch and wait for the hub's answer: the ``accepted`` frame, or raise
        :class:`HubError` with the status REST would have given, :class:`HubUnreachable` when the
        stream dropped before the answer (retry with the same idempotency key), or
        :class:`FrameTooBig` (send it over REST)."""
        ws = self._ws
        if ws is None:
            raise HubUnreachable("the stream to the hub is not connected")
        with self._lock:
            self._ref += 1
            ref = self._ref
            w = self._waiting[ref] = _Waiter()
        try:
            frame: str | bytes
            if self.enc == "msgpack":
                frame = msgpack.packb({"op": "submit", "ref": ref, "batch": _raw_batch(body)}, use_bin_type=True)
            else:
                frame = json.dumps({"op": "submit", "ref": ref, "batch": body}, separators=(",", ":"))
            if len(frame) > self.max_frame:
                raise FrameTooBig(f"batch frame of {len(frame)} bytes is over the hub's {self.max_frame}")
            try:
                ws.send(frame)
                self.bytes_sent += len(frame)
            except Exception as exc:  # ConnectionClosed, OSError: the reader notices and reconnects
                raise HubUnreachable(f"lost the stream to the hub at {self.client.url} while submitting ({exc})") from None
            if not w.event.wait(timeout_s):
                raise HubUnreachable(f"no answer from the hub at {self.client.url} within {timeout_s:g} s on the stream")
        finally:
            with self._lock:
                self._waiting.pop(ref, None)
        if w.error is not None:
            raise w.error
        assert w.answer is not None
        if w.answer["op"] == "refused":
            status, detail = int(w.answer.get("status", 500)), str(w.answer.get("detail", ""))
            if status == 401:
                raise self.client.auth_error(detail)
            retry = w.answer.get("retry_after")
            raise HubError(status, detail, float(retry) if isinstance(retry, (int, float)) else None)
        self.submits += 1
        return w.answer

    # ------------------------------------------------------------------ reader side
    def run(self, ex: Reader) -> bool:
        """Serve ``ex``'s results until it is shut down and has nothing pending (True), or until it
        is clear the hub has no stream (False: the caller reads over REST from ``ex._cursor``)."""
        failed = 0  # connects failed since the last good one; no bound: the reader runs until shut down
        while True:
            if ex._reading_done():
                self._drop()
                return True
            if self._ws is not None:  # connected (by ``first``, or below)
                try:
                    self._serve(ex)
                    return True
                except HubUnreachable as exc:
                    if ex._reading_done():  # shut down meanwhile (the hub stopping with us): nothing to reconnect for
                        return True
                    log.warning("%s; reconnecting", exc)
                finally:
                    self._drop()
                continue
            try:
                self._connect(ex._cursor)
            except StreamUnavailable as exc:
                log.info("the hub at %s offers no stream (%s); using REST", self.client.url, exc)
                return False
            except Exception as exc:  # HubUnreachable, AuthError, or anything unforeseen: this thread must
                # not die while futures wait on it (they would never complete); retry with backoff.
                if not isinstance(exc, (HubUnreachable, AuthError)):
                    log.warning("opening the stream to the hub failed unexpectedly", exc_info=True)
                delay = _CONNECT_RETRY.delay(failed)
                failed += 1
                if self.connects:
                    log.warning("stream to the hub not connected (%s); retrying in %.1f s", exc, delay)
                ex._rest_results_once(delay)  # results keep flowing (or this waits out the delay)
                continue
            failed = 0

    def _serve(self, ex: Reader) -> None:
        ws = self._ws
        while True:
            if ex._reading_done():
                return
            try:
                got = ws.recv(timeout=0.5)
            except TimeoutError:
                continue
            except Exception as exc:
                raise HubUnreachable(_closed_reason(exc, self.client.url)) from None
            self.bytes_received += len(got)
            try:
                msg = _decode(got)
                op = msg["op"]
            except (ValueError, TypeError, KeyError):  # msgpack's errors are ValueErrors too
                raise HubUnreachable(f"the hub sent a frame that is not the stream protocol: {str(got)[:80]!r}") from None
            if op == "results":  # no cursor: sent before the hub stored them (its stored copy moves the cursor later)
                ex._deliver(msg["results"], int(msg.get("cursor") or 0))
            elif op in ("accepted", "refused"):
                with self._lock:
                    w = self._waiting.get(msg.get("ref"))
                if w is not None:
                    w.answer = msg
                    w.event.set()
            elif op == "error":
                log.error("the hub closed the stream: %s", msg.get("detail"))
            # unknown ops from a newer hub are ignored

    def _connect(self, cursor: int) -> None:
        try:
            from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus
            from websockets.sync.client import connect
        except ImportError:
            raise StreamUnavailable("the websockets package is not installed") from None
        tls: ssl.SSLContext | None = None
        if self.url.startswith("wss://"):
            t = self.client._tls
            if isinstance(t, ssl.SSLContext):
                tls = t
            else:
                tls = ssl.create_default_context()
                if t is False:
                    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        url, sock = self.url, None
        try:
            if tls is not None:
                url, sock = _tls_socket(self.url, tls, _OPEN_TIMEOUT_S)
            ws = connect(url, sock=sock, additional_headers={"Authorization": f"Bearer {self.client._token}"}, compression=None,
                         open_timeout=_OPEN_TIMEOUT_S, max_size=None, close_timeout=2, proxy=None)
            if sock is not None:
                sock.settimeout(None)  # open: the stream may stay quiet for hours
        except InvalidStatus as exc:
            raise StreamUnavailable(f"the handshake got HTTP {exc.response.status_code}") from None
        except InvalidMessage as exc:
            if isinstance(exc.__cause__, (EOFError, OSError)):  # the connection dropped before an answer: a hub restarting
                raise HubUnreachable(f"cannot open the stream to {self.url} ({exc}: {exc.__cause__!r})") from None
            raise StreamUnavailable(f"the handshake failed: {exc}") from None
        except InvalidHandshake as exc:
            raise StreamUnavailable(f"the handshake failed: {exc}") from None
        except (OSError, TimeoutError, ConnectionClosed) as exc:  # ConnectionClosed: a hub restarting resets the handshake
            if sock is not None:
                sock.close()
            raise HubUnreachable(f"cannot open the stream to {self.url} ({exc})") from None
        try:
            ws.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Nagle + delayed ACK cost 40 ms a frame
        except OSError:  # already closed by the hub (a refused token): the close frame says why, below
            pass
        try:
            ws.send(json.dumps({"op": "hello", "after": cursor, "enc": ENCODING, **({"early": True} if self.early else {})}))
            welcome = json.loads(ws.recv(timeout=10))
        except Exception as exc:
            ws.close()
            rcvd = getattr(exc, "rcvd", None) or getattr(ws.protocol, "close_rcvd", None)
            if rcvd is not None and rcvd.code == CLOSE_AUTH:
                raise self.client.auth_error(str(rcvd.reason).removeprefix("the hub refused the token: ")) from None
            raise HubUnreachable(_closed_reason(exc, self.client.url)) from None
        if not isinstance(welcome, dict) or welcome.get("op") != "welcome":
            ws.close()
            raise StreamUnavailable(f"the hub answered hello with {str(welcome)[:80]!r}")
        self.max_frame = int(welcome.get("max_frame") or 0)
        self.enc = "msgpack" if welcome.get("enc") == "msgpack" else "json"
        self._ws = ws
        self.connects += 1

    def _drop(self) -> None:
        """The connection is gone: every submit still waiting learns it (and retries with its key)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:
                pass
        with self._lock:
            waiting = list(self._waiting.values())
        for w in waiting:
            if not w.event.is_set():
                w.error = HubUnreachable(f"the stream to the hub at {self.client.url} dropped before the submit was answered")
                w.event.set()

    def close(self) -> None:
        self._drop()


def _closed_reason(exc: BaseException, url: str) -> str:
    rcvd = getattr(exc, "rcvd", None)
    if rcvd is not None:
        if rcvd.code == CLOSE_AUTH:
            return f"the hub at {url} refused the token on the stream: {rcvd.reason}"
        return f"the hub at {url} closed the stream ({rcvd.code} {rcvd.reason})".rstrip()
    return f"lost the stream to the hub at {url} ({type(exc).__name__}: {exc})"


_OPEN_TIMEOUT_S = 10.0


def _tls_socket(url: str, tls: ssl.SSLContext, timeout_s: float) -> tuple[str, ssl.SSLSocket]:
    """A TLS connection to a ``wss://`` hub made here, and the ``ws://`` URL to speak over it.

    Why not websockets' own TLS: its client reads the handshake answer in a thread that, once the
    selector says the socket is readable, blocks in the TLS layer's read without a timeout (a TLS
    record that holds no application data, such as a session ticket, makes the socket readable and
    the read wait for more). When the hub then did not answer in time, closing the connection did
    not free that thread, and opening the stream hung for minutes after its own timeout (seen under
    load in tests/integration/test_tls.py). Here every read until the stream is open is bounded by
    ``timeout_s``; the caller clears the timeout once it is open."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 443
    raw = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock = tls.wrap_socket(raw, server_hostname=host)
    except BaseException:
        raw.close()
        raise
    sock.settimeout(timeout_s)
    return "ws://" + url[len("wss://"):], sock
