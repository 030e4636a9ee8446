"""The MTP drafter (engine/mtp.py, spec-decode-spec.md §1) and the target capture it reads (model.Capture).

The drafter's drafts and logits are checked against `RefMtp`, an independent float32 NumPy transcription of
spec §1.3 (mtp_first_pass / mtp_draft) reading the checkpoint's tensors itself; greedy speculative output
equals plain greedy output on tiny and tiny3 (random weights: the head's drafts are mostly rejected, so a
wrapper that proposes the recorded plain continuation while the MTP observes each step covers the accepting
path); the negative controls of spec §4 item 4 change the draft logits. CPU on the NumPy backend; marked gpu:
greedy identity on the 4B checkpoint.
"""
from pathlib import Path

import numpy as np
import pytest

from engine import SamplingParams
from engine.arrays import bf16_to_f32, to_numpy
from engine.config import ModelConfig, SpeculativeConfig
from engine.drafter import StepRecord
from engine.memory import unit_bytes
from engine.model import Capture, Qwen35Model
from engine.mtp import MtpDrafter
from engine.ops import make_backend
from engine.request import Request, Status
from engine.step import Step
from engine.weights import load_weights, read_safetensors
from test_engine import drive, make, prompt
from test_spec_decode import assert_idle, run

GREEDY = dict(temperature=0.0, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


# ---- an independent transcription of spec §1.3 ---------------------------------------------------------
def _f32(a):
    return bf16_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, np.float32)


def rms1p(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + w)


class RefLayer:
    """A Qwen3.5 full-attention decoder layer ([ARCH] §5) over rows appended one chunk at a time, its K/V
    kept in lists: returns the residual stream after the layer."""

    def __init__(self, cfg: ModelConfig, w):
        self.cfg, self.w, self.K, self.V = cfg, w, [], []

    def __call__(self, x, pos):
        c, w = self.cfg, self.w
        nh, nkv, hd, r = c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim
        T = len(x)
        a = rms1p(x, w("input_layernorm.weight"))
        qg = (a @ w("self_attn.q_proj.weight").T).reshape(T, nh, 2 * hd)  # query and gate interleaved per head
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        k = (a @ w("self_attn.k_proj.weight").T).reshape(T, nkv, hd)
        v = (a @ w("self_attn.v_proj.weight").T).reshape(T, nkv, hd)
        q, k = rms1p(q, w("self_attn.q_norm.weight")), rms1p(k, w("self_attn.k_norm.weight"))
        ang = np.asarray(pos, np.float64)[:, None] / c.rope_theta ** (np.arange(0, r, 2) / r)
        cos, sin = np.cos(ang)[:, None].astype(np.float32), np.sin(ang)[:, None].astype(np.float32)

        def rope(z):  # NeoX, on the first r dims
            z1, z2 = z[..., :r // 2], z[..., r // 2:r]
            return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin, z[..., r:]], -1)
        q, k = rope(q), rope(k)
        self.K += list(k)
        self.V += list(v)
        K, V = np.repeat(np.array(self.K), nh // nkv, 1), np.repeat(np.array(self.V), nh // nkv, 1)
        n0 = len(self.K) - T
        o = np.empty((T, nh, hd), np.float32)
        for t in range(T):  # row t sees every earlier entry and itself
            s = np.einsum("hd,shd->hs", q[t], K[:n0 + t + 1]) / np.sqrt(hd)
            p = np.exp(s - s.max(-1, keepdims=True))
            o[t] = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), V[:n0 + t + 1])
        x = x + (o.reshape(T, -1) * (1 / (1 + np.exp(-gate)))) @ w("self_attn.o_proj.weight").T
        b = rms1p(x, w("post_attention_layernorm.weight"))
        g, u = b @ w("mlp.gate_proj.weight").T, b @ w("mlp.up_proj.weight").T
        return x + (g / (1 + np.exp(-g)) * u) @ w("mlp.down_proj.weight").T


