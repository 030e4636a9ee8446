"""Test helpers for the HTTP server: a real `qwen35 serve` subprocess and an SSE parser."""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server.cli serve` on 127.0.0.1; the context exits with SIGINT and checks a clean exit."""

    def __init__(self, model_dir, *args: str, name: str = "tiny", device: str = "cpu", ready_timeout: float = 300,
                 env: dict | None = None):
        self.port = free_port()
        self.env = env or {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                    "--port", str(self.port), "--device", device, "--served-model-name", name,
                    "--uvicorn-log-level", "warning", *args]
        self.ready_timeout = ready_timeout
        self.device = device
        self.returncode = None

    def __enter__(self) -> "ServerProcess":
        if self.device != "cpu" and "cupy" in sys.modules:
            # this process's CuPy pool keeps the freed blocks of the GPU tests before it (engines, 4B weights):
            # give them back, or the server's memory plan counts them as used (the likely reason a GPU server
            # failed to start late in the suite on an 80 GB card)
            gc.collect()
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
        # keep the caller's PYTHONPATH (e.g. wheels installed into a side folder on the GPU machine)
        env = dict(os.environ, **self.env,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        # a file, not a pipe: readable while the server runs (log()), and never full
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("server did not become ready")

    def stop(self, sig=signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def log(self) -> str:
        """Everything the server printed so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def output(self) -> str:
        return self.log()

    def __exit__(self, *exc) -> None:
        self.stop()


def sse_events(raw: bytes | str) -> list:
    """Splits an SSE body into its JSON payloads ("[DONE]" kept as the string); checks the byte
    format on the way: every event is exactly `data: <compact single-line JSON>`."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    assert text.endswith("\n\n"), repr(text[-40:])
    out = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, repr(block[:80])
        payload = block[len("data: "):]
        if payload == "[DONE]":
            out.append(payload)
            continue
        obj = json.loads(payload)
        assert payload == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        out.append(obj)
    assert out and out[-1] == "[DONE]" and out.count("[DONE]") == 1
    return out


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (labels given must match)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
