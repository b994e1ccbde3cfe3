"""Run a real Mosquitto for a one-machine setup (demo, tests, small deployments).

The generated config listens on loopback only, sets ``set_tcp_nodelay true`` (QoS 1 hops cost
40-90 ms without it) and raises ``max_queued_messages`` well above the default 1000, past which
Mosquitto silently drops QoS 1 messages; durability still never depends on the broker.

With ``hub_login`` the broker runs locked down: no anonymous clients, a ``password_file`` and an
``acl_file`` in its working directory (written by the hub, see cloud_hub.broker_auth), and client
ids tied to usernames. Its pid is written to ``broker.pid`` so the hub can SIGHUP it after an
enrollment rewrote those files.
"""

from __future__ import annotations

import collections
import os
import pwd
import random
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mesh_agent.reload import reload_process

__all__ = ["MosquittoBroker", "BrokerError", "free_port", "find_mosquitto", "port_holder"]


class BrokerError(RuntimeError):
    pass


_PORT_FLOOR = 10_000  # below: well-known services (PostgreSQL 5432, Redis 6379, NATS 4222, ...)
_handed_out: collections.deque[int] = collections.deque(maxlen=4096)
_handed_lock = threading.Lock()
_port_rng = random.SystemRandom()  # not the global generator: a process that seeds that one must not draw its neighbours' ports


def _ephemeral_start() -> int:
    """Where the kernel's range for the source ports of outgoing connections (and for
    ``bind(port 0)``) begins."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nobody holds now, for a server started next (tests, LocalMesh).

    Why not just ``bind(port 0)``: the kernel hands those out from the ephemeral range, the range
    every outgoing connection takes its source port from, so between our close and the server's
    bind some client socket (another agent's, another test's) may take it, and the server fails
    to start (seen once in a hunt under load). A port below that range is never taken that way:
    one is drawn at random there, checked by binding it, and not handed out twice by this process.
    Falls back to port 0 where the kernel leaves no room below its range."""
    lo = _ephemeral_start()
    if lo - _PORT_FLOOR >= 1000:
        for _ in range(200):
            port = _port_rng.randrange(_PORT_FLOOR, lo)
            with _handed_lock:
                if port in _handed_out:
                    continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            with _handed_lock:
                _handed_out.append(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_holder(host: str, port: int) -> str | None:
    """Who listens on ``host:port``: "pid 812 (mosquitto)", "another process" when the kernel will
    not say (another user's socket without root), or None when nobody listens there."""
    import psutil

    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.laddr.ip in (host, "0.0.0.0", "::"):
            if c.pid is None:
                return "another process"
            try:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None


def port_taken(host: str, port: int) -> bool:
    # SO_REUSEADDR as Mosquitto sets it: a port in TIME_WAIT is free for it, and so for us.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _in_use_message(host: str, port: int) -> str:
    holder = port_holder(host, port) or "another process"
    hint = " (Debian's mosquitto package starts one there: `systemctl stop mosquitto`, or choose another --mqtt-port)" if port == 1883 else \
        " (choose another --mqtt-port)"
    return f"cannot start the embedded broker: {host}:{port} is already in use by {holder}{hint}"


@dataclass(frozen=True)
class BrokerTls:
    """Certificate files of a TLS listener (``mesh-hub tls init`` writes them; Let's Encrypt's work too).

    ``cafile`` is what clients' certificates are checked against when ``require_certificate``
    (mutual TLS); Mosquitto also wants it for the listener to start at all."""

    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False


def tls_listener_conf(port: int, host: str | None, tls: BrokerTls, *, websockets: bool = False) -> str:
    """mosquitto.conf lines for an MQTT-over-TLS listener (``websockets``: MQTT over wss).

    Debian's mosquitto 2.0.11 has websockets (libwebsockets 4.1, built in), with two quirks found
    here: a websockets listener bound to an IPv4 address listens on *every* interface unless the
    listener also says ``socket_domain ipv4``, and the broker refuses to start when its only
    listener is a websockets one (our configs always keep the plain loopback listener)."""
    lines = [f"listener {port}" + (f" {host}" if host else "")]
    if websockets and host and ":" not in host and host != "localhost":
        lines.append("socket_domain ipv4")
    if websockets:
        lines.append("protocol websockets")
    lines += [f"cafile {Path(tls.cafile).resolve()}", f"certfile {Path(tls.certfile).resolve()}", f"keyfile {Path(tls.keyfile).resolve()}",
              "tls_version tlsv1.2"]
    if tls.require_certificate:
        lines.append("require_certificate true")
    return "\n".join(lines) + "\n"


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()), None)


