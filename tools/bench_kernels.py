"""Per-op timings of the CUDA backend at Qwen3.5-4B shapes (random inputs, CUDA events, median),
then whole-model prefill (eager forward of one sequence) and decode step (graph replay, via
tools/bench_decode.py) times.

    PYTHONPATH=. python3 tools/bench_kernels.py [--json FILE] [--no-steps]
Prints one line per (op, shape): median ms, and achieved GB/s (bytes = each input read once + each
output written once) or TFLOP/s, with the fraction of the measured H200 ceilings (4.3 TB/s copy,
790 TFLOP/s bf16 dense). Writes everything as JSON (default $OUT/bench_kernels.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.gpu.backend import CudaBackend
from engine.ops import Cache
from engine.step import Step

COPY_GBS, BF16_TFLOPS = 4300.0, 790.0  # measured H200 ceilings (device README)


def bench(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return float(np.median(ts))


def graph_ms(op, n=16):
    """Median ms per call of op(i), i = 0..n-1, n calls captured in one CUDA graph: how a decode step
    runs them (an event pair around one eager call would also time the launch's host overhead)."""
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        for i in range(n):
            op(i)  # warm: compile, plans, and the pool's blocks on this stream
        s.begin_capture()
        for i in range(n):
            op(i)
        g = s.end_capture()
        return bench(lambda: g.launch(s)) / n


def bits(*shape, scale=1.0):
    x = (cupy.random.standard_normal(shape, dtype=cupy.float32) * scale).view(cupy.uint32)
    return (x >> 16).astype(cupy.uint16)


def prefill_times(lengths, reps=3, batch_invariant=False):
    """Eager forward of one fresh sequence of each length through the random-weight 4B model."""
    import bench_decode
    model = bench_decode.random_model("4b", batch_invariant)
    bs = bench_decode.BS
    need = -(-max(lengths) // bs)
    cache = model.alloc_cache(2, 1 + need, bs)
    rng = np.random.default_rng(0)
    out = []
    for L in lengths:
        st = Step.build([(list(rng.integers(0, 248000, L)), 0, 1, list(range(1, 1 + -(-L // bs))))])
        ms = bench(lambda: model.forward(st, cache), reps=reps, warm=1)
        flops = 2 * L * sum(w.size for layer in model.layers for w in layer.values()
                            if hasattr(w, "ndim") and w.ndim == 2)
        out.append(dict(tokens=L, ms=ms, gemm_tflop=flops / 1e12, gemm_roofline_ms=flops / BF16_TFLOPS / 1e9))
        print(f"prefill {L:>5} tokens: {ms:8.2f} ms  (layer GEMMs {flops / 1e12:.2f} TFLOP: "
              f"{flops / BF16_TFLOPS / 1e9:.2f} ms at the bf16 ceiling)", flush=True)
    del model, cache
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="output path (default $OUT/bench_kernels.json, else ./bench_kernels.json)")
    ap.add_argument("--no-steps", action="store_true", help="per-op table only")
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--max-model-len", type=int, default=8464,
                    help="the decode graphs' context, as the server sizes them (the attention split depends on it)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="CudaBackend(batch_invariant=True): gemm_inv for M > 16, fixed attention splits")
    args = ap.parse_args(argv)
    be = CudaBackend(batch_invariant=args.batch_invariant)
    rows = []
    H, F, V = 2560, 9216, 248320
    for M in (1, 32, 2048):
        for name, N, K in (("in_proj", 12352, H), ("gate_up", 2 * F, H), ("down", H, F), ("lm_head", V, H)):
            if name == "lm_head" and M == 2048:
                continue
            x, w = bits(M, K), bits(N, K, scale=K ** -0.5)
            ms = bench(lambda: be.linear(x, w))
            rows.append((f"gemm {name}", f"M={M} N={N} K={K}", ms,
                         f"{2 * M * N * K / ms / 1e9:.1f} TFLOP/s, {(N * K + M * K + M * N) * 2 / ms / 1e6:.0f} GB/s"))
    # Decode GEMMs, linear() (the cuda/gemv.cu path for M <= GEMV_MAX_M) vs cublasLt: 16 back-to-back calls
    # captured in one CUDA graph (as decode runs them; an event pair around one eager call would also
    # time the launch's host overhead), cycling over weight copies >= 400 MB in all so W comes from HBM.
    from engine.gpu.gemm import gemm
    for name, N, K in (("in_proj", 12352, H), ("gate_up", 2 * F, H), ("down", H, F), ("qkv", 10240, H),
                       ("o_proj", H, 4096), ("lm_head", V, H)):
        ws = [bits(N, K, scale=K ** -0.5) for _ in range(max(1, -(-400_000_000 // (N * K * 2))))]
        f32_out = N >= 100_000
        for M in (1, 4, 16):
            x = bits(M, K)
            nbytes = (N * K + M * K) * 2 + M * N * (4 if f32_out else 2)
            for path, op in (("gemv", lambda i: be.linear(x, ws[i % len(ws)])),
                             ("cublasLt", lambda i: gemm(x, ws[i % len(ws)], f32_out=f32_out))):
                ms = graph_ms(op)
                rows.append((f"{path} {name}", f"M={M} N={N} K={K}", ms,
                             f"{nbytes / ms / 1e6:.0f} GB/s ({nbytes / ms / 1e6 / COPY_GBS:.0%} of copy)"))
        del ws
    nk, nv, dk, dv = 16, 32, 128, 128
    C = 2 * nk * dk + nv * dv
    for B, L in ((1, 1), (32, 1), (1, 2048)):
        T = B * L
        timed = (lambda f: graph_ms(lambda i: f())) if L == 1 else bench  # decode shapes: graph-timed
        step = Step.build([([0] * L, 0, i, [0]) for i in range(B)])
        m = be.prepare(step, Cache([], [], [], [], 4096))
        proj = bits(T, C + nv * dv + 2 * nv)
        state = cupy.zeros((B, nv, dk, dv), cupy.float32)
        conv_state = cupy.zeros((B, 3, C), cupy.uint16)
        w = bits(C, 4)
        A_log, dtb = cupy.ones(nv, cupy.float32), cupy.zeros(nv, cupy.float32)
        qkv = be.conv1d(proj[:, :C], w, conv_state, m)
        a, b = proj[:, -nv:], proj[:, -2 * nv:-nv]
        ms = timed(lambda: be.conv1d(proj[:, :C], w, conv_state, m))
        rows.append(("conv1d", f"B={B} L={L}", ms, f"{(2 * T * C * 2 + 2 * B * 3 * C * 2) / ms / 1e6:.0f} GB/s"))
        ms = timed(lambda: be.delta_rule(qkv, a, b, A_log, dtb, state, m))
        rows.append(("delta_rule", f"B={B} L={L}", ms,
                     f"{(2 * B * nv * dk * dv * 4 + T * (C + nv * dv) * 2) / ms / 1e6:.0f} GB/s"))
        o = bits(T, nv * dv)
        ms = timed(lambda: be.gated_rms_norm(o, proj[:, C:C + nv * dv], cupy.ones(dv, cupy.float32), 1e-6))
        rows.append(("gated_rms_norm", f"T={T}", ms, f"{3 * T * nv * dv * 2 / ms / 1e6:.0f} GB/s"))
        x, r = bits(T, H), bits(T, H)
        ms = timed(lambda: be.add_rms_norm(x, r, cupy.zeros(H, cupy.float32), 1e-6))
        rows.append(("add_rms_norm", f"T={T}", ms, f"{4 * T * H * 2 / ms / 1e6:.0f} GB/s"))
        gu = bits(T, 2 * F)
        ms = timed(lambda: be._silu_mul(gu))
        rows.append(("silu_mul", f"T={T}", ms, f"{3 * T * F * 2 / ms / 1e6:.0f} GB/s"))
    nh, nkv, hd, bs = 16, 4, 256, 16
    for B, ctx, L in ((1, 8192, 1), (32, 2048, 1), (1, 1024, 1024), (1, 2048, 2048), (1, 8192, 2048), (1, 8192, 8192)):
        nblk = -(-ctx // bs)
        kc = bits(B * nblk + 1, bs, nkv, hd)
        vc = bits(B * nblk + 1, bs, nkv, hd)
        step = Step.build([([0] * L, ctx - L, i, list(range(1 + i * nblk, 1 + (i + 1) * nblk))) for i in range(B)])
        m = be.prepare(step, Cache([], [], [], [], bs))
        T = B * L
        timed = (lambda f: graph_ms(lambda i: f())) if L == 1 else bench
        proj = bits(T, 2 * nh * hd + 2 * nkv * hd)
        nq = 2 * nh * hd
        qn, kn = cupy.zeros(hd, cupy.float32), cupy.zeros(hd, cupy.float32)
        q, gate = be.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv * hd], proj[:, nq + nkv * hd:], qn, kn, kc, vc, m,
                               64, 1e7, 1e-6)
        ms = timed(lambda: be.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv * hd], proj[:, nq + nkv * hd:], qn, kn, kc,
                                        vc, m, 64, 1e7, 1e-6))
        rows.append(("attn_prep", f"T={T}", ms, f"{T * (nq + 2 * nkv * hd + nh * hd + 2 * nkv * hd) * 2 / ms / 1e6:.0f} GB/s"))
        ms = timed(lambda: be.attention(q, gate, kc, vc, m)) if L == 1 else bench(lambda: be.attention(q, gate, kc, vc, m), reps=5)
        kv_bytes = B * ctx * nkv * hd * 2 * 2
        flops = 4 * B * nh * hd * (ctx * L - L * (L - 1) / 2)
        rows.append(("attention", f"B={B} ctx={ctx} L={L}", ms,
                     f"{kv_bytes / ms / 1e6:.0f} GB/s KV, {flops / ms / 1e9:.2f} TFLOP/s"))
    print(f"{'op':<16} {'shape':<26} {'ms':>9}  rate")
    for name, shape, ms, rate in rows:
        print(f"{name:<16} {shape:<26} {ms:9.4f}  {rate}", flush=True)
    res = dict(ceilings=dict(copy_gbs=COPY_GBS, bf16_tflops=BF16_TFLOPS), batch_invariant=args.batch_invariant,
               ops=[dict(op=n, shape=sh, ms=ms, rate=r) for n, sh, ms, r in rows])
    out = args.json or (os.path.join(os.environ["OUT"], "bench_kernels.json") if os.environ.get("OUT")
                     else "bench_kernels.json")
    if not args.no_steps:
        res["prefill"] = prefill_times([int(x) for x in args.prefill.split(",")], batch_invariant=args.batch_invariant)
        import bench_decode
        dec = str(Path(out).with_name("bench_decode.json"))
        bench_decode.main(["--json", dec, "--max-model-len", str(args.max_model_len)] + (["--batch-invariant"] if args.batch_invariant else []))
        res["decode"] = json.loads(Path(dec).read_text())
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
