"""The bf16 logits gate (spec §14): our CUDA engine against Hugging Face bf16 on the same GPU.

Per preset: 12 seeded random prompts of 1-128 tokens (ids < 100,000), prefilled together in one
varlen step (random non-contiguous KV pages, shuffled slots), then 16 teacher-forced decode steps,
all sequences batched. HF runs each sequence alone: prefill, then the same 16 tokens one at a time
through its cache. Per scored position: our argmax is in HF's top-64 and at most 0.20 nat below HF's
best logprob; over HF's top-8 tokens, mean |dlogprob| <= 0.06 and p99 <= 0.20. The max is printed,
never asserted. On random weights HF bf16 is itself further than that from HF f32, so by default
those bounds are scaled to HF's own measured floor (see gate_failures); QWEN35_GATE_STRICT=1 asserts
them as written (for real checkpoints: QWEN35_MODEL_4B=/path/to/checkpoint). QWEN35_HF_LONG=1 adds
prompts of 4,097 and 8,192 tokens; QWEN35_HF_BIG=1 adds the 9b and 27b shapes (short prompts). Each
model is loaded straight onto the GPU and freed before the next (27b: HF bf16, then HF f32 at 108 GB,
then ours at 54 GB).

Scaled bounds pass subtle bugs: RoPE theta / 10 and q/k norm weights dropped move the 4b shape's
logprobs less than HF bf16 is from f32. So the gate also has f32-closeness rows, one per sublayer
(each layer's mixer and MLP output over the prompt tokens): ours must be at most ROW_RATIO times as far
from HF f32 as HF bf16 is, at every row. At the first attention layer those bugs are 3-5x HF bf16's
distance; test_gate_fails_on_subtle_bug plants each at the 4b shape and checks the gate fails there.
With QWEN35_REQUIRE_HF=1, missing torch/transformers or a torch without CUDA fail instead of skipping.
"""
import gc
import os

import numpy as np
import pytest

from conftest import gpu_or_skip  # noqa: E402
from hf_gate_util import (HFSublayers, SUBTLE_BUGS, hf_or_skip, plant_bug, record_sublayers, sublayer_errors,
                          sublayer_names)

cupy = gpu_or_skip()
torch, transformers = hf_or_skip(cuda=True)
# The f32 reference must be f32: TF32 would round HF's GDN conv (cuDNN) and matmuls to 10 mantissa bits.
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False

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
# Sublayer rows: ours may be this much further from HF f32 than HF bf16 is. Measured (CPU, HF bf16 as
# the engine's stand-in, the 4b widths, layers 0-3): HF bf16 is 2.5e-2 from f32 at the first attention
# output; with RoPE theta / 10 that row is 1.2e-1 from f32, with q/k norm weights dropped 8.3e-2.
ROW_RATIO = 2.0
_DIRS: dict = {}
_REFS: dict = {}


def _model_dir(tmp_path_factory, preset):
    if preset not in _DIRS:
        _DIRS[preset] = (os.environ.get(f"QWEN35_MODEL_{preset.upper()}")
                         or make_model(tmp_path_factory.mktemp(preset), preset))
    return _DIRS[preset]


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def run_ours(model, seqs, rng):
    """seqs: list of (prompt, decode tokens). Returns logprobs [n, 1 + DECODE, V] and each prompt's
    sublayer outputs."""
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
    subs = []
    for g in groups:
        st = Step.build([(list(seqs[i][0]), 0, slots[i], tables[i]) for i in g])
        logits, per_seq = record_sublayers(model, st, cache)
        out[g, 0] = _log_softmax(model.ops.to_host(logits))
        subs += per_seq
    for d in range(DECODE):
        st = Step.build([([int(seqs[i][1][d])], len(seqs[i][0]) + d, slots[i], tables[i]) for i in range(n)])
        out[:, 1 + d] = _log_softmax(model.ops.to_host(model.forward(st, cache)))
    return out, subs


def run_hf(hf, rows: HFSublayers, prompt, dec):
    """Logprobs [1 + DECODE, V] and the prefill's sublayer outputs."""
    res = []
    with torch.no_grad():
        o, subs = rows.record(lambda: hf(torch.tensor([list(prompt)], device="cuda"), use_cache=True))
        res.append(o.logits[0, -1].float())
        for t in dec:
            o = hf(torch.tensor([[int(t)]], device="cuda"), past_key_values=o.past_key_values, use_cache=True)
            res.append(o.logits[0, -1].float())
    return torch.log_softmax(torch.stack(res), -1).cpu().numpy(), subs


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


