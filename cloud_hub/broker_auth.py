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
import grp
import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from mesh_agent.reload import reload_process

__all__ = [
    "BrokerAccount",
    "new_broker_password",
    "broker_hash",
    "hash_part",
    "mosquitto_hash",
    "verify_mosquitto_hash",
    "render_password_file",
    "render_acl_file",
    "write_broker_files",
    "reload_broker",
    "PASSWORD_FILE",
    "ACL_FILE",
    "BROKER_CONF_LINES",
    "default_group",
    "group_id",
]

log = logging.getLogger(__name__)
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
    #: a site gateway (docs/sites.md): the devices whose frames it relays over its one uplink
    relays: tuple[str, ...] = ()


def new_broker_password() -> str:
    return secrets.token_urlsafe(32)


def mosquitto_hash(password: str, *, salt: bytes | None = None, iterations: int = _ITERATIONS) -> str:
    """``$7$<iterations>$<base64 salt>$<base64 PBKDF2-SHA512>``, the format of ``mosquitto_passwd``."""
    salt = os.urandom(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def broker_hash(password: str) -> str:
    """What the hub stores for an endpoint's broker password: the Mosquitto ``$7$`` hash, a space,
    and a bcrypt (cost 4) hash, the only hashed form NATS accepts in its config.

    Both, so that moving from Mosquitto to a NATS cluster (``mesh-hub broker-config --kind nats``)
    needs no re-enrollment: the hub never keeps the password itself. Cost 4 (~1 ms, as cheap as the
    ``$7$`` one): the passwords are 256-bit random, and NATS pays the cost on every CONNECT."""
    import bcrypt

    return f"{mosquitto_hash(password)} {bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()}"


def hash_part(stored: str, kind: str) -> str | None:
    """The ``kind`` ("mosquitto": ``$7$``, "bcrypt": ``$2b$``) hash out of a stored :func:`broker_hash`
    (or a bare ``$7$`` hash stored before bcrypt was added); None when it has none of that kind."""
    want = "$7$" if kind == "mosquitto" else "$2"
    return next((h for h in stored.split() if h.startswith(want)), None)


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
    lines += [f"{_check_name(a.username)}:{h}" for a in accounts if (h := hash_part(a.password_hash, "mosquitto"))]
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
            *[line for d in a.relays for line in (f"topic read {prefix}/ep/{_check_name(d)}/down", f"topic write {prefix}/ep/{d}/up")],
            "",
        ]
    return "\n".join(out)


#: Mosquitto drops root and runs as this user/group (Debian); it must be able to read the files.
BROKER_GROUP = "mosquitto"
_MODE = 0o640


def group_id(group: str | int) -> int:
    """A group name or number -> gid; ValueError naming the group when there is no such group."""
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"no such group {group!r} (the group Mosquitto runs as; Debian: mosquitto)") from None


def default_group(directory: Path) -> int | None:
    """The group new broker files get: the folder's group if it is setgid (the documented set-up:
    ``install -d -o root -g mosquitto -m 2750``), else ``mosquitto`` if that group exists, else none."""
    st = Path(directory).stat()
    if st.st_mode & stat.S_ISGID:
        return st.st_gid
    try:
        return grp.getgrnam(BROKER_GROUP).gr_gid
    except KeyError:
        return None


def _write_atomic(path: Path, text: str, gid: int | None) -> None:
    """Replace ``path`` atomically, keeping its owner, group and mode when it exists (the broker
    must still read it after the hub's rewrite); a new file is 0640 with group ``gid``."""
    uid, mode = -1, _MODE
    try:
        old = path.stat()
    except FileNotFoundError:
        pass
    else:
        mode = stat.S_IMODE(old.st_mode) & 0o770  # never world-readable, whatever it was
        gid = old.st_gid if gid is None else gid
        uid = old.st_uid if os.geteuid() == 0 else -1
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # no wider until chown'ed
    try:
        if gid is not None or uid != -1:
            try:
                os.fchown(fd, uid, -1 if gid is None else gid)
            except PermissionError:  # not root and not in that group: say so, the broker may not read it
                log.warning("cannot give %s to group %s (not permitted); Mosquitto may not be able to read it", path, gid)
        os.fchmod(fd, mode)  # after chown: chown clears nothing we set here, and umask does not apply
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if fd != -1:
            os.close(fd)
    os.replace(tmp, path)


def write_broker_files(directory: Path, hub_user: str, hub_password: str, prefix: str, accounts: Iterable[BrokerAccount],
                       peer_hubs: Iterable[tuple[str, str]] = (), *, group: str | int | None = None) -> tuple[Path, Path]:
    """Write ``password_file`` and ``acl_file`` (mode 0640, atomically) into ``directory``.

    Group: ``group`` if given; else an existing file keeps its owner, group and mode (the hub's
    rewrites after each enrollment must not take the broker's read access away); else
    :func:`default_group`. ``peer_hubs``: (username, ``$7$`` hash) of other hub replicas, given
    the hub's full access."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gid = group_id(group) if group is not None else None
    accounts = list(accounts)
    peers = list(peer_hubs)
    pw, acl = directory / PASSWORD_FILE, directory / ACL_FILE
    for path, text in (
        (pw, render_password_file(hub_user, mosquitto_hash(hub_password), accounts) + "".join(f"{_check_name(u)}:{h}\n" for u, h in peers)),
        (acl, render_acl_file(hub_user, prefix, accounts) + "".join(f"\n# hub replica\nuser {_check_name(u)}\ntopic readwrite #\n" for u, _ in peers)),
    ):
        _write_atomic(path, text, gid if gid is not None or path.exists() else default_group(directory))
    return pw, acl


def reload_broker(pid_file: Path) -> bool:
    """SIGHUP the broker whose pid is in ``pid_file`` (it re-reads password and ACL files; a NATS
    node its config). Several pids, one a line: the nodes of a cluster on this machine.

    Returns False when no such process runs (the broker is down; it reads the files on start)."""
    try:
        pids = [int(line) for line in Path(pid_file).read_text().split()]
    except (FileNotFoundError, ValueError):
        return False
    told = 0
    for pid in pids:
        # One node of a cluster down: the others still reload. One still starting: told once it listens for SIGHUP.
        told += reload_process(pid)
    return told > 0


#: What a mosquitto.conf needs to enforce these files (``{dir}`` is where they are written).
BROKER_CONF_LINES = (
    "allow_anonymous false\n"
    "password_file {dir}/" + PASSWORD_FILE + "\n"
    "acl_file {dir}/" + ACL_FILE + "\n"
    "use_username_as_clientid true\n"
)
