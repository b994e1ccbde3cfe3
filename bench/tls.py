"""What TLS costs: round trip, throughput and bytes on the wire, plaintext next to mqtts and wss, in one run.

Three meshes on this machine (real Mosquitto, hub process, one agent process with 2 workers):
``plain`` (HTTP + MQTT on loopback, the demo's setup), ``mqtts`` (HTTPS + MQTT over TLS, CA
pinned at enrollment) and ``wss`` (HTTPS + MQTT over secure WebSockets). Measured on each:

* warm round trip ``Executor.submit(noop).result()`` (rounds rotate through the meshes, so load
  drifting during the run hits them alike) and the raw broker floor (paho QoS 1 echo, TCP_NODELAY);
* throughput: N no-op tasks submitted, all results back;
* bytes on the wire through a counting TCP relay: a whole MQTT session set-up (TCP payload from
  connect to CONNACK: the TLS handshake is most of it) and the bytes per QoS 1 message of 200 B
  (TLS adds one record header + AEAD tag per record; WebSockets a frame header and a mask).

``tls_vs_plain(...) -> dict`` is the API (bench/footprint.py imports it); ``python bench/tls.py``
prints the JSON and writes bench/results/tls.json (and a dated copy).

    python bench/tls.py [--samples 200] [--tasks 2000] [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import _common as c

MODES = ("plain", "mqtts", "wss")
BUDGET_S = 120.0


def noop() -> None:
    return None


# ---------------------------------------------------------------- systems
@contextlib.contextmanager
def _mesh(mode: str, workdir: str | None) -> Iterator[tuple[Any, Any]]:
    from cloud_hub.localmesh import LocalMesh

    tmp = Path(tempfile.mkdtemp(prefix=f"bench-tls-{mode}-", dir=workdir))
    try:
        with LocalMesh(tmp / "mesh", hub_process=True, tls=mode != "plain",
                       mqtt_transport="websockets" if mode == "wss" else "tcp") as mesh:
            agent = mesh.add_agent(f"bench-{mode}", "mqtt", workers=2)
            mesh.wait_online(agent, timeout=60)
            yield mesh, agent
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _CountingRelay:
    """A TCP relay on 127.0.0.1 that counts payload bytes each way (what TCP carries, without IP/TCP headers)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.up = self.down = 0
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.upstream)
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(a, b, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def total(self) -> int:
        with self._lock:
            return self.up + self.down

    def close(self) -> None:
        self._srv.close()


@contextlib.contextmanager
def _floor_broker(workdir: str | None) -> Iterator[tuple[Any, Path]]:
    """One anonymous Mosquitto (the meshes' brokers bind client ids to logins) with a plain, a TLS
    and a wss listener, certificates from ``mesh-hub tls init``: the raw floor of each mode."""
    from cloud_hub.broker import BrokerTls, MosquittoBroker, free_port
    from cloud_hub.tls import init_dir

    tmp = Path(tempfile.mkdtemp(prefix="bench-tls-floor-", dir=workdir))
    try:
        f = init_dir(tmp / "tls")
        with MosquittoBroker(tmp / "broker", tls=BrokerTls(f.ca_cert, f.server_cert, f.server_key), ws_port=free_port()) as b:
            yield b, f.ca_cert
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _paho(mode: str, port: int, ca: Path | None, client_id: str) -> Any:
    import paho.mqtt.client as mqtt

    from mesh_agent.tls import client_context

    cl = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, transport="websockets" if mode == "wss" else "tcp")
    if mode != "plain":
        cl.tls_set_context(client_context(ca))
    if mode == "wss":
        cl.ws_set_options(path="/mqtt")
    # paho does not set TCP_NODELAY (docs: 40-90 ms per QoS 1 hop without it); under wss the socket is wrapped.
    cl.on_socket_open = lambda _c, _u, sock: getattr(sock, "_socket", sock).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return cl


