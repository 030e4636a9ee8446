"""Sweep every gemv_bf16 variant (MT, R, U, PF) and warp count at the 4B decode shapes against the plan
engine/gpu/gemv_plan.py picks: how its table was checked (docs/benchmarks/session13-h100.md).

Each configuration runs 16 back-to-back calls captured in one CUDA graph (no PDL), cycling over weight
copies of >= 400 MB so W comes from HBM. A warp count other than the plan's changes the summation order,
hence the bits (gemv_nw): only the variants are free choices.

    python3 tools/gemv_sweep.py --rows 1,4,16 --json gemv_sweep.json

--norm times instead a sublayer's output projection (the N = 2560 shapes) with the GEMV after it (down ->
in_proj, o_proj -> gate_up's SwiGLU) in three forms through the backend's ops (16 pairs a graph, no PDL,
as above), the weights and the norm's weight cycled (cold, as in a step): plain (the two GEMVs, no norm),
fused (linear_add_rms_norm, then the consumer takes its h) and unfused (GEMV, add_rms_norm, GEMV)
(docs/benchmarks/session24-h100.md).

    python3 tools/gemv_sweep.py --norm --rows 1,2,4 --json gemv_norm.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("QWEN35_PDL", "0")  # the sweep's graphs time each launch alone (no PDL), as before PDL was global
import cupy  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_kernels import bits, graph_ms  # noqa: E402
from engine.gpu.backend import NULL, CudaBackend, f32, i32, i64  # noqa: E402
from engine.gpu.gemv_plan import gemv_launch, gemv_plan  # noqa: E402
from engine.gpu.kernels import gemv_name  # noqa: E402
from tools.run_meta import device_name, run_meta  # noqa: E402

SHAPES = (("down", 2560, 9216, 0), ("o_proj", 2560, 4096, 0), ("in_proj", 12352, 2560, 0),
          ("gate_up", 18432, 2560, 2), ("qkv", 10240, 2560, 0))
VARIANTS = [(mt, r, u, pf) for mt in (1, 2) for r in (1, 2) for u in (2, 4, 8) for pf in (0, 1)
            if pf == 0 or (r, u) == (1, 4)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16", help="M values (<= 16)")
    ap.add_argument("--json", default="gemv_sweep.json")
    ap.add_argument("--norm", action="store_true", help="the fused-norm forms (see above) instead of the sweep")
    a = ap.parse_args(argv)
    be, ms = CudaBackend(), [int(m) for m in a.rows.split(",")]
    if a.norm:
        return norm_forms(be, ms, a.json)
    be.kernels.prefetch([("gemv.cu", gemv_name(*v, o)) for v in VARIANTS for o in (0, 2)])
    rows = []
    for shape, N, K, out in SHAPES:
        ws = cold_weights(N, K, copies(N, K))
        for M in ms:
            x, y = bits(M, K), cupy.empty((M, N // 2 if out == 2 else N), cupy.uint16)
            plan = gemv_plan(M, N, K, out)
            res = []
            for v, nw in itertools.product(VARIANTS, (4, 8, 16)):
                if v[0] != -(-M // 8):  # MT: the x tiles of 8 rows that M needs
                    continue
                name, blocks, nw, smem = launch = gemv_launch(v, out, N, nw)
                fn = be.kernels.fn("gemv.cu", name, smem)
                if fn.fn.num_regs * 32 * nw > 65536:  # would not launch
                    continue
                ms = graph_ms(lambda i: fn((blocks,), (32 * nw,), (x, i64(K), ws[i % len(ws)], y, i32(M), i32(N),
                                                                   i32(K), NULL, NULL, f32(0), NULL, NULL), shared_mem=smem))
                res.append(dict(kernel=name, warps=nw, us=ms * 1e3, gbs=N * K * 2 / ms / 1e6,
                                plan=launch == plan))
            res.sort(key=lambda e: e["us"])
            cur = next(e for e in res if e["plan"])
            best = res[0]
            print(f"{shape:8s} M={M:2d}  plan {cur['kernel']} x{cur['warps']}: {cur['us']:7.2f} us "
                  f"({cur['gbs']:4.0f} GB/s)  best {best['kernel']} x{best['warps']}: {best['us']:7.2f} us", flush=True)
            rows.append(dict(shape=shape, N=N, K=K, M=M, configs=res))
        del ws
    write(a.json, be, rows)


def copies(N: int, K: int) -> int:
    """How many [N, K] weights cycle over >= 400 MB (each call then reads its W from HBM)."""
    return max(1, -(-400_000_000 // (N * K * 2)))


def cold_weights(N: int, K: int, n: int) -> list:
    ws = [bits(N, K, scale=K ** -0.5) for _ in range(n)]
    cupy.cuda.Device().synchronize()  # (drawn on the default stream: not under the first timing)
    return ws


def write(path: str, be, rows: list) -> None:
    Path(path).write_text(json.dumps({**run_meta(), "device": device_name(be), "rows": rows}, indent=1))
    print(f"wrote {path}")


def norm_forms(be, ms: list[int], out: str) -> None:
    res = []
    for (shape, N, K, _), (cname, CN, CK, cout) in ((SHAPES[0], SHAPES[2]), (SHAPES[1], SHAPES[3])):
        n = copies(CN, CK)  # both weights cycle n copies, counted by the consumer's shape (as session 24 ran it)
        nwts = [cupy.random.standard_normal(N, dtype=cupy.float32) * 0.1 for _ in range(n)]
        ws, wc = cold_weights(N, K, n), cold_weights(CN, CK, n)
        consume = be.swiglu if cout == 2 else be.linear
        for M in ms:
            x, r, xn = bits(M, K), bits(M, N), bits(M, N)
            def plain(i):
                be.linear(x, ws[i % n])
                return consume(xn, wc[i % n])
            forms = dict(plain=plain,
                         fused=lambda i: consume(be.linear_add_rms_norm(x, ws[i % n], r, nwts[i % n], 1e-6)[0],
                                                 wc[i % n]),
                         unfused=lambda i: consume(be.add_rms_norm(be.linear(x, ws[i % n]), r, nwts[i % n], 1e-6)[0],
                                                   wc[i % n]))
            us = {k: graph_ms(f) * 1e3 for k, f in forms.items()}
            print(f"{shape:6s} -> {cname:7s} M={M}  " + "  ".join(f"{k} {v:6.2f}" for k, v in us.items()), flush=True)
            res.append(dict(shape=shape, consumer=cname, M=M, us=us))
        del ws, wc
    write(out, be, res)


if __name__ == "__main__":
    main()
