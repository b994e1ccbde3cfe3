"""Shared helpers for the benchmarks: machine info, statistics, result files, and the systems
under test (a LocalMesh with one agent, Parsl HTEX with local workers) as context managers.

Everything runs on 127.0.0.1, every loop is bounded in count and in time, and every process
started here is stopped on the way out (LocalMesh context manager, ``parsl.dfk().cleanup()``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterator

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# The repository root goes first, and this folder (which Python puts first for `python
# bench/x.py`) last: otherwise bench/scheduler.py would shadow the `scheduler` package the hub
# imports, and bench/multiprocessing.py the standard library's (uvicorn imports it).
_here = [p for p in sys.path if p and Path(p).resolve() == BENCH_DIR]
sys.path[:] = [str(REPO)] + [p for p in sys.path if p != str(REPO) and p not in _here] + _here


# ---------------------------------------------------------------- reporting
def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "hostname": socket.gethostname(),
        "versions": {m: _version(m) for m in ("parsl", "pyzmq", "paho-mqtt", "aiomqtt", "httpx", "uvicorn", "continuum-mesh")},
    }
    try:
        import zmq

        info["versions"]["libzmq"] = zmq.zmq_version()
    except Exception:
        pass
    from cloud_hub.broker import find_mosquitto

    exe = find_mosquitto()
    if exe:
        try:
            out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5)
            info["versions"]["mosquitto"] = (out.stdout or out.stderr).splitlines()[0].split()[-1]
        except Exception:
            pass
    return info


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def fsync_latency_ms(directory: str | None = None, n: int = 20) -> dict[str, float] | None:
    """p50/max of fsync after a small append, where the mesh keeps its SQLite files: every
    hub and agent commit pays one (``synchronous=FULL``)."""
    try:
        fd, path = tempfile.mkstemp(prefix="bench-fsync-", dir=directory)
    except OSError:
        return None
    try:
        ts = []
        for _ in range(n):
            os.write(fd, b"x" * 128)
            t0 = time.perf_counter()
            os.fsync(fd)
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        return {"dir": str(Path(path).parent), "p50": round(percentile(ts, 50), 3), "max": round(ts[-1], 3)}
    finally:
        os.close(fd)
        os.unlink(path)


def write_result(name: str, obj: dict[str, Any]) -> Path | None:
    """Print ``obj`` as one JSON object on stdout and write it to bench/results/<name>-<UTC>.json
    (in a ``--smoke`` run only print it: returns None)."""
    if SMOKE:
        print(json.dumps(obj, indent=2, sort_keys=False), flush=True)
        return None
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = utc_now().strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    text = json.dumps(obj, indent=2, sort_keys=False)
    path.write_text(text + "\n")
    print(text, flush=True)
    return path


def log(msg: str) -> None:
    """Progress goes to stderr: stdout carries only the JSON object."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of an already sorted list."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def latency_stats(samples_s: list[float], *, wanted: int, truncated: bool) -> dict[str, Any]:
    """Round-trip times (seconds) summarised in milliseconds."""
    ms = sorted(s * 1e3 for s in samples_s)
    out: dict[str, Any] = {"n": len(ms), "wanted": wanted, "truncated": truncated}
    if ms:
        out.update(
            p50_ms=round(percentile(ms, 50), 4),
            p90_ms=round(percentile(ms, 90), 4),
            p99_ms=round(percentile(ms, 99), 4),
            mean_ms=round(sum(ms) / len(ms), 4),
            min_ms=round(ms[0], 4),
            max_ms=round(ms[-1], 4),
        )
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def wait_all(futures: list["Future[Any]"], deadline: float) -> tuple[int, int]:
    """Wait for futures until ``deadline`` (monotonic); returns (done, failed)."""
    done = failed = 0
    for f in futures:
        left = deadline - time.monotonic()
        try:
            f.result(timeout=max(0.0, left))
        except TimeoutError:
            break
        except Exception:
            failed += 1
        done += 1
    return done, failed


