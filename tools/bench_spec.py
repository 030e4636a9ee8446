"""Speculative decoding benchmark (issue #19), in process on one machine (no HTTP).

  (a) The verify step's time vs K (1 + K tokens per sequence) at each batch size, beside the plain decode
      step, both launched through the engine's own runner (ModelRunner.forward: graph replay where the
      runner has graphs for the step, eager otherwise), every sequence at --ctx tokens of context, on an
      engine sized as a server (--max-model-len); time per step as bench_decode.py (tools/step_timer.py).
  (b) End to end, random-token prompts, greedy, ignore_eos, at most c requests in flight (2 x c requests
      per level, at least 4, as bench_engine.py): plain decoding, then oracle drafters proposing the
      target's own greedy continuation recorded from that plain run, each draft right with probability p
      (p = 1: accept-all) independently per position (tools/spec_oracles.py), at each K of --k.
      TPOT, ITL and tok/s are bench_serving.py's (vLLM's; ITL is between stream events, which carry a
      verify's tokens together).
  (c) The drafters of --speculative-config (the JSON goes to the engine as is), on the same workload; a
      drafter with weights (MTP, DFlash) also at each p of --drafter-oracle-p: it observes and proposes as
      usual, and the oracle's drafts are verified instead of its own (its cost at a controlled acceptance,
      which random weights cannot give it).
  (d) Projected TPOT at per-position acceptance vectors (--accept): tau = 1 + sum_j prod_{i<=j} p_i tokens
      per verify, projected TPOT = verify step time (a) / tau; a vector shorter than K holds its last
      value. It assumes every step is a verify of K drafts, as (b)'s oracles make them; (b) measures what
      (d) leaves out: the host's work between the steps (speculation steps synchronously) and the rollback
      copies after rejections.

Acceptance in (b) and (c): accepted / drafted from the engine's spec_decode counters, and per draft
position the share of the verifies reaching it (every draft before it accepted) that accepted it, read
from the runner's verify results. `diverged` counts requests whose tokens differ from the plain run's
(0 on the CPU; on the GPU a verify's bf16 rows may flip a near-tie, and an oracle then drafts from a
continuation that is no longer the target's). ITL is between stream events as vLLM defines it: one event
per step, a verify's tokens in one (before commit bffb49a each token of a verify was its own event, and
the median ITL the ~0 gap inside a verify's burst); TPOT is the figure to compare.

    python3 tools/bench_spec.py MODEL_DIR --json spec.json --md spec.md [--sections a,b,c] [--commit SHA]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' ...]
    python3 tools/bench_spec.py --from-json a.json [b.json ...] [--md spec.md]   # merged runs, (d) again
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import SamplingParams  # noqa: E402
from engine.config import MAX_SPEC_TOKENS, EngineArgs  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.runner import Verified  # noqa: E402
from tools.bench_engine import run_engine, run_level  # noqa: E402
from tools.bench_serving import calculate_metrics  # noqa: E402
from tools.run_meta import device_name, run_meta  # noqa: E402
from tools.spec_oracles import OracleOverDrafter, RecordedOracle  # noqa: E402
from tools.step_timer import time_per_call  # noqa: E402

VECTORS = {"MTP": [0.96, 0.80, 0.64], "DFlash": [0.91, 0.80, 0.69, 0.59]}  # issue #19's per-position rates
TARGET = {"concurrency": 1, "p": 0.8, "k": 3, "tpot_ms": 1.3}             # issue #19: median TPOT at most
METRICS = ("median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms", "median_itl_ms", "mean_itl_ms", "p99_itl_ms",
           "mean_ttft_ms", "output_throughput")
TOKENS = 200_000  # random prompt and draft ids below this, as bench_engine.py's


def tau(p: list[float], k: int) -> float:
    """Expected tokens per verify of k drafts with per-position acceptance p (each given every draft before
    it was accepted; a p shorter than k holds its last value): 1 + sum_j prod_{i<=j} p_i."""
    return 1.0 + float(np.cumprod([p[min(i, len(p) - 1)] for i in range(k)]).sum())


def oracle_label(p: float) -> str:
    return "accept-all" if p == 1 else f"oracle p={p:g}"


# ---- (a) the verify step vs K -----------------------------------------------------------------------
def _held_requests(eng, n: int, ctx: int, k: int, rng) -> list[Request]:
    """n requests at ctx tokens of context (prefilled through the runner) and one output token to compute,
    holding eng's slots and KV blocks up to position ctx + k. The engine's loop is idle (nothing was
    submitted), so the runner is the caller's."""
    reqs = []
    for i in range(n):
        req = Request(f"step-{i}", rng.integers(0, TOKENS, ctx).tolist(), SamplingParams(), 1 + k, frozenset(), None)
        req.slot, req.block_ids = eng.slots.allocate(), eng.kv.allocate(eng.kv.blocks_for(req.lifetime_tokens))
        req.spec_log = eng.scheduler.spec_logs.allocate()
        assert req.spec_log is not None, "the memory plan left no log sets for this batch"
        reqs.append(req)
    per = max(1, eng.args.max_num_batched_tokens // ctx)  # prompts per prefill, within the step budget
    for i in range(0, n, per):
        eng.runner.forward([(req, ctx) for req in reqs[i:i + per]], None)
    for req in reqs:
        req.num_computed, req.output_ids = ctx, [int(rng.integers(0, TOKENS))]
    return reqs


def verify_step_times(eng, k: int, batches: list[int], ctx: int, calls: int) -> list[dict]:
    """Per batch size: the plain decode step and the verify of k drafts, as the engine launches them
    (runner.forward; each verify replays the one before it, all of whose drafts it accepted: the most a
    steady run of verifies replays, step.py)."""
    rng = np.random.default_rng(k)
    runner, ops = eng.runner, eng.runner.model.ops
    graphs = sorted(name for name, v in vars(runner).items() if "graph" in name and v is not None)
    reqs = _held_requests(eng, max(batches), ctx, k, rng)
    rows = []
    try:
        for b in batches:
            batch = reqs[:b]
            for req in batch:
                req.drafts = []
            plain = time_per_call(lambda: runner.forward([(req, 1) for req in batch], None), ops, calls)
            for req in batch:
                req.drafts = rng.integers(0, TOKENS, k).tolist()

            def verify_step():
                for req in batch:
                    req.replay = 1 + k
                return runner.forward([(req, 1 + k) for req in batch], None)
            verify = time_per_call(verify_step, ops, calls)
            rows.append({"k": k, "batch": b, "ctx": ctx, "plain_ms": plain * 1e3, "verify_ms": verify * 1e3,
                         "verify_over_plain": verify / plain, "runner_graphs": graphs})
            print(f"(a) K={k:2d} batch {b:2d}: plain {plain * 1e3:7.2f} ms, verify {verify * 1e3:7.2f} ms "
                  f"({verify / plain:.2f}x)", flush=True)
    finally:
        for req in reqs:
            eng.kv.free(req.block_ids)
            eng.slots.free(req.slot)
            eng.scheduler.spec_logs.free(req.spec_log)
            req.replay = 0
    return rows


# ---- (b), (c) end to end ------------------------------------------------------------------------------
class AcceptTally:
    """Per-position acceptance of the verifies the runner collects (the engine counts totals only):
    reached[j] verifies drafted a token j with every draft before it accepted, accepted[j] accepted it."""

    def __init__(self, runner):
        self.reset()
        collect = runner.collect
        self.close = lambda: setattr(runner, "collect", collect)  # the runner's own collect back

        def counting(sampling):
            out = collect(sampling)
            for _, res in out:
                if isinstance(res, Verified):
                    a = len(res.tokens) - 1
                    self.reached[:min(a + 1, res.drafted)] += 1
                    self.accepted[:a] += 1
            return out
        runner.collect = counting

    def reset(self) -> None:
        self.reached, self.accepted = np.zeros(MAX_SPEC_TOKENS, np.int64), np.zeros(MAX_SPEC_TOKENS, np.int64)

    def per_position(self) -> list[float]:
        n = int(np.count_nonzero(self.reached))
        return (self.accepted[:n] / self.reached[:n]).tolist()


def e2e_levels(eng, levels: dict[int, list[list[int]]], output_len: int, label: str, k: int | None,
               recorded: dict, drafter_for=None) -> tuple[list[dict], dict]:
    """Every level on eng (after one warm-up request): rows of metrics and acceptance, and each prompt's
    tokens. drafter_for(c): the drafter swapped in for level c (None: the engine's own). recorded: the
    plain run's tokens by prompt, to count the requests that diverged from it (empty: not counted)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    first = next(iter(levels))
    if drafter_for is not None:
        eng.drafter = drafter_for(first)
    asyncio.run(run_level(eng, levels[first][:1], params, 1))  # warm-up (the verify path too, if any)
    tally = AcceptTally(eng.runner)
    try:
        rows, outputs = [], {}
        for c, prompts in levels.items():
            if drafter_for is not None:
                eng.drafter = drafter_for(c)  # a fresh oracle: its draws do not depend on the levels before
            tally.reset()
            s0 = eng.stats()
            res, wall = asyncio.run(run_level(eng, prompts, params, c))
            s1 = eng.stats()
            outputs.update((tuple(p), toks) for p, (_, toks) in zip(prompts, res))
            known = [tuple(p) for p in prompts if tuple(p) in recorded]
            rows.append(_e2e_row(label, k, c, prompts, output_len, res, wall, s0, s1, tally,
                                 sum(outputs[p] != recorded[p] for p in known) if known else None))
    finally:
        tally.close()
    return rows, outputs


def _e2e_row(label, k, c, prompts, output_len, res, wall, s0, s1, tally, diverged) -> dict:
    m = calculate_metrics([r for r, _ in res], wall)
    drafts, drafted, accepted = (getattr(s1, f) - getattr(s0, f) for f in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    per_position = tally.per_position()
    r = {"label": label, "k": k, "concurrency": c, "input_len": len(prompts[0]), "output_len": output_len,
         "requests": len(res), "failed": m["failed"], **{key: m[key] for key in METRICS},
         "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
         "acceptance": accepted / drafted if drafted else None, "per_position_acceptance": per_position,
         "per_position_reached": tally.reached[:len(per_position)].tolist(), "diverged": diverged}
    print(f"(b/c) {label} K={k} c={c}: TPOT {r['median_tpot_ms']:.2f} ms (mean {r['mean_tpot_ms']:.2f}), "
          f"ITL {r['median_itl_ms']:.2f} ms, {r['output_throughput']:.1f} tok/s, acceptance "
          f"{_fmt(r['acceptance'])} {_fmt_vec(per_position)}, diverged {diverged}", flush=True)
    return r


# ---- (d) projection and the target ----------------------------------------------------------------------
def projection(verify_rows: list[dict], vectors: dict[str, list[float]]) -> list[dict]:
    """Per vector, K and batch of (a): tau and verify time / tau, beside the plain step."""
    return [{"vector": name, "k": r["k"], "batch": r["batch"], "tau": tau(p, r["k"]), "verify_ms": r["verify_ms"],
             "plain_ms": r["plain_ms"], "projected_tpot_ms": r["verify_ms"] / tau(p, r["k"]),
             "speedup": r["plain_ms"] / (r["verify_ms"] / tau(p, r["k"]))}
            for name, p in vectors.items() for r in verify_rows]


def target(e2e_rows: list[dict]) -> dict | None:
    """Issue #19's gate: c1, the 0.8 oracle, K = 3, median TPOT <= 1.3 ms (None: not measured)."""
    row = next((r for r in e2e_rows if r.get("label") == oracle_label(TARGET["p"]) and r["k"] == TARGET["k"]
                and r["concurrency"] == TARGET["concurrency"]), None)
    if row is None:
        return None
    return {**TARGET, "median_tpot_ms": row["median_tpot_ms"], "mean_tpot_ms": row["mean_tpot_ms"],
            "pass": row["median_tpot_ms"] <= TARGET["tpot_ms"]}


# ---- the report -------------------------------------------------------------------------------------------
def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _fmt_vec(v) -> str:
    return "/".join(f"{x:.2f}" for x in v) if v else "-"


def finish(doc: dict, vectors: dict[str, list[float]]) -> dict:
    """(d) and the target, from the measured sections."""
    doc["projection"] = {"rule": "tau = 1 + sum_j prod_{i<=j} p_i; a vector shorter than K holds its last value; "
                                 "projected TPOT = verify step ms (a) / tau",
                         "vectors": vectors, "rows": projection(doc["verify_step"], vectors)}
    doc["target"] = target(doc["e2e"])
    return doc


def markdown(doc: dict) -> str:
    out = ["# Speculative decoding benchmark (issue #19)", ""]
    for m in doc["meta"]:
        out.append(f"- {m.get('device', '?')}, commit {m['commit']}, {m['date']}: `{m['command']}`")
    v = doc["verify_step"]
    if v:
        ks, batches = sorted({r["k"] for r in v}), sorted({r["batch"] for r in v})
        at = {(r["k"], r["batch"]): r for r in v}
        out += ["", f"## (a) verify step vs K: ms per step (x plain), {v[0]['ctx']} tokens of context, "
                f"runner graphs: {', '.join(v[0]['runner_graphs']) or 'none'}", "",
                "| batch | plain ms | " + " | ".join(f"K={k}" for k in ks) + " |",
                "|---" * (len(ks) + 2) + "|"]
        for b in batches:
            plain = np.median([r["plain_ms"] for r in v if r["batch"] == b])
            cells = [f"{at[k, b]['verify_ms']:.2f} ({at[k, b]['verify_over_plain']:.2f}x)" if (k, b) in at else "-"
                     for k in ks]
            out.append(f"| {b} | {plain:.2f} | " + " | ".join(cells) + " |")
    e = doc["e2e"]
    if e:
        size = next((f"{r['input_len']} x {r['output_len']} tokens" for r in e if "error" not in r), "")
        out += ["", f"## (b, c) end to end, {size}: TPOT, ITL (ms), output tok/s, acceptance", "",
                "| drafter | K | c | TPOT median | TPOT mean | ITL median | ITL p99 | tok/s | acceptance | "
                "per position | diverged |", "|---" * 11 + "|"]
        for r in e:
            if "error" in r:
                out.append(f"| {r['label']} | {_fmt(r['k'], 'd')} | - | error: {r['error']} |" + " |" * 7)
                continue
            out.append(f"| {r['label']} | {_fmt(r['k'], 'd')} | {r['concurrency']} | {r['median_tpot_ms']:.2f} | "
                       f"{r['mean_tpot_ms']:.2f} | {r['median_itl_ms']:.2f} | {r['p99_itl_ms']:.2f} | "
                       f"{r['output_throughput']:.1f} | {_fmt(r['acceptance'])} | "
                       f"{_fmt_vec(r['per_position_acceptance'])} | {_fmt(r['diverged'], 'd')} |")
    p = doc["projection"]
    if p["rows"]:
        batches = sorted({r["batch"] for r in p["rows"]})
        at = {(r["vector"], r["k"], r["batch"]): r for r in p["rows"]}
        keys = list(dict.fromkeys((r["vector"], r["k"]) for r in p["rows"]))
        out += ["", f"## (d) projected TPOT ms (x plain step); {p['rule']}", "",
                "| vector | K | tau | " + " | ".join(f"batch {b}" for b in batches) + " |",
                "|---" * (len(batches) + 3) + "|"]
        for vn, k in keys:
            tau_k = at[vn, k, batches[0]]["tau"]
            out.append(f"| {vn} {_fmt_vec(p['vectors'][vn])} | {k} | {tau_k:.3f} | " + " | ".join(
                f"{at[vn, k, b]['projected_tpot_ms']:.2f} ({at[vn, k, b]['speedup']:.2f}x)"
                if (vn, k, b) in at else "-" for b in batches) + " |")
        out.append("| plain step | | 1 | " + " | ".join(
            f"{np.median([r['plain_ms'] for r in doc['verify_step'] if r['batch'] == b]):.2f}" for b in batches) + " |")
    t = doc["target"]
    if t is not None:
        out += ["", f"Target (issue #19): c{t['concurrency']}, oracle p={t['p']}, K={t['k']}: median TPOT "
                f"{t['median_tpot_ms']:.2f} ms (mean {t['mean_tpot_ms']:.2f}) <= {t['tpot_ms']} ms: "
                f"**{'PASS' if t['pass'] else 'FAIL'}**"]
    return "\n".join(out) + "\n"


def merge(paths: list[str]) -> dict:
    """Several runs' JSON as one report (the lead may run the sections apart): rows concatenated."""
    doc = {"meta": [], "verify_step": [], "e2e": [], "vectors": {}}
    for path in paths:
        d = json.loads(Path(path).read_text())
        doc["meta"] += d["meta"]
        doc["verify_step"] += d["verify_step"]
        doc["e2e"] += d["e2e"]
        doc["vectors"] |= d["projection"]["vectors"]
    return doc


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--from-json", nargs="+", metavar="JSON", help="render saved runs (merged) instead of measuring")
    ap.add_argument("--sections", default="a,b,c", help="which of a (verify step), b (oracles), c (drafters) to run")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=8464, help="every engine's, as a server sizes it")
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    ap.add_argument("--verify-ks", default="1,2,3,4,7,15", help="(a) K values")
    ap.add_argument("--batches", default="1,4,16", help="(a) batch sizes")
    ap.add_argument("--ctx", type=int, default=1024 + 128, help="(a) context per sequence")
    ap.add_argument("--steps", type=int, default=30, help="(a) timed steps per cell")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts-per-level", type=int, default=0, help="default: 2 x concurrency, at least 4")
    ap.add_argument("--k", default="3", help="(b) K values of the oracles")
    ap.add_argument("--oracle-p", default="1,0.9,0.8,0.6", help="(b) per-position acceptance of the oracles")
    ap.add_argument("--speculative-config", action="append", default=[], metavar="JSON",
                    help="(c) a drafter, as the engine's --speculative-config (repeatable)")
    ap.add_argument("--drafter-oracle-p", default="0.8",
                    help="(c) drafters with weights also with an oracle's drafts at these p ('': none)")
    ap.add_argument("--accept", action="append", default=[], metavar="NAME=P1/P2/...",
                    help="(d) a per-position acceptance vector (default: issue #19's MTP and DFlash)")
    ap.add_argument("--trace-steps", metavar="FILE", help="every engine's step trace (tools/trace_report.py)")
    ap.add_argument("--commit", help="the code's commit, if the tree's .git is stale")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    vectors = {n: [float(x) for x in v.split("/")] for n, v in (s.split("=", 1) for s in a.accept)}
    if a.from_json:
        doc = merge(a.from_json)
        doc = finish(doc, vectors or doc.pop("vectors"))
    else:
        if not a.model_dir:
            ap.error("MODEL_DIR is needed unless --from-json")
        doc = measure(a)
        command = ["python3", "tools/bench_spec.py", *(sys.argv[1:] if argv is None else argv)]
        doc["meta"] = [run_meta(a.commit, command) | {"device": doc.pop("device"), "args": vars(a)}]
        doc = finish(doc, vectors or VECTORS)
    md = markdown(doc)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    if a.md:
        Path(a.md).write_text(md)
    return doc


