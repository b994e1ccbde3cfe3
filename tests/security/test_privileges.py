"""No privilege inside the sandbox (issue 25, item 4), also when the agent runs as root.

/proc/self/status shows no capability (effective, permitted, bounding), NoNewPrivs 1 and Seccomp 2;
the function cannot make namespaces, enter them, mount or unmount (not even the tmpfs hiding the
agent's data), ptrace or read the memory of anything outside, or see the agent in /proc. The
seccomp filter KILLS a call through a foreign ABI (on x86_64 the i386 ``int 0x80`` gate and x32
numbers, tried here as raw machine code), keeps refusing ``socket(AF_UNIX)`` without network, and
io_uring, userfaultfd, the keyring, perf events and bpf fail with ENOSYS or EPERM."""

from __future__ import annotations

import errno
import platform
import signal
from typing import Any

import pytest

from tests.security.conftest import SharedEndpoint
from tests.security.probes import (
    run_in_child,
    run_machine_code,
    run_native,
    syscall,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

x86_64_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the foreign-ABI attacks are x86_64 machine code")

# push rbx; mov eax, NR; (mov ebx, 1; mov ecx, 1; xor edx, edx;) int 0x80; movsxd rax, eax; pop rbx; ret
I386_GETPID = "53" "b814000000" "cd80" "4863c0" "5b" "c3"
I386_SOCKET_UNIX = "53" "b867010000" "bb01000000" "b901000000" "31d2" "cd80" "4863c0" "5b" "c3"  # socket(AF_UNIX, SOCK_STREAM, 0)
# mov eax, 0x40000000|41; mov edi, 1; mov esi, 1; xor edx, edx; syscall; ret  (x32 socket(AF_UNIX, ...))
X32_SOCKET_UNIX = "b829000040" "bf01000000" "be01000000" "31d2" "0f05" "c3"


def read_status() -> dict[str, Any]:
    import subprocess

    def fields(text: str) -> dict[str, str]:
        want = ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
        return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if k in want}

    with open("/proc/self/status") as f:
        mine = fields(f.read())
    child = subprocess.run(["/bin/cat", "/proc/self/status"], check=False, capture_output=True, text=True, timeout=20)  # after an exec
    return {"worker": mine, "exec_child": fields(child.stdout) if child.returncode == 0 else child.stderr}


