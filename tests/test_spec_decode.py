"""Speculative decoding (`speculative_config`): the verify path, acceptance and the transactional
rollback of the hybrid state, driven by test-only oracle drafters that propose from a recorded plain
run (right for `right` tokens, then wrong; None: all right). CPU: the tiny and tiny3 models on NumPy;
marked gpu: the 4B checkpoint (the `target` fixture).

"Equal to a plain run" for states: a verify computes its tokens as one chunk (the chunked GDN form,
multi-row matmuls) where plain decoding takes one token at a time, so states agree to float rounding
(CPU_TOL relative; GPU: bf16 kernels, GPU_TOL); a rolled-back state is the one from before the verify
bit for bit. Greedy tokens are identical on the CPU; on the GPU equal up to a flip within bf16 noise.
"""
import math

import numpy as np
import pytest

from engine import SamplingParams
from engine.arrays import array_module, as_f32, to_numpy
from engine.config import SpeculativeConfig
from engine.drafter import Drafter, NgramDrafter
from engine.engine import MAX_PAUSE, PAUSE_AFTER
from engine.request import Request
from engine.sampler import RowParams, Sampler
from test_engine import Collect, drive, make, prompt

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = dict(temperature=0.0, ignore_eos=True)
CPU_TOL, GPU_TOL = 2e-5, 3e-2
GPU_NOISE = 0.12  # tests/test_engine.py: mean |dlogit| of bf16 batch-shape noise on the random 4B


class Oracle(Drafter):
    """Proposes the recorded plain continuation of each prompt: its first `right` tokens as they are, the
    rest off by one (None: all right). Only prompts in `plain` get drafts; the others decode plainly."""

    def __init__(self, plain: dict, right: int | None = None):
        self.plain, self.right = plain, right

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        return [self._propose(req, k) for req, k in zip(reqs, rooms)]

    def _propose(self, req: Request, k: int) -> list[int]:
        want = self.plain.get(tuple(req.prompt_ids), [])[len(req.output_ids):][:k]
        return [t if self.right is None or i < self.right else (t + 1) % 1000 for i, t in enumerate(want)]


def outside_reservation(eng) -> list:
    """Records each (request, end) a forward computes past the request's lifetime reservation (prompt +
    max_tokens, and its KV blocks); it stays empty if a verify's drafts are capped as they must be."""
    real, bad = eng.runner.forward, []

    def forward(batch, prev, plan=None):
        bad.extend((req.request_id, req.num_computed + n) for req, n in batch if req.num_computed + n >
                   min(req.lifetime_tokens, len(req.block_ids) * eng.kv.block_size))
        return real(batch, prev, plan)
    eng.runner.forward = forward
    return bad


def run(target, prompts, sp, spec=None, drafter=None, hook=None, **kw):
    """Tokens per prompt (and the engine, stepped to idle) of one loop-less engine. hook: its logits hook."""
    kw = dict(dict(max_num_seqs=8, max_num_batched_tokens=64), **kw)
    eng, col = make(target, speculative_config=spec, **kw)
    eng.runner.logits_hook = hook
    bad = outside_reservation(eng)
    if drafter is not None:
        eng.drafter = drafter
    rids = [eng.submit(p, s, col) for p, s in zip(prompts, sp if isinstance(sp, list) else [sp] * len(prompts))]
    drive(eng, col, rids, max_steps=2000)
    eng.step()  # collects the step launched after the last token
    assert bad == []
    return [col.tokens(r) for r in rids], eng, col, rids


def assert_idle(eng, init_memory=None):
    st = eng.stats()
    assert (st.running, st.waiting, st.kv_blocks_used, st.state_slots_free) == (0, 0, 0, st.state_slots_total)
    logs = eng.scheduler.spec_logs
    assert logs is None or logs.num_free == logs.capacity
    d = getattr(eng.drafter, "inner", eng.drafter)
    for kept in ("_tokens", "_last", "context"):  # what the n-gram, MTP and DFlash drafters keep per request
        assert not getattr(d, kept, None), kept
    if init_memory is not None:
        assert st.device_memory_used == init_memory


PROMPTS = [prompt(1, 20), prompt(2, 37), prompt(3, 5), prompt(4, 16)]  # across block boundaries (16)


