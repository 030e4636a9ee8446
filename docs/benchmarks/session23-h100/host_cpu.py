"""Host time of the engine's step on a CPU, the model's device work stubbed out (session 23; not a tool).

Runs in whatever tree PYTHONPATH names (its engine/ and tools/), with /tmp/tiny (`qwen35 make-model /tmp/tiny
--preset tiny`); without CuPy a stand-in module takes its place: DecodeGraphs' Python runs as it is, its CUDA
calls (memcpyAsync, events, graph launch) do nothing.

    PYTHONPATH=TREE python3 host_cpu.py LABEL Model forward and argmax_finite return
prepared arrays. Prints one JSON line: the best of `repeat` timings, in us, of
- c1_verify_forward: ModelRunner.forward of a c1 K = 3 verify (Step.build, DecodeGraphs.kind/_check/_stage/run);
- c1_spec_step: one Engine.step of the c1 loop with the test oracle (p = 0.8, K = 3): collect, roll back,
  propose, schedule, launch, sampling launch, events;
- b16_decode_forward, b64_decode_forward: ModelRunner.forward of a pure decode graph step, 1024-token contexts.
"""
import json
import sys
import timeit

import numpy as np

try:
    import cupy  # noqa: F401
except ImportError:
    class _Any:  # every attribute and call gives itself
        def __getattr__(self, k): return self
        def __call__(self, *a, **k): return self
    sys.modules["cupy"] = _Any()

import engine.gpu.decode_graph as DG  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.step import Step  # noqa: E402
from tools.spec_oracles import RecordedOracle  # noqa: E402


class _Ev:
    def synchronize(self): pass
    def record(self, s=None): pass


class _Graph:
    def launch(self, s): pass


class _Pin:
    ptr = 0


class _Buf:
    class data:
        ptr = 0

    def __getitem__(self, k): return None


class _Ops:
    @staticmethod
    def feed(*a): pass


DG.cupy.cuda.runtime.memcpyAsync = lambda *a: None


def graphs(k: int, buckets, W: int) -> DG.DecodeGraphs:
    g = DG.DecodeGraphs.__new__(DG.DecodeGraphs)
    g.verify_k, g.max_num_seqs, g.dummy_slot, g.dummy_block, g.block_size = k, max(buckets), 0, 0, 16
    g.max_blocks_per_seq, g.max_ctx, g.buckets, g.keep, g.ops, g.graphs = W, W * 16, list(buckets), None, _Ops, {}
    for b in buckets:
        for kk in sorted({0, k}):
            n = b * (1 + kk)
            size = sum(Step.field_sizes(n, b, n, W))
            g.graphs[b, kk] = DG._Captured(b, kk, _Buf(), _Graph(), np.zeros((n, 8), np.float32), None,
                                           np.zeros(size, np.int32), _Ev(), _Pin(), np.zeros(size, np.int32))
    return g


def best(f, number, repeat=7):
    return min(timeit.repeat(f, number=number, repeat=repeat)) / number * 1e6


def c1(out):
    eng = Engine('/tmp/tiny', start=False, max_model_len=4096, max_num_seqs=4,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    V = eng.cfg.vocab_size
    Z = {n: np.zeros((n, V), np.float32) for n in range(1, 9)}
    m = eng.runner.model
    m.forward = lambda step, cache, capture=None: Z[len(step.logits_rows)]

    def argmax(x):
        a = np.zeros((len(x), 2), np.int64)
        a[:, 1] = 1
        return a
    m.ops.argmax_finite = argmax
    m.ops.copy_slots = lambda *a: None
    eng.runner.graphs = graphs(3, (1, 2, 4), 256)
    prompt = list(range(5, 1030))
    eng.drafter = RecordedOracle({tuple(prompt): [0] * 3000}, 0.8, V, seed=1)
    eng.submit(prompt, SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True), lambda o: None)
    for _ in range(3):
        eng.step()
    out["c1_spec_step"] = best(eng.step, 100)
    eng._flush()
    req = next(iter(eng._requests.values()))
    req.num_computed, req.pending, req.drafts = req.num_tokens - 1, 0, [1, 2, 3]
    out["c1_verify_forward"] = best(lambda: eng.runner.forward([(req, 4)], None), 2000)


def decode(out, B):
    reqs = []
    for i in range(B):
        r = Request(f"r{i}", list(range(1024)), SamplingParams(), 256, frozenset(), None)
        r.output_ids, r.num_computed, r.slot = list(range(100)), 1123, 1 + i
        r.block_ids = list(range(1 + i * 80, 1 + i * 80 + 80))
        reqs.append(r)
    run = ModelRunner.__new__(ModelRunner)
    run.graphs, run.ops, run.timing, run.capture = graphs(0, DG.bucket_sizes(64), 530), _Ops, False, None
    out[f"b{B}_decode_forward"] = best(lambda: run.forward([(r, 1) for r in reqs], None), 200)


if __name__ == "__main__":
    res = {"tree": sys.argv[1] if len(sys.argv) > 1 else ""}
    c1(res)
    decode(res, 16)
    decode(res, 64)
    print(json.dumps(res))
