"""``python -m cloud_hub.healthcheck [--wait S] URL``: exit 0 once URL answers 200, else 1 with why.

Why a module and not a curl line: systemd's ``ExecStartPost`` (device_images/systemd/
continuum-mesh-hub.service) and container health checks need a bounded wait for ``/healthz`` or
``/readyz`` that works where curl is not installed, prints the hub's own reason (``/readyz`` says
what is not ready), and does not care whether the loopback certificate is trusted: it asks
whether the hub answers, not who it is. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import urllib.error
import urllib.request

__all__ = ["check", "main"]


def check(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    """One probe: (answered 200, what it said or why it failed)."""
    ctx = ssl._create_unverified_context()  # loopback probe: liveness, not identity
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
            return r.status == 200, r.read(2000).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:  # 503 from /readyz carries the reason in its body
        body = exc.read(2000).decode("utf-8", "replace")
        try:
            body = json.dumps(json.loads(body))
        except ValueError:
            pass
        return False, f"HTTP {exc.code}: {body}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"no answer: {getattr(exc, 'reason', exc)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud_hub.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("url", help="e.g. http://127.0.0.1:8700/healthz or .../readyz")
    p.add_argument("--wait", type=float, default=0.0, help="keep asking once a second for this many seconds")
    p.add_argument("--timeout", type=float, default=2.0, help="how long one probe waits for an answer (default 2 s)")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        p.error(f"URL must start with http:// or https://, not {args.url!r}")
    if not args.timeout > 0:
        p.error(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    deadline = time.monotonic() + max(0.0, args.wait)
    for _ in range(int(max(0.0, args.wait)) + 2):  # bounded: about one probe a second until the deadline
        ok, said = check(args.url, args.timeout)
        if ok:
            return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    print(f"{args.url}: {said}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