# ---- configuration ---------------------------------------------------------------------------------
def test_config_parse_and_errors(tiny_dir):
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse(None) is None
    for bad, msg in [({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be .*got 0"),
                     ({"method": "ngram"}, "num_speculative_tokens must be"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, r"unknown keys \['k'\]"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                       "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
                     ("{nope", "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="prefix caching works with the ngram drafter only"):
        make(tiny_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, enable_prefix_caching=True)
    make(tiny_dir, speculative_config=SPEC, enable_prefix_caching=True)  # (test_prefix_engine.py serves with both)


def test_cli_flag(tiny_dir, capsys):
    from server.cli import build_parser, engine_kwargs
    a = build_parser().parse_args(["generate", "x", "--speculative-config", '{"method": "ngram", '
                                   '"num_speculative_tokens": 2}'])
    assert engine_kwargs(a)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "x", "--speculative-config", '{"method": "eagle"}'])
    assert e.value.code == 2 and "method 'eagle' is not supported" in capsys.readouterr().err


def _fed(eng):
    """Records, per forward, whether a sampling still in flight fed it (host and device overlapped)."""
    fed, real = [], eng.runner.forward
    eng.runner.forward = lambda batch, prev, plan=None: fed.append(prev is not None) or real(batch, prev, plan)
    return fed


def test_off_changes_nothing(tiny_dir):
    """Speculation off: no log sets, no drafter, and decodes fed on the device (overlapped). On: a log set of
    1 + k entries per sequence, no more state rows, and each step collects before it launches."""
    eng, col = make(tiny_dir)
    assert eng.drafter is None and eng.scheduler.spec_logs is None and not eng.runner.cache.rec_log
    assert eng.runner.cache.rec[0].shape[0] == eng.slots.num_slots
    fed = _fed(eng)
    drive(eng, col, [eng.submit(PROMPTS[0], SamplingParams(max_tokens=6, **GREEDY), col)])
    assert fed == [False] + [True] * 5
    eng, col = make(tiny_dir, speculative_config=SPEC, max_num_seqs=4)
    # 4 log sets and one for padding (CUDA graphs)
    assert eng.runner.cache.rec[0].shape[0] == eng.slots.num_slots
    assert eng.runner.cache.rec_log[0].shape[:2] == (5, 1 + SPEC["num_speculative_tokens"])
    eng.drafter = Oracle({tuple(PROMPTS[0]): list(range(100, 110))}, right=0)  # never right: stays below PAUSE_AFTER
    fed = _fed(eng)
    drive(eng, col, [eng.submit(PROMPTS[0], SamplingParams(max_tokens=PAUSE_AFTER + 1, **GREEDY), col)])
    assert fed == [False] * (PAUSE_AFTER + 1)


class Never(Drafter):
    """Proposes nothing (a drafter that never finds a continuation)."""

    def __init__(self):
        self.calls = 0

    def propose(self, reqs, rooms):
        self.calls += 1
        return [[] for _ in reqs]


@pytest.mark.parametrize("drafter", ["never", "reject-first"])
def test_failing_drafter_pauses(tiny_dir, drafter):
    """Proposals that bring no accepted token PAUSE_AFTER times in a row (no drafts, or all rejected) pause
    the request (engine._missed: steps without proposals, ending at a step number that is a multiple of
    the pause), which run one ahead (fed on the device) when no request can draft, except the step right
    after a verify (where it goes on is known once the verify is collected); tokens equal plain's."""
    n = 60
    plain, eng, _, _ = run(tiny_dir, PROMPTS[:1], SamplingParams(max_tokens=n, **GREEDY))
    eng, col = make(tiny_dir, speculative_config=SPEC)
    eng.drafter = Never() if drafter == "never" else Oracle({tuple(PROMPTS[0]): plain[0]}, right=0)
    fed = _fed(eng)
    verifies = []
    real = eng.runner.forward
    eng.runner.forward = lambda batch, prev, plan=None: verifies.append(
        any(req.drafts for req, _ in batch)) or real(batch, prev, plan)
    rid = eng.submit(PROMPTS[0], SamplingParams(max_tokens=n, **GREEDY), col)
    drive(eng, col, [rid])
    eng.step()
    assert col.tokens(rid) == plain[0]

    def pause(misses, step):  # the step it proposes again from
        p = min(MAX_PAUSE, 2 ** (misses - PAUSE_AFTER))
        return (step // p + 2) * p if misses >= PAUSE_AFTER else 0
    want, misses, resume, after_verify, n_prop = [False], 0, 0, False, 0  # step 1: the prefill
    for step in range(2, len(fed) + 1):  # one forward per step
        if after_verify:  # its collect here found every draft rejected
            misses += 1
            resume = pause(misses, step)
        proposes = step >= resume
        n_prop += proposes
        want.append(not (after_verify or proposes))
        after_verify = proposes and drafter != "never"
        if proposes and drafter == "never":
            misses += 1
            resume = pause(misses, step)
    assert fed == want
    assert (eng.drafter.calls if drafter == "never" else sum(verifies)) == n_prop
    assert n_prop <= 10  # 60 tokens: 4 misses, then pauses of about 1, 2, 4, 8, 16 steps
    assert drafter != "never" or not any(verifies)
    assert_idle(eng)


def test_seeded_requests_pause_by_their_own_tokens(tiny_dir):
    """A seeded request's pauses count its own tokens, not engine steps: where it verifies, and so its random
    draws, do not depend on the requests beside it. With a drafter that is always wrong (pauses throughout),
    seeded sampled requests give the same tokens alone and in a batch in another order and budget."""
    sp = [SamplingParams(max_tokens=40, temperature=0.8, seed=10 + i, ignore_eos=True) for i in range(3)]
    wrong = {tuple(p): [(t + 7) % 1000 for t in range(100)] for p in PROMPTS[:3]}  # never the sampled tokens
    alone = [run(tiny_dir, [p], [s], SPEC, Oracle(wrong))[0][0] for p, s in zip(PROMPTS[:3], sp)]
    batch, eng, _, _ = run(tiny_dir, PROMPTS[2::-1], sp[::-1], SPEC, Oracle(wrong), max_num_batched_tokens=24)
    assert batch[::-1] == alone
    st = eng.stats()
    assert 0 < st.spec_decode_num_drafts < 3 * 20  # it paused: far fewer verifies than decode steps
    assert_idle(eng)


def test_accepted_token_resets_the_pause_count(tiny_dir):
    """A drafter right on its first token (one accepted per verify) never pauses: every step verifies."""
    n = 30
    plain, _, _, _ = run(tiny_dir, PROMPTS[:1], SamplingParams(max_tokens=n, **GREEDY))
    toks, eng, _, _ = run(tiny_dir, PROMPTS[:1], SamplingParams(max_tokens=n, **GREEDY), SPEC,
                          Oracle({tuple(PROMPTS[0]): plain[0]}, right=1))
    st = eng.stats()
    assert toks == plain and st.spec_decode_num_accepted_tokens == st.spec_decode_num_drafts
    assert st.spec_decode_num_drafts >= (n - 1) // 2 - 1  # two tokens per verify, from the first decode on


def test_ngram_drafter():
    d = NgramDrafter(1, 3)
    req = lambda ids: Request("r", ids[:2], SamplingParams(), 10, frozenset(), None,  # noqa: E731
                              output_ids=ids[2:])
    assert d.propose([req([1, 2, 3, 4, 5, 1, 2, 3])], [3]) == [[4, 5, 1]]   # the longest suffix (3) first
    assert d.propose([req([1, 2, 9, 1, 2, 7, 2])], [5]) == [[7, 2]]         # the most recent occurrence
    assert d.propose([req([7, 7, 7])], [4]) == [[7]]                         # the continuation may overlap the suffix
    assert d.propose([req([1, 2, 3])], [4]) == [[]] and d.propose([req([5])], [2]) == [[]]
    assert NgramDrafter(2, 3).propose([req([1, 2, 3, 1])], [4]) == [[]]      # a 1-token match is too short
    # a request's tokens are kept and extended step by step (the same answers as from scratch), until forget()
    r = req([1, 2, 3, 1, 2])
    assert d.propose([r], [2]) == [[3, 1]]
    r.output_ids += [3, 4, 1, 2, 3]
    assert d.propose([r], [3]) == [[4, 1, 2]]
    d.forget(r)
    assert r not in d._tokens


# ---- greedy identity -------------------------------------------------------------------------------
@pytest.mark.parametrize("right", [None, 0, 2], ids=["accept-all", "reject-first", "prefix-2"])
@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_greedy_equals_plain(request, preset, right):
    """c1 and a batch where half the requests speculate: tokens equal plain greedy; counters count."""
    model = request.getfixturevalue(f"{preset}_dir")
    sp = SamplingParams(max_tokens=16, **GREEDY)
    want, eng, _, _ = run(model, PROMPTS, sp)
    init = eng.stats().device_memory_used
    plain = {tuple(p): t for p, t in zip(PROMPTS, want)}
    got, eng, _, _ = run(model, PROMPTS[:1], sp, SPEC, Oracle(plain, right))  # c1
    assert got == want[:1]
    half = {k: v for i, (k, v) in enumerate(plain.items()) if i % 2 == 0}
    got, eng, _, _ = run(model, PROMPTS, sp, SPEC, Oracle(half, right), max_num_batched_tokens=24)
    assert got == want
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_draft_tokens >= st.spec_decode_num_drafts
    accepted = {None: st.spec_decode_num_draft_tokens, 0: 0}.get(right)
    if accepted is not None:
        assert st.spec_decode_num_accepted_tokens == accepted
    assert_idle(eng)
    assert st.device_memory_used >= init  # the log sets


def assert_equal_up_to_noise(target, prompts, want, got, la, lb):
    """Greedy tokens per prompt equal; on the GPU equal up to a flip within bf16 noise (a verify step's rows
    may be computed in another batch shape than plain decoding's: tests/test_engine.py), the logits at the
    flip within GPU_NOISE. la, lb: the two runs' logits (_record)."""
    for p, a, b in zip(prompts, want, got):
        if a != b:
            assert target[1] == "cuda", (p, a, b)
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert np.abs(la[(tuple(p), k)] - lb[(tuple(p), k)]).mean() <= GPU_NOISE


def _record(store):
    """A logits hook keeping every row's raw logits by (prompt, output index); a verify's rows repeat
    its request, row i scoring output index len(output) + i."""
    def hook(reqs, logits):
        seen = {}
        for i, r in enumerate(reqs):
            seen[r] = seen.get(r, -1) + 1
            store[(tuple(r.prompt_ids), len(r.output_ids) + seen[r])] = np.array(logits[i])
        return logits
    return hook


def test_greedy_batch_of_16_equals_plain(target):
    """16 requests, every other one speculating (accepted-prefix 2), prompts of 3..93 tokens across
    block boundaries: greedy tokens equal plain ones. GPU: a verify step of more than 16 rows takes cublasLt
    GEMMs where plain decoding takes the GEMV (and mixed steps differ), so a greedy token may flip within bf16
    noise (as tests/test_engine.py): equal up to the flip, and the logits there within GPU_NOISE."""
    prompts = [prompt(20 + i, 3 + 6 * i) for i in range(16)]
    sp = SamplingParams(max_tokens=16, **GREEDY)
    la, lb = {}, {}
    eng, col = make(target, max_num_seqs=16, max_num_batched_tokens=128)
    eng.runner.logits_hook = _record(la)
    rids = [eng.submit(p, sp, col) for p in prompts]
    drive(eng, col, rids)
    want = [col.tokens(r) for r in rids]
    eng.shutdown()
    plain = {tuple(p): t for i, (p, t) in enumerate(zip(prompts, want)) if i % 2 == 0}
    eng, col = make(target, max_num_seqs=16, max_num_batched_tokens=128, speculative_config=SPEC)
    eng.drafter = Oracle(plain, 2)
    eng.runner.logits_hook = _record(lb)
    rids = [eng.submit(p, sp, col) for p in prompts]
    drive(eng, col, rids)
    eng.step()
    assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert_idle(eng)
    assert_equal_up_to_noise(target, prompts, want, [col.tokens(r) for r in rids], la, lb)


def test_ngram_engine_greedy_equals_plain(tiny_dir):
    """The real n-gram drafter on repetitive prompts whose last token is computed alone (a 1-token last
    chunk: drafts from the prompt's own pattern): tokens equal plain greedy."""
    prompts = [prompt(i, 8) * 4 + prompt(i, 1) for i in range(3)]  # 33 tokens: chunks of 16, 16, 1
    sp = SamplingParams(max_tokens=12, **GREEDY)
    want, _, _, _ = run(tiny_dir, prompts, sp, max_num_batched_tokens=16, max_num_seqs=1)
    spec = dict(SPEC, prompt_lookup_min=1, prompt_lookup_max=4)
    got, eng, _, _ = run(tiny_dir, prompts, sp, spec, max_num_batched_tokens=16, max_num_seqs=1)
    assert got == want
    assert eng.stats().spec_decode_num_drafts >= 3
    assert_idle(eng)


def test_penalties_and_logprobs_equal_plain(tiny_dir):
    """Greedy with a repetition penalty, min_tokens and logprobs: every verify row is processed with the
    drafts before it counted as output; tokens equal and logprobs within float rounding."""
    sp = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                        min_tokens=6, logprobs=3, ignore_eos=True)
    want, _, col0, r0 = run(tiny_dir, PROMPTS[:2], sp)
    plain = {tuple(p): t for p, t in zip(PROMPTS, want)}
    got, eng, col1, r1 = run(tiny_dir, PROMPTS[:2], sp, SPEC, Oracle(plain, 2))
    assert got == want and eng.stats().spec_decode_num_accepted_tokens > 0
    for a, b in zip(r0, r1):
        la = [lp for e in col0.events[a] for lp in e.logprobs or []]
        lb = [lp for e in col1.events[b] for lp in e.logprobs or []]
        assert len(la) == len(lb) == 16
        for x, y in zip(la, lb):
            assert x.token_id == y.token_id and list(x.top_logprobs) == list(y.top_logprobs)
            assert abs(x.logprob - y.logprob) < 1e-3


def test_requests_beyond_the_log_sets_run_without_speculation(tiny_dir):
    """A memory budget with log sets for 2 of 4 sequences: the first 2 admitted speculate, the other 2 run
    without speculation (the final event says which), all 4 give plain greedy's tokens, and the sets return
    to the pool."""
    from engine.memory import unit_bytes
    sp = SamplingParams(max_tokens=12, **GREEDY)
    want, eng, _, _ = run(tiny_dir, PROMPTS, sp)
    k, blocks = SPEC["num_speculative_tokens"], 64
    slot, block, log = unit_bytes(eng.runner.model, 16, k)
    budget = 5 * slot + blocks * block + 3 * log  # 4 slots + the dummy, the KV blocks, 2 log sets + the padding's
    got, eng, col, rids = run(tiny_dir, PROMPTS, sp, SPEC, Oracle({tuple(p): t for p, t in zip(PROMPTS, want)}),
                              max_num_seqs=4, kv_cache_memory=budget, num_kv_blocks=blocks)
    assert got == want and eng.scheduler.spec_logs.capacity == 2
    spec = [col.last(r).spec_decode for r in rids]
    assert [s["speculative"] for s in spec] == [True, True, False, False]
    assert all(s["draft_tokens"] > 0 and s["accepted_tokens"] == s["draft_tokens"] for s in spec[:2])
    assert all(s["draft_tokens"] == 0 for s in spec[2:])
    assert_idle(eng)


# ---- the hybrid state after every step -------------------------------------------------------------
def _state(eng, req):
    """req's GDN conv and recurrent state and the K/V of its computed positions, f32 on the host. After a
    verify the slot holds the state before it, and the committed state is the slot's with the tokens its
    next step replays (step.py) applied here, from the log in the backend's layout."""
    c = eng.runner.cache
    xp = array_module(c.rec[0])
    pos = np.arange(req.num_computed)
    blocks = xp.asarray(np.asarray(req.block_ids)[pos // c.block_size])
    off = xp.asarray(pos % c.block_size)
    host = lambda x: np.array(to_numpy(as_f32(x)))  # noqa: E731
    conv, rec = [host(a[req.slot]) for a in c.conv], [host(a[req.slot]) for a in c.rec]
    if req.replay:
        conv = [host(log[req.spec_log, req.replay - 1]) for log in c.conv_log]
        rec = [_replayed(S, host(log[req.spec_log, :req.replay])) for S, log in zip(rec, c.rec_log)]
    return conv + rec + [host(a[blocks, off]) for a in c.k + c.v]


def _replayed(S, entries):
    """S [nv, dk, dv] after the logged tokens: NumPy's entries [nv, dk + dv + 2] are the recurrence's inputs
    (k | v | g | beta), CUDA's [nv, dv / 32, dk + pad] each 32-column tile's normalized k, delta and decay."""
    from engine.backend_numpy import delta_rule_recurrent
    nv, dk, dv = S.shape
    for e in entries:
        if e.ndim == 2:
            _, S = delta_rule_recurrent(np.zeros((1, nv, dk), np.float32), e[None, :, :dk], e[None, :, dk:dk + dv],
                                        e[None, :, -2], e[None, :, -1], S)
        else:
            k, delta, decay = e[:, :, :dk], e[:, :, dk:dk + 32], e[:, :, dk + 32]  # [nv, tiles, .]
            S = S.reshape(nv, dk, dv // 32, 32) * decay[:, None, :, None] + k.transpose(0, 2, 1)[..., None] * delta[:, None]
            S = S.reshape(nv, dk, dv)
    return S


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("right", [None, 0, 1, 2], ids=["accept-all", "reject-first", "prefix-1", "prefix-2"])
def test_state_after_each_step_equals_plain(target, right):
    """After each step (its tokens collected), the request's KV up to its committed position and every GDN
    conv and recurrent state (its slot's, with what its next step replays from the log) equal those of a
    plain run at the same position: a verify that rejected a draft leaves the state after its last accepted
    token."""
    p, sp = prompt(7, 37), SamplingParams(max_tokens=20, **GREEDY)
    tol = CPU_TOL if target[1] == "cpu" else GPU_TOL
    eng, col = make(target, max_num_seqs=2, max_num_batched_tokens=64)
    rid = eng.submit(p, sp, col)
    ref = {}
    while not (rid in col.events and col.last(rid).finished):
        eng.step()
        req = eng._requests.get(rid)
        if req is not None:
            ref[req.num_computed] = _state(eng, req)
    want = col.tokens(rid)
    eng, col = make(target, max_num_seqs=2, max_num_batched_tokens=64, speculative_config=SPEC)
    eng.drafter = Oracle({tuple(p): want}, right)
    rid = eng.submit(p, sp, col)
    seen, rolled, worst = set(), 0, (0.0, 0)
    while True:
        st = eng.stats()
        eng.step()
        eng._flush()  # collect now (the next step would first): its replay count is then known
        drafted = eng.stats().spec_decode_num_draft_tokens - st.spec_decode_num_draft_tokens
        rolled += eng.stats().spec_decode_num_accepted_tokens - st.spec_decode_num_accepted_tokens < drafted
        req = eng._requests.get(rid)
        if req is None:
            break
        if req.output_ids != want[:len(req.output_ids)]:  # a greedy flip (GPU: bf16 noise): not comparable on
            assert target[1] == "cuda"
            break
        now = _state(eng, req)
        errs = [_rel(a, b) for a, b in zip(now, ref[req.num_computed])]
        if target[1] == "cpu":
            assert max(errs) < tol, (req.num_computed, errs)
        worst = max(worst, (max(errs), req.num_computed))
        seen.add(req.num_computed)
    assert col.tokens(rid) == want or target[1] == "cuda"
    assert rolled > 0 if right is not None else rolled == 0
    assert len(seen) > 3
    drive(eng, col, [rid])
    eng.step()
    assert_idle(eng)
    if worst[0] >= tol:  # GPU only (the CPU asserted it at each step); every structural check above held
        pytest.xfail(f"the states drift from a plain run's by {worst[0]:.3f} (relative, growing with depth; at "
                     f"position {worst[1]}) > {tol}: a verify computes its tokens in multi-row GEMMs and the "
                     "prefill attention where plain decoding takes the GEMV and decode attention, and bf16 "
                     "differences compound over the layers (4B, H200, 2026-12-04: 0.035 at the deepest layers, "
                     "when verifies also took the chunked GDN)")


# ---- sampling ---------------------------------------------------------------------------------------
def test_seeded_sampling_reproducible(tiny_dir):
    """Seeded sampled requests (with logprobs) give the same tokens and logprobs in another batch order and
    budget, one logprob entry per emitted token, of that token."""
    sp = [SamplingParams(max_tokens=16, temperature=0.3, top_k=20, seed=i, logprobs=1, ignore_eos=True)
          for i in range(4)]
    plain = {tuple(p): t for p, t in zip(PROMPTS, run(tiny_dir, PROMPTS, sp)[0])}  # drafts: plain samples
    a, _, ca, ra = run(tiny_dir, PROMPTS, sp, SPEC, Oracle(plain))
    b, eng, cb, rb = run(tiny_dir, PROMPTS[::-1], sp[::-1], SPEC, Oracle(plain), max_num_batched_tokens=24)
    assert a == b[::-1]
    lps = lambda col, r: [(x.token_id, x.logprob) for e in col.events[r] for x in e.logprobs or []]  # noqa: E731
    for r, q, toks in zip(ra, rb[::-1], a):  # logprobs to NumPy's M-dependent rounding (test_prefix_engine.py)
        assert [t for t, _ in lps(ca, r)] == [t for t, _ in lps(cb, q)] == toks
        assert np.allclose([x for _, x in lps(ca, r)], [x for _, x in lps(cb, q)], atol=1e-4)
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_accepted_tokens > 0
    assert_idle(eng)


def _probs(eng, prompts, sp):
    """p(next token | prompt) of sampling with sp, from the raw logits of a plain engine."""
    rows = {}

    def hook(reqs, x):
        for i, r in enumerate(reqs):
            rows.setdefault(tuple(r.prompt_ids), np.array(x[i]))
        return x
    eng.runner.logits_hook = hook
    c = Collect()
    drive(eng, c, [eng.submit(q, SamplingParams(max_tokens=1, **GREEDY), c) for q in prompts])
    row = RowParams(temperature=sp.temperature, top_k=sp.top_k)
    out = []
    for q in prompts:
        x = Sampler().process(rows[tuple(q)][None].astype(np.float32), [row])[0]
        e = np.exp(x - x.max())
        out.append(e / e.sum())
    return out


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x) by Wilson-Hilferty's normal approximation (within ~10%
    of the exact tail down to 1e-4 for df >= 4; SciPy is not among the test dependencies)."""
    h = 2 / (9 * df)
    return 0.5 * math.erfc(((x / df) ** (1 / 3) - (1 - h)) / math.sqrt(2 * h))


def test_rejection_sampling_matches_plain_distribution(tiny_dir):
    """Top-5 sampling, every second token verified with one draft, the most likely token after the
    first: accepted or replaced, the second token is distributed as plain sampling's p(. | first)
    (chi-square summed over the first token's values; drawing replacements without zeroing the draft
    fails it at p ~ 1e-5), and both branches occur."""
    p0, n = prompt(11, 6), 250
    sp = SamplingParams(max_tokens=3, temperature=0.5, top_k=5, ignore_eos=True)
    eng, _ = make(tiny_dir)
    (p1,) = _probs(eng, [p0], sp)
    firsts = [int(t) for t in np.flatnonzero(p1)]
    p2 = dict(zip(firsts, _probs(eng, [p0 + [t] for t in firsts], sp)))
    draft = {t: [int(np.argmax(p2[t]))] for t in firsts}

    class MostLikely(Drafter):
        def propose(self, reqs, rooms):
            return [draft[req.output_ids[0]] if len(req.output_ids) == 1 else [] for req in reqs]
    got, eng, _, _ = run(tiny_dir, [p0] * n, [SamplingParams(**dict(vars(sp), seed=i)) for i in range(n)],
                         {"method": "ngram", "num_speculative_tokens": 1}, MostLikely(),
                         max_num_seqs=64, max_num_batched_tokens=512, max_waiting_requests=n)
    chi, df = 0.0, 0
    for t in firsts:
        second = np.array([g[1] for g in got if g[0] == t])
        support = np.flatnonzero(p2[t])
        counts = np.array([(second == s).sum() for s in support])
        assert counts.sum() == len(second)  # never outside the top 5
        want = p2[t][support].astype(np.float64)
        expected = want / want.sum() * len(second)
        chi += float(((counts - expected) ** 2 / expected).sum())
        df += len(support) - 1
    assert chi2_sf(chi, df) > 1e-3
    st = eng.stats()
    assert st.spec_decode_num_draft_tokens == n and 0 < st.spec_decode_num_accepted_tokens < n
    assert_idle(eng)


# ---- limits, stops, aborts ----------------------------------------------------------------------------
def test_max_tokens_stop_and_eos_inside_an_accepted_run(tiny_dir):
    """With every draft accepted (4 per verify), max_tokens, a stop token id and a stop string that fall
    inside a verify's run end the request where plain decoding ends it, with the same text."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    base = SamplingParams(max_tokens=30, **GREEDY)
    want, _, col, rids = run(tiny_dir, PROMPTS[:1], base)
    full, text = want[0], col.text(rids[0])
    oracle = Oracle({tuple(PROMPTS[0]): full})
    stop_str = next(text[i:i + 2] for i in range(5, len(text)) if text[i:i + 2].strip() and
                    text.find(text[i:i + 2]) == i)
    cases = [SamplingParams(max_tokens=7, **GREEDY), SamplingParams(max_tokens=30, stop_token_ids=[full[8]], **GREEDY),
             SamplingParams(max_tokens=30, stop=[stop_str], **GREEDY)]
    for sp in cases:
        a, _, ca, ra = run(tiny_dir, PROMPTS[:1], sp)
        b, eng, cb, rb = run(tiny_dir, PROMPTS[:1], sp, spec, oracle)
        assert a == b and ca.text(ra[0]) == cb.text(rb[0])
        steps = [e.new_token_ids for e in cb.events[rb[0]] if e.new_token_ids]
        assert max(map(len, steps)) > 1 and sum(steps, []) == b[0]  # one event per step, a verify's tokens in it
        assert cb.last(rb[0]).completion_tokens == len(b[0])
        assert (ca.last(ra[0]).finish_reason, ca.last(ra[0]).stop_reason) == \
               (cb.last(rb[0]).finish_reason, cb.last(rb[0]).stop_reason)
        assert eng.stats().spec_decode_num_accepted_tokens > 0
        assert_idle(eng)
    assert len(a[0]) < 30


def test_verified_text_comes_after_the_next_launch(tiny_dir):
    """In a synchronous (speculative) step the collected tokens are appended before the next step is
    scheduled and launched, but detokenized (text, stop strings, the event) after that launch: at the
    launches after verifies the detokenizer has seen fewer tokens than were committed; the text is plain's."""
    want, _, cp, rp = run(tiny_dir, PROMPTS[:1], SamplingParams(max_tokens=20, **GREEDY))
    eng, col = make(tiny_dir, speculative_config=SPEC)
    eng.drafter = Oracle({tuple(PROMPTS[0]): want[0]})
    rid = eng.submit(PROMPTS[0], SamplingParams(max_tokens=20, **GREEDY), col)
    eng._drain(False)
    req = eng._requests[rid]
    seen, add = [], req.detokenizer.add
    req.detokenizer.add = lambda t: seen.append(t) or add(t)
    at_launch, real = [], eng.runner.forward
    eng.runner.forward = lambda batch, prev, plan=None: at_launch.append((len(req.output_ids), len(seen))) or real(
        batch, prev, plan)
    drive(eng, col, [rid])
    assert col.tokens(rid) == want[0] and col.text(rid) == cp.text(rp[0])
    behind = [(n, d) for n, d in at_launch if d < n]
    assert len(behind) >= 3 and all(n - d <= 1 + SPEC["num_speculative_tokens"] for n, d in behind)


def test_abort_mid_verify_leaks_nothing(target):
    p, sp = prompt(8, 20), SamplingParams(max_tokens=40, **GREEDY)
    want, _, _, _ = run(target, [p], sp)
    eng, col = make(target, max_num_seqs=2, max_num_batched_tokens=64, speculative_config=SPEC)
    drive(eng, col, [eng.submit(p, SamplingParams(max_tokens=8, **GREEDY), col)])  # what is made lazily, made
    eng.step()
    init = eng.stats().device_memory_used
    eng.drafter = Oracle({tuple(p): want[0]}, 1)
    rid = eng.submit(p, sp, col)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None and eng._inflight.verify is not None  # a verify's sampling in flight
    eng.abort(rid)
    eng.step()
    assert col.last(rid).finish_reason == "abort"
    eng.step()
    assert_idle(eng, init)
    # the slot serves the next request from zero state: its tokens are a fresh run's
    rid = eng.submit(p, sp, col)
    drive(eng, col, [rid])
    assert col.tokens(rid) == want[0] or target[1] == "cuda"


def test_non_finite_verify_row_ends_that_request_alone(tiny_dir):
    """A NaN in one speculating request's verify rows (greedy, then sampled with logprobs) ends it with an
    error; the others finish as they do without the fault; nothing leaks."""
    sp = [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=12, **GREEDY),
          SamplingParams(max_tokens=12, temperature=0.7, seed=1, logprobs=2, ignore_eos=True)]
    plain = {tuple(p): t for p, t in zip(PROMPTS, run(tiny_dir, PROMPTS[:3], sp)[0])}
    want, _, _, _ = run(tiny_dir, PROMPTS[:3], sp, SPEC, Oracle(plain))
    for bad in (0, 2):
        eng, col = make(tiny_dir, max_num_seqs=4, max_num_batched_tokens=64, speculative_config=SPEC)
        eng.drafter = Oracle(plain)
        rids = [eng.submit(p, s, col) for p, s in zip(PROMPTS[:3], sp)]

        def nan_in_verify(reqs, logits):
            for j, r in enumerate(reqs):
                if r.request_id == rids[bad] and r.drafts and len(r.output_ids) > 3:
                    logits[j, 5] = np.nan
            return logits
        eng.runner.logits_hook = nan_in_verify
        drive(eng, col, rids)
        eng.step()
        assert col.last(rids[bad]).finish_reason == "error" and "non-finite" in col.last(rids[bad]).error
        assert [col.tokens(r) for i, r in enumerate(rids) if i != bad] == [w for i, w in enumerate(want) if i != bad]
        assert eng.stats().spec_decode_num_accepted_tokens > 0
        assert_idle(eng)


def test_server_streams_verified_tokens_and_counts_them(tiny_dir):
    """Through the HTTP server: a speculating request's completion, whole and streamed (one chunk per
    step, a verify's several tokens in one), is the plain greedy text, and /metrics counts the drafts."""
    import json

    from starlette.testclient import TestClient

    from server.app import ServerContext, build_app
    want, _, col, rids = run(tiny_dir, PROMPTS[:1], SamplingParams(max_tokens=10, **GREEDY))
    eng, _ = make(tiny_dir, max_num_seqs=2, speculative_config=SPEC)
    eng.drafter = Oracle({tuple(PROMPTS[0]): want[0]})
    eng._thread.start()
    req = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    try:
        with TestClient(build_app(ServerContext(eng, "tiny", "tiny"))) as c:
            r = c.post("/v1/completions", json=req)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == col.text(rids[0])
            assert r.json()["usage"]["completion_tokens"] == 10
            assert r.json()["usage"]["spec_decode"] == {"draft_tokens": 6, "accepted_tokens": 6,  # 1 + 4 + 4 + 1
                                                        "choices_without_speculation": 0}
            with c.stream("POST", "/v1/completions", json=dict(req, stream=True)) as s:
                chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == col.text(rids[0])
            assert len(chunks) == 4  # the prefill's token, then verifies emitting 2, 5 and 2 tokens
            text = c.get("/metrics").text
    finally:
        eng.shutdown()
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode")}
    assert counts["vllm:spec_decode_num_drafts_total"] > 0
    assert counts["vllm:spec_decode_num_draft_tokens_total"] >= counts["vllm:spec_decode_num_accepted_tokens_total"] > 0


def test_long_context_greedy_equals_plain(target):
    """A 4097-token prompt (chunked prefill, 257 KV blocks) beside a short one: greedy verifies of the long
    one with an accepted-prefix oracle give plain greedy's tokens; so does the n-gram drafter itself over a
    4097-token prompt that repeats (it drafts from the first copy); everything returns to idle. GPU: equal
    up to a flip within bf16 noise (two sequences: the verify's batch shape is not plain decoding's).
    Only the long prompt speculates: a verifying neighbour would take 1 + k tokens of each step's budget
    where a decode takes 1, so the long prompt's chunks (and their bf16 bits) would differ from the plain
    run's, and a flip at its first token leaves the oracle no draft to accept."""
    prompts = [prompt(41, 4097), prompt(42, 17)]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    kw = dict(max_model_len=4200, max_num_batched_tokens=1024)
    la, lb = {}, {}
    want, _, _, _ = run(target, prompts, sp, hook=_record(la), **kw)
    got, eng, _, _ = run(target, prompts, sp, SPEC, Oracle({tuple(prompts[0]): want[0]}, 2), hook=_record(lb), **kw)
    assert_equal_up_to_noise(target, prompts, want, got, la, lb)
    assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert_idle(eng)
    rep = prompt(43, 2048)
    prompts = [rep + rep + rep[:1]]
    la, lb = {}, {}
    want, _, _, _ = run(target, prompts, sp, hook=_record(la), **kw)
    got, eng, _, _ = run(target, prompts, sp, SPEC, hook=_record(lb), **kw)
    assert_equal_up_to_noise(target, prompts, want, got, la, lb)
    assert eng.stats().spec_decode_num_drafts > 0
    assert_idle(eng)
