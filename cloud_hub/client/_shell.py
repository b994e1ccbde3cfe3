"""``ShellFunction``: run a shell command on the endpoint; get its return code, stdout and stderr
(a :class:`ShellResult`), as in Globus Compute.

This module travels by value (registered with cloudpickle below), so an endpoint needs nothing
beyond the agent to run it, and a ``ShellResult`` comes back as this very class.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ShellFunction", "ShellResult"]


class ShellResult:
    """``returncode``, ``stdout`` and ``stderr`` (their last ``snippet_lines`` lines) and ``cmd``
    (the command after formatting). A walltime overrun is return code 124, like ``timeout(1)``."""

    def __init__(self, cmd: str, stdout: str, stderr: str, returncode: int, exception_name: str | None = None) -> None:
        self.cmd, self.stdout, self.stderr, self.returncode = cmd, stdout, stderr, returncode
        self.exception_name = exception_name

    def __str__(self) -> str:
        return self.stdout

    def __repr__(self) -> str:
        return f"ShellResult(cmd={self.cmd!r}, returncode={self.returncode}, stdout={self.stdout[-60:]!r}, stderr={self.stderr[-60:]!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"cmd": self.cmd, "stdout": self.stdout, "stderr": self.stderr, "returncode": self.returncode,
                "exception_name": self.exception_name}


class ShellFunction:
    """``ShellFunction("echo '{message}'")``: submitted with ``message="hi"``, the endpoint runs
    ``echo 'hi'`` with ``/bin/sh`` and returns a :class:`ShellResult` (``return_dict=True``: a
    JSON-friendly dict). ``walltime`` (seconds) stops it with return code 124; ``stdout`` /
    ``stderr``: files on the endpoint to append the streams to as well."""

    def __init__(self, cmd: str, stdout: str | None = None, stderr: str | None = None, walltime: float | None = None,
                 snippet_lines: int = 1000, name: str | None = None, return_dict: bool = False) -> None:
        self.cmd = cmd
        self.stdout, self.stderr = stdout, stderr
        self.walltime = walltime
        self.snippet_lines = int(snippet_lines)
        self.__name__ = name or "ShellFunction"
        self.return_dict = return_dict

    def __call__(self, **kwargs: Any) -> Any:
        import subprocess

        cmd = self.cmd.format(**kwargs)
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, errors="replace", timeout=self.walltime)  # noqa: S602
            out, err, rc, exc = p.stdout, p.stderr, p.returncode, None
        except subprocess.TimeoutExpired as e:
            def text(b: Any) -> str:
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

            out, err, rc, exc = text(e.stdout), text(e.stderr), 124, "subprocess.TimeoutExpired"
        for path, data in ((self.stdout, out), (self.stderr, err)):
            if path:
                with open(path, "a") as f:
                    f.write(data)
        res = ShellResult(cmd, self._snippet(out), self._snippet(err), rc, exc)
        return res.to_dict() if self.return_dict else res

    def _snippet(self, text: str) -> str:
        lines = text.splitlines(keepends=True)
        return "".join(lines[-self.snippet_lines:]) if self.snippet_lines > 0 else ""


def _ship_by_value() -> None:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_ship_by_value()