def _hf(d, dtype, seqs):
    """HF in `dtype` on every prompt: (logprobs, sublayer outputs) per prompt, the model freed after."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, device_map="cuda").eval()
    rows = HFSublayers(hf)
    runs = [run_hf(hf, rows, p, dec) for p, dec in seqs]
    rows.remove()
    del hf, rows
    gc.collect()
    torch.cuda.empty_cache()
    return [r[0] for r in runs], [r[1] for r in runs]


def _reference(tmp_path_factory, preset, long):
    """(model dir, prompts, HF bf16's answers, HF f32's answers) of one case. One case is kept at a
    time (a 27b run holds GBs of sublayer outputs); the planted-bug tests reuse the 4b one."""
    key = (preset, long)
    if key not in _REFS:
        _REFS.clear()
        d = _model_dir(tmp_path_factory, preset)
        seqs = _prompts(np.random.default_rng(SEED), long)
        _REFS[key] = (d, seqs, _hf(d, torch.bfloat16, seqs), _hf(d, torch.float32, seqs))
    return _REFS[key]


def _ours(d, seqs):
    cfg = ModelConfig.from_dir(d)
    model = Qwen35Model(cfg, load_weights(d, cfg), CudaBackend())
    out = run_ours(model, seqs, np.random.default_rng(SEED + 1))
    del model
    cupy.get_default_memory_pool().free_all_blocks()
    return cfg, out


def gate_failures(cfg, tag, ours, ref, truth) -> list[str]:
    """Prints the gate's numbers; returns its failures (empty: the gate passes), sublayer rows first.
    ours, ref (HF bf16), truth (HF f32): (logprobs, sublayer outputs) per prompt."""
    failures = []
    names = sublayer_names(cfg)
    e_ours, e_hf = sublayer_errors(ours[1], truth[1]), sublayer_errors(ref[1], truth[1])
    print(f"\nSUBLAYERS {tag}: distance from hf-f32, ours / hf-bf16 (ratio)")
    for name, a, b in zip(names, e_ours, e_hf):
        print(f"  {name:>16} {a:.3e} {b:.3e} ({a / b:.2f})")
        if a > ROW_RATIO * b:
            failures.append(f"sublayer {name}: ours {a:.3g} from HF f32, above {ROW_RATIO} x HF bf16's {b:.3g}")
    fails, mean, p99, mx, npos = gate(ours[0], ref[0])
    f_ours, m_o, p_o, x_o, _ = gate(ours[0], truth[0])
    f_hf, m_h, p_h, x_h, _ = gate(ref[0], truth[0])
    print(f"\nFLOOR {tag}: ours vs hf-f32 mean {m_o:.4f} p99 {p_o:.4f} max {x_o:.4f} regret fails {len(f_ours)}; "
          f"hf-bf16 vs hf-f32 mean {m_h:.4f} p99 {p_h:.4f} max {x_h:.4f} regret fails {len(f_hf)}")
    print(f"\nGATE {tag}: {npos} positions, regret fails {len(fails)}, "
          f"top-{TOPN} |dlogprob| mean {mean:.4f} p99 {p99:.4f} max {mx:.4f}")
    if os.environ.get("QWEN35_GATE_STRICT"):
        if fails:
            failures.append(f"regret: {fails[:5]}")
        if not (mean <= MEAN_TOL and p99 <= P99_TOL):
            failures.append(f"top-{TOPN} |dlogprob| mean {mean:.4f} p99 {p99:.4f} above {MEAN_TOL} / {P99_TOL}")
        return failures
    # The bf16 noise floor of the reference itself: HF bf16 against HF f32 on the same GPU. On random
    # weights it sits far above the spec's real-checkpoint floors (0.025 / 0.086; measured here: tiny
    # 0.054 / 0.21, 4b 0.12 / 0.39), so by default the tolerances are the larger of the spec's and 1.25x
    # HF's own floor, we must be at least as close to f32 as HF bf16 is (10% slack), and a regret miss
    # against HF bf16 counts only when HF f32 confirms it, at most as many as HF bf16's own misses
    # against f32 (at least 1). QWEN35_GATE_STRICT=1 (real checkpoints) asserts the spec's numbers as is.
    if not (m_o <= max(MEAN_TOL, 1.1 * m_h) and p_o <= max(P99_TOL, 1.1 * p_h)):
        failures.append(f"ours vs HF f32: mean {m_o:.4f} p99 {p_o:.4f} above HF bf16's floor {m_h:.4f} / {p_h:.4f}")
    confirmed = {(f[0], f[1]) for f in f_ours}
    fails = [f for f in fails if (f[0], f[1]) in confirmed]
    if len(fails) > max(1, len(f_hf)):
        failures.append(f"regret: {fails[:5]}")
    mean_tol, p99_tol = max(MEAN_TOL, 1.25 * m_h), max(P99_TOL, 1.25 * p_h)
    if not (mean <= mean_tol and p99 <= p99_tol):
        failures.append(f"top-{TOPN} |dlogprob| mean {mean:.4f} p99 {p99:.4f} above {mean_tol:.4f} / {p99_tol:.4f}")
    return failures


CASES = [("tiny", False), ("tiny3", False), ("4b", False)]
if os.environ.get("QWEN35_HF_LONG"):
    CASES += [("tiny", True), ("tiny3", True), ("4b", True)]
if os.environ.get("QWEN35_HF_BIG"):  # 18 and 54 GB checkpoints: QWEN35_MODEL_9B / _27B, else written here
    CASES += [("9b", False), ("27b", False)]


@pytest.mark.parametrize("preset,long", CASES, ids=[f"{p}{'-long' if lg else ''}" for p, lg in CASES])
def test_hf_bf16_gate(tmp_path_factory, preset, long):
    d, seqs, ref, truth = _reference(tmp_path_factory, preset, long)
    cfg, ours = _ours(d, seqs)
    failures = gate_failures(cfg, f"{preset}{' long' if long else ''}", ours, ref, truth)
    assert not failures, failures


@pytest.mark.parametrize("bug", SUBTLE_BUGS)
def test_gate_fails_on_subtle_bug(tmp_path_factory, monkeypatch, bug):
    """The bug planted into the CUDA backend at the 4b shape: the gate fails, first at the first attention layer."""
    d, seqs, ref, truth = _reference(tmp_path_factory, "4b", False)
    plant_bug(monkeypatch, CudaBackend, bug)
    cfg, ours = _ours(d, seqs)
    failures = gate_failures(cfg, f"4b {bug}", ours, ref, truth)
    first_attention = sublayer_names(cfg)[2 * cfg.full_layers[0]]
    assert failures and failures[0].startswith(f"sublayer {first_attention}:"), failures[:3]
