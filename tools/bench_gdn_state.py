"""The chunked GDN prefill (gdn_chunk_prep + the state pass) on each state pass: gdn_chunk_state (mma.sync,
32 state columns a block) and gdn_chunk_state_wg (wgmma, 64 a block, sm_90a), for steps of several prompts,
and which one the backend's rule (CudaBackend._gdn_state_wg) picks. Random inputs at dk = dv = 128, 16 key
heads; device ms per delta_rule call (CUDA events around --calls back-to-back calls, median of --reps).

    python3 tools/bench_gdn_state.py [--nv 32,48] [--steps "1024;1024x2;1024x4;1024x8;8192;1000,10"] [--json PATH]

A step is comma-separated prompt lengths, LxN meaning N prompts of L tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.gpu.backend import CudaBackend  # noqa: E402
from engine.ops import Cache  # noqa: E402
from engine.step import Step  # noqa: E402
from tools.bench_kernels import bench, bits  # noqa: E402
from tools.run_meta import device_name, run_meta  # noqa: E402


def lengths(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        n, _, k = part.partition("x")
        out += [int(n)] * int(k or 1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--nv", default="32,48", help="value heads (4B, 9B: 32; 27B: 48)")
    ap.add_argument("--steps", default="1024;1024x2;1024x3;1024x4;1024x8;8192;8192x2;1000,10;1000,200,50")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    be = CudaBackend()
    nk, dk = 16, 128
    rows = []
    print(f"{'nv':>3} {'step':<22} {'mma ms':>8} {'wgmma ms':>9} {'rule':>6} {'best':>6}")
    for nv in (int(v) for v in args.nv.split(",")):
        C = 2 * nk * dk + nv * dk
        for spec in args.steps.split(";"):
            lens = lengths(spec)
            T = sum(lens)
            step = Step.build([([0] * n, 0, i, [0] * (n // 4096 + 1)) for i, n in enumerate(lens)])
            m = be.prepare(step, Cache([], [], [], [], 4096))
            qkv = bits(T, C, scale=0.5)
            ab = bits(T, 2 * nv)
            state = cupy.zeros((len(lens), nv, dk, dk), cupy.float32)
            A_log, dtb = cupy.zeros(nv, cupy.float32), cupy.zeros(nv, cupy.float32)
            ms = {}
            for wg in (False, True):
                be.gdn_state_wg = wg

                def calls():
                    for _ in range(args.calls):
                        be.delta_rule(qkv, ab[:, :nv], ab[:, nv:], A_log, dtb, state, m)
                ms[wg] = bench(calls, reps=args.reps) / args.calls
            be.gdn_state_wg = None
            rule = be._gdn_state_wg(m, nv, dk, dk)
            best = ms[True] < ms[False]
            rows.append(dict(nv=nv, step=spec, lens=lens, mma_ms=ms[False], wgmma_ms=ms[True], rule_wg=rule,
                             best_wg=best))
            print(f"{nv:>3} {spec:<22} {ms[False]:8.3f} {ms[True]:9.3f} {'wgmma' if rule else 'mma':>6} "
                  f"{'wgmma' if best else 'mma':>6}")
    path = args.json or os.path.join(os.environ.get("OUT", "."), "bench_gdn_state.json")
    with open(path, "w") as f:
        json.dump(dict(meta=run_meta(), device=device_name(be), num_sms=be.num_sms, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