# ---------------------------------------------------------------- systems under test
@contextlib.contextmanager
def local_mesh(transport: str, *, workers: int = 2, workdir: str | None = None) -> Iterator[tuple[Any, Any]]:
    """A LocalMesh (real Mosquitto, hub process, one agent process) with one agent on ``transport``.

    ``workdir`` is where the hub's and the agent's SQLite files live (default: the system temp
    dir, on disk); both stores commit with ``synchronous=FULL``, so its fsync latency counts."""
    from cloud_hub.broker import find_mosquitto
    from cloud_hub.localmesh import LocalMesh

    if find_mosquitto() is None:
        raise SystemExit("mosquitto is not installed: run ./taskw setup (apt-get install mosquitto)")
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-mesh-{transport}-", dir=workdir))
    try:
        with LocalMesh(tmp / "mesh", hub_process=True) as mesh:  # hub in its own process, as deployed
            agent = mesh.add_agent(f"bench-{transport}", transport, workers=workers)
            mesh.wait_online(agent, timeout=60)
            yield mesh, agent
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


PARSL_SETTINGS = {
    "executor": "HighThroughputExecutor",
    "max_workers_per_node": 2,
    "provider": "LocalProvider(init_blocks=1, min_blocks=1, max_blocks=1)",
    "address": "127.0.0.1",
    "other": "Parsl defaults (encrypted=True, DFK logging to run_dir, python_app through the DFK)",
}