class RefMtp:
    """spec §1.3 in float32 NumPy, from the safetensors: mtp_first_pass over a sequence's first n positions
    (the target's post-norm hidden rows given), then mtp_draft."""

    def __init__(self, model_dir):
        self.cfg = ModelConfig.from_dir(model_dir)
        t = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            t |= read_safetensors(f)
        self.t = t
        self.E = _f32(t["model.language_model.embed_tokens.weight"])
        self.W_lm = self.E if self.cfg.tie_word_embeddings else _f32(t["lm_head.weight"])

    def w(self, name):
        return _f32(self.t[name])

    def layer(self, i):
        return RefLayer(self.cfg, lambda n: self.w(f"model.language_model.layers.{i}.{n}"))

    def head(self, ids, h, pos, layer):
        H = self.cfg.hidden_size
        e = rms1p(self.E[ids], self.w("mtp.pre_fc_norm_embedding.weight"))
        u = np.concatenate([e, rms1p(h, self.w("mtp.pre_fc_norm_hidden.weight"))], -1) @ self.w("mtp.fc.weight").T
        assert u.shape[1] == H
        return rms1p(layer(u, pos), self.w("mtp.norm.weight"))

    def drafts(self, tokens, h_post, k):
        """tokens: x_0..x_n (x_n the pending token), h_post: [n, H] -> (k drafts, their logits [k, V])."""
        n = len(tokens) - 1
        layer = RefLayer(self.cfg, lambda name: self.w(f"mtp.layers.0.{name}"))
        g = self.head(np.asarray(tokens[1:]), h_post, np.arange(n), layer)[-1]  # ids shifted left by one
        ds, logits = [], []
        for s in range(k):
            logits.append(self.W_lm @ g)
            ds.append(int(np.argmax(logits[-1])))
            if s + 1 < k:
                g = self.head(np.array([ds[-1]]), g[None], np.array([n + s]), layer)[0]
        return ds, np.array(logits)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return RefMtp(tiny_dir)


