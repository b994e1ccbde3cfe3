"""What the task path's security costs, each part next to its own baseline in the same run.

* frame checks: verifying a ``tasks`` frame (header, HMAC-SHA256, freshness, replay, msgpack,
  body shape checks) vs. only msgpack-unpacking the same body, for 1, 100 and 2000 tasks;
* ZeroMQ: ROUTER/DEALER echo with CURVE (and a ZAP handler) vs. plain, interleaved;
* MQTT: QoS 1 echo on a Mosquitto with passwords, ACLs and ``use_username_as_clientid`` vs. the
  same Mosquitto anonymous, interleaved (two brokers, same tuning);
* broker login: CONNECT round trip with a ``$7$`` (PBKDF2-SHA512, 1000 rounds) password vs. anonymous.

Prints one JSON object and writes bench/results/security-<UTC>.json. Loopback only; bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
import timeit
from pathlib import Path
from typing import Any, Callable, Iterator

import _common as c

BUDGET_S = 240.0


def frame_checks(repeat: int) -> dict[str, Any]:
    import msgpack

    from mesh_agent.protocol import Envelope, Kind, ReplayGuard, decode, encode, new_key, open_frame

    key = new_key()
    out: dict[str, Any] = {}
    for n in (1, 100, 2000):
        tasks = [{"id": os.urandom(16).hex(), "fn": "ab" * 32, "args": b"pickle\n" + os.urandom(60), "timeout": None, "exp": time.time() + 86400}
                 for _ in range(n)]
        body = {"tasks": tasks, "functions": {"ab" * 32: b"dill\n" + os.urandom(800)}, "allow": None}
        frames = [encode(Envelope(Kind.TASKS, "ep-0123456789ab", body), key) for _ in range(repeat)]
        payload = open_frame(frames[0], key).payload
        guard = ReplayGuard()
        it = iter(frames)
        full = timeit.timeit(lambda: decode(next(it), key, replay=guard), number=repeat) / repeat
        bare = timeit.timeit(lambda: msgpack.unpackb(payload, raw=False, strict_map_key=True), number=repeat) / repeat
        out[f"tasks_{n}"] = {
            "frame_bytes": len(frames[0]),
            "verify_and_decode_us": round(full * 1e6, 2),
            "msgpack_only_us": round(bare * 1e6, 2),
            "overhead_us": round((full - bare) * 1e6, 2),
            "per_task_overhead_us": round((full - bare) * 1e6 / n, 3),
        }
    return out


@contextlib.contextmanager
def zmq_echo(curve: bool) -> Iterator[Callable[[], None]]:
    """ROUTER echo thread + DEALER; with ``curve`` both ends use CURVE and a ZAP handler admits the client key."""
    import zmq
    import zmq.utils.z85

    ctx = zmq.Context()
    stop = threading.Event()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvtimeo = 5000
    threads = []
    if curve:
        server_pub, server_sec = zmq.curve_keypair()
        client_pub, client_sec = zmq.curve_keypair()
        zap = ctx.socket(zmq.REP)
        zap.linger = 0
        zap.bind("inproc://zeromq.zap.01")

        def serve_zap() -> None:
            poller = zmq.Poller()
            poller.register(zap, zmq.POLLIN)
            while not stop.is_set():
                if poller.poll(100):
                    m = zap.recv_multipart()
                    ok = m[5] == b"CURVE" and zmq.utils.z85.encode(m[6]) == client_pub
                    zap.send_multipart([m[0], m[1], b"200" if ok else b"400", b"", b"ep" if ok else b"", b""])

        threads.append(threading.Thread(target=serve_zap, daemon=True))
        router.curve_server = True
        router.curve_secretkey = server_sec
        router.zap_domain = b"bench"
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_pub, client_pub, client_sec
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                router.send_multipart(router.recv_multipart())

    threads.append(threading.Thread(target=serve, daemon=True))
    for t in threads:
        t.start()
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * 200

    def once() -> None:
        dealer.send(payload)
        dealer.recv()

    try:
        yield once
    finally:
        stop.set()
        for t in threads:
            t.join(2)
        for s in (dealer, router):
            s.close(0)
        if curve:
            zap.close(0)
        ctx.term()


@contextlib.contextmanager
def mqtt_echo(port: int, logins: tuple[tuple[str, str], tuple[str, str]] | None) -> Iterator[Callable[[], None]]:
    """QoS 1 echo between two paho clients (TCP_NODELAY), optionally each with its own login."""
    import socket
    import uuid

    import paho.mqtt.client as mqtt

    tag = uuid.uuid4().hex[:8]
    req, rep = "mesh/ep/ep-echo/down", "mesh/ep/ep-echo/up"  # the echo side is endpoint ep-echo, the pinger the hub
    got = threading.Event()
    clients: list[Any] = []

    def make(login: tuple[str, str] | None, topic: str, on_message: Callable[..., None]) -> Any:
        subscribed = threading.Event()
        cl = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-{len(clients)}-{tag}")
        if login:
            cl.username_pw_set(*login)
        cl.on_socket_open = lambda cl_, u, sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cl.on_message = on_message
        cl.on_connect = lambda c_, u, f, rc, p=None: c_.subscribe(topic, qos=1)
        cl.on_subscribe = lambda *a: subscribed.set()
        cl.connect("127.0.0.1", port, keepalive=30)
        cl.loop_start()
        clients.append(cl)
        if not subscribed.wait(10):
            raise RuntimeError("MQTT bench client did not subscribe")
        return cl

    try:
        make(logins[0] if logins else None, req, lambda c_, u, m: c_.publish(rep, m.payload, qos=1))
        ping = make(logins[1] if logins else None, rep, lambda c_, u, m: got.set())

        def once() -> None:
            got.clear()
            ping.publish(req, b"x" * 200, qos=1)
            if not got.wait(5):
                raise TimeoutError("MQTT echo not answered within 5s")

        yield once
    finally:
        for cl in clients:
            cl.disconnect()
            cl.loop_stop()


def connect_once(port: int, login: tuple[str, str] | None) -> Callable[[], None]:
    import paho.mqtt.client as mqtt

    def once() -> None:
        done = threading.Event()
        cl = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        if login:
            cl.username_pw_set(*login)
        cl.on_connect = lambda *a: done.set()
        cl.connect("127.0.0.1", port)
        cl.loop_start()
        try:
            if not done.wait(5):
                raise TimeoutError("no CONNACK")
        finally:
            cl.disconnect()
            cl.loop_stop()

    return once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--samples", type=int, default=2000, help="round trips per system (default 2000)")
    p.add_argument("--repeat", type=int, default=200, help="frames decoded per size (default 200)")
    c.add_common_args(p)
    args = p.parse_args()
    warmup, rounds, connects = 50, 10, max(20, args.samples // 20)
    if args.quick:
        args.samples, args.repeat = 200, 30
        connects = max(20, args.samples // 20)
    if c.smoke(args):
        args.samples, args.repeat, warmup, rounds, connects = 10, 5, 3, 2, 4
    started = time.monotonic()
    out = c.header("security", args)
    c.log("frame verification vs msgpack alone")
    out["frame_checks"] = frame_checks(args.repeat)

    from cloud_hub.broker import MosquittoBroker
    from cloud_hub.broker_auth import BrokerAccount, mosquitto_hash, write_broker_files

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-security-")))
        hub = ("mesh-hub", "hubpw")
        secure = MosquittoBroker(tmp / "secure", hub_login=hub)
        # endpoint logins exactly as enrollment writes them: each limited to its own topic pair
        accounts = [BrokerAccount("ep-echo", mosquitto_hash("pw-echo"), "ep-echo"), BrokerAccount("ep-conn", mosquitto_hash("pw-conn"), "ep-conn")]
        write_broker_files(secure.workdir, *hub, "mesh", accounts)
        stack.enter_context(secure)
        plain = stack.enter_context(MosquittoBroker(tmp / "plain"))
        c.log("connect cost: $7$ login vs anonymous")
        conn = c.interleaved_rtt({"connect_login": connect_once(secure.port, ("ep-conn", "pw-conn")),
                                  "connect_anonymous": connect_once(plain.port, None)},
                                 samples=connects, warmup=3, rounds=min(5, connects), budget_s=60)
        systems = {
            "zmq_curve": stack.enter_context(zmq_echo(True)),
            "zmq_plain": stack.enter_context(zmq_echo(False)),
            "mqtt_acl": stack.enter_context(mqtt_echo(secure.port, (("ep-echo", "pw-echo"), hub))),
            "mqtt_anonymous": stack.enter_context(mqtt_echo(plain.port, None)),
        }
        c.log(f"timing {args.samples} round trips each: {', '.join(systems)}")
        rtt = c.interleaved_rtt(systems, samples=args.samples, warmup=warmup, rounds=rounds, budget_s=BUDGET_S)
    out["round_trips"] = rtt
    out["connect"] = conn
    out["overheads"] = {
        "zmq_curve_vs_plain_p50_ratio": c.ratio(rtt["zmq_curve"].get("p50_ms"), rtt["zmq_plain"].get("p50_ms")),
        "mqtt_acl_vs_anonymous_p50_ratio": c.ratio(rtt["mqtt_acl"].get("p50_ms"), rtt["mqtt_anonymous"].get("p50_ms")),
        "connect_login_vs_anonymous_p50_ratio": c.ratio(conn["connect_login"].get("p50_ms"), conn["connect_anonymous"].get("p50_ms")),
    }
    c.finish("security", out, args, started)


if __name__ == "__main__":
    main()
