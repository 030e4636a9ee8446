"""The DFlash drafter (engine/dflash.py) against an independent float32 transcription of
spec-decode-spec §2.3 (`dflash_append` / `dflash_draft`), reading the drafter's safetensors directly;
its context bookkeeping; negative controls (taps off by one, a sliding layer made non-causal); the
checkpoint and loader checks."""
import json
import shutil

import numpy as np
import pytest

from engine.arrays import bf16_to_f32
from engine.backend_numpy import NumpyBackend
from engine.checkpoint import dflash_config_json, make_dflash
from engine.config import ConfigError, ModelConfig
from engine.dflash import DFlashDrafter, load_dflash
from engine.model import Qwen35Model
from engine.request import Request, Status
from engine.weights import WeightError, load_weights, read_safetensors

BS = 16  # KV block size


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return make_dflash(tmp_path_factory.mktemp("dflash-tiny"), "tiny")


@pytest.fixture(scope="module")
def target(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)
    return Qwen35Model(cfg, load_weights(tiny_dir, cfg), NumpyBackend())


def _drafter(drafter_dir, target, num_blocks=64, max_num_seqs=4):
    cfg, w = load_dflash(drafter_dir, target.cfg)
    d = DFlashDrafter(cfg, w, target, 15, max_num_seqs)
    d.alloc(num_blocks, BS)
    return d


def _request(rid, n_tokens, blocks, rng):
    """A running request with n_tokens known tokens whose KV pages are `blocks`."""
    req = Request(rid, rng.integers(0, 1000, n_tokens).tolist(), None, 64, frozenset(), None)
    req.status, req.block_ids = Status.RUNNING, list(blocks)
    return req


# ---- the independent transcription (spec-decode-spec §2.3), float32 --------------------------------------
def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta=1e7):
    """Full-width NeoX rotate-half. x [T, heads, hd]."""
    hd = x.shape[-1]
    ang = pos[:, None].astype(np.float64) / theta ** (np.arange(0, hd, 2) / hd)
    cos, sin = (np.concatenate([f(ang)] * 2, -1)[:, None].astype(np.float32) for f in (np.cos, np.sin))
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


class Reference:
    def __init__(self, drafter_dir, embed, lm_head, causal_sliding=True):
        raw = json.loads((drafter_dir / "config.json").read_text())
        self.W = {k: bf16_to_f32(v) for k, v in read_safetensors(drafter_dir / "model.safetensors").items()}
        self.types, self.window = raw["layer_types"], raw["sliding_window"]
        self.nh, self.nkv, self.hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
        self.mask = raw["dflash_config"]["mask_token_id"]
        self.E, self.lm_head, self.causal_sliding = embed, lm_head, causal_sliding
        self.ctx = [(np.zeros((0, self.nkv, self.hd), np.float32),) * 2 for _ in self.types]

    def append(self, taps_rows, pos_rows):
        W = self.W
        c = _rms(taps_rows @ W["fc.weight"].T, W["hidden_norm.weight"])
        for i, (K, V) in enumerate(self.ctx):
            p = f"layers.{i}.self_attn."
            k = _rope(_rms((c @ W[p + "k_proj.weight"].T).reshape(len(c), self.nkv, self.hd), W[p + "k_norm.weight"]),
                      pos_rows)
            self.ctx[i] = (np.concatenate([K, k]), np.concatenate([V, (c @ W[p + "v_proj.weight"].T).reshape(k.shape)]))

    def draft_logits(self, x_L, blk=16):
        W = self.W
        L = len(self.ctx[0][0])
        h = self.E[[x_L] + [self.mask] * (blk - 1)]
        pos = np.arange(L, L + blk)
        for i, kind in enumerate(self.types):
            p = f"layers.{i}."
            a = _rms(h, W[p + "input_layernorm.weight"])
            q = _rope(_rms((a @ W[p + "self_attn.q_proj.weight"].T).reshape(blk, self.nh, self.hd),
                           W[p + "self_attn.q_norm.weight"]), pos)
            kb = _rope(_rms((a @ W[p + "self_attn.k_proj.weight"].T).reshape(blk, self.nkv, self.hd),
                            W[p + "self_attn.k_norm.weight"]), pos)
            vb = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(blk, self.nkv, self.hd)
            K, V = (np.repeat(np.concatenate([c, b]), self.nh // self.nkv, 1) for c, b in zip(self.ctx[i], (kb, vb)))
            s = np.einsum("qhd,khd->hqk", q, K) / np.sqrt(self.hd)
            kpos = np.arange(L + blk)
            if kind == "sliding_attention" and self.causal_sliding:
                s = np.where((kpos[None] > pos[:, None]) | (kpos[None] <= pos[:, None] - self.window), -np.inf, s)
            s = np.exp(s - s.max(-1, keepdims=True))
            o = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), V).reshape(blk, -1)
            h = h + o @ W[p + "self_attn.o_proj.weight"].T
            a = _rms(h, W[p + "post_attention_layernorm.weight"])
            g, u = a @ W[p + "mlp.gate_proj.weight"].T, a @ W[p + "mlp.up_proj.weight"].T
            h = h + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
        return _rms(h, W["norm.weight"])[1:] @ self.lm_head.T