def target_post_norm(model, tokens, capture=Capture(post_norm=True)):
    """The target's capture over `tokens` as one prefill in a fresh cache (the NumPy model)."""
    cache = model.alloc_cache(2, -(-len(tokens) // 16) + 1, 16)
    step = Step.build([(list(tokens), 0, 1, list(range(1, -(-len(tokens) // 16) + 1)))])
    return model.forward(step, cache, capture)


# ---- the capture -----------------------------------------------------------------------------------------
def test_capture_post_norm_and_taps(tiny_dir, ref):
    """post_norm is the lm_head's input on every row; taps are the residual stream after the layers asked,
    concatenated in their order: the stream after layer 3 (full attention) is RefLayer(3) of the stream after
    layer 2, and the final norm of the stream after the last layer is post_norm."""
    cfg = ModelConfig.from_dir(tiny_dir)
    model = Qwen35Model(cfg, load_weights(tiny_dir, cfg), make_backend("cpu"))
    tokens, H, last = prompt(5, 21), cfg.hidden_size, cfg.num_layers - 1
    assert cfg.layer_types[3] == "full_attention"
    plain = target_post_norm(model, tokens, None)
    logits, cap = target_post_norm(model, tokens, Capture(post_norm=True, taps=(last, 2, 3)))
    assert set(cap) == {"post_norm", "taps"} and cap["taps"].shape == (21, 3 * H)
    np.testing.assert_array_equal(logits, plain)  # the logits rows are unchanged by a capture
    np.testing.assert_allclose(logits, cap["post_norm"][-1:] @ ref.W_lm.T, rtol=1e-5, atol=1e-5)
    s_last, s2, s3 = cap["taps"][:, :H], cap["taps"][:, H:2 * H], cap["taps"][:, 2 * H:]
    np.testing.assert_allclose(rms1p(s_last, ref.w("model.language_model.norm.weight")), cap["post_norm"],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ref.layer(3)(s2, np.arange(21)), s3, rtol=1e-4, atol=1e-4)
    _, only = target_post_norm(model, tokens, Capture(taps=(2,)))
    assert set(only) == {"taps"}
    np.testing.assert_array_equal(only["taps"], s2)


# ---- the drafter against the transcription ----------------------------------------------------------------
def _req(ids, n, slot=1):
    """A running request whose first n tokens are committed and ids[n] is its pending token."""
    req = Request("r", ids[:4], SamplingParams(), 64, frozenset(), None, output_ids=ids[4:n + 1])
    req.status, req.num_computed, req.slot, req.block_ids = Status.RUNNING, n, slot, list(range(1, 9))
    return req


def _drafter_after_prefill(tiny_dir, tokens, n, chunks=(), **variant):
    """An MtpDrafter (maybe a variant) that observed the target's prefill of tokens[:n] in the given chunk
    sizes (the rest in one); returns (drafter, request)."""
    cfg = ModelConfig.from_dir(tiny_dir)
    weights = load_weights(tiny_dir, cfg, mtp=True)
    model = Qwen35Model(cfg, weights, make_backend("cpu"), draft_kv_layers=1)
    cache = model.alloc_cache(2, 9, 16)
    drafter = MtpDrafter(model, weights, **variant)
    drafter.bind(cache)
    req = _req(list(tokens), n)
    capture = Capture(post_norm=True, taps=(cfg.num_layers - 1,))  # what every variant may read
    base = 0
    for size in list(chunks) + [n - sum(chunks)]:
        _, cap = model.forward(Step.build([(list(tokens[base:base + size]), base, 1, req.block_ids)]), cache, capture)
        drafter.observe(StepRecord(cap, [(req, base, 0, size)]))
        base += size
    return drafter, req


def _check(ref, drafter, req, k):
    tokens = req.prompt_ids + req.output_ids
    n = req.num_computed
    h = target_post_norm(drafter.model, tokens[:n])[1]["post_norm"]
    want, want_logits = ref.drafts(tokens, h, k)
    got, steps = drafter.draft([req], [k])
    assert got == [want]
    np.testing.assert_allclose(np.concatenate([to_numpy(lg) for _, lg in steps]), want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [(), (16, 7)], ids=["one-chunk", "chunked"])
def test_drafts_after_a_prompt_equal_reference(tiny_dir, ref, chunks):
    tokens = prompt(9, 40)
    drafter, req = _drafter_after_prefill(tiny_dir, tokens, 37, chunks)
    _check(ref, drafter, req, 4)
    _check(ref, drafter, req, 1)  # a second proposal from the same point: the chain's KV rewritten


class OracleMtp(MtpDrafter):
    """The MTP observing every step, proposing the recorded plain continuation (right for `right` tokens,
    then off by one) where it has one, its own drafts elsewhere; `seen` keeps each request's state after
    every observe, for the reference checks."""
    plain: dict = {}
    right = 2

    def propose(self, reqs, rooms):
        own = super().propose(reqs, rooms)
        out = []
        for req, k, d in zip(reqs, rooms, own):
            want = self.plain.get(tuple(req.prompt_ids))
            if want is None:
                out.append(d)
                continue
            want = want[len(req.output_ids):][:k]
            out.append([t if i < self.right else (t + 1) % 1000 for i, t in enumerate(want)])
        return out


def _swap(eng, model_dir, cls=MtpDrafter, **attrs):
    """Replaces the engine's MTP drafter with a `cls` one (same weights and cache)."""
    cfg = eng.cfg
    d = cls(eng.runner.model, load_weights(model_dir, cfg, mtp=True))
    d.bind(eng.runner.cache)
    for k, v in attrs.items():
        setattr(d, k, v)
    eng.drafter = d
    return d


def test_drafts_after_verifies_equal_reference(tiny_dir, ref):
    """In the engine (prompt in chunks, then verifies that accept 2 of 3 drafts and ones that reject), after
    each collected step the drafter's drafts and logits equal the transcription's from the whole sequence."""
    p, sp = prompt(7, 37), SamplingParams(max_tokens=14, **GREEDY)
    want, _, _, _ = run(tiny_dir, [p], sp)
    eng, col = make(tiny_dir, max_num_seqs=2, max_num_batched_tokens=16, speculative_config=MTP)
    d = _swap(eng, tiny_dir, OracleMtp, plain={tuple(p): want[0]})
    rid = eng.submit(p, sp, col)
    checked = set()
    while not (rid in col.events and col.last(rid).finished):
        eng.step()
        eng._flush()  # as the next step() begins: collect, then observe
        if eng._record is not None:
            d.observe(eng._record)
            eng._record = None
        req = eng._requests.get(rid)
        if req is not None and req.num_tokens - req.num_computed == 1 and req.num_computed not in checked:
            checked.add(req.num_computed)
            _check(ref, d, req, 3)
    assert col.tokens(rid) == want[0]
    assert len(checked) >= 4 and eng.stats().spec_decode_num_accepted_tokens > 0
    eng.step()
    assert_idle(eng)


def test_failing_mtp_runs_ahead_while_paused(tiny_dir, ref):
    """An MTP whose drafts are all rejected pauses (engine._missed); the steps in which no request drafts run
    one ahead (their decode fed on the device) and the head observes each as its sampling is launched, the
    token the step samples fed on the device: whenever the request proposes again, its drafts and logits
    equal the transcription's from the whole sequence; tokens equal plain greedy; nothing is kept after."""
    p, sp = prompt(8, 37), SamplingParams(max_tokens=48, **GREEDY)
    want, _, _, _ = run(tiny_dir, [p], sp)
    eng, col = make(tiny_dir, speculative_config=MTP)
    d = _swap(eng, tiny_dir, OracleMtp, plain={tuple(p): want[0]}, right=0)
    fed, real = [], eng.runner.forward
    eng.runner.forward = lambda batch, prev, plan=None: fed.append(prev is not None) or real(batch, prev, plan)
    checked, propose = [], d.propose

    def checking(reqs, rooms):
        for req in reqs:
            _check(ref, d, req, 3)
            checked.append(req.num_computed)
        return propose(reqs, rooms)
    d.propose = checking
    rid = eng.submit(p, sp, col)
    drive(eng, col, [rid])
    eng.step()
    assert col.tokens(rid) == want[0]
    st = eng.stats()
    assert st.spec_decode_num_drafts == len(checked) and st.spec_decode_num_accepted_tokens == 0
    assert len(checked) >= 6 and sum(fed) >= 20  # proposals after pauses; most steps ran one ahead
    assert d._last == {}
    assert_idle(eng)


# ---- greedy identity ---------------------------------------------------------------------------------------
class SomeMtp(MtpDrafter):
    """The MTP proposing for the prompts in `only` alone: the others decode plainly in the same batches."""
    only: set = set()

    def propose(self, reqs, rooms):
        return super().propose(reqs, [k if tuple(r.prompt_ids) in self.only else 0 for r, k in zip(reqs, rooms)])


PROMPTS16 = [prompt(40 + i, 3 + 6 * i) for i in range(16)]  # 3..93 tokens: across KV blocks (16)
PLAIN: dict = {}  # preset -> plain greedy tokens of PROMPTS16


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_greedy_equals_plain(request, preset, k):
    """c1 and a batch of 16 where every other request speculates with the MTP: tokens equal plain greedy;
    every KV block and state slot is idle after."""
    model = request.getfixturevalue(f"{preset}_dir")
    sp, spec = SamplingParams(max_tokens=8, **GREEDY), dict(MTP, num_speculative_tokens=k)
    kw = dict(max_num_seqs=16, max_num_batched_tokens=128)
    if preset not in PLAIN:
        PLAIN[preset] = run(model, PROMPTS16, sp, **kw)[0]
    want = PLAIN[preset]
    got, eng, _, _ = run(model, PROMPTS16[5:6], sp, spec, **kw)  # c1
    assert got == want[5:6]
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_draft_tokens >= st.spec_decode_num_drafts
    assert_idle(eng)
    eng, col = make(model, speculative_config=spec, **kw)
    _swap(eng, model, SomeMtp, only={tuple(p) for p in PROMPTS16[::2]})
    rids = [eng.submit(p, sp, col) for p in PROMPTS16]
    drive(eng, col, rids)
    eng.step()
    assert [col.tokens(r) for r in rids] == want
    assert eng.stats().spec_decode_num_drafts >= 8
    assert_idle(eng)


# ---- negative controls (spec §4 item 4) ----------------------------------------------------------------------
@pytest.mark.parametrize("variant", [dict(embedding_first=False), dict(post_norm=False), dict(norms_1p=False)],
                         ids=["hidden-first", "pre-norm-hidden", "plain-norms"])
def test_negative_controls_change_the_draft_logits(tiny_dir, variant):
    tokens = prompt(3, 30)
    good, req = _drafter_after_prefill(tiny_dir, tokens, 29)
    bad, req2 = _drafter_after_prefill(tiny_dir, tokens, 29, **variant)
    a = np.concatenate([to_numpy(x) for _, x in good.draft([req], [2])[1]])
    b = np.concatenate([to_numpy(x) for _, x in bad.draft([req2], [2])[1]])
    assert np.abs(a - b).mean() > 1e-2 * np.abs(a).mean()


# ---- configuration ---------------------------------------------------------------------------------------------
def test_config(tiny_dir):
    """method mtp parses (vLLM's keys); the cache has the head's KV layer, its blocks counted by the memory plan;
    prefix caching stays exclusive. (A checkpoint without mtp.*: tests/test_loading.py.)"""
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}').method == "mtp"
    plain, _ = make(tiny_dir, max_num_seqs=2, num_kv_blocks=20)
    eng, _ = make(tiny_dir, max_num_seqs=2, num_kv_blocks=20, speculative_config=MTP)
    nk = len(plain.runner.cache.k)
    assert len(eng.runner.cache.k) == nk + 1
    assert unit_bytes(eng.runner.model, 16)[1] * nk == unit_bytes(plain.runner.model, 16)[1] * (nk + 1)
    assert isinstance(eng.drafter, MtpDrafter) and eng.drafter.k is eng.runner.cache.k[-1]
    with pytest.raises(ValueError, match="prefix caching"):
        make(tiny_dir, speculative_config=MTP, enable_prefix_caching=True)


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_greedy_equals_plain(request):
    """The 4B checkpoint (QWEN35_MODEL_4B or the random one): greedy MTP output equals plain greedy at c1 on a
    4097-token prompt, token for token (a verify's rows take the decode's kernels: GEMV rows, attn_fwd split
    per sequence, the GDN recurrence); in a batch of 16 (with that prompt), where verifies of more than 16 rows
    take cublasLt GEMMs, equal up to a flip within bf16 noise (the logits there, as tests/test_spec_decode.py)."""
    from conftest import gpu_or_skip
    gpu_or_skip()  # before the fixture writes a 4B checkpoint
    from test_spec_decode import GPU_NOISE, _record
    target = (request.getfixturevalue("model_4b_dir"), "cuda")
    prompts = [prompt(60 + i, 3 + 37 * i) for i in range(15)] + [prompt(99, 4097)]
    sp = SamplingParams(max_tokens=24, **GREEDY)
    kw = dict(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4200)
    want, _, _, _ = run(target, prompts[-1:], sp, **kw)
    got, eng, _, _ = run(target, prompts[-1:], sp, MTP, **kw)
    assert got == want and eng.stats().spec_decode_num_drafts > 0
    logits = []
    for spec in (None, MTP):
        rec = {}
        eng, col = make(target, speculative_config=spec, **kw)
        eng.runner.logits_hook = _record(rec)
        rids = [eng.submit(p, sp, col) for p in prompts]
        drive(eng, col, rids, max_steps=2000)
        eng.step()
        assert_idle(eng)
        logits.append((rec, [col.tokens(r) for r in rids]))
        eng.shutdown()
    (la, want), (lb, got) = logits
    for p, a, b in zip(prompts, want, got):
        if a != b:
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert np.abs(la[(tuple(p), k)] - lb[(tuple(p), k)]).mean() <= GPU_NOISE


def test_long_context_greedy_equals_plain(tiny_dir):
    """The MTP drafter over a 4097-token prompt (its first pass writes the head's KV for every prompt
    position, chunk by chunk): greedy output equals plain greedy."""
    prompts = [prompt(43, 4097)]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    kw = dict(max_model_len=4200, max_num_batched_tokens=1024)
    want, _, _, _ = run(tiny_dir, prompts, sp, **kw)
    got, eng, _, _ = run(tiny_dir, prompts, sp, MTP, **kw)
    assert got == want and eng.stats().spec_decode_num_drafts > 0
    assert_idle(eng)
