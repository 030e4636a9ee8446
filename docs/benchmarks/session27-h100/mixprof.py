"""Ad hoc: host vs device of mixed steps (8 decoding streams + an injected long prompt, chunk cap N)."""
import cProfile, json, pstats, sys, time, io
import numpy as np
sys.path.insert(0, ".")
from engine import SamplingParams
from engine.engine import Engine

model, cap, inj, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
trace = f"{out}/mix-trace-{cap}.jsonl"
eng = Engine(model, start=False, max_num_seqs=16, max_model_len=16400, max_num_batched_tokens=8192,
             prefill_budget_with_decodes=cap, trace_steps=trace)
rng = np.random.default_rng(0)
bg = SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.0)
for i in range(8):
    eng.submit(rng.integers(100, 20000, 512).tolist(), bg, lambda o: None)
for _ in range(40):
    eng.step()
def inject():
    done = []
    eng.submit(rng.integers(100, 20000, inj).tolist(), SamplingParams(max_tokens=1, temperature=0.0),
               lambda o: o.finished and done.append(1))
    return done
d = inject()  # warm (one unprofiled injection)
while not d: eng.step()
for _ in range(20): eng.step()
pr = cProfile.Profile()
t_prof = time.perf_counter()
d = inject(); n = 0
t = time.perf_counter()
pr.enable()
while not d:
    eng.step(); n += 1
pr.disable()
wall = time.perf_counter() - t
for _ in range(5): eng.step()
print(f"cap {cap} inject {inj}: {n} steps, {wall*1e3/n:.2f} ms a step (profiled)")
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28); print(s.getvalue()[-6000:])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25); print(s.getvalue()[-5000:])
lines = [json.loads(l) for l in open(trace)]
mixed = [l for l in lines if l["kind"] == "mixed" and l["t"] < t_prof]
mixedp = [l for l in lines if l["kind"] == "mixed" and l["t"] >= t_prof]
dec = [l for l in lines if l["kind"] == "decode"]
for name, L in (("mixed", mixed), ("mixed-profiled", mixedp), ("decode", dec)):
    if L:
        print(name, len(L), {k: round(float(np.median([x[k] for x in L])), 2) for k in
                             ("step_ms", "gpu_ms", "schedule_ms", "launch_ms", "sample_ms", "wait_ms", "deliver_ms")})
eng.shutdown() if hasattr(eng, "shutdown") else None
