"""Start-up time of `qwen35 serve`: process start to a healthy /health, and to the first streamed token.

Runs the server twice on one kernel cache directory: first empty (cold: every kernel compiled), then
again on what the first run left there (warm). With --prebuilt DIR (cubins from tools/build_kernels.py,
as the cuda container image ships them) it runs as a fresh container does instead: the kernel cache
DIR as it is and an empty CuPy kernel cache (prebuilt), then again with that CuPy cache kept
(prebuilt-cupy-warm: a container whose CUPY_CACHE_DIR is a kept volume). Each run: launch, poll
/health every 50 ms, then one streamed completion (a prompt of --prompt-len token ids, so the prefill
kernels run too, and 2 output tokens). Prints a table and writes JSON ($OUT/bench_startup.json when
OUT is set).

    python3 tools/bench_startup.py MODEL_DIR [--module server.cli] [--cache-dir DIR | --prebuilt DIR]
                                   [--json FILE] [serve flags]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(model: str, module: str, cache_dir: str, prompt_len: int, extra: list[str], timeout: float,
             cupy_cache_dir: str | None = None) -> dict:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, CUPY_CACHE_DIR=cupy_cache_dir or cache_dir, QWEN35_KERNEL_CACHE=cache_dir,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", model, "--host", "127.0.0.1", "--port",
                             str(port), "--uvicorn-log-level", "warning", *extra],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        healthy = None
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{Path(log.name).read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    healthy = time.monotonic() - t0
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        if healthy is None:
            raise RuntimeError(f"not healthy after {timeout} s:\n{Path(log.name).read_text()[-4000:]}")
        body = {"prompt": list(range(100, 100 + prompt_len)), "max_tokens": 2, "stream": True,
                "ignore_eos": True, "temperature": 0}
        t1 = time.monotonic()
        first = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic()
        done = time.monotonic()
        return {"healthy_s": healthy, "first_request_ttft_s": first - t1, "first_request_e2e_s": done - t1,
                "start_to_first_token_s": first - t0,
                "log_tail": [ln for ln in Path(log.name).read_text().splitlines() if "qwen35" in ln][-8:]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--module", default="server.cli", help="the module whose `serve` subcommand starts the server")
    ap.add_argument("--cache-dir", default=None, help="kernel cache directory (default: a fresh temporary one)")
    ap.add_argument("--prebuilt", default=None, metavar="DIR",
                    help="kernel cache filled by tools/build_kernels.py, used as it is, with an empty CuPy cache")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    a, extra = ap.parse_known_args(argv)  # anything else goes to `serve`
    a.extra = [x for x in extra if x != "--"]
    cupy_cache = None
    if a.prebuilt:
        cache, kinds = a.prebuilt, ("prebuilt", "prebuilt-cupy-warm")
        cupy_cache = tempfile.mkdtemp(prefix="qwen35-cupy-cache-")
    else:
        cache, kinds = a.cache_dir or tempfile.mkdtemp(prefix="qwen35-kcache-"), ("cold", "warm")
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
    out = {"model": a.model_dir, "module": a.module, "prompt_len": a.prompt_len, "prebuilt": a.prebuilt}
    for kind in kinds:
        out[kind] = run_once(a.model_dir, a.module, cache, a.prompt_len, a.extra, a.timeout, cupy_cache)
        r = out[kind]
        print(f"{kind}: healthy {r['healthy_s']:6.1f} s  first request TTFT {r['first_request_ttft_s']:6.2f} s  "
              f"start to first token {r['start_to_first_token_s']:6.1f} s", flush=True)
        for ln in r["log_tail"]:
            print("   ", ln)
    path = a.json or os.path.join(os.environ.get("OUT", "."), "bench_startup.json")
    Path(path).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
