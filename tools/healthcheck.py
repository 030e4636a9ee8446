"""The container image's HEALTHCHECK: GET /health of the `qwen35 serve` in this container (exit 0 on a
200, else 1), with the standard library only (the image has no curl).

The address comes from the server's own command line (/proc/1/cmdline: `--host`, `--port`, as given
to `docker run IMAGE ...`; with `--init` PID 1 is docker-init, whose command line holds the server's),
so a port chosen by a flag is the one checked.
"""
from __future__ import annotations

import sys
import urllib.request


def address(argv: list[str]) -> tuple[str, int]:
    host, port = "127.0.0.1", 8000
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if name == "--port" and value.isdigit():
            port = int(value)
        elif name == "--host" and value not in ("", "0.0.0.0", "::"):
            host = value  # a specific address: only there does the server answer
    return (f"[{host}]" if ":" in host else host), port


def main() -> int:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    host, port = address(argv)
    try:
        # no proxy: an HTTP(S)_PROXY in the container's environment must not take local traffic
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://{host}:{port}/health", timeout=2) as r:
            return 0 if r.status == 200 else 1
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"; say why in docker inspect
        print(f"http://{host}:{port}/health: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
