"""Files that hold secrets are created owner-only (0600), never briefly world-readable.

Why here: the hub's SQLite database holds every endpoint's HMAC key and the hub's CURVE secret
key; the agent's queue holds task arguments and results. Python's ``sqlite3`` creates a new
database with the process umask (typically 0644), and SQLite gives the ``-wal``, ``-shm`` and
``-journal`` files the database file's mode. So the database file is created 0600 *before*
SQLite opens it, and an existing file (and its WAL/SHM, say from an older version) that others
may read is tightened. Shared by the agent's queue and the hub's store; stdlib only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Iterator

__all__ = ["prepare_private_sqlite", "private_umask", "PRIVATE_MODE"]

PRIVATE_MODE = 0o600
_SIDE_FILES = ("", "-wal", "-shm", "-journal")
log = logging.getLogger(__name__)


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Anything created inside is owner-only (umask 077). Process-wide: keep the block short."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def prepare_private_sqlite(path: Path) -> None:
    """Make sure ``path`` (a SQLite database) and its side files are readable by their owner only.

    Creates a missing database file empty with mode 0600 (SQLite treats an empty file as a new
    database); a missing parent folder is created 0700. Existing files with group or other bits
    are chmod'ed to 0600; one we may not chmod (another owner) is left as it is with a warning.
    """
    path = Path(path)
    if not path.parent.exists():
        with private_umask():
            path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, PRIVATE_MODE)
        except OSError:
            return  # the caller's open fails with its own, clearer error (a folder, no permission, ...)
        os.close(fd)
    for suffix in _SIDE_FILES:
        side = Path(f"{path}{suffix}")
        try:
            mode = side.stat().st_mode
        except OSError:
            continue
        if stat.S_ISREG(mode) and mode & 0o077:
            try:
                os.chmod(side, PRIVATE_MODE)
            except OSError as exc:
                log.warning("%s is readable by other users and cannot be made private: %s", side, exc)