@contextlib.contextmanager
def _echo(mode: str, port: int, ca: Path | None, payload: int = 200) -> Iterator[tuple[Callable[[], None], Any]]:
    """A QoS 1 publisher and a subscriber on one topic, through a counting relay: ``once()`` sends one
    message and waits for it. Yields (once, relay)."""
    relay = _CountingRelay(("127.0.0.1", port))
    got = threading.Event()
    topic = f"bench/tls/{mode}"
    sub = _paho(mode, relay.port, ca, f"bench-sub-{mode}")
    pub = _paho(mode, relay.port, ca, f"bench-pub-{mode}")
    subscribed = threading.Event()
    sub.on_message = lambda *_: got.set()
    sub.on_subscribe = lambda *_: subscribed.set()
    sub.on_connect = lambda cl, *_: cl.subscribe(topic, qos=1)
    sub.connect("127.0.0.1", relay.port)
    sub.loop_start()
    pub.connect("127.0.0.1", relay.port)
    pub.loop_start()
    if not subscribed.wait(15):
        raise RuntimeError(f"{mode}: the echo subscriber did not subscribe")
    body = b"x" * payload

    def once() -> None:
        got.clear()
        pub.publish(topic, body, qos=1)
        if not got.wait(10):
            raise RuntimeError(f"{mode}: echo lost")

    try:
        yield once, relay
    finally:
        for cl in (pub, sub):
            cl.disconnect()
            cl.loop_stop()
        relay.close()


def _session_bytes(mode: str, port: int, ca: Path | None) -> dict[str, int]:
    """TCP payload bytes of one connection set-up: TCP connect to CONNACK (TLS handshake, WebSocket
    upgrade, MQTT CONNECT/CONNACK), each way."""
    relay = _CountingRelay(("127.0.0.1", port))
    cl = _paho(mode, relay.port, ca, f"bench-hs-{mode}")
    done = threading.Event()
    cl.on_connect = lambda *_: done.set()
    try:
        cl.connect("127.0.0.1", relay.port)
        cl.loop_start()
        if not done.wait(15):
            raise RuntimeError(f"{mode}: no CONNACK")
        time.sleep(0.2)  # TLS 1.3 session tickets arrive just after the handshake; count them
        return {"up": relay.up, "down": relay.down, "total": relay.total()}
    finally:
        cl.disconnect()
        cl.loop_stop()
        relay.close()


