"""Prefix caching A/B in one run (in process, no HTTP): the same seeded workloads on an engine with
prefix caching off, then on, with issue 16's four measurements:

  (a) a shared system prompt (4096 tokens) + 128 unique tokens, 256 output, at c1 and c16: TTFT of
      hits vs cold (target: hit TTFT <= 15% of cold). Two requests go first in both modes: the
      second leaves the branch point at 4096 that the measured ones hit.
  (b) 5-turn conversations (256 new tokens and 128 output per turn, each turn's prompt = the last
      prompt + its output + the new tokens, at the token level: no chat template), one at a time:
      TTFT per turn.
  (c) the cold path on a no-reuse random workload (1024 x 256, the serving matrix's concurrency
      cells): output tokens/s and TTFT with the cache on vs off (target: within 2%).
  (d) prompts of 100-500 tokens sharing a 64-token prefix, at c8: the hit rate (tokens restored /
      prompt tokens; target > 0) and TTFT.

    python tools/bench_prefix.py MODEL_DIR --json prefix.json [--only a,c] [--repeat N] [--quick] [--trace-steps P]

Prints one table (off, on, on/off per measurement; medians over --repeat alternating off/on runs) and
writes every row to --json. --quick runs
small sizes (a CPU smoke test; the numbers mean nothing). (c) over HTTP is bench_matrix.py's
`--cells '1024x256-*'` against `qwen35 serve` with and without --enable-prefix-caching.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import SamplingParams  # noqa: E402
from engine.config import EngineArgs  # noqa: E402
from tools.bench_engine import run_engine  # noqa: E402
from tools.run_meta import run_meta  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    system: int = 4096
    unique: int = 128
    out_a: int = 256
    conc_a: tuple = (1, 16)
    convos: int = 4
    turn_new: int = 256
    turn_out: int = 128
    turns: int = 5
    cold_in: int = 1024
    cold_out: int = 256
    conc_c: tuple = (1, 4, 16, 64)
    short_head: int = 64
    short_range: tuple = (100, 500)
    short_n: int = 64
    short_out: int = 32


QUICK = Sizes(system=256, unique=16, out_a=4, conc_a=(1, 4), convos=2, turn_new=32, turn_out=8, cold_in=64,
              cold_out=4, conc_c=(1, 4), short_n=16, short_range=(70, 130), short_out=2)


def _ids(rng, n):
    return rng.integers(0, 200_000, n).tolist()


def _params(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _one(eng, prompt, params) -> dict:
    st, ttft, tokens, cached = time.perf_counter(), None, [], 0
    async for o in eng.add_request(prompt, params):
        if o.new_token_ids and ttft is None:
            ttft = time.perf_counter() - st
        tokens += o.new_token_ids
        cached = o.cached_tokens or 0
    return {"ttft": ttft or 0.0, "e2e": time.perf_counter() - st, "tokens": tokens, "cached": cached,
            "prompt": len(prompt)}


def _wave(eng, prompts, params, concurrency) -> tuple[list[dict], float]:
    """Every prompt, at most `concurrency` in flight. Returns the per-request results and the wall time."""
    async def run():
        sem = asyncio.Semaphore(concurrency)

        async def guarded(p):
            async with sem:
                return await _one(eng, p, params)
        return await asyncio.gather(*map(guarded, prompts))
    t0 = time.perf_counter()
    res = asyncio.run(run())
    return res, time.perf_counter() - t0


def _summary(res, wall) -> dict:
    ttft = [r["ttft"] for r in res]
    tpot = [(r["e2e"] - r["ttft"]) / (len(r["tokens"]) - 1) for r in res if len(r["tokens"]) > 1]
    return {"requests": len(res), "mean_ttft_ms": 1e3 * float(np.mean(ttft)),
            "median_ttft_ms": 1e3 * float(np.median(ttft)),
            "median_tpot_ms": 1e3 * float(np.median(tpot)) if tpot else None,
            "output_tok_s": sum(len(r["tokens"]) for r in res) / wall,
            "cached_tokens": sum(r["cached"] for r in res), "prompt_tokens": sum(r["prompt"] for r in res),
            "requests_hit": sum(r["cached"] > 0 for r in res)}


def shared_system_prompt(eng, z: Sizes) -> list[dict]:
    rng = np.random.default_rng(1)
    system = _ids(rng, z.system)
    _wave(eng, [system + _ids(rng, z.unique) for _ in range(2)], _params(z.out_a), 1)  # leaves the branch point
    rows = []
    for c in z.conc_a:
        res, wall = _wave(eng, [system + _ids(rng, z.unique) for _ in range(max(8, 2 * c))], _params(z.out_a), c)
        rows.append({"workload": "a", "label": f"shared {z.system} + {z.unique}, c{c}", **_summary(res, wall)})
    return rows


def multi_turn(eng, z: Sizes) -> list[dict]:
    rng = np.random.default_rng(2)
    per_turn = [[] for _ in range(z.turns)]
    for _ in range(z.convos):
        prompt = _ids(rng, z.turn_new)
        for t in range(z.turns):
            (r,), _ = _wave(eng, [prompt], _params(z.turn_out), 1)
            per_turn[t].append(r)
            prompt = prompt + r["tokens"] + _ids(rng, z.turn_new)
    return [{"workload": "b", "label": f"turn {t + 1}", **_summary(res, sum(r["e2e"] for r in res))}
            for t, res in enumerate(per_turn)]


def cold_path(eng, z: Sizes) -> list[dict]:
    rng = np.random.default_rng(3)
    rows = []
    for c in z.conc_c:
        res, wall = _wave(eng, [_ids(rng, z.cold_in) for _ in range(max(8, 2 * c))], _params(z.cold_out), c)
        rows.append({"workload": "c", "label": f"no reuse {z.cold_in}x{z.cold_out}, c{c}", **_summary(res, wall)})
    return rows


def short_prompts(eng, z: Sizes) -> list[dict]:
    rng = np.random.default_rng(4)
    head = _ids(rng, z.short_head)
    prompts = [head + _ids(rng, int(rng.integers(*z.short_range)) - z.short_head) for _ in range(z.short_n)]
    res, wall = _wave(eng, prompts, _params(z.short_out), 8)
    return [{"workload": "d", "label": f"{z.short_range[0]}-{z.short_range[1]} tokens, shared {z.short_head}, c8",
             **_summary(res, wall)}]


WORKLOADS = {"a": shared_system_prompt, "b": multi_turn, "c": cold_path, "d": short_prompts}


def _median_rows(rows) -> dict:
    """(workload, label, mode) -> that measurement's row with the median TTFT and tok/s over repetitions."""
    groups = {}
    for r in rows:
        groups.setdefault((r["workload"], r["label"], r["mode"]), []).append(r)
    return {k: {**g[0], **{m: float(np.median([r[m] for r in g])) for m in ("mean_ttft_ms", "output_tok_s")}}
            for k, g in groups.items()}


