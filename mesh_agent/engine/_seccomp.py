"""The seccomp filter of a sandboxed worker: one classic BPF program, built here, no libseccomp.

Why each rule (docs/environments.md, "The sandbox"; issue 25):

* **A foreign ABI kills the process.** A filter that checks syscall numbers is only right for
  the ABI whose numbers it checks: on x86_64 the 32-bit ``int 0x80`` gate and the x32 ABI (bit
  0x40000000 in the number) reach other tables, and an attacker got ``socket(AF_UNIX)`` through
  ``int 0x80``. So the first rule compares ``seccomp_data.arch`` and kills on a mismatch, and on
  x86_64 any number with the x32 bit set is killed too.
* **Kernel surfaces a Python function never needs** fail with EPERM: namespaces (``unshare``,
  ``setns``, ``clone`` with a ``CLONE_NEW*`` flag; ``clone3`` gets ENOSYS so libc falls back to
  ``clone``), mounts, ``ptrace`` and ``process_vm_*``, ``io_uring``, ``userfaultfd``, the kernel
  keyring, ``perf_event_open``, ``bpf``, module and kexec loading, ``open_by_handle_at``
  (which opens files by handle around the mount tree), ``syslog``, ``acct``, swap.
* **No network: no Unix sockets.** bubblewrap's new network namespace takes TCP/UDP away but a
  read-only bind still lets a process ``connect()`` to a socket file it can see, so without
  ``network`` ``socket(AF_UNIX, ...)`` fails with EPERM. Inherited sockets and ``socketpair``
  still work (the worker's channel is one).

The worker's lockdown (``_lockdown.py``) installs the program with no_new_privs before it execs
the worker interpreter, so it covers interpreter start-up (a tenant venv's ``.pth`` files) too.
Stdlib only: the lockdown imports this module by file path, before ``site`` runs.
"""

from __future__ import annotations

import ctypes
import platform
import struct

__all__ = ["SUPPORTED", "program", "install", "deny_unix_sockets"]

_X86_64, _AARCH64, _ARM = 0xC000003E, 0xC00000B7, 0x40000028

#: machine -> (AUDIT_ARCH_*, syscall numbers by name): the CPUs endpoints run on. x86_64 and
#: aarch64 from the kernel's headers (asm/unistd_64.h, asm-generic/unistd.h), arm EABI from
#: arch/arm/tools/syscall.tbl.
_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (_X86_64, {
        "socket": 41, "clone": 56, "ptrace": 101, "syslog": 103, "pivot_root": 155, "acct": 163, "mount": 165,
        "umount2": 166, "swapon": 167, "swapoff": 168, "init_module": 175, "delete_module": 176, "kexec_load": 246,
        "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
        "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442}),
    "aarch64": (_AARCH64, {
        "socket": 198, "clone": 220, "ptrace": 117, "syslog": 116, "pivot_root": 41, "acct": 89, "mount": 40,
        "umount2": 39, "swapon": 224, "swapoff": 225, "init_module": 105, "delete_module": 106, "kexec_load": 104,
        "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "perf_event_open": 241,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270,
        "process_vm_writev": 271, "finit_module": 273, "kexec_file_load": 294, "bpf": 280, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442}),
    "armv7l": (_ARM, {
        "socket": 281, "clone": 120, "ptrace": 26, "syslog": 103, "pivot_root": 218, "acct": 51, "mount": 21,
        "umount2": 52, "swapon": 87, "swapoff": 115, "init_module": 128, "delete_module": 129, "kexec_load": 347,
        "add_key": 309, "request_key": 310, "keyctl": 311, "unshare": 337, "perf_event_open": 364,
        "name_to_handle_at": 370, "open_by_handle_at": 371, "setns": 375, "process_vm_readv": 376,
        "process_vm_writev": 377, "finit_module": 379, "bpf": 386, "userfaultfd": 388,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442}),
}
_TABLES["armv6l"] = _TABLES["armv7l"]

#: machine -> (AUDIT_ARCH_*, __NR_socket), as before: what callers check a CPU against
SUPPORTED = {m: (arch, t["socket"]) for m, (arch, t) in _TABLES.items()}

_DENIED = ("ptrace", "syslog", "pivot_root", "acct", "mount", "umount2", "swapon", "swapoff", "init_module",
           "delete_module", "kexec_load", "add_key", "request_key", "keyctl", "unshare", "perf_event_open",
           "name_to_handle_at", "open_by_handle_at", "setns", "process_vm_readv", "process_vm_writev", "finit_module",
           "kexec_file_load", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
           "open_tree", "move_mount", "fsopen", "fsmount", "fspick", "mount_setattr")

#: CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_EPERM, _ENOSYS = 0x00050000 | 1, 0x00050000 | 38
_AF_UNIX = 1
_X32_BIT = 0x40000000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data; arg0's low word on little-endian CPUs


def program(machine: str | None = None, *, network: bool = False) -> bytes:
    """The filter for ``machine`` (default: this one) as ``struct sock_filter`` records (pure).
    Raises ``OSError`` for a CPU with no table: a sandbox never starts without its filter."""
    machine = machine or platform.machine()
    found = _TABLES.get(machine)
    if found is None:
        raise OSError(f"no seccomp filter for {machine} (supported: {', '.join(_TABLES)})")
    arch, nr = found
    # Instructions as (code, true-label, false-label, k); labels are resolved to jump offsets below.
    ins: list[tuple[int, int | str, int | str, int]] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 0, "kill", arch),
        (_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if arch == _X86_64:
        ins.append((_JGE_K, "kill", 0, _X32_BIT))
    for name in _DENIED:
        if name in nr:
            ins.append((_JEQ_K, "eperm", 0, nr[name]))
    ins.append((_JEQ_K, "enosys", 0, nr["clone3"]))
    ins.append((_JEQ_K, "clone", 0, nr["clone"]))
    if not network:
        ins.append((_JEQ_K, "socket", 0, nr["socket"]))
    ins.append((_RET_K, 0, 0, _ALLOW))
    labels: dict[str, int] = {}

    def label(name: str, *body: tuple[int, int | str, int | str, int]) -> None:
        labels[name] = len(ins)
        ins.extend(body)

    label("clone", (_LD_W_ABS, 0, 0, _OFF_ARG0), (_JSET_K, "eperm", 0, _CLONE_NEW), (_RET_K, 0, 0, _ALLOW))
    if not network:
        label("socket", (_LD_W_ABS, 0, 0, _OFF_ARG0), (_JEQ_K, "eperm", 0, _AF_UNIX), (_RET_K, 0, 0, _ALLOW))
    label("eperm", (_RET_K, 0, 0, _EPERM))
    label("enosys", (_RET_K, 0, 0, _ENOSYS))
    label("kill", (_RET_K, 0, 0, _KILL_PROCESS))
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(ins):
        jumps = []
        for target in (jt, jf):
            off = labels[target] - i - 1 if isinstance(target, str) else int(target)
            if not 0 <= off <= 255:
                raise AssertionError("seccomp jump out of range")
            jumps.append(off)
        out += struct.pack("=HBBI", code, jumps[0], jumps[1], k)
    return bytes(out)


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


def install(prog: bytes) -> None:
    """Install ``prog`` on this process and what it starts (no_new_privs first); raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _Prog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def deny_unix_sockets() -> None:
    """Install the whole filter of a sandbox without network on this process (tests, probes)."""
    install(program(network=False))