class MosquittoBroker:
    def __init__(self, workdir: Path, port: int | None = None, host: str = "127.0.0.1", extra_conf: str = "",
                 hub_login: tuple[str, str] | None = None, tls: BrokerTls | None = None, tls_port: int | None = None,
                 ws_port: int | None = None) -> None:
        """``hub_login`` = (username, password) of the hub's own broker user turns on passwords and ACLs.

        ``tls`` adds an MQTT-over-TLS listener (``tls_port``, a free port by default) and, with
        ``ws_port``, an MQTT-over-wss one, both on ``host``, next to the plain listener on
        ``port`` (which the hub itself uses on this machine)."""
        self.workdir = Path(workdir)
        self.tls = tls
        self.tls_port = (tls_port or free_port()) if tls is not None else None
        self.ws_port = ws_port if tls is not None else None
        self.host = host
        self.port = port or free_port()
        self.extra_conf = extra_conf
        self.hub_login = hub_login
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def conf_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def pid_path(self) -> Path:
        return self.workdir / "broker.pid"

    @property
    def secure(self) -> bool:
        return self.hub_login is not None

    def _auth_conf(self) -> str:
        if self.hub_login is None:
            return "allow_anonymous true\n"
        from cloud_hub.broker_auth import ACL_FILE, BROKER_CONF_LINES, PASSWORD_FILE, write_broker_files

        if not (self.workdir / PASSWORD_FILE).exists() or not (self.workdir / ACL_FILE).exists():
            write_broker_files(self.workdir, *self.hub_login, prefix="mesh", accounts=[])  # the hub adds endpoints
        return BROKER_CONF_LINES.format(dir=self.workdir)

    def reload(self) -> None:
        """Re-read password and ACL files (what the hub does through ``broker.pid``)."""
        if self.proc is not None and self.proc.poll() is None:
            reload_process(self.proc.pid)

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(
            f"listener {self.port} {self.host}\n"
            # Started as root, mosquitto drops to user 'mosquitto', which cannot write our
            # (private) working directory: stay the user who started it.
            f"user {pwd.getpwuid(os.getuid()).pw_name}\n"
            + self._auth_conf()
            + "set_tcp_nodelay true\n"
            "max_queued_messages 100000\n"
            "max_inflight_messages 1000\n"
            "persistence true\n"
            f"persistence_location {self.workdir}/\n"
            "autosave_interval 5\n"
            f"log_dest file {self.workdir}/mosquitto.log\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            + self.extra_conf
            + self._tls_conf()
        )
        return self.conf_path

    def _tls_conf(self) -> str:
        # Last in the file: listener options bind to the listener line above them.
        if self.tls is None or self.tls_port is None:
            return ""
        out = tls_listener_conf(self.tls_port, self.host, self.tls)
        if self.ws_port:
            out += tls_listener_conf(self.ws_port, self.host, self.tls, websockets=True)
        return out

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        exe = find_mosquitto()
        if exe is None:
            raise BrokerError("mosquitto is not installed (Debian: apt-get install mosquitto); ./taskw setup installs it")
        # A port someone else holds (Debian's own mosquitto on 1883) must stop us here: connecting
        # to "whatever answers" would attach the hub to a broker without our logins and ACLs.
        if port_taken(self.host, self.port):
            raise BrokerError(_in_use_message(self.host, self.port))
        self.write_config()
        self.proc = subprocess.Popen([exe, "-c", str(self.conf_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid_path.write_text(f"{self.proc.pid}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                code = self.proc.returncode
                self.proc = None  # reaped by poll(): no defunct child stays behind
                if port_taken(self.host, self.port):  # lost a race for the port
                    raise BrokerError(_in_use_message(self.host, self.port))
                raise BrokerError(f"mosquitto exited with {code}: {err.strip() or self._log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            if self._listening():
                return self
            time.sleep(0.05)  # something answered, but not (yet) our process: see whether it exits
        self.stop()
        raise BrokerError(f"mosquitto did not listen on {self.host}:{self.port} within {timeout}s; {self._log_tail()}")

    def _listening(self) -> bool:
        """Our own child holds the listening socket (not a broker that was there before us)."""
        import psutil

        if self.proc is None:
            return False
        try:
            conns = psutil.Process(self.proc.pid).net_connections(kind="inet")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port for c in conns)

    def _log_tail(self) -> str:
        try:
            lines = (self.workdir / "mosquitto.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no broker log"
        return f"last log line: {lines[-1]}" if lines else "empty broker log"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "MosquittoBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