def _taps(rng, n, n_taps=3, H=128):
    return (rng.standard_normal((n, n_taps * H)) * 0.5).astype(np.float32)


@pytest.mark.parametrize("prompt", [5, 37, 70], ids=["short", "block-crossing", "past-window"])
def test_draft_matches_the_transcription(drafter_dir, target, prompt):
    """Prefill context, then a verify's commit of 3 rows: the draft logits match at each point, for a
    context inside one page, one crossing pages, and one longer than the sliding window (40)."""
    rng = np.random.default_rng(prompt)
    d = _drafter(drafter_dir, target)
    ref = Reference(drafter_dir, target.embed, target.lm_head)
    req = _request("a", prompt + 8, range(1, 10), rng)
    taps = _taps(rng, prompt + 3)
    for lo, hi in ((0, prompt), (prompt, prompt + 3)):
        d.append(taps, [(req, lo, lo, hi - lo)])
        ref.append(taps[lo:hi], np.arange(lo, hi))
        req.num_computed = hi
        assert d.context[req] == hi
        got, want = d.block_logits([req]), ref.draft_logits(req.prompt_ids[hi])
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        assert d.propose([req], [15]) == [want.argmax(-1).tolist()]


def test_batch_and_rooms(drafter_dir, target):
    """Two requests drafted together: each as drafted alone; rooms cut the drafts; a request whose
    block runs past its reservation (one page) uses scratch pages, not another request's."""
    rng = np.random.default_rng(1)
    d = _drafter(drafter_dir, target)
    a, b = _request("a", 12, [3], rng), _request("b", 30, [4, 5], rng)
    taps = _taps(rng, 40)
    d.append(taps, [(a, 0, 0, 11), (b, 0, 11, 29)])
    a.num_computed, b.num_computed = 11, 29
    both = d.propose([a, b], [15, 4])
    assert both == [d.propose([a], [15])[0], d.propose([b], [4])[0]] and len(both[1]) == 4


def test_context_append_must_continue(drafter_dir, target):
    rng = np.random.default_rng(2)
    d = _drafter(drafter_dir, target)
    req = _request("a", 20, [1, 2], rng)
    d.append(_taps(rng, 10), [(req, 0, 0, 10)])
    with pytest.raises(RuntimeError, match="covers 10 positions, an append starts at 12"):
        d.append(_taps(rng, 3), [(req, 12, 0, 3)])
    req.num_computed = 11
    with pytest.raises(RuntimeError, match="the target committed 11"):
        d.propose([req], [3])
    d.forget(req)
    assert d.context == {}


def _logits_after(drafter_dir, target, taps, prompt, seed=3, **ref_kw):
    rng = np.random.default_rng(seed)
    ref = Reference(drafter_dir, target.embed, target.lm_head, **ref_kw)
    ref.append(taps[:prompt], np.arange(prompt))
    return ref.draft_logits(int(rng.integers(0, 1000)))


def test_negative_controls(drafter_dir, target):
    """What the transcription fixes matters: taps one layer off (here: the tap rows shifted by one
    tap block), or a sliding layer made non-causal, changes the drafter's logits."""
    rng = np.random.default_rng(4)
    prompt = 20
    taps = _taps(rng, prompt)
    d = _drafter(drafter_dir, target)
    req = _request("a", prompt + 1, [1, 2], rng)
    req.prompt_ids[prompt] = int(np.random.default_rng(3).integers(0, 1000))
    d.append(taps, [(req, 0, 0, prompt)])
    req.num_computed = prompt
    got = d.block_logits([req])
    good = _logits_after(drafter_dir, target, taps, prompt)
    assert np.abs(got - good).max() <= 1e-4 * np.abs(good).max()
    shifted = np.roll(taps, 128, axis=1)  # tap i's columns now hold tap i-1's: the taps of layers one off
    for bad in (_logits_after(drafter_dir, target, shifted, prompt),
                _logits_after(drafter_dir, target, taps, prompt, causal_sliding=False)):
        assert np.abs(bad - good).max() > 1e-2 * np.abs(good).max()


