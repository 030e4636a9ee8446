"""The bf16 logits gate (spec §14): our CUDA engine against Hugging Face bf16 on the same GPU.

Per preset: 12 seeded random prompts of 1-128 tokens (ids < 100,000), prefilled together in one
varlen step (random non-contiguous KV pages, shuffled slots), then 16 teacher-forced decode steps,
all sequences batched. HF runs each sequence alone: prefill, then the same 16 tokens one at a time
through its cache. Per scored position: our argmax is in HF's top-64 and at most 0.20 nat below HF's
best logprob; over HF's top-8 tokens, mean |dlogprob| <= 0.06 and p99 <= 0.20. The max is printed,
never asserted. On random weights HF bf16 is itself further than that from HF f32, so by default
those bounds are scaled to HF's own measured floor (see the test body); QWEN35_GATE_STRICT=1 asserts
them as written (for real checkpoints: QWEN35_MODEL_4B=/path/to/checkpoint). QWEN35_HF_LONG=1 adds
prompts of 4,097 and 8,192 tokens; QWEN35_HF_BIG=1 adds the 9b and 27b shapes (short prompts). Each
model is loaded straight onto the GPU and freed before the next (27b: 54 GB ours, then HF bf16, then
HF f32 at 108 GB).
"""
import os

import numpy as np
import pytest

from conftest import gpu_or_skip  # noqa: E402

cupy = gpu_or_skip()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

from engine.gpu.backend import CudaBackend  # noqa: E402
from engine.checkpoint import make_model  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.model import Qwen35Model  # noqa: E402
from engine.step import Step  # noqa: E402
from engine.weights import load_weights  # noqa: E402

pytestmark = pytest.mark.gpu
SEED = 0x5EED3535
DECODE = 16
BLOCK = 16
TOPK, TOPN = 64, 8
REGRET, MEAN_TOL, P99_TOL = 0.20, 0.06, 0.20