def _throughput(ex: Any, n: int, budget_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    futures = [ex.submit(noop) for _ in range(n)]
    done, failed = c.wait_all(futures, time.monotonic() + budget_s)
    dt = time.perf_counter() - t0
    return {"tasks": n, "done": done, "failed": failed, "seconds": round(dt, 3), "tasks_per_s": round(done / dt, 1) if dt > 0 else None}


# ---------------------------------------------------------------- the API
def tls_vs_plain(*, samples: int = 200, warmup: int = 20, rounds: int = 5, tasks: int = 2000, echo_messages: int = 200,
                 workdir: str | None = None, modes: tuple[str, ...] = MODES, echo_warmup: int = 20) -> dict[str, Any]:
    """Measure plaintext, mqtts and wss side by side in this process; returns a JSON-able dict.

    ``round_trip``: mesh warm RTT per mode (SDK -> hub -> agent -> hub -> SDK) and the raw broker
    echo floor; ``throughput``: ``tasks`` no-ops per mode; ``wire``: session set-up bytes and bytes
    per 200 B QoS 1 message; ``overhead``: each TLS mode against plain (ratios, extra bytes)."""
    from cloud_hub.broker import find_mosquitto
    from cloud_hub.client import Executor

    if find_mosquitto() is None:
        raise RuntimeError("mosquitto is not installed: run ./taskw setup (apt-get install mosquitto)")
    out: dict[str, Any] = {"modes": list(modes), "params": {"samples": samples, "warmup": warmup, "rounds": rounds, "tasks": tasks,
                                                              "echo_messages": echo_messages, "echo_payload_bytes": 200}}
    with contextlib.ExitStack() as stack:
        meshes: dict[str, tuple[Any, Any, Any]] = {}
        for m in modes:
            c.log(f"starting a {m} mesh (hub process, one MQTT agent, 2 workers)")
            mesh, agent = stack.enter_context(_mesh(m, workdir))
            meshes[m] = (mesh, agent, stack.enter_context(Executor(mesh.client, agent.endpoint_id)))
        broker, floor_ca = stack.enter_context(_floor_broker(workdir))
        ca = {m: None if m == "plain" else floor_ca for m in modes}

        def port(m: str) -> int:
            return {"plain": broker.port, "mqtts": broker.tls_port, "wss": broker.ws_port}[m]

        c.log("bytes on the wire: session set-up")
        out["wire"] = {m: {"session_setup_bytes": _session_bytes(m, port(m), ca[m])} for m in modes}
        echoes = {}
        for m in modes:
            once, relay = stack.enter_context(_echo(m, port(m), ca[m]))
            echoes[m] = once
            for _ in range(echo_warmup):
                once()
            before = relay.total()
            for _ in range(echo_messages):
                once()
            # publisher -> broker -> subscriber, each a PUBLISH and a PUBACK: one message's bytes on both hops
            out["wire"][m]["bytes_per_qos1_message"] = round((relay.total() - before) / echo_messages, 1)
        c.log(f"round trips: {samples} per mode, {rounds} rotating rounds")
        systems: dict[str, Callable[[], Any]] = {}
        for m in modes:
            ex = meshes[m][2]
            systems[f"mesh_{m}"] = (lambda ex=ex: ex.submit(noop).result(30))
            systems[f"broker_echo_{m}"] = echoes[m]
        rtt = c.interleaved_rtt(systems, samples=samples, warmup=warmup, rounds=rounds, budget_s=BUDGET_S)
        out["round_trip"] = {m: {"mesh": rtt[f"mesh_{m}"], "broker_echo": rtt[f"broker_echo_{m}"]} for m in modes}
        out["throughput"] = {}
        for m in modes:
            c.log(f"throughput: {tasks} no-ops over {m}")
            out["throughput"][m] = _throughput(meshes[m][2], tasks, 60.0)
    base = out["round_trip"].get("plain")
    if base:
        out["overhead"] = {}
        for m in modes:
            if m == "plain":
                continue
            rt = out["round_trip"][m]
            out["overhead"][m] = {
                "mesh_rtt_p50_ratio": c.ratio(rt["mesh"].get("p50_ms"), base["mesh"].get("p50_ms")),
                "mesh_rtt_p50_extra_ms": round(rt["mesh"].get("p50_ms", 0) - base["mesh"].get("p50_ms", 0), 3),
                "broker_echo_p50_ratio": c.ratio(rt["broker_echo"].get("p50_ms"), base["broker_echo"].get("p50_ms")),
                "throughput_ratio": c.ratio(out["throughput"][m]["tasks_per_s"], out["throughput"]["plain"]["tasks_per_s"]),
                "session_setup_extra_bytes": out["wire"][m]["session_setup_bytes"]["total"] - out["wire"]["plain"]["session_setup_bytes"]["total"],
                "extra_bytes_per_qos1_message": round(out["wire"][m]["bytes_per_qos1_message"] - out["wire"]["plain"]["bytes_per_qos1_message"], 1),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=200, help="timed round trips per system (default 200)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tasks", type=int, default=2000, help="no-op tasks for the throughput phase (default 2000)")
    c.add_common_args(p)
    args = p.parse_args()
    if args.quick:
        args.samples, args.warmup, args.rounds, args.tasks = min(args.samples, 30), min(args.warmup, 5), min(args.rounds, 3), min(args.tasks, 300)
    echo = {}
    if c.smoke(args):
        args.samples, args.warmup, args.rounds, args.tasks = min(args.samples, 5), min(args.warmup, 2), 1, min(args.tasks, 20)
        echo = {"echo_messages": 5, "echo_warmup": 2}
    started = time.monotonic()
    out = c.header("tls", args)
    out.update(tls_vs_plain(samples=args.samples, warmup=args.warmup, rounds=args.rounds, tasks=args.tasks, workdir=args.workdir, **echo))
    c.finish("tls", out, args, started)
    c.smoke_check([f"throughput over {m}: {r['done']} of {r['tasks']} done, {r['failed']} failed"
                   for m, r in out["throughput"].items() if r["failed"] or r["done"] < r["tasks"]])
    if not args.no_save:
        (c.RESULTS_DIR / "tls.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