def measure(a) -> dict:
    """The plain run first (its tokens are the oracles' recordings), then one engine per K serving both (a)
    and the oracles of (b), then one per --speculative-config; each released before the next starts."""
    sections = set(a.sections.split(","))
    verify_ks, batches, levels_c = _ints(a.verify_ks) if "a" in sections else [], _ints(a.batches), _ints(a.concurrency)
    oracle_ks = _ints(a.k) if "b" in sections else []
    kw = dict(device=a.device, max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
              max_num_seqs=max(batches + levels_c), trace_steps=a.trace_steps)
    rng = np.random.default_rng(0)
    levels = {c: [rng.integers(0, TOKENS, a.input_len).tolist() for _ in range(a.prompts_per_level or max(4, 2 * c))]
              for c in levels_c}
    doc = {"device": None, "verify_step": [], "e2e": []}
    recorded = {}

    def e2e(eng, label, k, drafter_for=None):
        doc["device"] = device_name(eng.runner.model.ops)
        rows, outputs = e2e_levels(eng, levels, a.output_len, label, k, recorded, drafter_for)
        doc["e2e"].extend(rows)
        return outputs

    if sections & {"b", "c"}:
        recorded.update(run_engine(a.model_dir, lambda eng: e2e(eng, "plain", None), **kw))
    for k in sorted(set(verify_ks) | set(oracle_ks)):
        def work(eng, k=k):
            doc["device"] = device_name(eng.runner.model.ops)
            if k in verify_ks:
                doc["verify_step"] += verify_step_times(eng, k, batches, a.ctx, a.steps)
            if k in oracle_ks:
                vocab = eng.cfg.vocab_size
                for p in (float(x) for x in a.oracle_p.split(",")):
                    e2e(eng, oracle_label(p), k, lambda c, p=p: RecordedOracle(recorded, p, vocab, seed=c))
        run_engine(a.model_dir, work, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kw)

    def drafter(eng, spec, k):
        e2e(eng, spec, k)
        inner, vocab = eng.drafter, eng.cfg.vocab_size
        if inner.capture is None:  # no weights (n-gram): nothing but its proposals to measure
            return
        for p in (float(x) for x in a.drafter_oracle_p.split(",") if x):
            e2e(eng, f"{spec}, {oracle_label(p)} drafts", k,
                lambda c, p=p: OracleOverDrafter(inner, RecordedOracle(recorded, p, vocab, seed=c)))

    if "c" in sections:
        for spec in a.speculative_config:
            k = json.loads(spec).get("num_speculative_tokens")
            try:
                run_engine(a.model_dir, lambda eng: drafter(eng, spec, k), speculative_config=spec, **kw)
            except Exception as e:  # noqa: BLE001 - a drafter not built yet: say so, measure the rest
                doc["e2e"].append({"label": spec, "k": k, "error": f"{type(e).__name__}: {e}"})
                print(f"(c) {spec}: {type(e).__name__}: {e}", flush=True)
    return doc


if __name__ == "__main__":
    main()
