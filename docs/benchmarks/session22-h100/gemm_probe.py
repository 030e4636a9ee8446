"""GEMM probe at decode M (17..64) on the 4B shapes: cublasLt (as linear() picks it), gemm_splitk (v1) and
gemm_sk2 (ST stages) at each cluster size; graph-timed, weights cycled over >= 400 MB so W comes from HBM."""
import json, os, sys, time
import numpy as np
import cupy
sys.path.insert(0, os.getcwd())
from engine.gpu.backend import CudaBackend, i32
from engine.gpu.gemm import gemm
from engine.gpu.launch import pdl
from engine.gpu.gemv_plan import SPLITK_SMEM

H, F, V = 2560, 9216, 248320
SHAPES = {"in_proj": (12352, H), "qkv": (10240, H), "gate_up": (2 * F, H), "down": (H, F), "o_proj": (H, 4096),
          "lm_head": (V, H)}
MS = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "32,64").split(",")]
be = CudaBackend()
be.kernels.prefetch([("gemv.cu", f"gemm_splitk<{c}, 0>") for c in (1, 2, 4, 8)]
                    + [("gemv.cu", f"gemm_sk2<{c}, 0, {st}>") for c in (1, 2, 4, 8) for st in (4, 8)])
dev = cupy.cuda.Device()
res = []


def bits(*shape):
    u = (cupy.random.standard_normal(shape, dtype=cupy.float32) * shape[-1] ** -0.5).view(cupy.uint32)
    return (u >> 16).astype(cupy.uint16)


def timeit(fns, reps=3):
    s = cupy.cuda.Stream(non_blocking=True)
    with s, pdl():
        for f in fns: f()
        s.synchronize()
        s.begin_capture()
        for f in fns: f()
        g = s.end_capture()
        g.launch(s); s.synchronize()
        best = 1e9
        for _ in range(reps):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(s); g.launch(s); e1.record(s); e1.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / len(fns))
    return best


for name, (N, K) in SHAPES.items():
    copies = max(2, int(np.ceil(400e6 / (N * K * 2))))
    if name == "lm_head": copies = 2
    ws = [bits(N, K) for _ in range(copies)]
    for M in MS:
        x = bits(M, K)
        ref = gemm(x, ws[0], f32_out=False).astype(cupy.float32) if name != "lm_head" else None
        out = cupy.empty((M, N), cupy.uint16)
        row = {"shape": name, "N": N, "K": K, "M": M}
        gemm(x, ws[0])  # tune
        row["cublasLt"] = timeit([lambda w=w: gemm(x, w) for w in ws] * (12 // copies + 1))
        for kern, sts in (("gemm_splitk", [None]), ("gemm_sk2", [4, 8])):
            for st in sts:
                for cl in (1, 2, 4, 8):
                    tmpl = f"{kern}<{cl}, 0>" if st is None else f"{kern}<{cl}, 0, {st}>"
                    smem = SPLITK_SMEM if st is None else max(st * 12288, 64 * 132 * 4)
                    blocks = -(-N // 128)
                    fn = be._fn("gemv.cu", tmpl, smem)
                    call = lambda w, fn=fn, smem=smem, cl=cl: fn((blocks, cl), (256,), (x, np.int64(K), w, out, i32(M), i32(N), i32(K)), shared_mem=smem)
                    out.fill(0xFFFF)
                    call(ws[0]); cupy.cuda.runtime.deviceSynchronize()
                    err = None
                    if ref is not None:
                        o = (out.astype(cupy.uint32) << 16).view(cupy.float32)
                        err = float(cupy.abs(o - ref).max() / cupy.abs(ref).max())
                    t = timeit([lambda w=w: call(w) for w in ws] * (12 // copies + 1))
                    row[f"{tmpl}"] = t
                    row[f"{tmpl} err"] = err
        gbs = lambda t: N * K * 2 / t / 1e3
        best = min((v, k) for k, v in row.items() if isinstance(v, float) and not k.endswith("err") and k != "cublasLt")
        print(f"{name:8} M={M:3} cublasLt {row['cublasLt']:7.1f} us ({gbs(row['cublasLt']):5.0f} GB/s)  best {best[1]:22} {best[0]:7.1f} us ({gbs(best[0]):5.0f} GB/s)", flush=True)
        print("    " + "  ".join(f"{k.replace('gemm_','')}={v:.1f}" for k, v in row.items() if isinstance(v, float) and not k.endswith("err") and k != "cublasLt"), flush=True)
        errs = [v for k, v in row.items() if k.endswith("err") and v is not None]
        if errs: print(f"    max rel err {max(errs):.2e}", flush=True)
        res.append(row)
    del ws
    cupy.get_default_memory_pool().free_all_blocks()
json.dump({"device": dev.attributes.get("MultiProcessorCount"), "rows": res}, open(os.path.join(os.environ.get("OUT", "."), "gemm_probe.json"), "w"), indent=1)
