"""Per-op timings of the CUDA backend at Qwen3.5-4B shapes (random inputs, CUDA events, median).

    PYTHONPATH=. python3 tools/bench_kernels.py
Prints one line per (op, shape): median ms, and achieved GB/s (bytes = each input read once + each
output written once) or TFLOP/s for GEMMs.
"""
from __future__ import annotations

import cupy
import numpy as np

from engine.backend_cuda import CudaBackend
from engine.backend_numpy import Cache
from engine.step import Step


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


def bits(*shape, scale=1.0):
    x = (cupy.random.standard_normal(shape, dtype=cupy.float32) * scale).view(cupy.uint32)
    return (x >> 16).astype(cupy.uint16)


def main():
    be = CudaBackend()
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
    nk, nv, dk, dv = 16, 32, 128, 128
    C = 2 * nk * dk + nv * dv
    for B, L in ((1, 1), (32, 1), (1, 2048)):
        T = B * L
        step = Step.build([([0] * L, 0, i, [0]) for i in range(B)])
        m = be.prepare(step, Cache([], [], [], [], 4096))
        proj = bits(T, C + nv * dv + 2 * nv)
        state = cupy.zeros((B, nv, dk, dv), cupy.float32)
        conv_state = cupy.zeros((B, 3, C), cupy.uint16)
        w = bits(C, 4)
        A_log, dtb = cupy.ones(nv, cupy.float32), cupy.zeros(nv, cupy.float32)
        qkv = be.conv1d(proj[:, :C], w, conv_state, m)
        a, b = proj[:, -nv:], proj[:, -2 * nv:-nv]
        ms = bench(lambda: be.conv1d(proj[:, :C], w, conv_state, m))
        rows.append(("conv1d", f"B={B} L={L}", ms, f"{(2 * T * C * 2 + 2 * B * 3 * C * 2) / ms / 1e6:.0f} GB/s"))
        ms = bench(lambda: be.delta_rule(qkv, a, b, A_log, dtb, state, m))
        rows.append(("delta_rule", f"B={B} L={L}", ms,
                     f"{(2 * B * nv * dk * dv * 4 + T * (C + nv * dv) * 2) / ms / 1e6:.0f} GB/s"))
        o = bits(T, nv * dv)
        ms = bench(lambda: be.gated_rms_norm(o, proj[:, C:C + nv * dv], cupy.ones(dv, cupy.float32), 1e-6))
        rows.append(("gated_rms_norm", f"T={T}", ms, f"{3 * T * nv * dv * 2 / ms / 1e6:.0f} GB/s"))
        x, r = bits(T, H), bits(T, H)
        ms = bench(lambda: be.add_rms_norm(x, r, cupy.zeros(H, cupy.float32), 1e-6))
        rows.append(("add_rms_norm", f"T={T}", ms, f"{4 * T * H * 2 / ms / 1e6:.0f} GB/s"))
        gu = bits(T, 2 * F)
        ms = bench(lambda: be.silu_mul(gu))
        rows.append(("silu_mul", f"T={T}", ms, f"{3 * T * F * 2 / ms / 1e6:.0f} GB/s"))
    nh, nkv, hd, bs = 16, 4, 256, 16
    for B, ctx, L in ((1, 8192, 1), (32, 2048, 1), (1, 2048, 2048)):
        nblk = -(-ctx // bs)
        kc = bits(B * nblk + 1, bs, nkv, hd)
        vc = bits(B * nblk + 1, bs, nkv, hd)
        step = Step.build([([0] * L, ctx - L, i, list(range(1 + i * nblk, 1 + (i + 1) * nblk))) for i in range(B)])
        m = be.prepare(step, Cache([], [], [], [], bs))
        T = B * L
        proj = bits(T, 2 * nh * hd + 2 * nkv * hd)
        nq = 2 * nh * hd
        qn, kn = cupy.zeros(hd, cupy.float32), cupy.zeros(hd, cupy.float32)
        q, gate = be.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv * hd], proj[:, nq + nkv * hd:], qn, kn, kc, vc, m,
                               64, 1e7, 1e-6)
        ms = bench(lambda: be.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv * hd], proj[:, nq + nkv * hd:], qn, kn, kc,
                                        vc, m, 64, 1e7, 1e-6))
        rows.append(("attn_prep", f"T={T}", ms, f"{T * (nq + 2 * nkv * hd + nh * hd + 2 * nkv * hd) * 2 / ms / 1e6:.0f} GB/s"))
        ms = bench(lambda: be.attention(q, gate, kc, vc, m), reps=5 if L > 1 else 20)
        kv_bytes = B * ctx * nkv * hd * 2 * 2
        flops = 4 * B * nh * hd * (ctx * L - L * (L - 1) / 2)
        rows.append(("attention", f"B={B} ctx={ctx} L={L}", ms,
                     f"{kv_bytes / ms / 1e6:.0f} GB/s KV, {flops / ms / 1e9:.2f} TFLOP/s"))
    print(f"{'op':<16} {'shape':<26} {'ms':>9}  rate")
    for name, shape, ms, rate in rows:
        print(f"{name:<16} {shape:<26} {ms:9.4f}  {rate}")


if __name__ == "__main__":
    main()
