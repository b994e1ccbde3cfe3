"""The worker channel hand-off for runtimes that pass only fds 3..N (podman --preserve-fds):
the socket really arrives at fd 3 through /bin/sh, and nothing else of the parent's goes in."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from mesh_agent.engine.environments import DEFAULT_KIND, WorkerKind, channel_prefix, container_argv

# Stands in for what --preserve-fds 1 promises inside the container: every fd above 3 is closed.
ONLY_FD3 = "import os,sys; os.closerange(4, 4096); os.execvp(sys.argv[1], sys.argv[1:])"
ECHO = ("import os,socket,sys; s=socket.socket(fileno=int(sys.argv[1])); s.sendall(b'ping:'+s.recv(16)); "
        "print(len(os.listdir('/proc/self/fd')))")


def test_no_channel_fd_keeps_the_inherited_number() -> None:
    assert channel_prefix(DEFAULT_KIND, 17) == ([], 17)
    assert channel_prefix(WorkerKind(channel_fd=3), 3) == ([], 3)


def test_channel_moves_to_fd3_and_the_original_is_closed(tmp_path: Path) -> None:
    parent, child = socket.socketpair()
    spare = os.open(os.devnull, os.O_RDONLY)  # another inherited fd that must not reach the worker
    try:
        kind = WorkerKind(wrap=(sys.executable, "-c", ONLY_FD3), channel_fd=3)
        prefix, fd = channel_prefix(kind, child.fileno())
        assert fd == 3 and child.fileno() != 3
        argv = [*prefix, *kind.wrap, sys.executable, "-c", ECHO, str(fd)]
        proc = subprocess.Popen(argv, pass_fds=(child.fileno(), spare), stdout=subprocess.PIPE, text=True)
        child.close()
        parent.sendall(b"hello")
        parent.settimeout(30)
        assert parent.recv(32) == b"ping:hello"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        # stdin, stdout, stderr, the channel at 3, and listdir's own handle: the spare fd is gone.
        assert int(out.strip()) == 5
    finally:
        parent.close()
        os.close(spare)


def test_podman_passes_exactly_one_extra_fd() -> None:
    argv = container_argv("/usr/bin/podman", "img", ["/opt/boot"])
    assert argv[argv.index("--preserve-fds") + 1] == "1" and argv[-2:] == ["img", "python3"]