# ---- checkpoint and loader ------------------------------------------------------------------------
def test_checkpoint_layout_4b():
    """The 4B preset's config is z-lab's Qwen3.5-4B-DFlash (spec-decode-spec §2.1) and its tensor list has
    the 69 tensors and 634,425,856 parameters of §2.2."""
    from engine.dflash import DFlashConfig, dflash_shapes
    raw = dflash_config_json("4b")
    assert raw["dflash_config"] == {"block_size": 16, "mask_token_id": 248077,
                                    "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29]}
    assert raw["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] and raw["sliding_window"] == 4096
    shapes = dflash_shapes(DFlashConfig.from_dict(raw), 8)
    assert len(shapes) == 69 and sum(int(np.prod(s)) for s in shapes.values()) == 634_425_856
    assert shapes["fc.weight"] == (2560, 20480) and shapes["layers.5.self_attn.q_proj.weight"] == (4096, 2560)


@pytest.mark.parametrize("change,error", [
    (lambda c: c["dflash_config"].update(mask_token_id=300000), "mask_token_id 300000 is outside"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 8]), r"target_layer_ids \[1, 8\]"),
    (lambda c: c.update(hidden_size=256), "hidden_size 256 != the target's 128"),
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "layer_types"),
])
def test_loader_rejects_a_mismatched_config(drafter_dir, tiny_dir, tmp_path, change, error):
    shutil.copytree(drafter_dir, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    change(raw)
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=error):
        load_dflash(tmp_path / "d", ModelConfig.from_dir(tiny_dir))


def test_loader_rejects_mis_shaped_weights(tiny_dir, tmp_path):
    """A drafter made for another target's shape (4B taps: fc reads 8 taps) fails on its first tensor."""
    raw = dflash_config_json("tiny")
    make_dflash(tmp_path / "d", "tiny")
    raw["dflash_config"]["target_layer_ids"] = [1, 3]
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightError, match=r"fc.weight: expected shape \[128, 256\], found \[128, 384\]"):
        load_dflash(tmp_path / "d", ModelConfig.from_dir(tiny_dir))


# ---- in the engine --------------------------------------------------------------------------------
from engine import SamplingParams  # noqa: E402
from tools.spec_oracles import OracleOverDrafter  # noqa: E402
from test_engine import drive, make, prompt  # noqa: E402
from test_spec_decode import GPU_NOISE, GREEDY, Oracle, _record, assert_idle, outside_reservation  # noqa: E402


class Checked(OracleOverDrafter):
    """The engine's DFlash drafter, checked: after every observe() its context covers exactly what the
    target committed for each request it saw (L); proposals come from it, or (forced) from an Oracle of
    the plain run while it still drafts (and so checks its context) every step. Requests not in
    `drafting` get no drafts (they decode plainly beside the speculating ones)."""

    def __init__(self, inner, forced=None, drafting=None):
        super().__init__(inner, forced)
        self.drafting, self.checked = drafting, 0

    def observe(self, record):
        super().observe(record)
        for req, _, _, _ in record.committed():
            assert self.inner.context[req] == req.num_computed
            self.checked += 1

    def propose(self, reqs, rooms):
        rooms = [k if self.drafting is None or tuple(r.prompt_ids) in self.drafting else 0
                 for r, k in zip(reqs, rooms)]
        return self.inner.propose(reqs, rooms) if self.oracle is None else super().propose(reqs, rooms)


def _dflash_run(target, drafter_dir, prompts, sp, forced=None, drafting=None, k=15, **kw):
    eng, col = make(target, speculative_config={"method": "dflash", "model": str(drafter_dir),
                                                "num_speculative_tokens": k}, **kw)
    bad = outside_reservation(eng)
    eng.drafter = checked = Checked(eng.drafter, forced, drafting)
    logits = {}
    eng.runner.logits_hook = _record(logits)
    rids = [eng.submit(p, sp, col) for p in prompts]
    drive(eng, col, rids, max_steps=2000)
    eng.step()
    assert bad == [] and checked.checked > 0
    return [col.tokens(r) for r in rids], eng, logits


def _plain_run(target, prompts, sp, **kw):
    eng, col = make(target, **kw)
    logits = {}
    eng.runner.logits_hook = _record(logits)
    rids = [eng.submit(p, sp, col) for p in prompts]
    drive(eng, col, rids, max_steps=2000)
    eng.shutdown()
    return [col.tokens(r) for r in rids], logits


def _assert_same(target, prompts, want, got, la, lb):
    """Equal tokens (GPU: up to one flip within bf16 noise, as tests/test_spec_decode.py)."""
    for p, a, b in zip(prompts, want, got):
        if a != b:
            assert target[1] == "cuda", (p, a, b)
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert np.abs(la[(tuple(p), i)] - lb[(tuple(p), i)]).mean() <= GPU_NOISE


