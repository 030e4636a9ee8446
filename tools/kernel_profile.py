"""Where a forward's device time goes, kernel by kernel: an eager prefill of one sequence of L tokens (or of N
of them in one step, --prefill-seqs N: an admission wave's prefill), an eager mixed step (D decode rows beside
one prompt chunk of P tokens, as chunked prefill runs under decode load), a CUDA-graph decode step of B
sequences and, with --verify-k K, the graph of B speculative verifies of K drafts each (what a verify pays over
a decode), on the 4b shapes with random weights (bench_decode.random_model).

Per scenario: each kernel's calls and device microseconds per forward (CUPTI activity records through
torch.profiler, which only this tool needs; the GPU machine has torch), its share of the kernels' total,
the forward's own time between device events beside that total, and the host's time to enqueue it (when
that nears the device's, the forward waits on the host). Kernels run without programmatic
dependent launch (QWEN35_PDL=0, set here): with it each kernel's span would include its wait for the one
before. Writes JSON ($OUT/kernel_profile.json when OUT is set).

  python3 tools/kernel_profile.py [--prefill 1024,8192] [--prefill-seqs 1] [--mixed 64,256 --mixed-decodes 16]
      [--decode-batches 1,16,64] [--verify-k 3] [--ctx 1024] [--max-model-len 8464] [--reps 5] [--top 25] [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("QWEN35_PDL", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from engine.gpu.decode_graph import DecodeGraphs  # noqa: E402
from engine.step import Step  # noqa: E402
from tools.bench_decode import BS, random_model  # noqa: E402
from tools.run_meta import device_name  # noqa: E402
from tools.step_timer import host_per_call, time_per_call  # noqa: E402


def kernel_name(raw: str) -> str:
    """A kernel's name with its template arguments, without the parameter list."""
    return re.sub(r"^void ", "", raw.split("(")[0]).strip()


