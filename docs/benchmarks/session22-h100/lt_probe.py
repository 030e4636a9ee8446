"""cublasLt algorithm choice at decode M (24..64) on the 4B shapes, W from HBM: each of up to 32 heuristic
candidates graph-timed on weights cycled over >= 400 MB; against the heuristic's first and the production
choice (engine/gpu/gemm.py: the fastest of 8, timed on one hot weight)."""
import json, os, sys
import numpy as np
import cupy
sys.path.insert(0, os.getcwd())
from engine.gpu import gemm as G

H, F, V = 2560, 9216, 248320
SHAPES = {"in_proj": (12352, H), "qkv": (10240, H), "gate_up": (2 * F, H), "down": (H, F), "o_proj": (H, 4096),
          "lm_head": (V, H)}
MS = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "24,32,48,64").split(",")]
g = G.get_gemm()
res = []


def bits(*shape):
    u = (cupy.random.standard_normal(shape, dtype=cupy.float32) * shape[-1] ** -0.5).view(cupy.uint32)
    return (u >> 16).astype(cupy.uint16)


def cold_time(plan, x, ws, out, reps=3):
    s = cupy.cuda.Stream(non_blocking=True)
    n = len(ws) * max(1, 12 // len(ws))
    with s:
        for w in ws: g._run(plan, x, w, out, s.ptr)
        s.synchronize()
        s.begin_capture()
        for i in range(n): g._run(plan, x, ws[i % len(ws)], out, s.ptr)
        gr = s.end_capture()
        gr.launch(s); s.synchronize()
        best = 1e9
        for _ in range(reps):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(s); gr.launch(s); e1.record(s); e1.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / n)
    return best


def old_tune(plan, x, w, out, stream, reps=5):
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    best = [float("inf")] * len(plan.candidates)
    for _ in range(2):
        for i in range(len(plan.candidates)):
            plan.choose(i)
            g._run(plan, x, w, out, stream.ptr)
            start.record(stream)
            for _ in range(reps):
                g._run(plan, x, w, out, stream.ptr)
            end.record(stream)
            end.synchronize()
            best[i] = min(best[i], cupy.cuda.get_elapsed_time(start, end))
    plan.choose(min(range(len(best)), key=best.__getitem__))


def idx_of(plan, prod, times, x, ws, out):
    i = next((i for i, c in enumerate(plan.candidates) if bytes(c.algo) == bytes(prod.algo)), None)
    if i is None:
        times.append(cold_time(prod, x, ws, out)); i = len(times) - 1
    return i


for name, (N, K) in SHAPES.items():
    f32 = name == "lm_head"
    copies = 2 if f32 else max(2, int(np.ceil(400e6 / (N * K * 2))))
    ws = [bits(N, K) for _ in range(copies)]
    for M in MS:
        x = bits(M, K)
        out = cupy.empty((M, N), cupy.float32 if f32 else cupy.uint16)
        plan = G._Plan(g, M, N, K, K, K, f32, 32)
        times = []
        for i in range(len(plan.candidates)):
            plan.choose(i)
            times.append(cold_time(plan, x, ws, out))
        prod = G._Plan(g, M, N, K, K, K, f32, G.TUNE_CANDIDATES)
        g._tune(prod, x, ws[0], out, cupy.cuda.get_current_stream())
        chosen = idx_of(plan, prod, times, x, ws, out)
        old = G._Plan(g, M, N, K, K, K, f32, G.TUNE_CANDIDATES)
        old_tune(old, x, ws[0], out, cupy.cuda.get_current_stream())
        ochosen = idx_of(plan, old, times, x, ws, out)
        b8 = int(np.argmin(times[:8])); b32 = int(np.argmin(times))
        gbs = lambda t: N * K * 2 / t / 1e3
        row = dict(shape=name, M=M, N=N, K=K, n=len(times), times=times, first=times[0], old_idx=ochosen, old=times[ochosen], prod_idx=chosen,
                   prod=times[chosen], best8_idx=b8, best8=times[b8], best32_idx=b32, best32=times[b32])
        res.append(row)
        print(f"{name:8} M={M:3} first {times[0]:6.1f}  old[{ochosen}] {times[ochosen]:6.1f}  new[{chosen}] {times[chosen]:6.1f}  best8[{b8}] {times[b8]:6.1f}"
              f"  best{len(times)}[{b32}] {times[b32]:6.1f} us ({gbs(times[b32]):5.0f} GB/s)", flush=True)
    del ws
    cupy.get_default_memory_pool().free_all_blocks()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "lt_probe.json"), "w"), indent=1)