PROMPTS = [prompt(1, 37), prompt(2, 20), prompt(3, 5)] + [prompt(10 + i, 3 + 4 * i) for i in range(13)]
SP = SamplingParams(max_tokens=12, **GREEDY)  # the first prompt's context crosses KV blocks and the window (40)
KW = dict(max_num_seqs=16, max_num_batched_tokens=96)


@pytest.fixture(scope="module")
def plain16(tiny_dir):
    return _plain_run(tiny_dir, PROMPTS, SP, **KW)


@pytest.mark.parametrize("forced", [None, "accept-all", "reject-first"])
def test_greedy_dflash_c1_equals_plain(tiny_dir, drafter_dir, plain16, forced):
    """c1 with the DFlash drafter's own drafts, all-right drafts and all-wrong ones: tokens equal plain
    greedy; the context always covers what was committed; nothing leaks."""
    want = plain16[0]
    oracle = None if forced is None else Oracle({tuple(PROMPTS[0]): want[0]}, None if forced == "accept-all" else 0)
    got, eng, _ = _dflash_run(tiny_dir, drafter_dir, PROMPTS[:1], SP, oracle, **KW)
    assert got == want[:1]
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    if forced is not None:
        assert st.spec_decode_num_accepted_tokens == (st.spec_decode_num_draft_tokens if forced == "accept-all" else 0)
    assert_idle(eng)
    assert eng.drafter.inner.context == {}


def test_greedy_dflash_batch_of_16_equals_plain(tiny_dir, drafter_dir, plain16):
    """16 requests, every other one speculating with the drafter's own drafts (the others decode plainly;
    the drafter keeps every request's context all the same), prompts chunked by the step budget; K = 4 of
    the block's 15 drafts (a CPU verify of 16 rows is slow)."""
    got, eng, _ = _dflash_run(tiny_dir, drafter_dir, PROMPTS, SP, drafting={tuple(p) for p in PROMPTS[::2]}, k=4,
                              **KW)
    assert got == plain16[0]
    assert eng.stats().spec_decode_num_drafts > 0
    assert_idle(eng)
    assert eng.drafter.inner.context == {}


def test_config_and_errors(tiny_dir, drafter_dir):
    from engine.config import SpeculativeConfig
    cfg = SpeculativeConfig.parse({"method": "dflash", "model": "/x", "num_speculative_tokens": 15})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("dflash", "/x", 15)
    for bad in ({"method": "dflash", "num_speculative_tokens": 3}, {"method": "ngram", "model": "/x",
                                                                  "num_speculative_tokens": 3}):
        with pytest.raises(ValueError, match="'model'"):
            SpeculativeConfig.parse(bad)
    shutil_dir = drafter_dir.parent / "dflash-block8"
    if not shutil_dir.exists():
        shutil.copytree(drafter_dir, shutil_dir)
        raw = json.loads((shutil_dir / "config.json").read_text())
        raw["dflash_config"]["block_size"] = 8
        (shutil_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_speculative_tokens 8 is more than"):
        make(tiny_dir, speculative_config={"method": "dflash", "model": str(shutil_dir), "num_speculative_tokens": 8})


@pytest.mark.gpu
def test_gpu_4b_greedy_dflash_equals_plain(tmp_path_factory):
    """The random 4B target with a random 4B-shaped drafter: greedy speculative output equals plain at c1
    and in a batch of 16 (half speculating) with one 4097-token prompt (past the 4096-key window)."""
    from conftest import gpu_or_skip
    gpu_or_skip()
    import os
    target = (os.environ.get("QWEN35_MODEL_4B") or make_model_4b(tmp_path_factory), "cuda")
    ddir = make_dflash(tmp_path_factory.mktemp("dflash-4b"), "4b")
    sp = SamplingParams(max_tokens=32, **GREEDY)
    prompts = [prompt(40 + i, 3 + 9 * i) for i in range(15)] + [prompt(99, 4097)]
    kw = dict(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=4200)
    want, la = _plain_run(target, prompts, sp, **kw)
    got, eng, lb = _dflash_run(target, ddir, prompts[-1:], sp, **kw)
    _assert_same(target, prompts[-1:], want[-1:], got, la, lb)
    assert_idle(eng)
    eng.shutdown()
    got, eng, lb = _dflash_run(target, ddir, prompts, sp, drafting={tuple(p) for p in prompts[::2]} |
                               {tuple(prompts[-1])}, **kw)
    _assert_same(target, prompts, want, got, la, lb)
    assert eng.stats().spec_decode_num_drafts > 0
    assert_idle(eng)
    eng.shutdown()


def make_model_4b(factory):
    from engine.checkpoint import make_model
    return make_model(factory.mktemp("4b"), "4b")
