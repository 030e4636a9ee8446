"""Decode step time, eager forward vs CUDA-graph replay (engine/gpu/decode_graph.py), on the 4b shapes.

Sequences hold `--ctx` tokens of context (prefilled eagerly; the values do not matter for speed) and
the same decode step (position ctx) is run repeatedly at each batch size: time per step over
`--steps` back-to-back steps, between device events around them (tools/step_timer.py: max(host launch
time, GPU time), what a serving loop sees). Prints a table and writes JSON (to $OUT/bench_decode.json when OUT is set).

Weights: by default random bf16 drawn on the GPU for the 4b preset's config (the speed of a decode step
does not depend on the values, and it skips writing and reading an 8 GB checkpoint); --make-model DIR
writes the random 4b checkpoint there with make_model and loads it; --model-dir DIR loads an existing one.

  python3 tools/bench_decode.py [--preset 4b] [--batches 1,4,8,16,32,64] [--ctx 1024] [--steps 30]
      [--max-model-len N]   (the graphs' context bound, as a server sizes them; default ctx + 1)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

from engine.gpu.backend import CudaBackend  # noqa: E402
from engine.checkpoint import config_json, make_model  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.gpu.decode_graph import DecodeGraphs  # noqa: E402
from engine.model import Qwen35Model  # noqa: E402
from engine.step import Step  # noqa: E402
from engine.weights import expected_shapes, load_weights  # noqa: E402
from tools.run_meta import device_name  # noqa: E402
from tools.step_timer import time_per_call  # noqa: E402

BS = 16


class RandomWeightBackend(CudaBackend):
    """CudaBackend whose 2-D bf16 weights are drawn on the GPU (std 1/sqrt(fan_in)), ignoring the
    placeholder host arrays it is given; vectors are uploaded as given (zeros)."""

    def weight(self, arr):
        if isinstance(arr, list):  # a fused projection: only its shape matters
            arr = np.broadcast_to(arr[0].reshape(-1)[0], (sum(a.shape[0] for a in arr), *arr[0].shape[1:]))
        if arr.ndim == 2 and arr.dtype == np.uint16:
            x = cupy.random.standard_normal(arr.shape, dtype=cupy.float32)
            x *= np.float32(1.0 / np.sqrt(arr.shape[1]))
            return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
        return super().weight(arr)


def random_model(preset: str, batch_invariant: bool = False) -> Qwen35Model:
    cfg = ModelConfig.from_dict(config_json(preset))
    f32 = lambda k: k.endswith(("A_log", "linear_attn.norm.weight"))  # noqa: E731
    w = {k: np.broadcast_to(np.zeros((), np.float32 if f32(k) else np.uint16), s)
         for k, s in expected_shapes(cfg).items()}
    return Qwen35Model(cfg, w, RandomWeightBackend(batch_invariant=batch_invariant))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="4b")
    ap.add_argument("--make-model", metavar="DIR", help="write the preset's random checkpoint to DIR and load it")
    ap.add_argument("--model-dir", metavar="DIR", help="load this checkpoint")
    ap.add_argument("--batches", default="1,4,8,16,32,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the context the graphs are sized for, as a server's --max-model-len (default: ctx + 1)")
    ap.add_argument("--prefill-chunk", type=int, default=16, help="sequences per eager prefill step")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true", help="CudaBackend(batch_invariant=True)")
    ap.add_argument("--json", help="output path (default $OUT/bench_decode.json, else ./bench_decode.json)")
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]

    t = time.perf_counter()
    if a.make_model or a.model_dir:
        d = Path(a.model_dir) if a.model_dir else make_model(a.make_model, a.preset)
        cfg = ModelConfig.from_dir(d)
        model = Qwen35Model(cfg, load_weights(d, cfg), CudaBackend(batch_invariant=a.batch_invariant))
        source = str(d)
    else:
        model = random_model(a.preset, a.batch_invariant)
        source = f"random bf16 on GPU, {a.preset} config"
    cupy.cuda.Device().synchronize()
    t_load = time.perf_counter() - t
    print(f"model ({source}) ready in {t_load:.1f} s", flush=True)

    nmax = max(batches)
    need = -(-(a.ctx + 1) // BS)
    cache = model.alloc_cache(nmax + 1, 1 + nmax * need, BS)  # slot 0 / page 0: the dummies
    slots = [i + 1 for i in range(nmax)]
    blocks = [list(range(1 + i * need, 1 + (i + 1) * need)) for i in range(nmax)]
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    if not a.no_prefill:
        for i0 in range(0, nmax, a.prefill_chunk):
            ids = range(i0, min(nmax, i0 + a.prefill_chunk))
            model.forward(Step.build([(list(rng.integers(0, 248000, a.ctx)), 0, slots[i], blocks[i]) for i in ids]),
                          cache)
        cupy.cuda.Device().synchronize()
    t_prefill = time.perf_counter() - t
    print(f"prefill of {nmax} x {a.ctx} tokens: {t_prefill:.1f} s", flush=True)

    width = max(need, -(-a.max_model_len // BS))
    graphs = DecodeGraphs(model, cache, max_num_seqs=nmax, dummy_slot=0, dummy_block=0, max_blocks_per_seq=width)
    rows = []
    print(f"{'batch':>5} {'bucket':>6} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'capture s':>9} "
          f"{'graph tok/s':>11}", flush=True)
    for B in batches:
        st = Step.build([([int(rng.integers(0, 248000))], a.ctx, slots[i], blocks[i]) for i in range(B)])
        eager = time_per_call(lambda: model.forward(st, cache), model.ops, a.steps)
        t = time.perf_counter()
        graphs.capture(graphs.bucket_for(B))
        cupy.cuda.Device().synchronize()
        t_cap = time.perf_counter() - t
        graph = time_per_call(lambda: graphs.run(st), model.ops, a.steps)
        ok = bool(np.isfinite(cupy.asnumpy(graphs.run(st))).all())
        r = dict(batch=B, bucket=graphs.bucket_for(B), eager_ms=eager * 1e3, graph_ms=graph * 1e3,
                 speedup=eager / graph, capture_s=t_cap, graph_tok_s=B / graph, finite_logits=ok)
        rows.append(r)
        print(f"{B:>5} {r['bucket']:>6} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} {r['speedup']:>7.2f}x "
              f"{t_cap:>9.2f} {r['graph_tok_s']:>11.0f}", flush=True)

    out = a.json or (os.path.join(os.environ["OUT"], "bench_decode.json") if os.environ.get("OUT")
                     else "bench_decode.json")
    Path(out).write_text(json.dumps(dict(preset=a.preset, weights=source, device=device_name(model.ops), ctx=a.ctx,
                                         steps=a.steps,
                                         max_model_len=width * BS,
                                         batch_invariant=a.batch_invariant,
                                         load_s=t_load, prefill_s=t_prefill, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
