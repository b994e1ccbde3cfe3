"""Per-endpoint broker credentials and topic ACLs for Mosquitto (``password_file`` + ``acl_file``).

Why: frames are signed, so a device cannot forge work for another, but on an open broker it could
still read another device's task stream or flood its topics. Each MQTT endpoint therefore gets its
own broker username (its endpoint id) and a random password at enrollment; the hub keeps only a
Mosquitto ``$7$`` hash (PBKDF2-SHA512, what ``mosquitto_passwd`` writes and Mosquitto 2 checks), and
the ACL lets each endpoint read only ``{prefix}/ep/{id}/down`` and write only ``{prefix}/ep/{id}/up``.
The hub's own broker user may read and write everything. ``use_username_as_clientid`` in the broker
config stops one device from taking over another's MQTT session by claiming its client id.

Files are rewritten atomically from the hub's database on start-up and after each enrollment, and
the broker is told to reload them with SIGHUP (``mesh-hub broker-config`` writes the same files).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = [
    "BrokerAccount",
    "new_broker_password",
    "mosquitto_hash",
    "verify_mosquitto_hash",
    "render_password_file",
    "render_acl_file",
    "write_broker_files",
    "reload_broker",
    "PASSWORD_FILE",
    "ACL_FILE",
    "BROKER_CONF_LINES",
]

PASSWORD_FILE = "password_file"
ACL_FILE = "acl_file"
#: 1,000 rounds: the passwords are 256-bit random, so the KDF cost is not what protects them, and
#: Mosquitto pays it on every CONNECT (a fleet reconnecting after an outage).
_ITERATIONS = 1000
_SALT_BYTES = 12  # as mosquitto_passwd


@dataclass(frozen=True)
class BrokerAccount:
    """One endpoint's broker login: username, ``$7$`` hash, and the endpoint whose topics it may use."""

    username: str
    password_hash: str
    endpoint_id: str


def new_broker_password() -> str:
    return secrets.token_urlsafe(32)


def mosquitto_hash(password: str, *, salt: bytes | None = None, iterations: int = _ITERATIONS) -> str:
    """``$7$<iterations>$<base64 salt>$<base64 PBKDF2-SHA512>``, the format of ``mosquitto_passwd``."""
    salt = os.urandom(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_mosquitto_hash(password: str, encoded: str) -> bool:
    try:
        _, seven, iterations, salt, digest = encoded.split("$")
        if seven != "7":
            return False
        want = base64.b64decode(digest, validate=True)
        got = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(salt, validate=True), int(iterations), len(want))
    except ValueError:
        return False
    return hmac.compare_digest(got, want)


def _check_name(name: str) -> str:
    # Mosquitto's file formats are line and colon based; topic wildcards in a username would turn
    # an ACL line into a pattern. Hub-made names never contain these; refuse rather than escape.
    if not name or any(c in name for c in ":\n\r\t #+/") or not name.isascii():
        raise ValueError(f"unusable broker username {name!r}")
    return name


def render_password_file(hub_user: str, hub_hash: str, accounts: Iterable[BrokerAccount]) -> str:
    lines = [f"{_check_name(hub_user)}:{hub_hash}"]
    lines += [f"{_check_name(a.username)}:{a.password_hash}" for a in accounts]
    return "\n".join(lines) + "\n"


def render_acl_file(hub_user: str, prefix: str, accounts: Iterable[BrokerAccount]) -> str:
    out = [
        "# Written by the Continuum Mesh hub (mesh-hub broker-config); rewritten on every enrollment.",
        "# The hub's own user: every topic.",
        f"user {_check_name(hub_user)}",
        "topic readwrite #",
        "",
    ]
    for a in accounts:
        _check_name(a.endpoint_id)
        out += [
            f"# endpoint {a.endpoint_id}: its own topics and nothing else",
            f"user {_check_name(a.username)}",
            f"topic read {prefix}/ep/{a.endpoint_id}/down",
            f"topic write {prefix}/ep/{a.endpoint_id}/up",
            "",
        ]
    return "\n".join(out)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_broker_files(directory: Path, hub_user: str, hub_password: str, prefix: str, accounts: Iterable[BrokerAccount],
                       peer_hubs: Iterable[tuple[str, str]] = ()) -> tuple[Path, Path]:
    """Write ``password_file`` and ``acl_file`` (mode 0640, atomically) into ``directory``.

    ``peer_hubs``: (username, ``$7$`` hash) of other hub replicas, given the hub's full access."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    accounts = list(accounts)
    peers = list(peer_hubs)
    pw, acl = directory / PASSWORD_FILE, directory / ACL_FILE
    _write_atomic(pw, render_password_file(hub_user, mosquitto_hash(hub_password), accounts)
                  + "".join(f"{_check_name(u)}:{h}\n" for u, h in peers))
    _write_atomic(acl, render_acl_file(hub_user, prefix, accounts)
                  + "".join(f"\n# hub replica\nuser {_check_name(u)}\ntopic readwrite #\n" for u, _ in peers))
    return pw, acl


def reload_broker(pid_file: Path) -> bool:
    """SIGHUP the Mosquitto whose pid is in ``pid_file`` (it re-reads password and ACL files).

    Returns False when there is no such process (the broker is down; it reads the files on start)."""
    try:
        pid = int(Path(pid_file).read_text().strip())
        os.kill(pid, signal.SIGHUP)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False
    return True


#: What a mosquitto.conf needs to enforce these files (``{dir}`` is where they are written).
BROKER_CONF_LINES = (
    "allow_anonymous false\n"
    "password_file {dir}/" + PASSWORD_FILE + "\n"
    "acl_file {dir}/" + ACL_FILE + "\n"
    "use_username_as_clientid true\n"
)