def profile(fn, reps: int) -> dict[str, tuple[float, float]]:
    """name -> (calls, device us) per call of fn, from CUPTI kernel records."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn()
    cupy.cuda.Device().synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        cupy.cuda.Device().synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            a = agg[kernel_name(e.name)]
            a[0] += 1
            a[1] += getattr(e, "device_time_total", None) or e.cuda_time_total
    return {k: (n / reps, t / reps) for k, (n, t) in agg.items()}


def report(title: str, kernels: dict, wall_ms: float, host_ms: float, top: int) -> dict:
    total = sum(t for _, t in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    print(f"\n{title}: forward {wall_ms:.3f} ms between events, kernels {total / 1e3:.3f} ms "
          f"({sum(n for n, _ in kernels.values()):.0f} launches), host {host_ms:.3f} ms to enqueue")
    print(f"{'kernel':70s} {'calls':>6} {'us':>9} {'share':>6}")
    for name, (n, t) in rows[:top]:
        print(f"{name[:70]:70s} {n:6.0f} {t:9.1f} {t / total:6.1%}")
    if len(rows) > top:
        rest = rows[top:]
        print(f"{'(' + str(len(rest)) + ' more)':70s} {sum(n for _, (n, _) in rest):6.0f} "
              f"{sum(t for _, (_, t) in rest):9.1f} {sum(t for _, (_, t) in rest) / total:6.1%}")
    return dict(scenario=title, wall_ms=wall_ms, kernels_ms=total / 1e3, host_ms=host_ms,
                kernels=[dict(name=k, calls=n, us=t) for k, (n, t) in rows])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="4b")
    ap.add_argument("--prefill", default="1024,8192", help="prompt lengths (one sequence each); '' for none")
    ap.add_argument("--prefill-seqs", type=int, default=1,
                    help="prompts of each --prefill length in one step (an admission wave's prefill)")
    ap.add_argument("--mixed", default="", help="prompt chunk lengths of eager mixed steps; '' (default) for none")
    ap.add_argument("--mixed-decodes", type=int, default=16, help="decode rows of each mixed step")
    ap.add_argument("--decode-batches", default="1,16,64", help="decode graph batch sizes; '' for none")
    ap.add_argument("--verify-k", type=int, default=0, help="also verify graphs of this many drafts per sequence")
    ap.add_argument("--ctx", type=int, default=1024, help="the decode sequences' context")
    ap.add_argument("--max-model-len", type=int, default=8464, help="the decode graphs' context bound")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="kernels listed per scenario")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.prefill_seqs < 1:
        ap.error("--prefill-seqs must be at least 1")
    lengths = [int(x) for x in a.prefill.split(",") if x]
    batches = [int(x) for x in a.decode_batches.split(",") if x]
    mixed = [int(x) for x in a.mixed.split(",") if x]

    model = random_model(a.preset)
    nmax = max(batches + ([a.mixed_decodes] if mixed else []), default=0)
    K = a.verify_k
    need = -(-(a.ctx + 1 + K) // BS)
    pre = -(-max(lengths + mixed, default=0) // BS)
    n_pre = a.prefill_seqs
    # slot 0 / page 0: the graphs' dummies; log sets 0..nmax - 1 the verifies', nmax the padding's
    cache = model.alloc_cache(nmax + 1 + n_pre, 1 + nmax * need + n_pre * pre, BS, nmax + 1 if K else 0, K)
    rng = np.random.default_rng(0)
    out = []

    def eager(label, chunks):  # an eager forward of these chunks
        st = Step.build(chunks)
        fwd = lambda: model.forward(st, cache)  # noqa: E731
        wall = time_per_call(fwd, model.ops, a.reps) * 1e3
        host = host_per_call(fwd, model.ops, a.reps) * 1e3
        out.append(report(label, profile(fwd, a.reps), wall, host, a.top))

    def prompt(P, j=0):  # P prompt tokens in slot nmax + 1 + j, on pages after the decode sequences'
        first = 1 + nmax * need + j * pre
        return list(rng.integers(0, 248000, P)), 0, nmax + 1 + j, list(range(first, first + -(-P // BS)))

    def decodes(B, n=1):  # B sequences with n new tokens at position ctx in slots 1..B; the KV's values do not matter
        return [(rng.integers(0, 248000, n).tolist(), a.ctx, i + 1, list(range(1 + i * need, 1 + (i + 1) * need)))
                for i in range(B)]

    def graph(label, st):
        graphs.capture(graphs.bucket_for(st.num_seqs), graphs.kind(st))
        run = lambda: graphs.run(st)  # noqa: E731
        wall = time_per_call(run, model.ops, 20) * 1e3
        host = host_per_call(run, model.ops, 20) * 1e3
        out.append(report(label, profile(run, a.reps * 4), wall, host, a.top))

    for L in lengths:
        eager(f"prefill {L} tokens" if n_pre == 1 else f"prefill {n_pre} x {L} tokens",
              [prompt(L, j) for j in range(n_pre)])
    for P in mixed:  # the decode rows first, as the scheduler orders them
        eager(f"mixed step: {a.mixed_decodes} decodes (ctx {a.ctx}) + {P} prompt tokens",
              decodes(a.mixed_decodes) + [prompt(P)])
    if batches:
        graphs = DecodeGraphs(model, cache, max_num_seqs=nmax, dummy_slot=0, dummy_block=0,
                              max_blocks_per_seq=max(need, -(-a.max_model_len // BS)), verify_k=K,
                              dummy_spec_log=nmax if K else None)
        for B in batches:
            graph(f"decode graph batch {B}, ctx {a.ctx}", Step.build(decodes(B)))
            if K:
                # each replays a verify that accepted everything, as in a steady run of verifies (step.py)
                graph(f"verify graph K = {K} batch {B}, ctx {a.ctx}",
                      Step.build(decodes(B, 1 + K), [1 + K] * B, spec={i: i for i in range(B)},
                                 replay={i: 1 + K for i in range(B)}))
    path = a.json or (os.path.join(os.environ["OUT"], "kernel_profile.json") if os.environ.get("OUT")
                      else "kernel_profile.json")
    Path(path).write_text(json.dumps(dict(preset=a.preset, device=device_name(model.ops), pdl=False,
                                          ctx=a.ctx, verify_k=K, max_model_len=a.max_model_len, scenarios=out), indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
