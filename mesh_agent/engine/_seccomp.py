"""A seccomp filter for sandboxed workers: ``socket(AF_UNIX, ...)`` fails with EPERM.

Why: bubblewrap's new network namespace takes away TCP/UDP, but not Unix sockets on the
filesystem: a read-only bind still lets a process ``connect()`` to any socket file it can see
(a database's, a container runtime's). Creating a Unix socket is the one step every such connect
needs, so the filter refuses it; the worker's own channel to the agent is an inherited socket and
``socketpair``, pipes and everything else stay allowed. Installed by the worker itself after start
(no new privileges), before any user code; loaded only in sandboxed workers.

Pure ctypes, no libseccomp: a classic BPF program of eight instructions over ``seccomp_data``
(``nr`` at offset 0, ``arch`` at 4, the first argument's low word at 16 on little-endian CPUs).
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["SUPPORTED", "deny_unix_sockets"]

# machine -> (AUDIT_ARCH_*, __NR_socket): the little-endian CPUs endpoints run on
SUPPORTED = {
    "x86_64": (0xC000003E, 41),
    "aarch64": (0xC00000B7, 198),
    "armv7l": (0x40000028, 281),
    "armv6l": (0x40000028, 281),
}

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_RET_K = 0x06
_ALLOW = 0x7FFF0000
_ERRNO_EPERM = 0x00050000 | 1
_AF_UNIX = 1


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def deny_unix_sockets() -> None:
    """Install the filter on this process (and what it starts); raises OSError if it cannot."""
    found = SUPPORTED.get(platform.machine())
    if found is None:
        raise OSError(f"no socket filter for {platform.machine()}")
    arch, nr = found
    prog = [
        (_LD_W_ABS, 0, 0, 4), (_JEQ_K, 0, 5, arch),     # another ABI: allow (cannot happen here)
        (_LD_W_ABS, 0, 0, 0), (_JEQ_K, 0, 3, nr),       # not socket(): allow
        (_LD_W_ABS, 0, 0, 16), (_JEQ_K, 0, 1, _AF_UNIX),  # socket() of another family: allow
        (_RET_K, 0, 0, _ERRNO_EPERM),
        (_RET_K, 0, 0, _ALLOW),
    ]
    filters = (_Filter * len(prog))(*[_Filter(*ins) for ins in prog])
    fprog = _Prog(len(prog), ctypes.cast(filters, ctypes.POINTER(_Filter)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