def try_unshare(flag_names: list[str]) -> dict[str, Any]:
    flags = {"CLONE_NEWUSER": 0x10000000, "CLONE_NEWNS": 0x00020000, "CLONE_NEWNET": 0x40000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWCGROUP": 0x02000000}

    def attempt(flag: int) -> list[int]:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return [libc.unshare(flag), ctypes.get_errno()]

    return {n: run_in_child(attempt, flags[n]) for n in flag_names}


def isolate_mounts() -> bool:
    """In a forked child: a mount namespace of its own, private, if the sandbox allows one (then the
    sandbox is broken already), so that a mount attack that works cannot spoil the worker for the
    tests after it. Where it is refused, the attack runs in the worker's namespace."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        return False
    libc.mount(None, b"/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE
    return True


def try_mounts() -> dict[str, Any]:
    def attempt(what: str) -> list[int]:
        import ctypes

        isolate_mounts()
        libc = ctypes.CDLL(None, use_errno=True)
        if what == "umount /tmp":
            r = libc.umount2(b"/tmp", 0)
        elif what == "umount -l /tmp":
            r = libc.umount2(b"/tmp", 2)
        elif what == "mount tmpfs /tmp":
            r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
        elif what == "remount / rw":
            r = libc.mount(None, b"/", None, 32 | 0x20, None)  # MS_REMOUNT | MS_BIND... (any change at all)
        else:
            r = libc.mount(b"/", b"/tmp", None, 4096 | 16384, None)  # MS_BIND | MS_REC
        return [r, ctypes.get_errno()]

    out = {w: run_in_child(attempt, w) for w in ("umount /tmp", "umount -l /tmp", "mount tmpfs /tmp", "remount / rw", "bind / on /tmp")}
    return out


def unmount_everything_then_read(key_file: str, data_dir: str) -> dict[str, Any]:
    """Lazily unmount every mount point (deepest first) in a child, then look for the agent's key."""

    def attempt() -> dict[str, Any]:
        import ctypes
        import os

        isolated = isolate_mounts()
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        unmounted = []
        for mp in sorted(set(points), key=lambda p: -p.count("/")):
            if libc.umount2(mp.encode(), 2) == 0:
                unmounted.append(mp)
        found: dict[str, Any] = {"unmounted": unmounted, "own_mount_namespace": isolated}
        for p in (key_file, data_dir):
            found[p] = os.path.exists(p)
        try:
            with open(key_file) as f:
                found["key"] = f.read()[:200]
        except OSError as exc:
            found["key"] = None
            found["key_error"] = f"{type(exc).__name__}: {exc}"
        return found

    return run_in_child(attempt)


def try_setns() -> dict[str, Any]:
    def attempt(ns: str) -> list[int]:
        import ctypes
        import os

        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
        except OSError as exc:
            return [-2, exc.errno or 0]
        return [libc.setns(fd, 0), ctypes.get_errno()]

    return {ns: run_in_child(attempt, ns) for ns in ("net", "mnt", "pid", "user", "uts", "ipc", "cgroup")}


def try_ptrace(agent_pid: int) -> dict[str, Any]:
    import ctypes
    import os

    def attach(pid: int) -> list[int]:
        return list(syscall(101, 16, pid, 0, 0))  # ptrace(PTRACE_ATTACH, pid)

    def vm_read(pid: int) -> list[int]:
        class Iov(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        buf = ctypes.create_string_buffer(64)
        local = Iov(ctypes.cast(buf, ctypes.c_void_p), 64)
        remote = Iov(0x400000, 64)
        return list(syscall(310, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))  # process_vm_readv

    def proc_mem(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/mem", "rb") as f:
                f.seek(0x400000)
                f.read(16)
            return "read"
        except OSError as exc:
            return f"{type(exc).__name__}: {exc.strerror}"

    return {
        "attach_agent": run_in_child(attach, agent_pid),
        "vm_read_agent": run_in_child(vm_read, agent_pid),
        "proc_mem_agent": proc_mem(agent_pid),
        "agent_in_proc": os.path.exists(f"/proc/{agent_pid}"),
        "attach_parent": run_in_child(attach, os.getppid()),
    }


def foreign_abi(code_hex: str, helper: bytes | None, helper_args: list[str]) -> dict[str, Any]:
    """Run the raw machine code; where an executable mapping cannot be made, the compiled helper."""
    out: dict[str, Any] = {"machine_code": run_machine_code(code_hex)}
    if "error" in out["machine_code"] and helper is not None:
        out["helper"] = run_native(helper, helper_args, timeout=20)
    return out


def sockets_and_network(ports: list[int]) -> dict[str, Any]:
    import socket

    out: dict[str, Any] = {}
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.close()
        out["af_unix"] = "created"
    except OSError as exc:
        out["af_unix"] = f"{type(exc).__name__}: {exc.strerror}"
    try:
        a, b = socket.socketpair()
        a.sendall(b"x")
        out["socketpair"] = b.recv(1).decode()
        a.close(), b.close()
    except OSError as exc:
        out["socketpair"] = f"{type(exc).__name__}: {exc.strerror}"
    for port in ports:
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=3)
            c.close()
            out[f"tcp {port}"] = "connected"
        except OSError as exc:
            out[f"tcp {port}"] = f"{type(exc).__name__}: {exc.strerror or exc}"
    return out


def dangerous_call(name: str) -> dict[str, Any]:
    def attempt() -> list[int]:
        import ctypes
        import os
        import struct

        buf = ctypes.create_string_buffer(512)
        if name == "io_uring_setup":
            ret, err = syscall(425, 4, buf)
        elif name == "userfaultfd":
            ret, err = syscall(323, os.O_CLOEXEC)
        elif name == "keyctl":
            ret, err = syscall(250, 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
        elif name == "add_key":
            ret, err = syscall(248, b"user", b"mesh-sec", b"x", 1, -2)  # into the process keyring
        elif name == "request_key":
            ret, err = syscall(249, b"user", b"mesh-sec", None, 0)
        elif name == "perf_event_open":
            attr = ctypes.create_string_buffer(struct.pack("<IIQ", 1, 112, 0).ljust(112, b"\0"))  # SOFTWARE, CPU_CLOCK
            ret, err = syscall(298, attr, 0, -1, -1, 0)
        elif name == "bpf":
            attr = ctypes.create_string_buffer(struct.pack("<IIII", 2, 4, 4, 1).ljust(128, b"\0"))  # BPF_MAP_CREATE array
            ret, err = syscall(321, 0, attr, 128)
        elif name == "open_by_handle_at":
            handle = ctypes.create_string_buffer(struct.pack("<Ii", 8, 1) + b"\2\0\0\0\0\0\0\0")  # "shocker": inode 2
            mount_fd = os.open("/", os.O_RDONLY)
            ret, err = syscall(304, mount_fd, handle, os.O_RDONLY)
        elif name == "syslog":
            ret, err = syscall(103, 3, buf, 512)  # SYSLOG_ACTION_READ_ALL: the kernel log
        else:
            raise ValueError(name)
        if ret >= 0 and name in ("io_uring_setup", "userfaultfd", "perf_event_open", "bpf", "open_by_handle_at"):
            os.close(ret)
        return [ret, err]

    return run_in_child(attempt)


# ---------------------------------------------------------------------------------------------- tests


def test_no_capabilities_no_new_privileges_and_a_seccomp_filter(shared: SharedEndpoint) -> None:
    seen = shared.run("b", read_status).expect()
    for who, st in seen.items():
        assert isinstance(st, dict), f"{who}: {st}"
        caps = {k: int(st[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
        assert not any(caps.values()), f"{who} in the sandbox holds capabilities: {st}"
        assert st["NoNewPrivs"] == "1", f"{who}: no_new_privs is not set: {st}"
        assert st["Seccomp"] == "2", f"{who}: no seccomp filter: {st}"
        assert st["Uid"].split()[0] != "0" or shared.user == "nobody", f"{who} runs as root on the host: {st}"


def test_cannot_create_a_user_namespace(shared: SharedEndpoint) -> None:
    seen = shared.run("b", try_unshare, ["CLONE_NEWUSER"]).expect()
    r = seen["CLONE_NEWUSER"]
    assert r.get("value", [0])[0] != 0, f"unshare(CLONE_NEWUSER) worked inside the sandbox: {r}"


def test_cannot_unshare_other_namespaces(shared: SharedEndpoint) -> None:
    names = ["CLONE_NEWNS", "CLONE_NEWNET", "CLONE_NEWPID", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWCGROUP",
             "CLONE_NEWUSER"]
    seen = shared.run("b", try_unshare, names).expect()
    worked = {n: r for n, r in seen.items() if r.get("value", [0])[0] == 0}
    assert not worked, f"unshare() worked inside the sandbox: {worked}"


def test_cannot_mount_or_unmount(shared: SharedEndpoint) -> None:
    seen = shared.run("b", try_mounts).expect()
    worked = {w: r for w, r in seen.items() if r.get("value", [-1])[0] == 0}
    assert not worked, f"mount operations worked inside the sandbox: {worked}"


def test_cannot_unmount_what_hides_the_agents_key(shared: SharedEndpoint) -> None:
    seen = shared.run("b", unmount_everything_then_read, str(shared.key_file), str(shared.data_dir)).expect()
    found = seen.get("value", seen)
    assert shared.key_hex not in str(found.get("key")), f"UNMOUNTING INSIDE THE SANDBOX REVEALED THE AGENT'S KEY: {found}"
    assert not found.get("unmounted"), f"mount points could be unmounted inside the sandbox: {found.get('unmounted')}"


def test_cannot_setns_into_another_namespace(shared: SharedEndpoint) -> None:
    seen = shared.run("b", try_setns).expect()
    worked = {ns: r for ns, r in seen.items() if r.get("value", [-1])[0] == 0}
    assert not worked, f"setns() on /proc/1/ns/* worked inside the sandbox: {worked}"


def test_cannot_ptrace_or_read_memory_of_the_agent(shared: SharedEndpoint) -> None:
    seen = shared.run("b", try_ptrace, shared.agent_pid).expect()
    assert seen["attach_agent"].get("value", [-1])[0] != 0, f"PTRACE_ATTACH to the agent worked: {seen}"
    assert seen["vm_read_agent"].get("value", [-1])[0] < 0, f"process_vm_readv of the agent worked: {seen}"
    assert seen["proc_mem_agent"] != "read", f"/proc/<agent>/mem was readable: {seen}"
    assert not seen["agent_in_proc"], f"/proc/{shared.agent_pid} (the agent) exists in the sandbox: {seen}"


@x86_64_only
def test_int80_socket_af_unix_is_killed_not_allowed(shared: SharedEndpoint) -> None:
    """The old filter allowed every foreign-ABI call: socket(AF_UNIX) through int 0x80 walked past it."""
    seen = shared.run("b", foreign_abi, I386_SOCKET_UNIX, shared.helper, ["int80", "359", "1", "1", "0"]).expect()
    r = seen.get("helper", seen["machine_code"])
    assert r.get("signal") == signal.SIGSYS, f"an i386 socket(AF_UNIX) through int 0x80 was not killed by the filter: {seen}"


@x86_64_only
def test_int80_any_syscall_is_killed(shared: SharedEndpoint) -> None:
    seen = shared.run("b", foreign_abi, I386_GETPID, shared.helper, ["int80", "20", "0", "0", "0"]).expect()
    r = seen.get("helper", seen["machine_code"])
    assert r.get("signal") == signal.SIGSYS, f"an i386 getpid through int 0x80 was not killed by the filter: {seen}"


@x86_64_only
def test_x32_syscall_is_killed(shared: SharedEndpoint) -> None:
    seen = shared.run("b", foreign_abi, X32_SOCKET_UNIX, shared.helper, ["x32", "41", "1", "1", "0"]).expect()
    r = seen.get("helper", seen["machine_code"])
    assert r.get("signal") == signal.SIGSYS, f"an x32 socket(AF_UNIX) (nr | 0x40000000) was not killed by the filter: {seen}"


def test_unix_sockets_and_network_stay_refused(shared: SharedEndpoint) -> None:
    ports = [shared.mesh.broker.port, shared.mesh.hub_cfg.port]
    seen = shared.run("b", sockets_and_network, ports).expect()
    assert seen["af_unix"].startswith("PermissionError"), f"socket(AF_UNIX) was not refused without network: {seen}"
    assert seen["socketpair"] == "x", f"socketpair no longer works in the sandbox (it should): {seen}"
    connected = [k for k, v in seen.items() if k.startswith("tcp") and v == "connected"]
    assert not connected, f"the sandbox reached the broker or the hub over TCP: {seen}"


@pytest.mark.parametrize("call", ["io_uring_setup", "userfaultfd", "keyctl", "add_key", "request_key", "perf_event_open",
                                  "bpf", "open_by_handle_at", "syslog"])
def test_dangerous_kernel_interfaces_fail_with_enosys_or_eperm(shared: SharedEndpoint, call: str) -> None:
    seen = shared.run("b", dangerous_call, call).expect()
    assert "value" in seen, f"{call} did not fail cleanly inside the sandbox (it must return ENOSYS/EPERM): {seen}"
    ret, err = seen["value"]
    assert ret == -1 and err in (errno.ENOSYS, errno.EPERM), \
        f"{call} inside the sandbox returned {ret} ({errno.errorcode.get(err, err)}), not ENOSYS/EPERM"


def kernel_knobs() -> dict[str, Any]:
    """Open host-wide kernel knobs for writing (never writing to them: opening proves the right),
    and try to make this process the OOM killer's last choice (in a child)."""
    import os

    out: dict[str, Any] = {}
    for p in ("/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches",
              "/sys/kernel/uevent_helper", "/proc/sys/kernel/hostname"):
        try:
            fd = os.open(p, os.O_WRONLY)
            os.close(fd)
            out[p] = "opened for writing"
        except OSError as exc:
            out[p] = f"{type(exc).__name__}: {exc.strerror}"

    def unkillable() -> str:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
        with open("/proc/self/oom_score_adj") as f:
            return f.read().strip()

    out["oom_score_adj -1000"] = run_in_child(unkillable)
    return out


def test_cannot_open_kernel_knobs_or_escape_the_oom_killer(shared: SharedEndpoint) -> None:
    seen = shared.run("b", kernel_knobs).expect()
    opened = {p: r for p, r in seen.items() if r == "opened for writing"}
    assert not opened, f"host-wide kernel settings can be opened for writing inside the sandbox: {opened}"
    oom = seen["oom_score_adj -1000"]
    assert oom.get("value") != "-1000", f"a sandboxed process made itself exempt from the OOM killer (the agent would go first): {oom}"
