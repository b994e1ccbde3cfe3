"""The first program inside a sandbox: give up every privilege, then exec the worker.

Run by bubblewrap as ``python -S -I _lockdown.py <worker argv...>`` with its settings as JSON in
``MESH_LOCKDOWN``: ``-S -I`` so that no
``site`` hook, ``.pth`` file or environment variable of anyone's runs before the lockdown is in
place. Stdlib only; it imports the filter module by its file path.

In order (docs/environments.md, "The sandbox"):

1. **Root agent** (bubblewrap ran privileged, no user namespace): empty the capability bounding
   set, drop supplementary groups, switch to the sandbox uid/gid (65534 unless configured), and
   clear the inheritable set, so the worker is an unprivileged uid *on the host* with no
   capability at all. Unprivileged agents already got a user namespace with every capability
   dropped from bubblewrap (``--unshare-user --disable-userns --cap-drop ALL``).
2. Resource limits: processes (a fork bomb stays inside), open files, core dumps off.
3. no_new_privs and the seccomp filter (``_seccomp.program``).
4. ``execve`` the worker interpreter, with the spec's variables added only now (a loader variable
   such as LD_AUDIT given to bubblewrap or to this program would run the tenant's library first).

Any failure exits with status 70 and one line on stderr: a sandbox that cannot lock itself down
never runs the task.
"""

from __future__ import annotations

import json
import os
import sys


def _load_filter_module():  # type: ignore[no-untyped-def]
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_seccomp.py")
    spec = importlib.util.spec_from_file_location("_mesh_seccomp", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _drop_root(uid: int, gid: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for cap in range(64):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0 and ctypes.get_errno() not in (22,):  # EINVAL: no such cap
            raise OSError(ctypes.get_errno(), f"cannot drop capability {cap} from the bounding set")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two Data records
    data = (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    if os.getuid() == 0 or os.geteuid() == 0:
        raise OSError("still root after setresuid")


def _limits(opts: dict) -> None:
    import resource

    for name, value in (("RLIMIT_NPROC", opts.get("nproc")), ("RLIMIT_NOFILE", opts.get("nofile")), ("RLIMIT_CORE", 0)):
        if value is None:
            continue
        res = getattr(resource, name)
        _soft, hard = resource.getrlimit(res)
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(res, (value, value))


def main(argv: list[str]) -> None:
    try:
        opts = json.loads(os.environ.pop("MESH_LOCKDOWN"))  # not on the command line: ps shows that to everyone
        if os.getuid() == 0 or os.geteuid() == 0:
            _drop_root(int(opts.get("uid", 65534)), int(opts.get("gid", 65534)))
        _limits(opts)
        seccomp = _load_filter_module()
        seccomp.install(seccomp.program(network=bool(opts.get("network"))))
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (opts.get("env") or {}).items()})
        os.execve(argv[1], argv[1:], env)
    except BaseException as exc:  # noqa: BLE001 - never run unconfined
        sys.stderr.write(f"sandbox lockdown failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(70)


if __name__ == "__main__":
    main(sys.argv)