def _model_dir(tmp_path_factory, preset):
    env = os.environ.get(f"QWEN35_MODEL_{preset.upper()}")
    if env:
        return env
    return make_model(tmp_path_factory.mktemp(preset), preset)


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def run_ours(model, seqs, rng):
    """seqs: list of (prompt, decode tokens). Returns logprobs [n, 1 + DECODE, V]."""
    n = len(seqs)
    need = [-(-(len(p) + DECODE) // BLOCK) for p, _ in seqs]
    pages = rng.permutation(np.arange(1, sum(need) + 1)).tolist()
    tables, o = [], 0
    for k in need:
        tables.append(pages[o:o + k])
        o += k
    slots = rng.permutation(n + 2)[:n].tolist()
    cache = model.alloc_cache(n + 2, sum(need) + 1, BLOCK)
    model.ops.reset_slots(cache, slots)
    out = np.empty((n, 1 + DECODE, model.cfg.vocab_size), np.float32)
    # one batched prefill (long prompts alone: one step each), then batched decode steps
    groups = [[i] for i in range(n)] if max(len(p) for p, _ in seqs) > 1024 else [list(range(n))]
    for g in groups:
        st = Step.build([(list(seqs[i][0]), 0, slots[i], tables[i]) for i in g])
        out[g, 0] = _log_softmax(model.ops.to_host(model.forward(st, cache)))
    for d in range(DECODE):
        st = Step.build([([int(seqs[i][1][d])], len(seqs[i][0]) + d, slots[i], tables[i]) for i in range(n)])
        out[:, 1 + d] = _log_softmax(model.ops.to_host(model.forward(st, cache)))
    return out


def run_hf(hf, prompt, dec):
    res = []
    with torch.no_grad():
        o = hf(torch.tensor([list(prompt)], device="cuda"), use_cache=True)
        res.append(o.logits[0, -1].float())
        for t in dec:
            o = hf(torch.tensor([[int(t)]], device="cuda"), past_key_values=o.past_key_values, use_cache=True)
            res.append(o.logits[0, -1].float())
    return torch.log_softmax(torch.stack(res), -1).cpu().numpy()


def gate(ours_all, hf_all):
    """Returns (regret failures, mean, p99, max, positions) over all scored positions."""
    fails, diffs = [], []
    for si, (ours, ref) in enumerate(zip(ours_all, hf_all)):
        for pos in range(ours.shape[0]):
            o, h = ours[pos], ref[pos]
            top = np.argsort(-h)[:TOPK]
            am = int(np.argmax(o))
            if am not in set(top.tolist()) or h[top[0]] - h[am] > REGRET:
                fails.append((si, pos, am, int(top[0]), float(h[top[0]] - h[am])))
            t8 = top[:TOPN]
            diffs.extend(np.abs(o[t8] - h[t8]).tolist())
    d = np.asarray(diffs)
    return fails, float(d.mean()), float(np.percentile(d, 99)), float(d.max()), len(ours_all) * ours_all[0].shape[0]


def _prompts(rng, long):
    lens = [1, 128] + rng.integers(2, 128, 10).tolist()
    if long:
        lens = [4097, 8192]
    return [(rng.integers(0, 100000, L), rng.integers(0, 100000, DECODE)) for L in lens]


CASES = [("tiny", False), ("tiny3", False), ("4b", False)]
if os.environ.get("QWEN35_HF_LONG"):
    CASES += [("tiny", True), ("tiny3", True), ("4b", True)]
if os.environ.get("QWEN35_HF_BIG"):  # 18 and 54 GB checkpoints: QWEN35_MODEL_9B / _27B, else written here
    CASES += [("9b", False), ("27b", False)]


@pytest.mark.parametrize("preset,long", CASES, ids=[f"{p}{'-long' if lg else ''}" for p, lg in CASES])
def test_hf_bf16_gate(tmp_path_factory, preset, long):
    d = _model_dir(tmp_path_factory, preset)
    cfg = ModelConfig.from_dir(d)
    rng = np.random.default_rng(SEED)
    seqs = _prompts(rng, long)
    model = Qwen35Model(cfg, load_weights(d, cfg), CudaBackend())
    ours = run_ours(model, seqs, rng)
    del model
    cupy.get_default_memory_pool().free_all_blocks()
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device_map="cuda").eval()
    ref = [run_hf(hf, p, dec) for p, dec in seqs]
    del hf
    torch.cuda.empty_cache()
    # The bf16 noise floor of the reference itself: HF bf16 against HF f32 on the same GPU. On random
    # weights it sits far above the spec's real-checkpoint floors (0.025 / 0.086; measured here: tiny
    # 0.054 / 0.21, 4b 0.12 / 0.39), so by default the tolerances are the larger of the spec's and 1.25x
    # HF's own floor, we must be at least as close to f32 as HF bf16 is (10% slack), and a regret miss
    # against HF bf16 counts only when HF f32 confirms it, at most as many as HF bf16's own misses
    # against f32 (at least 1). QWEN35_GATE_STRICT=1 (real checkpoints) asserts the spec's numbers as is.
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, device_map="cuda").eval()
    truth = [run_hf(hf32, p, dec) for p, dec in seqs]
    del hf32
    torch.cuda.empty_cache()
    fails, mean, p99, mx, npos = gate(ours, ref)
    f_ours, m_o, p_o, x_o, _ = gate(ours, truth)
    f_hf, m_h, p_h, x_h, _ = gate(ref, truth)
    tag = f"{preset}{' long' if long else ''}"
    print(f"\nFLOOR {tag}: ours vs hf-f32 mean {m_o:.4f} p99 {p_o:.4f} max {x_o:.4f} regret fails {len(f_ours)}; "
          f"hf-bf16 vs hf-f32 mean {m_h:.4f} p99 {p_h:.4f} max {x_h:.4f} regret fails {len(f_hf)}")
    print(f"\nGATE {tag}: {npos} positions, regret fails {len(fails)}, "
          f"top-{TOPN} |dlogprob| mean {mean:.4f} p99 {p99:.4f} max {mx:.4f}")
    if os.environ.get("QWEN35_GATE_STRICT"):
        assert not fails, fails[:5]
        assert mean <= MEAN_TOL and p99 <= P99_TOL, (mean, p99)
        return
    mean_tol, p99_tol = max(MEAN_TOL, 1.25 * m_h), max(P99_TOL, 1.25 * p_h)
    assert m_o <= max(MEAN_TOL, 1.1 * m_h) and p_o <= max(P99_TOL, 1.1 * p_h), "ours vs HF f32: above HF bf16's floor"
    confirmed = {(f[0], f[1]) for f in f_ours}
    fails = [f for f in fails if (f[0], f[1]) in confirmed]
    assert len(fails) <= max(1, len(f_hf)), fails[:5]
    assert mean <= mean_tol and p99 <= p99_tol, (mean, mean_tol, p99, p99_tol)
