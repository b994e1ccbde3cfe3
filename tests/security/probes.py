"""Helpers that run INSIDE the sandbox, as parts of the attack functions tenants submit.

They travel by value with the functions that call them (``tests`` is the user's own package to the
serializer), so they import everything they need themselves and touch nothing of the test process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_in_child", "run_machine_code", "run_native", "syscall", "walk_visible"]


def run_native(binary: bytes, args: list[str], timeout: float = 60.0, argv0: str = "mesh-sec-helper") -> dict[str, Any]:
    """Run the compiled helper (tests/security/helper.c) from a memfd, or from /tmp if memfds
    cannot be executed; ``{"how", "returncode", "signal", "stdout", "stderr"}`` or ``{"error"}``."""
    import os
    import signal as _signal
    import subprocess

    attempts: list[str] = []
    fd = -1
    try:
        fd = os.memfd_create("mesh-sec-helper", 0)  # not CLOEXEC: the child execs it through /proc/self/fd
        os.write(fd, binary)
        targets = [(f"/proc/self/fd/{fd}", "memfd")]
    except OSError as exc:
        attempts.append(f"memfd: {type(exc).__name__}: {exc}")
        targets = []
    path = "/tmp/mesh-sec-helper"
    try:
        with open(path, "wb") as f:
            f.write(binary)
        os.chmod(path, 0o755)
        targets.append((path, "tmp"))
    except OSError as exc:
        attempts.append(f"tmp: {type(exc).__name__}: {exc}")
    try:
        for exe, how in targets:
            try:
                p = subprocess.run([argv0, *args], check=False, executable=exe, capture_output=True, timeout=timeout,
                                   pass_fds=(fd,) if fd >= 0 else ())
            except (OSError, subprocess.SubprocessError) as exc:
                attempts.append(f"{how}: {type(exc).__name__}: {exc}")
                continue
            sig = -p.returncode if p.returncode < 0 else None
            return {"how": how, "returncode": p.returncode, "signal": sig,
                    "signal_name": _signal.Signals(sig).name if sig else None,
                    "stdout": p.stdout.decode(errors="replace")[-2000:], "stderr": p.stderr.decode(errors="replace")[-2000:]}
        return {"error": "; ".join(attempts) or "no way to run the helper"}
    finally:
        if fd >= 0:
            os.close(fd)


def run_machine_code(code_hex: str, timeout: float = 10.0) -> dict[str, Any]:
    """Call a few bytes of x86-64 machine code (a function returning rax) in a forked child, from an
    executable anonymous mapping via ctypes. ``{"returned": int}`` if it came back, ``{"signal": n}``
    if the child was killed, ``{"error": ...}`` if the code could not even be placed."""
    import ctypes
    import mmap
    import os
    import signal as _signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into the worker
        try:
            os.close(r)
            try:
                m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
                m.write(bytes.fromhex(code_hex))
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            except BaseException as exc:  # noqa: BLE001
                os.write(w, f"error {type(exc).__name__}: {exc}".encode())
                os._exit(3)
            ret = ctypes.CFUNCTYPE(ctypes.c_long)(addr)()
            os.write(w, f"ret {ret}".encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        got, st = os.waitpid(pid, os.WNOHANG)
        if got:
            status = st
            break
        time.sleep(0.02)
    if status is None:
        os.kill(pid, _signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return {"error": "timed out"}
    data = os.read(r, 4096).decode(errors="replace")
    os.close(r)
    out: dict[str, Any] = {}
    if os.WIFSIGNALED(status):
        out["signal"] = os.WTERMSIG(status)
        out["signal_name"] = _signal.Signals(out["signal"]).name
    else:
        out["exit"] = os.WEXITSTATUS(status)
    if data.startswith("ret "):
        out["returned"] = int(data[4:])
    elif data.startswith("error "):
        out["error"] = data[6:]
    return out


def syscall(nr: int, *args: Any) -> tuple[int, int]:
    """``(return value, errno)`` of a raw system call through libc's ``syscall()``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    conv = [a if isinstance(a, (ctypes._SimpleCData, ctypes.Array, ctypes.Structure)) or hasattr(a, "_obj")  # type: ignore[attr-defined]
            else ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ret = libc.syscall(ctypes.c_long(nr), *conv)
    return int(ret), ctypes.get_errno()


def walk_visible(root: str, needed: list[str], system: list[str], limit: int = 200) -> list[str]:
    """Paths under ``root`` that are visible but neither a system directory (``system``, visible
    whole) nor on the way to (or inside) one of the ``needed`` runtime paths."""
    import os

    def on_path(p: str) -> str:
        for n in needed:
            if p == n or n.startswith(p.rstrip("/") + "/"):
                return "ancestor" if p != n else "needed"
            if p.startswith(n.rstrip("/") + "/"):
                return "needed"
        return ""

    extra: list[str] = []
    stack = [root]
    while stack and len(extra) < limit:
        d = stack.pop()
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            p = os.path.join(d, name)
            if d == "/" and name in system:
                continue
            kind = on_path(p)
            if kind == "ancestor":
                stack.append(p)
            elif not kind:
                extra.append(p)
    return extra


def run_in_child(fn: Any, *args: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Call ``fn(*args)`` in a forked child, so that whatever it changes (namespaces, mounts) or
    whatever kills it stays out of the worker: ``{"value": ...}`` (JSON-able), ``{"signal": n}`` or
    ``{"error": ...}``."""
    import json
    import os
    import signal as _signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            try:
                payload = {"value": fn(*args)}
            except BaseException as exc:  # noqa: BLE001
                payload = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(payload, default=repr).encode())
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        got, st = os.waitpid(pid, os.WNOHANG)
        if got:
            status = st
            break
        time.sleep(0.01)
    if status is None:
        os.kill(pid, _signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return {"error": "timed out"}
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"signal": sig, "signal_name": _signal.Signals(sig).name}
    try:
        return json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {"error": "unreadable answer from the child"}
