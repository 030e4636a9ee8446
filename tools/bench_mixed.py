"""Mixed-load ITL gate (serving-conventions §10.2): how much a cold long prefill stalls running decodes.

One cell per (injected prompt length, QPS). B background streams (--background 8 of --bg-input-len
512 / --bg-output-len 4096, greedy, ignore_eos) start; once every one is decoding, --baseline-s
seconds record their undisturbed ITL; then cold prompts of the cell's length (output 1, each prompt
distinct) arrive as a Poisson process at the cell's QPS, round(qps * --duration) of them over
--duration seconds (bench_serving's arrival process); the window lasts until the last injected
request has finished. A background stream that finishes is started again (bg_restarts) so the batch
stays full; at the end of the window the background is cancelled.

- mixed ITL: the gaps between consecutive tokens of one background stream whose later token falls
  in the window (p50/p99/max); injected TTFT: vllm bench serve's TTFT of the injected requests.
- valid (needs --trace FILE, the file the server writes with --trace-steps FILE; only the lines
  appended during the window are read): some step has prefill_tokens > 0 and decode_rows >= B, i.e.
  an injected prefill met the full background batch (injected requests make one token and never
  decode, and the background prefilled before the window, so such a step's prefill is injected).
  Without a trace (e.g. vLLM) validity is unknown ("?").
- gate (issue 15): PASS when the cell is valid, the mixed ITL p99 is at most --p99-factor (3) x the
  steady TPOT and the mixed ITL max at most --max-factor (5) x it, the steady TPOT being the median
  gap of the baseline window (the undisturbed background step, not the injection window's); an
  invalid cell cannot pass. The tool exits 1 when any cell fails (the negative control must fail).
- saturated (a throughput wall, not a tail effect): fewer injected requests completed than were
  sent, one waited longer than --duration for its token, qps x mean injected TTFT >= 1 (Little's law:
  an injected prompt is always in the server), or the mixed ITL p50 is over twice the baseline p50.

Chunked prefill on/off is a server setting; run the tool once per server, with a --label:

    qwen35 serve $M --max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 1024 --trace-steps /tmp/on.jsonl
    python tools/bench_mixed.py --label chunked-1024 --trace /tmp/on.jsonl --out-dir D
    qwen35 serve $M --max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 16400 --trace-steps /tmp/off.jsonl
    python tools/bench_mixed.py --label unchunked --trace /tmp/off.jsonl --out-dir D

(16400 tokens per step hold a 16384-token prompt plus the 8 decodes, so no prefill is chunked.) The
negative control serves with --max-num-seqs 8 (= --background): every cell must come out invalid.
--launch MODEL_DIR starts `python -m server.cli serve MODEL_DIR --trace-steps ...` itself on a free
local port with --server-args, runs the cells and stops it. --from-json A.json [B.json ...] renders
one table from saved results (e.g. chunked next to unchunked).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXTRA = {"temperature": 0.0, "ignore_eos": True}


# ---- metrics (pure functions of timelines and trace records) ----------------------------------------
def window_gaps(results: list[bs.RequestResult], t0: float, t1: float) -> list[float]:
    """Inter-token gaps (s) of each stream whose later token lands in [t0, t1]."""
    gaps: list[float] = []
    for r in results:
        if r.ttft:
            t = bs.event_times(r)
            gaps += np.diff(t)[(t[1:] >= t0) & (t[1:] <= t1)].tolist()
    return gaps


def trace_summary(steps: list[dict], background: int) -> dict:
    hit = [s for s in steps if s["prefill_tokens"] > 0 and s["decode_rows"] >= background]
    full = [s["step_ms"] for s in steps if s["kind"] == "decode" and s["decode_rows"] >= background]
    return {"valid": bool(hit), "valid_steps": len(hit), "steps": len(steps),
            "max_decode_rows": max((s["decode_rows"] for s in steps), default=0),
            # device time: the engine runs one step ahead, so a long step's wall time shows in the
            # launch-to-launch period (step_ms) of the step after it
            "max_valid_step_gpu_ms": max((s["gpu_ms"] for s in hit), default=None),
            "median_full_decode_step_ms": float(np.median(full)) if full else None,
            # the engine's side of the ITL max: the longest launch-to-launch period between two steps that both
            # decode the whole background (a much larger client ITL max is a stall outside the engine)
            "max_full_decode_period_ms": max((1e3 * (b["t"] - a["t"]) for a, b in zip(steps, steps[1:])
                                              if min(a["decode_rows"], b["decode_rows"]) >= background), default=None)}


def saturation(sent: int, completed: int, ttfts: list[float], qps: float, duration: float,
               mixed_p50: float, baseline_p50: float) -> list[str]:
    """Why the server could not keep up with the injection (empty: it could); times in s."""
    why = []
    if completed < sent:
        why.append(f"{completed}/{sent} injected requests completed")
    if ttfts and max(ttfts) > duration:
        why.append(f"an injected request waited {max(ttfts):.1f} s, longer than the {duration:g} s window")
    if ttfts and qps * float(np.mean(ttfts)) >= 1:
        why.append(f"qps x mean injected TTFT = {qps * float(np.mean(ttfts)):.2f} >= 1")
    if baseline_p50 and mixed_p50 > 2 * baseline_p50:
        why.append(f"mixed ITL p50 {1e3 * mixed_p50:.1f} ms > 2 x baseline {1e3 * baseline_p50:.1f} ms")
    return why


def gate(valid: bool | None, itl_p99_ms: float | None, itl_max_ms: float | None, steady_ms: float | None,
         p99_factor: float = 3.0, max_factor: float = 5.0) -> tuple[bool, list[str]]:
    """(passed, why not) for one cell against the ITL bounds (times in ms)."""
    if not valid:
        return False, ["invalid: no injected prefill met the whole background" if valid is False
                       else "validity unknown (no step trace)"]
    if not steady_ms or itl_p99_ms is None or itl_max_ms is None:
        return False, ["no baseline or mixed ITL samples"]
    why = []
    if itl_p99_ms > p99_factor * steady_ms:
        why.append(f"ITL p99 {itl_p99_ms:.1f} ms > {p99_factor:g} x steady {steady_ms:.2f} ms")
    if itl_max_ms > max_factor * steady_ms:
        why.append(f"ITL max {itl_max_ms:.1f} ms > {max_factor:g} x steady {steady_ms:.2f} ms")
    return not why, why


def _ms(values, q) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if len(values) else None


# ---- one cell -----------------------------------------------------------------------------------------
def _trace_size(path) -> int:
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def read_trace(path, start: int, end: int) -> list[dict]:
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read(end - start).decode(errors="replace").splitlines()
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut at a boundary
            out.append(json.loads(line))
    return out


async def run_cell(a, tok, model: str, length: int, qps: float) -> dict:
    import httpx

    seed = zlib.crc32(f"{length}-{qps}".encode())
    B = a.background
    bg_reqs = bs.random_dataset(tok, B, a.bg_input_len, a.bg_output_len, seed=seed)
    n = max(1, round(qps * a.duration))
    inj = bs.random_dataset(tok, n, length, 1, seed=seed + 1)
    url = a.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    streams: list[list[bs.RequestResult]] = [[] for _ in range(B)]
    stop = asyncio.Event()

    # one client for the background and the injected requests, made before any window: making one inside the
    # injection window (bench_serving's default) stalled this loop ~40 ms, a background gap of the window
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=httpx.Limits(max_connections=None)) as client:
        async def worker(k: int) -> None:
            while not stop.is_set():
                res = bs.RequestResult()
                streams[k].append(res)
                task = asyncio.create_task(bs.send_completion(client, url, model, bg_reqs[k], EXTRA,
                                                              f"mixed-{seed}-bg{k}-{len(streams[k])}", headers, res))
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not task.done():  # the window is over: disconnect (the server aborts the request)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                elif res.error:
                    return

        workers = [asyncio.create_task(worker(k)) for k in range(B)]
        try:
            deadline = time.perf_counter() + a.ready_timeout
            while not all(s and s[-1].itl for s in streams):  # every stream past its first token
                errors = [r.error for s in streams for r in s if r.error]
                if errors or time.perf_counter() > deadline:
                    raise RuntimeError(f"background did not start decoding: {errors[:1] or 'timeout'}")
                await asyncio.sleep(0.005)
            t_ready = time.perf_counter()
            await asyncio.sleep(a.baseline_s)
            off0, t0 = _trace_size(a.trace), time.perf_counter()
            injected, _ = await bs.run_benchmark(a.base_url, model, inj, request_rate=qps, seed=seed, extra=EXTRA,
                                                 api_key=a.api_key, progress=False, client=client)
            t1, off1 = time.perf_counter(), _trace_size(a.trace)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)

    bg = [r for s in streams for r in s]
    mixed, base = window_gaps(bg, t0, t1), window_gaps(bg, t_ready, t0)
    im = bs.calculate_metrics(injected, t1 - t0, (50, 90, 99), tok)
    ttfts = [r.ttft for r in injected if r.success]
    trace = trace_summary(read_trace(a.trace, off0, off1), B) if a.trace else None
    why = saturation(n, im["completed"], ttfts, qps, a.duration, float(np.median(mixed)) if mixed else 0.0,
                     float(np.median(base)) if base else 0.0)
    valid = trace["valid"] if trace else None
    passed, gate_why = gate(valid, _ms(mixed, 99), _ms(mixed, 100), _ms(base, 50), a.p99_factor, a.max_factor)
    return {"label": a.label, "qps": qps, "inject_len": length, "background": B, "bg_input_len": a.bg_input_len,
            "bg_output_len": a.bg_output_len, "injected": n, "completed": im["completed"], "failed": im["failed"],
            "errors": [r.error for r in injected if not r.success],
            "valid": valid, "saturated": bool(why), "saturated_why": why,
            "gate": "PASS" if passed else "FAIL", "gate_why": gate_why, "p99_bound_ms": a.p99_factor * _ms(base, 50)
            if base else None, "max_bound_ms": a.max_factor * _ms(base, 50) if base else None,
            "itl_p50_ms": _ms(mixed, 50), "itl_p99_ms": _ms(mixed, 99), "itl_max_ms": _ms(mixed, 100),
            "itl_samples": len(mixed), "baseline_itl_p50_ms": _ms(base, 50), "baseline_itl_p99_ms": _ms(base, 99),
            "window_s": t1 - t0, "bg_restarts": len(bg) - B, "bg_failed": sum(1 for r in bg if r.error),
            "trace": trace, "injected_metrics": im}


# ---- output ---------------------------------------------------------------------------------------------
def markdown(cells: list[dict]) -> str:
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    yn = lambda v: "?" if v is None else ("yes" if v else "no")  # noqa: E731
    lines = ["| label | qps | injected len | valid | saturated | steady ms | ITL p50 ms | ITL p99 ms (bound) | "
             "ITL max ms (bound) | engine max period ms | gate | injected TTFT mean ms | injected TTFT p99 ms | "
             "completed/failed |",
             "|---" * 14 + "|"]
    for c in cells:
        im = c["injected_metrics"]
        lines.append(f"| {c['label']} | {c['qps']:g} | {c['inject_len']} | {yn(c['valid'])} | {yn(c['saturated'])} | "
                     f"{f(c['baseline_itl_p50_ms'])} | {f(c['itl_p50_ms'])} | "
                     f"{f(c['itl_p99_ms'])} ({f(c.get('p99_bound_ms'))}) | "
                     f"{f(c['itl_max_ms'])} ({f(c.get('max_bound_ms'))}) | "
                     f"{f((c.get('trace') or {}).get('max_full_decode_period_ms'))} | {c.get('gate', '-')} | "
                     f"{f(im['mean_ttft_ms'])} | {f(im['p99_ttft_ms'])} | {c['completed']}/{c['failed']} |")
    b = cells[0] if cells else None
    if b:
        lines += ["", f"Background: {b['background']} x {b['bg_input_len']}/{b['bg_output_len']} tokens (greedy, "
                      "ignore_eos); injected prompts have output 1. Mixed ITL: background gaps ending in the "
                      "injection window. Valid: an injected prefill ran in a step with the whole background decoding. "
                      "Engine max period: the step trace's longest launch-to-launch period between two steps that "
                      "both decode the whole background (the engine's side of the ITL max)."]
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(model_dir: str, server_args: str, trace: str, log_path: Path, timeout: float):
    """Our server on a free local port with a step trace; yields its URL, stops it with SIGINT."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--trace-steps", trace, "--uvicorn-log-level", "warning", *shlex.split(server_args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up ({' '.join(cmd)}); see {log_path}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_all(a) -> list[dict]:
    if a.trace and not os.path.exists(a.trace):
        raise SystemExit(f"--trace {a.trace} does not exist: start the server with --trace-steps {a.trace}")
    info = bs.server_model(a.base_url, a.api_key)
    model = a.model or info["id"]
    tokenizer = a.tokenizer or info.get("root")
    if not (Path(str(tokenizer)) / "tokenizer.json").is_file():
        raise SystemExit("--tokenizer is needed: the server's /v1/models root is not a local tokenizer directory")
    tok = bs.load_tokenizer(tokenizer)
    lens = [int(x) for x in a.inject_lens.split(",")]
    for length in lens:  # warm the server's prefill path at each size (not measured)
        warm = bs.random_dataset(tok, a.warmups, length, 1, seed=length)
        if warm:
            asyncio.run(bs.run_benchmark(a.base_url, model, warm, max_concurrency=1, extra=EXTRA,
                                         api_key=a.api_key, progress=False))
    cells = []
    for length in lens:
        for qps in (float(q) for q in a.qps.split(",")):
            print(f"[{a.label}] injecting {length}-token prompts at {qps:g} req/s ...", file=sys.stderr, flush=True)
            c = asyncio.run(run_cell(a, tok, model, length, qps))
            print(markdown([c]).splitlines()[2], file=sys.stderr, flush=True)
            cells.append(c)
            time.sleep(a.cooldown)
    return cells


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model id to send (default: GET /v1/models data[0].id)")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: /v1/models root)")
    ap.add_argument("--trace", default=None, metavar="FILE", help="the server's --trace-steps file (for validity)")
    ap.add_argument("--label", default="server", help="the server setting, e.g. chunked-1024 or unchunked")
    ap.add_argument("--background", type=int, default=8, help="background streams (B)")
    ap.add_argument("--bg-input-len", type=int, default=512)
    ap.add_argument("--bg-output-len", type=int, default=4096)
    ap.add_argument("--inject-lens", default="4096,8192,16384")
    ap.add_argument("--qps", default="0.25,0.5,1")
    ap.add_argument("--duration", type=float, default=40.0, help="injection seconds per cell")
    ap.add_argument("--baseline-s", type=float, default=3.0, help="background-only seconds before injecting")
    ap.add_argument("--warmups", type=int, default=1, help="unmeasured injected prompts of each length first")
    ap.add_argument("--cooldown", type=float, default=3.0, help="idle seconds after each cell")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--launch", default=None, metavar="MODEL_DIR", help="start our server on MODEL_DIR for the run")
    ap.add_argument("--server-args", default="", help="extra `qwen35 serve` flags with --launch (one string)")
    ap.add_argument("--p99-factor", type=float, default=3.0, help="gate: ITL p99 bound in steady TPOTs")
    ap.add_argument("--max-factor", type=float, default=5.0, help="gate: ITL max bound in steady TPOTs")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="FILE", help="only render saved results")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.from_json:
        cells = [c for p in a.from_json for c in json.loads(Path(p).read_text())["cells"]]
        (out / "mixed.md").write_text(markdown(cells))
        print(markdown(cells))
        return cells
    if a.launch:
        a.tokenizer = a.tokenizer or a.launch  # the server's /v1/models root is no path without a served name
        a.trace = str((out / f"steps-{a.label}.jsonl").resolve())
        Path(a.trace).unlink(missing_ok=True)
        with launched(a.launch, a.server_args, a.trace, out / f"server-{a.label}.log", a.ready_timeout) as url:
            a.base_url = url
            cells = run_all(a)
    else:
        cells = run_all(a)
    args = {k: v for k, v in vars(a).items() if k != "api_key"}
    (out / f"mixed-{a.label}.json").write_text(json.dumps({"args": args, "cells": cells}, indent=1))
    (out / f"mixed-{a.label}.md").write_text(markdown(cells))
    print(markdown(cells))
    failed = [c for c in cells if c["gate"] == "FAIL"]
    for c in failed:
        print(f"FAIL [{c['label']}] {c['inject_len']} tokens at {c['qps']:g} req/s: {'; '.join(c['gate_why'])}")
    print(f"gate: {len(cells) - len(failed)} PASS, {len(failed)} FAIL")
    return cells


if __name__ == "__main__":
    sys.exit(1 if any(c.get("gate") == "FAIL" for c in main()) else 0)  # saved cells from before the gate: 0
