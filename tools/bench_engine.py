"""In-process engine benchmark (no HTTP): the same random workload as bench_serving at several
concurrency levels, reporting TTFT, TPOT (vLLM's definitions), output tokens/s, the fraction of wall
time the device was busy (forward + sampling, device-timed) and the median period of full-batch decode
steps, read from the step trace.

    python tools/bench_engine.py MODEL_DIR --input-len 1024 --output-len 256 --concurrency 1,4,8,16,32,64

By default each level runs 2 x concurrency requests, at most `concurrency` in flight, so a request
decodes while others are admitted and their prefill shares its steps (TPOT counts that, as vLLM's
does). --one-wave runs exactly `concurrency` requests per level, all submitted together, with a step
budget that admits every prompt in one step: each request then decodes beside the same others from
its first token to its last, and TPOT is the engine's decode step, comparable with the bare graph
step of bench_decode.py.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import SamplingParams  # noqa: E402
from engine.config import EngineArgs  # noqa: E402
from engine.engine import Engine  # noqa: E402
from tools.bench_serving import RequestResult  # noqa: E402


async def _consume(stream, st: float, prompt_len: int) -> tuple[RequestResult, list[int]]:
    """One request's events recorded as bench_serving records a streamed request (its metric code then
    applies: vLLM's TTFT, ITL between events, latency), and its token ids."""
    res, tokens, last = RequestResult(prompt_len=prompt_len, start_time=st), [], st
    async for o in stream:
        if o.new_token_ids:
            now = time.perf_counter()
            if tokens:
                res.itl.append(now - last)
            else:
                res.ttft = now - st
            last, tokens = now, tokens + o.new_token_ids
    res.success, res.output_tokens, res.latency = bool(tokens), len(tokens), last - st
    return res, tokens


async def run_level(eng, prompts, params, concurrency, one_wave=False):
    """Every prompt, at most `concurrency` in flight (one_wave: all submitted at once). Returns, in prompt
    order, each request's (RequestResult, token ids), and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def guarded(p):
        async with sem:
            st = time.perf_counter()  # TTFT and E2EL include the request's validation, as before
            return await _consume(eng.add_request(p, params), st, len(p))

    t0 = time.perf_counter()
    if one_wave:
        # Validating 64 prompts takes longer than the interpreter's 5 ms thread switch interval: hold the
        # engine thread off until the whole wave is in its inbox, so that one step admits all of it.
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)
        try:
            streams = [eng.add_request(p, params) for p in prompts]
        finally:
            sys.setswitchinterval(old)
        res = await asyncio.gather(*[_consume(s, t0, len(p)) for s, p in zip(streams, prompts)])
    else:
        res = await asyncio.gather(*[guarded(p) for p in prompts])
    return list(res), time.perf_counter() - t0


def run_engine(model_dir, work, **engine_args):
    """work(engine)'s result, on an engine shut down and released afterwards: the next engine of the
    process plans its memory from what the device has free."""
    eng = Engine(model_dir, **engine_args)
    try:
        return work(eng)
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        if "cupy" in sys.modules:
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", default="1,4,8,16,32,64")
    ap.add_argument("--prompts-per-level", type=int, default=0, help="default: 2 x concurrency (at least 4)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=0, help="default: input + output + 16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="default: the engine's; with --one-wave, enough for every prompt of the largest level")
    ap.add_argument("--one-wave", action="store_true", help="concurrency requests per level, all admitted in one step")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-steps", default=None, metavar="FILE", help="keep the step trace (tools/trace_report.py)")
    ap.add_argument("--batch-invariant", action="store_true", help="Engine(batch_invariant=True)")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="Engine(speculative_config=JSON): speculative decoding "
                         "(random weights: drafts ~never accepted)")
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    trace = Path(a.trace_steps or Path(tempfile.mkdtemp()) / "steps.jsonl")
    trace.unlink(missing_ok=True)
    budget = a.max_num_batched_tokens or (max(levels) * (a.input_len + 1) if a.one_wave
                                          else EngineArgs.max_num_batched_tokens)
    eng = Engine(a.model_dir, device=a.device, max_num_seqs=max(levels), trace_steps=str(trace),
                 batch_invariant=a.batch_invariant, speculative_config=a.speculative_config,
                 max_model_len=a.max_model_len or a.input_len + a.output_len + 16,
                 max_num_batched_tokens=max(budget, max(levels)))
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    asyncio.run(run_level(eng, [rng.integers(0, 200000, a.input_len).tolist()], params, 1))  # warm-up
    for c in levels:
        n = a.prompts_per_level or (c if a.one_wave else max(4, 2 * c))
        prompts = [rng.integers(0, 200000, a.input_len).tolist() for _ in range(n)]
        start = time.perf_counter()
        res, wall = asyncio.run(run_level(eng, prompts, params, c, a.one_wave))
        res = [r for r, _ in res]
        steps = [json.loads(s) for s in trace.read_text().splitlines()]
        steps = [s for s in steps if s["t"] >= start]
        ttft = [r.ttft for r in res]
        tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in res if r.output_tokens > 1]
        decode = [s["step_ms"] for s in steps if s["kind"] == "decode" and s["decode_rows"] == c]
        rows.append({"concurrency": c, "requests": n, "window": [start, start + wall],
                     "mean_ttft_ms": 1e3 * float(np.mean(ttft)),
                     "median_tpot_ms": 1e3 * float(np.median(tpot)), "mean_tpot_ms": 1e3 * float(np.mean(tpot)),
                     "output_tok_s": sum(r.output_tokens for r in res) / wall,
                     "gpu_busy_frac": sum(s["gpu_ms"] for s in steps) / 1e3 / wall,
                     "p99_tpot_ms": 1e3 * float(np.percentile(tpot, 99)),
                     "prompt_steps": sum(s["kind"] != "decode" for s in steps),
                     "full_batch_decode_step_ms": float(np.median(decode)) if decode else None})
        r = rows[-1]
        print(f"c={c:3d}  TTFT {r['mean_ttft_ms']:8.1f} ms  TPOT {r['median_tpot_ms']:7.2f} ms  "
              f"{r['output_tok_s']:8.1f} tok/s  GPU busy {r['gpu_busy_frac']:.2f}  "
              f"full-batch decode step {r['full_batch_decode_step_ms'] or 0:.2f} ms  "
              f"TPOT p99 {r['p99_tpot_ms']:.2f} ms  steps with prompt tokens {r['prompt_steps']}", flush=True)
    eng.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