@contextlib.contextmanager
def parsl_htex(workers: int = 2) -> Iterator[Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """Parsl with a HighThroughputExecutor of ``workers`` local workers; yields ``python_app``
    bound to it. Cleans up the DFK (interchange, worker pool) on the way out."""
    # HTEX launches `interchange.py` and `process_worker_pool.py` from PATH.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    import parsl
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.providers import LocalProvider

    tmp = Path(tempfile.mkdtemp(prefix="bench-parsl-"))
    cfg = Config(
        executors=[
            HighThroughputExecutor(
                label="htex",
                max_workers_per_node=workers,
                address="127.0.0.1",
                provider=LocalProvider(init_blocks=1, min_blocks=1, max_blocks=1),
                worker_logdir_root=str(tmp / "workers"),
            )
        ],
        run_dir=str(tmp / "runinfo"),
        usage_tracking=0,
    )
    dfk = parsl.load(cfg)
    try:
        yield lambda fn: parsl.python_app(fn, executors=["htex"])
    finally:
        try:
            dfk.cleanup()
        finally:
            parsl.clear()
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- floors
@contextlib.contextmanager
def mqtt_echo(host: str, port: int, payload_size: int = 64) -> Iterator[Callable[[], None]]:
    """Raw Mosquitto QoS 1 echo; yields ``once()``, one round trip: client A publishes to
    ``req``; client B, subscribed, publishes the payload back to ``rep``; A waits for it. Both
    sockets get TCP_NODELAY in ``on_socket_open``; the broker has ``set_tcp_nodelay true``."""
    import paho.mqtt.client as mqtt

    tag = uuid.uuid4().hex[:8]
    req, rep = f"bench/{tag}/req", f"bench/{tag}/rep"
    got = threading.Event()

    def nodelay(client: Any, userdata: Any, sock: Any) -> None:
        with contextlib.suppress(Exception):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    clients: list[Any] = []

    def make(name: str, topic: str, on_message: Callable[..., None]) -> Any:
        subscribed = threading.Event()
        cl = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-{name}-{tag}")
        cl.on_socket_open = nodelay
        cl.on_message = on_message
        cl.on_connect = lambda c_, u, f, rc, p=None: c_.subscribe(topic, qos=1)
        cl.on_subscribe = lambda *a: subscribed.set()
        cl.connect(host, port, keepalive=30)
        cl.loop_start()
        clients.append(cl)
        if not subscribed.wait(10):
            raise RuntimeError(f"MQTT client {name} did not subscribe within 10s")
        return cl

    payload = b"x" * payload_size
    try:
        make("echo", req, lambda c_, u, m: c_.publish(rep, m.payload, qos=1))
        ping = make("ping", rep, lambda c_, u, m: got.set())

        def once() -> None:
            got.clear()
            ping.publish(req, payload, qos=1)
            if not got.wait(5):
                raise TimeoutError("MQTT echo not answered within 5s")

        yield once
    finally:
        for cl in clients:
            cl.disconnect()
            cl.loop_stop()


@contextlib.contextmanager
def zmq_echo(payload_size: int = 64) -> Iterator[Callable[[], None]]:
    """Raw ZeroMQ ROUTER (echo thread) / DEALER over tcp://127.0.0.1; yields ``once()``."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                router.send_multipart(router.recv_multipart())

    t = threading.Thread(target=serve, name="zmq-echo", daemon=True)
    t.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * payload_size

    def once() -> None:
        dealer.send(payload)
        dealer.recv()

    try:
        yield once
    finally:
        stop.set()
        t.join(2)
        dealer.close(0)
        router.close(0)
        ctx.term()


def interleaved_rtt(systems: dict[str, Callable[[], Any]], *, samples: int, warmup: int, rounds: int,
                    budget_s: float) -> dict[str, dict[str, Any]]:
    """Time each system's ``once()`` sequentially, ``samples`` times each, in ``rounds`` blocks
    that rotate through the systems, so background load drifting during the run hits all of
    them alike. ``warmup`` untimed calls each first; stops early (``truncated``) after ``budget_s``."""
    deadline = time.monotonic() + budget_s
    for once in systems.values():
        for _ in range(warmup):
            if time.monotonic() > deadline:
                break
            once()
    times: dict[str, list[float]] = {name: [] for name in systems}
    per_round = max(1, -(-samples // max(1, rounds)))
    names = list(systems)
    r = 0
    while any(len(v) < samples for v in times.values()) and time.monotonic() < deadline:
        order = names[r % len(names):] + names[: r % len(names)]
        r += 1
        for name in order:
            once, got = systems[name], times[name]
            for _ in range(min(per_round, samples - len(got))):
                t0 = time.perf_counter()
                once()
                got.append(time.perf_counter() - t0)
            if time.monotonic() > deadline:
                break
    return {name: latency_stats(v, wanted=samples, truncated=len(v) < samples) for name, v in times.items()}


# ---------------------------------------------------------------- smoke mode
#: True in a ``--smoke`` run (set by :func:`smoke`): :func:`write_result` and :func:`finish` only
#: print, so a smoke run never writes or overwrites anything under bench/results/.
SMOKE = False
SMOKE_HELP = ("a few seconds: tiny sizes through the same code path (and the same-run baselines where they are cheap); "
              "prints the JSON (with \"smoke\": true), writes nothing under bench/results/, exits non-zero on any failure")


def add_smoke_arg(parser: Any) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def smoke(args: Any) -> bool:
    """Call right after ``parse_args``: True in a ``--smoke`` run, which then also counts as
    ``--no-save`` (where the script has that option) and makes :func:`write_result` print only."""
    global SMOKE
    if getattr(args, "smoke", False):
        SMOKE = True
        if hasattr(args, "no_save"):
            args.no_save = True
        log("--smoke: tiny sizes, nothing written under bench/results/; the figures mean nothing")
    return SMOKE


def smoke_check(problems: list[str]) -> None:
    """In a ``--smoke`` run, exit 1 when something went wrong that the full run only reports
    (tasks failed or timed out, a leg that errored): call it after the JSON is printed."""
    if SMOKE and problems:
        for p in problems:
            log(f"--smoke: FAILED: {p}")
        raise SystemExit(1)


def smoke_skipped(what: str, why: str) -> dict[str, Any]:
    """What a smoke run reports in place of a part it leaves out (said on stderr too)."""
    log(f"--smoke: {what} skipped: {why}")
    return {"skipped_in_smoke": why}


# ---------------------------------------------------------------- CLI
def add_common_args(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="small numbers (about a tenth of a full run)")
    add_smoke_arg(parser)
    parser.add_argument("--transports", default="mqtt,zmq", help="comma-separated: mqtt,zmq (default both)")
    parser.add_argument("--no-parsl", action="store_true", help="skip the Parsl HTEX comparison")
    parser.add_argument("--no-save", action="store_true", help="print the JSON but do not write bench/results/")
    parser.add_argument("--workdir", default=None,
                        help="directory for the mesh's SQLite files (default: system temp dir); "
                             "e.g. /dev/shm to see what fsync latency costs")


def header(name: str, args: Any) -> dict[str, Any]:
    now = utc_now()
    return {
        "benchmark": name,
        "smoke": bool(getattr(args, "smoke", False)),
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info(),
        "params": {k: v for k, v in vars(args).items()},
        "fsync_ms": fsync_latency_ms(args.workdir),
        "loadavg_start": loadavg(),
    }


def finish(name: str, out: dict[str, Any], args: Any, started: float) -> None:
    out["loadavg_end"] = loadavg()
    out["runtime_s"] = round(time.monotonic() - started, 2)
    if args.no_save or SMOKE:
        print(json.dumps(out, indent=2), flush=True)
    else:
        path = write_result(name, out)
        if path is not None:
            log(f"wrote {path.relative_to(REPO)}")
