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

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["MosquittoBroker", "BrokerError", "free_port", "find_mosquitto"]


class BrokerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()), None)


class MosquittoBroker:
    def __init__(self, workdir: Path, port: int | None = None, host: str = "127.0.0.1", extra_conf: str = "",
                 hub_login: tuple[str, str] | None = None) -> None:
        """``hub_login`` = (username, password) of the hub's own broker user turns on passwords and ACLs."""
        self.workdir = Path(workdir)
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
            self.proc.send_signal(signal.SIGHUP)

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
        )
        return self.conf_path

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        exe = find_mosquitto()
        if exe is None:
            raise BrokerError("mosquitto is not installed (Debian: apt-get install mosquitto); ./taskw setup installs it")
        self.write_config()
        self.proc = subprocess.Popen([exe, "-c", str(self.conf_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid_path.write_text(f"{self.proc.pid}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise BrokerError(f"mosquitto exited with {self.proc.returncode}: {err.strip()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise BrokerError(f"mosquitto did not listen on {self.host}:{self.port} within {timeout}s")

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
