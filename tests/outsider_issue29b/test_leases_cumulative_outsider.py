"""Outsider's check of issue 29 item 3, "Leases confirmed cumulatively" (docs/sites.md, docs/protocol.md).

Written from the documentation only. Real processes: Mosquitto, an in-process hub, a
``mesh-agent gateway`` and three ``mesh-agent start`` devices behind it; the uplink goes through
the emulator's fault proxy. Every task appends a line per run (start and end) to a file, so real
executions are counted; results are read back from the hub's REST API.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
import zlib
from hashlib import sha256
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh
from sim.emulate.proxy import LinkShape
from tests.proxy import ProxyThread
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")


# ------------------------------------------------------------------ helpers
def _work(tag: str, dev: str, dur: float, log: str, pad: bytes = b"") -> str:
    """The task: one 'S' line when a run starts, one 'E' line when it ends."""
    import os
    import time

    def line(kind: str) -> None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{kind} {tag} {dev} {os.getpid()} {time.time():.6f}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    line("S")
    time.sleep(dur)
    line("E")
    return tag


def _runs(log: Path) -> list[tuple[str, str, str, int, float]]:
    if not log.exists():
        return []
    out = []
    for ln in log.read_text().splitlines():
        parts = ln.split()
        if len(parts) == 5:
            out.append((parts[0], parts[1], parts[2], int(parts[3]), float(parts[4])))
    return out


def _starts(log: Path) -> dict[str, int]:
    c: dict[str, int] = {}
    for kind, tag, *_ in _runs(log):
        if kind == "S":
            c[tag] = c.get(tag, 0) + 1
    return c


def _results(mesh: LocalMesh, ids: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(0, len(ids), 1000):
        r = mesh.client._http.post("/v1/results/wait", json={"task_ids": ids[i:i + 1000], "timeout_s": 0})
        r.raise_for_status()
        rows += r.json()["results"]
    return rows


def _stats(mesh: LocalMesh) -> dict[str, Any]:
    assert mesh.hub is not None
    return dict(mesh.hub.hub.dispatcher.stats)


def _submit(mesh: LocalMesh, fid: str, devs: list, tags: list[str], dur: float, log: Path,
            pad: bytes = b"") -> dict[str, tuple[str, str]]:
    """tag -> (task id, device endpoint id); round robin over devs."""
    out = {}
    for i, tag in enumerate(tags):
        d = devs[i % len(devs)]
        tid = mesh.client.submit(d.endpoint_id, fid, tag, d.cfg.name, dur, str(log), pad)
        out[tag] = (tid, d.endpoint_id)
    return out


def _wait_all(mesh: LocalMesh, tasks: dict[str, tuple[str, str]], timeout: float, what: str, logs: list) -> None:
    ids = [t for t, _ in tasks.values()]
    wait_for(lambda: len(_results(mesh, ids)) >= len(ids), f"{what}: all {len(ids)} results", timeout,
             step=0.5, logs=logs)


def _check_exactly_once(mesh: LocalMesh, tasks: dict[str, tuple[str, str]], log: Path,
                        may_rerun: set[str] = frozenset()) -> None:
    ids = {tid: (tag, ep) for tag, (tid, ep) in tasks.items()}
    rows = _results(mesh, list(ids))
    seen = [r["task_id"] for r in rows]
    assert len(seen) == len(set(seen)), f"a task has more than one result row: {len(seen)} rows, {len(set(seen))} ids"
    assert set(seen) == set(ids), f"missing results: {sorted(set(ids) - set(seen))[:5]}"
    for r in rows:
        tag, ep = ids[r["task_id"]]
        assert r["ok"], f"task {tag} failed: {base64.b64decode(r['data'])[:300]!r}"
        assert r["endpoint_id"] == ep, f"task {tag} ran on {r['endpoint_id']}, not on {ep}"
        assert base64.b64decode(r["data"]) == b"json\n" + json.dumps(tag).encode(), f"result of {tag} is another task's"
    starts = _starts(log)
    never = sorted(t for t in tasks if starts.get(t, 0) == 0)
    assert not never, f"tasks with a result but never run (log says): {never[:5]}"
    twice = {t: n for t, n in starts.items() if n > 1 and t not in may_rerun}
    assert not twice, f"tasks run more than once (not explained by a device kill): {twice}"
    extra = sorted(set(starts) - set(tasks))
    assert not extra, f"runs of unknown tags: {extra[:5]}"


@contextlib.contextmanager
def _shaped_site(tmp_path: Path, gw_name: str, dev_prefix: str, lost_after_s: float,
                 shape: LinkShape) -> Iterator[tuple[LocalMesh, ProxyThread, Any, list[Any]]]:
    """A hub (lease_s 2 s, site_hold_s 300 s), a gateway whose uplink goes through a fault proxy,
    3 devices behind it, all online; then the uplink takes ``shape``."""
    with LocalMesh(tmp_path / "mesh", heartbeat_s=1.0, lost_after_s=lost_after_s, lease_s=2.0,
                   hub_overrides={"site_hold_s": 300.0}) as mesh:
        proxy = ProxyThread(("127.0.0.1", mesh.broker.port))
        try:
            gw = mesh.add_gateway(gw_name, hold=64, uplink_port=proxy.port, workers=1)
            devs = [mesh.add_site_device(f"{dev_prefix}-{i}", gw) for i in range(3)]
            mesh.wait_online(gw, *devs, timeout=60)
            proxy.proxy.shape = shape
            yield mesh, proxy, gw, devs
        finally:
            proxy.stop()


# ------------------------------------------------------------------ test 1
def test_slow_confirmations_lease_each_task_ahead_once(tmp_path: Path) -> None:
    """Every confirmation is far slower than lease_s (2 s): 1.5 s +- 0.3 s each way, 48 kbit/s.
    No task may be leased ahead twice, nothing given up; each runs and is stored once."""
    log = tmp_path / "runs.log"
    with _shaped_site(tmp_path, "gw1", "d1", 20.0, LinkShape(latency_s=1.5, jitter_s=0.3, bandwidth_bps=48_000)) as (mesh, proxy, gw, devs):
        time.sleep(2.0)  # let the shaped link carry what was in flight
        before = _stats(mesh)
        fid = mesh.client.register_function(_work)
        tasks = _submit(mesh, fid, devs, [f"s{i:03d}" for i in range(42)], 0.05, log)
        _wait_all(mesh, tasks, 90, "slow uplink", [gw, *devs])
        after = _stats(mesh)
        print("stats before", before, "\nstats after", after, "\nproxy", proxy.stats)
        _check_exactly_once(mesh, tasks, log)
        leased = after.get("site_leased", 0) - before.get("site_leased", 0)
        assert leased == len(tasks), (f"{len(tasks)} tasks were leased ahead {leased} times over a slow but "
                                      f"unbroken uplink (promise: no re-lease merely because confirmations are slow); {after}")
        assert after.get("site_given_up", 0) == before.get("site_given_up", 0), after
        assert after["results_stored"] - before["results_stored"] == len(tasks), after


# ------------------------------------------------------------------ test 2
def test_short_reset_long_blackhole_and_device_kill(tmp_path: Path) -> None:
    """A 3 s reset outage (the gateway's session should survive it), then a 20 s blackhole (it
    does not: lost_after_s 6), a second wave submitted during the blackhole, and a device
    SIGKILLed mid-run while the uplink is dark. Every task: one result; one run, except a task
    the killed device was running (at-least-once, docs/protocol.md section 7)."""
    log = tmp_path / "runs.log"
    with _shaped_site(tmp_path, "gw2", "d2", 6.0, LinkShape(latency_s=0.3, jitter_s=0.1, bandwidth_bps=256_000)) as (mesh, proxy, gw, devs):
        fid = mesh.client.register_function(_work)
        tasks = _submit(mesh, fid, devs, [f"a{i:03d}" for i in range(33)], 0.8, log)
        wait_for(lambda: sum(_starts(log).values()) >= 4, "first runs", 40, step=0.2, logs=[gw, *devs])
        proxy.cut("reset", cause="short")
        time.sleep(3.0)
        proxy.restore(cause="short")
        wait_for(lambda: sum(_starts(log).values()) >= 10, "runs after the short outage", 40, step=0.2, logs=[gw, *devs])
        proxy.cut("blackhole", cause="long")
        t_cut = time.monotonic()
        wave2 = _submit(mesh, fid, devs, [f"b{i:03d}" for i in range(15)], 0.3, log)
        victim = devs[1]

        def running_on_victim() -> bool:
            open_: dict[str, int] = {}
            for kind, tag, dev, _pid, _t in _runs(log):
                if dev == victim.cfg.name:
                    open_[tag] = open_.get(tag, 0) + (1 if kind == "S" else -1)
            return any(v > 0 for v in open_.values())

        wait_for(running_on_victim, "the victim device mid-run during the blackhole", 10, step=0.05, logs=[victim])
        victim.kill()
        t_kill = time.time()
        time.sleep(1.0)
        victim.start()
        time.sleep(max(0.0, 20.0 - (time.monotonic() - t_cut)))
        proxy.restore(cause="long")
        tasks.update(wave2)
        _wait_all(mesh, tasks, 75, "after the outages", [gw, *devs])
        time.sleep(2.0)  # late duplicates, if any, would show up now
        # A task the victim was running at the kill, or had just finished, may run again.
        may = set()
        for kind, tag, dev, _pid, t in _runs(log):
            if dev == victim.cfg.name and t <= t_kill + 0.05:
                may.add(tag)
        ends = {tag for kind, tag, dev, _p, t in _runs(log) if kind == "E" and dev == victim.cfg.name and t < t_kill - 1.0}
        may -= ends
        print("stats", _stats(mesh), "\nproxy", proxy.stats, "\nmay rerun", sorted(may))
        _check_exactly_once(mesh, tasks, log, may_rerun=may)
        st = _stats(mesh)
        assert st["results_stored"] == len(tasks), st


# ------------------------------------------------------------------ test 3
def test_gateway_sigkilled_with_batches_in_flight(tmp_path: Path) -> None:
    """A narrow uplink (32 kbit/s, 1 s latency) is busy carrying site_down batches (tasks with
    ~900 B of arguments each) when the gateway is SIGKILLed (with its site Mosquitto), twice.
    The gateway comes back each time; nothing may be stranded while it is connected, nothing
    run or stored twice."""
    log = tmp_path / "runs.log"
    with _shaped_site(tmp_path, "gw3", "d3", 10.0, LinkShape(latency_s=1.0, jitter_s=0.2, bandwidth_bps=32_000)) as (mesh, proxy, gw, devs):
        fid = mesh.client.register_function(_work)
        # Counted from before the submits: on a loaded machine the 45 submits can take as long as
        # the uplink takes to carry all their batches.
        down0 = proxy.stats["bytes_down"]
        tasks = _submit(mesh, fid, devs, [f"k{i:03d}" for i in range(45)], 0.1, log, pad=os.urandom(900))
        wait_for(lambda: proxy.stats["bytes_down"] - down0 > 6_000, "batches crossing the uplink", 30, step=0.1, logs=[gw])
        gw.kill()
        n_at_kill1 = len(_results(mesh, [t for t, _ in tasks.values()]))
        time.sleep(1.5)
        gw.start()
        wait_for(lambda: sum(_starts(log).values()) >= 5, "runs after the first gateway restart", 60, step=0.2,
                 logs=[gw, *devs])
        gw.kill()
        time.sleep(2.5)
        gw.start()
        _wait_all(mesh, tasks, 90, "after two gateway kills", [gw, *devs])
        time.sleep(2.0)
        st = _stats(mesh)
        print("stats", st, "\nproxy", proxy.stats, "\nresults at first kill", n_at_kill1)
        _check_exactly_once(mesh, tasks, log)
        assert st["results_stored"] == len(tasks), st


# ------------------------------------------------------------------ test 4
SITE_UP, SITE_DOWN = 11, 12


def _seal(ep: str, kind: int, body: dict[str, Any], key: bytes, *, flip: bool = False) -> bytes:
    """A v2 frame built from docs/protocol.md section 1 alone."""
    raw = msgpack.packb(body, use_bin_type=True)
    mid = secrets.token_hex(12).encode()
    ts = time.time()
    head = (b"CM\x02" + bytes([len(ep)]) + ep.encode() + bytes([kind]) + bytes([len(mid)]) + mid
            + struct.pack(">d", ts) + struct.pack(">d", ts + 120.0))
    mac = hmac.new(key, head + raw, sha256).digest()
    if flip:
        mac = bytes([mac[0] ^ 1]) + mac[1:]
    return head + mac + raw


def _open(frame: bytes) -> tuple[int, dict[str, Any]]:
    n = frame[3]
    kind = frame[4 + n]
    m = frame[5 + n]
    body = frame[6 + n + m + 16 + 32:]
    if kind & 0x80:
        body = zlib.decompress(body)
    return kind & 0x7F, msgpack.unpackb(body, raw=False)


def _tasks_in_site_down(payload: bytes) -> list[str]:
    """Task ids of the device tasks frames inside a site_down (empty for anything else)."""
    try:
        kind, body = _open(payload)
        if kind != SITE_DOWN:
            return []
        ids = []
        for _idx, inner in body.get("f", []):
            k, b = _open(bytes(inner))
            if k == 4:
                ids += [t["id"] for t in b.get("tasks", [])]
        return ids
    except Exception:
        return []


class MqttTap:
    """A man in the middle on the gateway's own uplink TCP connection (what a compromised gateway
    box sees and can write): it reads the MQTT PUBLISH packets the broker delivers to the gateway,
    and can slip a QoS 0 PUBLISH of its own into the gateway's stream between two of its packets."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(8)
        self.port = self.lsock.getsockname()[1]
        self.down: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._up: socket.socket | None = None
        self._level = 4
        self._stop = False
        self.drop_tasks_batches = 0
        self.dropped: list[list[str]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            with self._lock:
                self._up = u
            threading.Thread(target=self._pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    @staticmethod
    def _packet(buf: bytearray) -> int:
        """Length of the first complete MQTT packet in buf, or 0."""
        mult, n, i = 1, 0, 1
        while True:
            if i >= len(buf):
                return 0
            b = buf[i]
            n += (b & 0x7F) * mult
            mult *= 128
            i += 1
            if not b & 0x80:
                break
        return i + n if len(buf) >= i + n else 0

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        buf = bytearray()
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                buf += data
                while (n := self._packet(buf)):
                    pkt = bytes(buf[:n])
                    del buf[:n]
                    if up and pkt[0] >> 4 == 1:  # CONNECT: note the protocol level
                        self._level = pkt[self._hdr(pkt) + 6]
                    if not up and pkt[0] >> 4 == 3:
                        topic, payload = self._publish_seen(pkt)
                        if self.drop_tasks_batches > 0:
                            ids = _tasks_in_site_down(payload)
                            if ids:  # a site_down carrying tasks: it vanishes on the way
                                self.drop_tasks_batches -= 1
                                self.dropped.append(ids)
                                continue
                    with self._lock:
                        dst.sendall(pkt)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    @staticmethod
    def _hdr(pkt: bytes) -> int:
        i = 1
        while pkt[i] & 0x80:
            i += 1
        return i + 1

    def _publish_seen(self, pkt: bytes) -> tuple[str, bytes]:
        i = self._hdr(pkt)
        tl = struct.unpack(">H", pkt[i:i + 2])[0]
        topic = pkt[i + 2:i + 2 + tl].decode()
        j = i + 2 + tl
        if (pkt[0] >> 1) & 3:
            j += 2
        if self._level == 5:  # properties
            mult, n = 1, 0
            while True:
                b = pkt[j]
                j += 1
                n += (b & 0x7F) * mult
                mult *= 128
                if not b & 0x80:
                    break
            j += n
        self.down.append((topic, pkt[j:]))
        return topic, pkt[j:]

    def inject(self, topic: str, payload: bytes) -> None:
        t = topic.encode()
        var = struct.pack(">H", len(t)) + t + (b"\0" if self._level == 5 else b"")
        rest = var + payload
        n, enc = len(rest), bytearray()
        while True:
            b = n % 128
            n //= 128
            enc.append(b | (0x80 if n else 0))
            if not n:
                break
        with self._lock:
            assert self._up is not None, "no gateway connection to inject into"
            self._up.sendall(b"\x30" + bytes(enc) + rest)

    def stop(self) -> None:
        self._stop = True
        self.lsock.close()


def _site_downs(tap: MqttTap, down_topic: str) -> list[dict[str, Any]]:
    out = []
    for topic, payload in list(tap.down):
        if topic != down_topic or not payload.startswith(b"CM"):
            continue
        try:
            kind, body = _open(payload)
        except Exception:
            continue
        if kind == SITE_DOWN and isinstance(body, dict):
            out.append(body)
    return out


def test_lying_gateway_and_lost_batch(tmp_path: Path) -> None:
    """Two sites on one hub, each gateway's uplink through a man in the middle on its own TCP
    connection (MqttTap).

    Site A, a lying gateway: an attacker on the gateway box (its key, its uplink connection) reads
    the hub's site_down numbering off the wire and slips site_up frames into the gateway's own
    MQTT connection that lie: "stored up to" numbers never sent (n+1000, 2**62), a foreign
    numbering, a negative number, malformed claims; the honest gateway process keeps working. The
    lies may delay work but nothing may run twice, be stored twice or be lost.

    Site B, an honest gateway on a lossy wire: one site_down carrying tasks vanishes on the way
    while the gateway stays connected; the next work goes 1 s later and is stored. The lost batch
    must be re-sent on that evidence ("the gateway stored later batches", "its summary stops
    short of it"), not stranded for site_hold_s (300 s) while the gateway is connected."""
    log = tmp_path / "runs.log"
    with LocalMesh(tmp_path / "mesh", heartbeat_s=1.0, lost_after_s=8.0, lease_s=2.0,
                   hub_overrides={"site_hold_s": 300.0}) as mesh:
        tap = MqttTap(("127.0.0.1", mesh.broker.port))
        tap_b = MqttTap(("127.0.0.1", mesh.broker.port))
        try:
            gw = mesh.add_gateway("gw4", hold=64, uplink_port=tap.port, workers=1)
            devs = [mesh.add_site_device(f"d4-{i}", gw) for i in range(3)]
            gw_b = mesh.add_gateway("gw5", hold=64, uplink_port=tap_b.port, workers=1)
            devs_b = [mesh.add_site_device(f"d5-{i}", gw_b) for i in range(2)]
            mesh.wait_online(gw, *devs, gw_b, *devs_b, timeout=60)
            key = bytes.fromhex(json.loads(Path(gw.cfg.credentials_file).read_text())["key"])
            ep = gw.endpoint_id
            up_topic = f"{gw.cfg.mqtt.topic_prefix}/ep/{ep}/up"
            down_topic = f"{gw.cfg.mqtt.topic_prefix}/ep/{ep}/down"
            fid = mesh.client.register_function(_work)

            # ---- site A: lies
            tasks = _submit(mesh, fid, devs, [f"w{i:03d}" for i in range(12)], 0.05, log)
            _wait_all(mesh, tasks, 45, "first wave", [gw, *devs])
            numbered = wait_for(lambda: [b for b in _site_downs(tap, down_topic) if "e" in b and "n" in b],
                                "a numbered site_down read off the gateway's uplink", 15)
            e = numbered[-1]["e"]
            top = max(b["n"] for b in numbered if b["e"] == e)
            print("attacker read", len(numbered), "site_down; numbering", e, "top n", top)
            # Control: a frame with a broken MAC is counted as rejected (so the counter is live).
            rej0 = _stats(mesh)["rejected_frames"]
            tap.inject(up_topic, _seal(ep, SITE_UP, {"d": [], "f": [], "s": {"c": [e, top + 1]}}, key, flip=True))
            wait_for(lambda: _stats(mesh)["rejected_frames"] > rej0, "the broken-MAC control frame to be rejected", 10)
            # The lie proper: stored up to a number far past anything sent, then more work.
            rej1 = _stats(mesh)["rejected_frames"]
            tap.inject(up_topic, _seal(ep, SITE_UP, {"d": [], "f": [], "s": {"c": [e, top + 1000]}}, key))
            time.sleep(0.5)
            print("rejected after the well-formed lie:", _stats(mesh)["rejected_frames"] - rej1)
            wave2 = _submit(mesh, fid, devs, [f"x{i:03d}" for i in range(24)], 0.1, log)
            for claim in ([e, 2 ** 62], ["deadbeef", 3], [e, -5], [e, "7"], "junk", [e], [e, top + 1000]):
                tap.inject(up_topic, _seal(ep, SITE_UP, {"d": [], "f": [], "s": {"c": claim}}, key))
            tap.inject(up_topic, _seal(ep, SITE_UP, {"d": [], "f": [], "s": {"c": [e, top + 5],
                                                                             "l": [[7, 1, 1, 1, 0, 0, 0, 0, 0]]}}, key))
            tasks.update(wave2)
            _wait_all(mesh, tasks, 60, "work after the lies (the honest gateway holds all of it)", [gw, *devs])
            wave3 = _submit(mesh, fid, devs, [f"z{i:03d}" for i in range(9)], 0.05, log)
            tasks.update(wave3)
            _wait_all(mesh, tasks, 45, "a wave after the lies", [gw, *devs])
            print("after the lies", _stats(mesh))
            _check_exactly_once(mesh, tasks, log)

            # ---- site B: one lost site_down, gateway connected throughout
            warm = _submit(mesh, fid, devs_b, [f"v{i:03d}" for i in range(4)], 0.05, log)
            _wait_all(mesh, warm, 45, "site B warm-up", [gw_b, *devs_b])
            tap_b.drop_tasks_batches = 1
            lossy = _submit(mesh, fid, devs_b, [f"l{i:03d}" for i in range(6)], 0.05, log)
            wait_for(lambda: tap_b.dropped, "a tasks-carrying site_down to drop", 15)
            time.sleep(1.0)
            later = _submit(mesh, fid, devs_b, [f"m{i:03d}" for i in range(12)], 0.05, log)
            _wait_all(mesh, later, 45, "site B's later batches", [gw_b, *devs_b])
            lossy.update(later)
            lossy.update(warm)
            print("dropped batch held", tap_b.dropped, "stats", _stats(mesh))
            _wait_all(mesh, lossy, 45, f"the dropped site_down's {len(tap_b.dropped[0])} tasks re-sent while the gateway "
                      f"is connected (later batches were stored; site_hold_s 300 s); stats {_stats(mesh)}", [gw_b, *devs_b])
            tasks.update(lossy)
            time.sleep(1.0)
            st = _stats(mesh)
            print("stats", st)
            _check_exactly_once(mesh, tasks, log)
            assert st["results_stored"] == len(tasks), st
        finally:
            tap.stop()
            tap_b.stop()