def _table(rows) -> str:
    """One line per measurement: off, on and on/off for TTFT, throughput (medians over repetitions), and the
    hit rate with caching on."""
    by = _median_rows(rows)
    keys = list(dict.fromkeys((r["workload"], r["label"]) for r in rows))
    out = [f"{'':4}{'measurement':42}{'TTFT off':>10}{'TTFT on':>10}{'on/off':>8}{'tok/s off':>11}"
           f"{'tok/s on':>10}{'on/off':>8}{'hit rate':>9}"]
    for w, label in keys:
        off, on = by.get((w, label, "off")), by.get((w, label, "on"))
        if off is None or on is None:
            continue
        hit = on["cached_tokens"] / max(on["prompt_tokens"], 1)
        out.append(f"({w}) {label:42}{off['mean_ttft_ms']:10.1f}{on['mean_ttft_ms']:10.1f}"
                   f"{on['mean_ttft_ms'] / off['mean_ttft_ms']:8.3f}{off['output_tok_s']:11.1f}{on['output_tok_s']:10.1f}"
                   f"{on['output_tok_s'] / off['output_tok_s']:8.3f}{hit:9.3f}")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", default="a,b,c,d", help="comma-separated workloads")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-state-snapshots", type=int, default=None)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    ap.add_argument("--repeat", type=int, default=1, help="off/on pairs, alternating; the table shows medians")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-steps", default=None, metavar="PREFIX",
                    help="each engine's step trace to PREFIX-MODE-REP.jsonl (tools/trace_report.py)")
    a = ap.parse_args(argv)
    z = QUICK if a.quick else Sizes()
    rows = []

    def run(eng, mode, rep):
        _wave(eng, [[1] * z.cold_in], _params(2), 1)  # warm-up
        for w in a.only.split(","):
            for r in WORKLOADS[w](eng, z):
                rows.append({"mode": mode, "rep": rep, **r})
                print(f"[{mode}] ({w}) {r['label']}: TTFT {r['mean_ttft_ms']:.1f} ms, "
                      f"{r['output_tok_s']:.1f} tok/s, cached {r['cached_tokens']}/{r['prompt_tokens']}", flush=True)
        stats = eng.stats()
        print(f"[{mode}] snapshots cached {stats.state_snapshots_cached}/{stats.state_snapshots_total}, "
              f"KV blocks cached {stats.kv_blocks_cached}/{stats.kv_blocks_total}", flush=True)

    for rep, mode in enumerate(("off", "on") * a.repeat):
        run_engine(a.model_dir, lambda eng: run(eng, mode, rep // 2), device=a.device, max_num_seqs=a.max_num_seqs,
                   max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
                   batch_invariant=a.batch_invariant, enable_prefix_caching=mode == "on",
                   num_state_snapshots=a.num_state_snapshots,
                   trace_steps=f"{a.trace_steps}-{mode}-{rep // 2}.jsonl" if a.trace_steps else None)
    print(_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({**run_meta(), "args": vars(a), "sizes": asdict(z), "rows": rows},
                                           indent=1))
    return rows


if __name__ == "__main__":
    main()
