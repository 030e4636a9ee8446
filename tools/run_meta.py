"""What a benchmark's JSON records about its run: the code's commit, the date, the command line and the device."""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path


def run_meta(commit: str | None = None, command: list[str] | None = None) -> dict:
    """commit: overrides `git rev-parse HEAD` (a device machine's copy of the tree may carry a stale .git).
    command: the command line to record (default: the process's)."""
    head = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    return {"commit": head, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": shlex.join(command or sys.argv)}


def device_name(ops) -> str:
    """The GPU's name for the CUDA backend, else the backend's."""
    if ops.name != "cuda":
        return ops.name
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name
