"""Host time per call of the engine loop's parts, plain and speculative (oracle drafter), at c1.

    python3 tools/host_breakdown.py MODEL_DIR [--k 3] [--p 0.8] [--requests 2] [--output-len 256] [--threaded]
        [--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}']

Steps an Engine(start=False) by hand (no event loop thread), or with --threaded lets the engine's own loop
thread run it for an asyncio client (as bench_spec.py and a server do), and wraps the engine's, runner's,
DecodeGraphs' and backend's methods with perf_counter accumulators; prints per method its calls, time per
call and per step. Calls nest (a parent's time includes its children's); ModelRunner.collect includes the
wait for the device. First a plain run, whose tokens the oracle (tools/spec_oracles.py) then proposes
from, right with probability p per position. With --speculative-config naming a drafter with weights
(MTP, DFlash) that drafter observes and proposes as usual, its methods timed too, and the oracle's drafts
are verified instead (spec_oracles.OracleOverDrafter): its cost at a controlled acceptance.

The critical path: in a synchronous step (one that waits for the step before it: a speculative one) the
device idles from the moment the previous step's tokens reach the host (the first HostCopy.result after
the wait returns) until the step's forward is launched (ModelRunner.forward returns); that host time is
printed per step (mean, median, p90), what a speculative step pays on top of its device time (on the
CUDA backend, whose forward only enqueues work; the NumPy backend's forward computes, so there it includes
the forward).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import SamplingParams  # noqa: E402
from engine import arrays as A, runner as R, step as S, verify as V  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from tools.bench_engine import run_level  # noqa: E402
from tools.spec_oracles import OracleOverDrafter, RecordedOracle  # noqa: E402

ACC: dict = collections.defaultdict(lambda: [0, 0.0])
CRITICAL: list = []  # per synchronous step: seconds from its input tokens on the host to its forward launched


def wrap(owner, name: str, label: str, undo: list) -> None:
    f = getattr(owner, name)  # (a classmethod comes bound; the wrapper then stands in for it)
    undo.append((owner, name, owner.__dict__[name]))

    @functools.wraps(f)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            e = ACC[label]
            e[0] += 1
            e[1] += time.perf_counter() - t
    setattr(owner, name, timed)


def instrument(gpu: bool, drafter=None) -> list:
    """Wraps the methods (and a drafter's observe and propose); returns what restore() puts back."""
    undo: list = []
    owners = [(Engine, ["step", "_flush", "_collect", "_propose", "_launch", "_launch_sampling", "_send_deferred",
                        "_on_verified", "_on_tokens", "_schedule_and_launch", "_must_wait"]),
              (R.ModelRunner, ["forward", "sample", "collect"]), (Scheduler, ["schedule"])]
    if gpu:
        from engine.gpu import backend as BK, decode_graph as DG
        owners += [(DG.DecodeGraphs, ["run", "_check", "_stage", "kind"]),
                   (BK.CudaBackend, ["prepare", "copy_slots", "argmax_finite"])]
    if drafter is not None:
        owners.append((type(drafter), ["observe", "propose"]))
    for cls, names in owners:
        for n in names:
            wrap(cls, n, f"{cls.__name__}.{n}", undo)
    wrap(V, "launch", "verify.launch", undo)
    wrap(V, "finish", "verify.finish", undo)
    wrap(S.Step, "build", "Step.build", undo)
    track_critical(undo)
    return undo


def track_critical(undo: list) -> None:
    """Appends to CRITICAL, per synchronous step, the host time from the end of the wait for the tokens it
    continues (the first HostCopy.result since the last forward) to the end of its ModelRunner.forward."""
    mark = {"ready": None, "sync": False}
    result, must_wait, forward = A.HostCopy.result, Engine._must_wait, R.ModelRunner.forward
    undo += [(A.HostCopy, "result", result), (Engine, "_must_wait", must_wait), (R.ModelRunner, "forward", forward)]

    def ready(self):
        out = result(self)
        if mark["ready"] is None:
            mark["ready"] = time.perf_counter()
        return out

    def waits(self):
        mark["sync"] = must_wait(self)
        return mark["sync"]

    def launched(self, *a, **k):
        try:
            return forward(self, *a, **k)
        finally:
            if mark["sync"] and mark["ready"] is not None:
                CRITICAL.append(time.perf_counter() - mark["ready"])
            mark["ready"], mark["sync"] = None, False

    A.HostCopy.result, Engine._must_wait, R.ModelRunner.forward = ready, waits, launched


def restore(undo: list) -> None:
    for owner, name, f in reversed(undo):
        setattr(owner, name, f)


def drive(eng, prompts, params, threaded: bool = False) -> tuple[float, list[list[int]]]:
    """Each prompt alone, stepped until it finishes (threaded: by the engine's loop thread, for an asyncio
    client): (wall seconds, tokens per prompt)."""
    if threaded:
        res, wall = asyncio.run(run_level(eng, prompts, params, 1))
        return wall, [toks for _, toks in res]
    out = []
    t = time.perf_counter()
    for p in prompts:
        toks, done = [], []
        eng.submit(p, params, lambda o, toks=toks, done=done: (toks.extend(o.new_token_ids),
                                                               o.finished and done.append(1)))
        while not done:
            eng.step()
        out.append(toks)
    return time.perf_counter() - t, out


def table(tag: str, tokens: int, wall: float) -> None:
    steps = ACC["Engine.step"][0]
    print(f"-- {tag}: {wall / tokens * 1e3:.3f} ms per token (wall, prefill included), {steps} steps --")
    for k, (n, t) in sorted(ACC.items(), key=lambda kv: -kv[1][1]):
        print(f"{k:32s} calls {n:5d}  per call {t / n * 1e6:8.1f} us  per step {t / steps * 1e6:8.1f} us")
    if CRITICAL:
        c = np.array(CRITICAL) * 1e6
        print(f"critical path of {len(c)} synchronous steps (tokens on the host -> next forward launched): mean "
              f"{c.mean():.1f} us, median {np.median(c):.1f}, p90 {np.percentile(c, 90):.1f}")
    ACC.clear()
    CRITICAL.clear()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--p", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threaded", action="store_true", help="the engine's loop thread steps it, for an asyncio client")
    ap.add_argument("--speculative-config", metavar="JSON",
                    help="the engine's; a drafter with weights runs beside the oracle (default: n-gram, K = --k)")
    a = ap.parse_args(argv)
    spec = json.loads(a.speculative_config) if a.speculative_config else {"method": "ngram",
                                                                          "num_speculative_tokens": a.k}
    a.k = spec["num_speculative_tokens"]
    eng = Engine(a.model_dir, start=a.threaded, device=a.device, max_model_len=a.input_len + a.output_len + 64,
                 max_num_seqs=4, speculative_config=spec)
    inner = eng.drafter if eng.drafter.capture is not None else None  # a drafter with weights
    undo = instrument(eng.runner.model.ops.name == "cuda", inner)
    try:
        measure(eng, a, inner)
    finally:
        restore(undo)
        ACC.clear()
        CRITICAL.clear()
        eng.shutdown()


def measure(eng, a, inner) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200000, a.input_len).tolist() for _ in range(a.requests + 1)]
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    eng.drafter = None  # plain first: its tokens are the oracle's recording
    drive(eng, prompts[:1], params, a.threaded)  # warm-up
    ACC.clear()
    CRITICAL.clear()
    wall, toks = drive(eng, prompts[1:], params, a.threaded)
    table("plain", sum(map(len, toks)), wall)
    eng.drafter = RecordedOracle({tuple(p): t for p, t in zip(prompts[1:], toks)}, a.p, eng.cfg.vocab_size, seed=1)
    if inner is not None:
        eng.drafter = OracleOverDrafter(inner, eng.drafter)
    wall, toks = drive(eng, prompts[1:], params, a.threaded)
    table(f"oracle p={a.p:g}, K={a.k}" + (f", {type(inner).__name__} drafting" if inner else ""),
          sum(map(len, toks)), wall)


if __name__ == "__main__":
    main()
