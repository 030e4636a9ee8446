"""Where a mixed step's time goes: running streams decoding while a long prompt is prefilled beside them in
chunks (the mixed-load gate's situation, bench_mixed.py, without a server or a client).

An Engine (no loop thread) serves --background streams of --bg-input-len prompt tokens, greedy, that
decode throughout; after they reach steady decoding, an --inject-len prompt is submitted and stepped until
its first token (one unmeasured injection first: kernels, GEMM plans, the memory pool). The step trace of
the measured injection gives per step kind the medians of the step period and its parts (trace.py): the
host's enqueue of the forward (launch_ms) against the device time between events around it (gpu_ms, which
includes the device waiting for the host when the host is slower). --profile adds one more injection under
cProfile and prints its top functions (profiled times run ~1.8x the plain ones).

    python3 tools/mixed_step.py MODEL_DIR [--cap 256] [--inject-len 8192] [--background 8] [--profile]
        [--enforce-eager] [--json out.json]

--cap is `--prefill-budget-with-decodes`: the prompt tokens of a step that also decodes (0: no cap, the
step budget --max-num-batched-tokens alone).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from tools.run_meta import device_name, run_meta  # noqa: E402
from tools.trace_report import PHASES, load  # noqa: E402


def medians(steps: list[dict]) -> dict:
    """Each phase's median over the steps; and the longest step (a chunk late in a long prompt attends over the
    most keys)."""
    out = {"steps": len(steps)} | {k: round(float(np.median([s[k] for s in steps])), 3) for k in ("step_ms",) + PHASES if steps}
    return out | ({"max_step_ms": round(max(s["step_ms"] for s in steps), 3)} if steps else {})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--cap", type=int, default=256, help="--prefill-budget-with-decodes (0: none)")
    ap.add_argument("--inject-len", type=int, default=8192)
    ap.add_argument("--background", type=int, default=8)
    ap.add_argument("--bg-input-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (small mixed steps replay one)")
    ap.add_argument("--profile", action="store_true", help="one more injection under cProfile: its top functions")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    trace = Path(tmp.name) / "steps.jsonl"
    max_len = max(a.inject_len, a.bg_input_len) + 1024
    eng = Engine(a.model_dir, start=False, device=a.device, max_num_seqs=a.background + 2, max_model_len=max_len,
                 max_num_batched_tokens=a.max_num_batched_tokens, prefill_budget_with_decodes=a.cap,
                 enforce_eager=a.enforce_eager, trace_steps=str(trace))
    try:
        rng = np.random.default_rng(0)
        vocab = min(eng.runner.model.cfg.vocab_size, 20000)  # random ids of ordinary tokens
        bg = SamplingParams(max_tokens=max_len - a.bg_input_len, ignore_eos=True, temperature=0.0)
        for _ in range(a.background):
            eng.submit(rng.integers(100, vocab, a.bg_input_len).tolist(), bg, lambda o: None)

        def inject() -> float:
            """Steps until the injected prompt's first token; returns when it was submitted."""
            done: list = []
            t = time.perf_counter()
            eng.submit(rng.integers(100, vocab, a.inject_len).tolist(), SamplingParams(max_tokens=1, temperature=0.0),
                       lambda o: o.finished and done.append(1))
            while not done:
                eng.step()
            return t

        for _ in range(20):  # the background's prefill, then steady decoding
            eng.step()
        inject()  # unmeasured
        for _ in range(20):
            eng.step()
        t0 = inject()
        t1 = time.perf_counter()
        for _ in range(20):  # steady decode steps after it (the baseline step)
            eng.step()
        profile = None
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            inject()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            profile = s.getvalue()
        eng.step()  # the last step's trace line is written when the next one begins
        window = load(trace, (t0, t1))
        after = [s for s in load(trace) if t1 < s["t"] and s["kind"] == "decode"][:20]
        res = {"mixed": medians([s for s in window if s["kind"] == "mixed"]),
               "prefill": medians([s for s in window if s["kind"] == "prefill"]),
               "decode": medians(after),
               "meta": [run_meta() | {"device": device_name(eng.runner.ops), "args": vars(a)}]}
    finally:
        eng.shutdown()
        tmp.cleanup()
    for kind in ("mixed", "prefill", "decode"):
        print(f"{kind:8s}", res[kind])
    if profile:
        print(profile)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
