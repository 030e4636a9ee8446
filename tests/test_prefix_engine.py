"""Prefix caching end to end (scheduler, engine, runner, both backends' copy_slots): a hit gives the
tokens and logits of the same request served cold by an engine with caching off; what requests hold
returns to idle after every test; nothing a failed or aborted step computed is ever published.
CPU: the tiny model on NumPy; marked gpu: the 4B checkpoint on the GPU (the `target` fixture).

What "the same logits" means here:
  - CPU: greedy tokens equal, and every sampled row's logits within CPU_TOL (max |dlogit|). The NumPy
    reference is itself reproducible only to ~3e-5 on this model (the same cold prompt chunked at 96
    or 2048 tokens, logits of magnitude ~10: its matmuls sum in an order that depends on M).
  - GPU, batch-invariant: logits bit-equal.
  - GPU, default: bf16 logits move in their last bits with the batch shape (tests/test_engine.py), so
    on the random 4B checkpoint a greedy token may flip: tokens equal up to the first flip, and every
    row compared up to it within bf16 noise (mean |dlogit| <= GPU_NOISE, as tests/test_engine.py).
"""
import gc

import numpy as np
import pytest

from engine.engine import Engine
from engine.request import Request
from engine.sampling_params import SamplingParams
from test_spec_decode import Oracle

CPU_TOL = 5e-4
GPU_NOISE = 0.12


def ids(rng, n):
    return rng.integers(0, 200_000, n).tolist()


class Run:
    """A loop-less engine driven from the test: greedy requests, stepped until they finish. Keeps per
    request its events and the host logits of its sampled rows, and per step the (request id, start,
    new tokens) of its batch and the positions it saved snapshots at. `fail` ("forward" | "sampling")
    makes the next step fail there."""

    def __init__(self, target, **engine_args):
        model, self.device = target
        if self.device == "cuda":
            engine_args.setdefault("kv_cache_memory", 4 << 30)  # several engines live at once
        for k, v in dict(max_num_seqs=4, max_num_batched_tokens=128).items():
            engine_args.setdefault(k, v)
        self.eng = Engine(model, start=False, device=self.device, **engine_args)
        self.events, self.logits, self.prompt_len, self.steps, self.saves, self.fail = {}, {}, {}, [], [], None
        real = self.eng.runner.forward

        def forward(batch, prev, plan=None):
            if self.fail == "forward":
                self.fail = None
                raise RuntimeError("injected forward failure")
            self.steps.append([(r.request_id, r.num_computed, n) for r, n in batch])
            self.saves.append([pos for _, _, pos in plan.save] if plan is not None else [])
            return real(batch, prev, plan)
        self.eng.runner.forward = forward
        self.eng.runner.logits_hook = self._hook
        self.generate([1, 2, 3])  # a first request: whatever the backend makes lazily is made before a test

    def _hook(self, reqs, logits):
        if self.fail == "sampling":
            self.fail = None
            raise RuntimeError("injected sampling failure")
        for i, r in enumerate(reqs):
            self.logits.setdefault(r.request_id, []).append(np.array(logits[i]))
        return logits

    def submit(self, prompt, max_tokens=6) -> str:
        rid = self.eng.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              lambda out: self.events.setdefault(out.request_id, []).append(out))
        self.prompt_len[rid] = len(prompt)
        return rid

    def done(self, rid) -> bool:
        return rid in self.events and self.events[rid][-1].finished

    def wait(self, *rids, max_steps=5000):
        for _ in range(max_steps):
            if all(self.done(r) for r in rids):
                self.eng.step()  # collects the step launched after the last token (its arrays are freed)
                return
            self.eng.step()
        raise AssertionError("requests did not finish")

    def generate(self, prompt, max_tokens=6) -> str:
        return self.generate_all([prompt], max_tokens)[0]

    def generate_all(self, prompts, max_tokens=6) -> list[str]:
        rids = [self.submit(p, max_tokens) for p in prompts]
        self.wait(*rids)
        return rids

    def tokens(self, rid):
        return [t for e in self.events[rid] for t in e.new_token_ids]

    def last(self, rid):
        return self.events[rid][-1]

    def cached(self, rid):
        return self.last(rid).cached_tokens

    def chunks(self, rid):
        """(start, tokens) of each prompt chunk the request ran in."""
        return [(start, n) for step in self.steps for r, start, n in step if r == rid and start < self.prompt_len[rid]]

    def assert_idle(self, memory=None):
        """Nothing held (cached-but-free blocks and snapshots count as free); on the GPU the device memory
        of live arrays back to `memory`."""
        s = self.eng.stats()
        assert (s.running, s.waiting, s.kv_blocks_used, s.state_snapshots_used) == (0, 0, 0, 0)
        assert s.kv_blocks_free == s.kv_blocks_total and s.state_slots_free == s.state_slots_total
        if self.eng.prefix is not None:
            assert self.eng.prefix.num_tracked == 0
        if memory is not None:
            assert s.device_memory_used == memory[id(self)]


def probe(prompt) -> Request:
    """A request to ask PrefixCache.match about (never submitted)."""
    return Request("probe", list(prompt), SamplingParams(max_tokens=1), 1, frozenset(), sink=None)


def memory_now(*runs) -> dict:
    """Each run's backend memory now (the NumPy backend counts its own arrays; on the GPU it is the
    process's pool, the same for every run)."""
    gc.collect()
    return {id(r): r.eng.runner.ops.memory_used() for r in runs}


def assert_same(cold: Run, crid, hit: Run, hrid, exact=False):
    """hit's request gives cold's tokens and logits (the module docstring says within what)."""
    ta, tb = cold.tokens(crid), hit.tokens(hrid)
    la, lb = cold.logits[crid], hit.logits[hrid]
    flip = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    noisy = cold.device == "cuda" and not exact
    assert flip is None or noisy, f"tokens differ at {flip}: {ta} vs {tb}"
    assert len(ta) == len(tb)
    for k in range(len(ta) if flip is None else flip + 1):
        d = np.abs(la[k] - lb[k])
        if cold.device == "cpu":
            assert d.max() <= CPU_TOL, (k, d.max())
        elif exact:
            assert np.array_equal(la[k], lb[k]), (k, d.max())
        else:
            assert d.mean() <= GPU_NOISE, (k, d.mean(), d.max())


@pytest.fixture(scope="module")
def engines(target):
    """A caching engine and a cold one (caching off), same settings: chunked prefill (128-token budget)."""
    return Run(target, enable_prefix_caching=True), Run(target)


@pytest.fixture
def pair(engines):
    """The engines, checked idle after the test (device memory as before it)."""
    mem = memory_now(*engines)
    yield engines
    for r in engines:
        r.assert_idle(mem)


@pytest.mark.parametrize("src,dst", [([1, 4], [5, 2]), ([3], [0])])
def test_copy_slots(target, src, dst):
    """copy_slots copies whole rows of every GDN layer's conv and recurrent state, and nothing else (several
    pairs, and one pair, which the GPU passes by value)."""
    from engine.config import ModelConfig
    from engine.ops import make_backend
    model_dir, device = target
    ops = make_backend(device)
    cache = ops.alloc_cache(ModelConfig.from_dir(model_dir), 6, 2, 16)
    rng = np.random.default_rng(0)
    before = []
    for a in cache.conv + cache.rec:
        x = rng.integers(0, 1 << 14, a.shape).astype(a.dtype)  # bf16 bits on the GPU, small floats on the CPU
        if device == "cpu":
            a[...] = x
        else:
            a.set(x)
        before.append(x)
    ops.copy_slots(cache, src, dst)
    for a, x in zip(cache.conv + cache.rec, before):
        want = x.copy()
        want[dst] = x[src]
        assert np.array_equal(np.asarray(a if device == "cpu" else a.get()), want)


# ---- hits equal cold ------------------------------------------------------------------------------
@pytest.mark.parametrize("hit", [64, 128, 1024, 4096])
def test_hit_equals_cold_resumed_into_a_chunked_prefill_beside_cold_ones(target, pair, hit):
    if hit == 4096 and target[1] == "cpu":
        pytest.skip("a cold 4096-token prefill alone takes ~15 s on the NumPy backend (its attention); the GPU "
                    "target runs it, and test_prefix_cache.py covers 4096 in the scheduler")
    warm, cold = pair
    rng = np.random.default_rng(hit)
    shared = ids(rng, hit)
    warm.generate(shared + ids(rng, 10))             # leaves a snapshot at its last 64-aligned boundary: `hit`
    decoder = warm.submit(ids(rng, 5), max_tokens=30)
    warm.eng.step()
    other = warm.submit(ids(rng, 20))                 # cold, admitted in the hit's step
    prompt = shared + ids(rng, 200)
    h = warm.submit(prompt)
    warm.wait(h, other, decoder)
    assert warm.cached(h) == hit and warm.cached(other) == 0
    chunks = warm.chunks(h)
    assert chunks[0][0] == hit and len(chunks) >= 2   # resumed at the hit, in more than one chunk
    first = next(s for s in warm.steps if (h, hit, chunks[0][1]) in s)
    assert {r for r, _, _ in first} == {h, other, decoder}
    c = cold.generate(prompt)
    assert cold.cached(c) is None                     # caching off: no usage field
    assert_same(cold, c, warm, h)


def test_divergence_inside_a_block_and_at_a_block_boundary(pair):
    warm, cold = pair
    rng = np.random.default_rng(1)
    x = ids(rng, 300)
    warm.generate(x[:128] + ids(rng, 5))              # a snapshot at 128
    assert warm.cached(warm.generate(x[:200])) == 128  # hits 128; KV of x[:192], a snapshot at 192
    for at, hit in [(133, 128),    # inside the block [128, 144): the KV match ends at 128
                    (144, 128),    # at a block boundary: KV to 144, the deepest snapshot at 128
                    (192, 192)]:   # at a chunk boundary
        prompt = x[:at] + ids(rng, 40)
        h, c = warm.generate(prompt), cold.generate(prompt)
        assert warm.cached(h) == hit, at
        assert_same(cold, c, warm, h)


def test_rolling_decode_snapshot_serves_the_next_turn(pair):
    """A decode that crosses a 64-aligned position saves the state there after the step (on the GPU after a
    CUDA-graph replay): the next turn, prompt + output + a new message, resumes there."""
    warm, cold = pair
    rng = np.random.default_rng(2)
    convo, hits = ids(rng, 100), []
    for turn in range(3):
        h = warm.generate(convo, max_tokens=40)
        c = cold.generate(convo, max_tokens=40)
        assert_same(cold, c, warm, h)
        hits.append(warm.cached(h))
        convo = convo + warm.tokens(h) + ids(rng, 30)
    decode_saves = [pos for step, saves in zip(warm.steps, warm.saves) if all(n == 1 for _, _, n in step)
                    for pos in saves]
    assert decode_saves, "no snapshot saved by a pure-decode step"
    assert hits == [0, 128, 192]   # computed 139, then 209 (prompt + output - 1): the rolling boundaries


# ---- what is never published ----------------------------------------------------------------------
def test_abort_during_a_prefill_that_would_have_published(pair):
    warm, cold = pair
    prompt = ids(np.random.default_rng(3), 300)
    snaps, kv = warm.eng.prefix.snaps.num_cached, warm.eng.kv.num_cached
    rid = warm.submit(prompt)
    while not warm.saves or not warm.saves[-1]:       # chunks of 128: the second one ends at 256, saved
        warm.eng.step()
    assert warm.saves[-1] == [256] and not warm.done(rid)
    warm.eng.abort(rid)
    warm.wait(rid)
    assert warm.last(rid).finish_reason == "abort"
    # its steps sampled nothing, so none was known complete before the abort: nothing of it is published
    assert (warm.eng.prefix.snaps.num_cached, warm.eng.kv.num_cached) == (snaps, kv)
    again = warm.generate(prompt)
    assert warm.cached(again) == 0
    assert_same(cold, cold.generate(prompt), warm, again)
    assert warm.cached(warm.generate(prompt)) == 256


@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_fault_in_a_step_holding_a_hit(pair, where):
    warm, cold = pair
    rng = np.random.default_rng(4 if where == "forward" else 5)
    shared = ids(rng, 200)
    warm.generate(shared + ids(rng, 10))              # a snapshot at 192
    victim, bystander = shared + ids(rng, 30), ids(rng, 20)
    a, b = warm.submit(victim), warm.submit(bystander)
    warm.fail = where
    warm.wait(a, b)
    for r in (a, b):
        assert warm.last(r).finish_reason == "error" and f"injected {where} failure" in warm.last(r).error
    warm.assert_idle()                                 # the hit's pin and the step's saves are released
    assert warm.eng.prefix.match(probe(victim)).tokens == 192  # the snapshot it restored from stays
    again = warm.generate(victim)
    assert warm.cached(again) == 192
    assert_same(cold, cold.generate(victim), warm, again)




# ---- pressure and admission -----------------------------------------------------------------------
def test_eviction_under_pressure_every_output_equals_cold(target, engines):
    """More distinct prefixes than the snapshot pool (3) and the spare KV blocks hold: LRU eviction of
    both, and every output is still the cold one."""
    warm = Run(target, enable_prefix_caching=True, num_state_snapshots=3, num_kv_blocks=61, max_num_seqs=3)
    cold = engines[1]
    mem = memory_now(warm)
    rng = np.random.default_rng(6)
    prefixes = [ids(rng, 128) for _ in range(5)]
    prompts, rids = [], []
    for rnd in range(3):
        batch = [prefixes[i] + ids(rng, int(rng.integers(5, 60))) for i in rng.permutation(5)]
        rids += warm.generate_all(batch, max_tokens=2)
        prompts += batch
        assert warm.eng.prefix.snaps.num_cached <= 3
    hits = [warm.cached(r) for r in rids]
    assert 0 < sum(h > 0 for h in hits) < len(hits)
    for c, r in zip(cold.generate_all(prompts, max_tokens=2), rids):
        assert_same(cold, c, warm, r)
    warm.assert_idle(mem)


def test_admission_never_over_commits_with_shared_prefixes(target, engines):
    """10 usable KV blocks, all cached-but-free after the first request. A request sharing 8 of them takes
    them out of the free count: the next one, needing those 8 (now held) and 2 more, waits."""
    warm = Run(target, enable_prefix_caching=True, num_kv_blocks=11, max_model_len=160)
    cold = engines[1]
    mem = memory_now(warm)
    rng = np.random.default_rng(7)
    p = ids(rng, 150)
    warm.generate(p, max_tokens=10)                    # 160 tokens: every block
    assert warm.eng.stats().kv_blocks_free == 10
    big, small = p[:128] + ids(rng, 30), p[:128] + ids(rng, 20)
    b = warm.submit(big, max_tokens=2)                 # 10 blocks, 8 of them shared
    s = warm.submit(small, max_tokens=1)               # 10 blocks, 8 shared: must wait for b
    warm.eng.step()
    st = warm.eng.stats()
    assert (st.running, st.waiting, st.kv_blocks_free) == (1, 1, 0)
    warm.wait(b, s)
    assert (warm.cached(b), warm.cached(s)) == (128, 128)
    steps_of = [{r for r, _, _ in step} for step in warm.steps]
    assert min(i for i, x in enumerate(steps_of) if s in x) > max(i for i, x in enumerate(steps_of) if b in x)
    assert warm.chunks(s) == [(128, 20)]
    for prompt, rid, n in ((big, b, 2), (small, s, 1)):
        assert_same(cold, cold.generate(prompt, max_tokens=n), warm, rid)
    hog = warm.generate(ids(rng, 150), max_tokens=10)  # needs every block: evicts the cached ones
    assert warm.last(hog).finish_reason == "length" and warm.eng.prefix.match(probe(p)).tokens == 0
    warm.assert_idle(mem)


def test_batch_invariant_hit_is_bit_exact(target):
    """batch_invariant: a hit resumes at a 64-aligned boundary, so its prefill is cut where a cold one is:
    on the GPU the logits are bit-equal to the cold request's (cache off, alone); on the CPU the tokens."""
    kw = dict(batch_invariant=True, max_num_batched_tokens=4 + 2 * 64)
    warm, cold = Run(target, enable_prefix_caching=True, **kw), Run(target, **kw)
    mem = memory_now(warm, cold)
    rng = np.random.default_rng(8)
    shared = ids(rng, 128)
    warm.generate(shared + ids(rng, 10))               # min_tail 2: its last boundary is 128
    decoder = warm.submit(ids(rng, 5), max_tokens=20)
    warm.eng.step()
    prompt = shared + ids(rng, 150)
    h = warm.submit(prompt)
    warm.wait(h, decoder)
    assert warm.cached(h) == 128 and all(start % 64 == 0 for start, _ in warm.chunks(h))
    assert_same(cold, cold.generate(prompt), warm, h, exact=True)
    for r in (warm, cold):
        r.assert_idle(mem)


# ---- flags, memory plan, an empty pool ------------------------------------------------------------
def test_flags_and_memory_plan(engines):
    import argparse

    from server.cli import _add_engine_args, engine_kwargs
    from engine.config import EngineArgs
    from engine.memory import plan_cache
    ap = argparse.ArgumentParser()
    _add_engine_args(ap)
    kw = engine_kwargs(ap.parse_args(["--enable-prefix-caching", "--num-state-snapshots", "3"]))
    assert (kw["enable_prefix_caching"], kw["num_state_snapshots"]) == (True, 3)
    assert engine_kwargs(ap.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in engine_kwargs(ap.parse_args([]))

    warm, cold = engines
    eng = warm.eng
    rows = eng.runner.cache.rec[0].shape[0]
    assert rows == eng.slots.num_slots + eng.stats().state_snapshots_total and cold.eng.prefix is None
    model, gib = eng.runner.model, 1 << 30

    def plan(**a):
        return plan_cache(model, EngineArgs(max_num_seqs=2, kv_cache_memory=gib, **a), 1024)
    off, on = plan(num_state_snapshots=3), plan(enable_prefix_caching=True)
    assert off.num_snapshots == 0 and on.num_snapshots == 8            # 4 per sequence by default
    assert off.num_blocks == 2 * 64 + 1                                 # what 2 sequences of 1024 can use
    assert on.num_blocks == (gib - (3 + 8) * on.slot_bytes) // on.block_bytes  # caching: the rest is KV
    assert plan(enable_prefix_caching=True, num_state_snapshots=5).num_snapshots == 5
    assert "8 state snapshots" in on.describe("numpy", 0, EngineArgs(enable_prefix_caching=True))
    with pytest.raises(ValueError, match="num_state_snapshots"):
        plan(enable_prefix_caching=True, num_state_snapshots=-1)


def test_an_empty_snapshot_pool_serves_cold(target, engines):
    empty, cold = Run(target, enable_prefix_caching=True, num_state_snapshots=0), engines[1]
    mem = memory_now(empty)
    prompt = ids(np.random.default_rng(9), 200)
    first, second = empty.generate_all([prompt, prompt])
    assert (empty.cached(first), empty.cached(second), empty.eng.stats().state_snapshots_total) == (0, 0, 0)
    assert_same(cold, cold.generate(prompt), empty, second)
    empty.assert_idle(mem)


# ---- with speculative decoding (the n-gram method's engine; a test drafter) ------------------------------
def test_speculation_with_prefix_caching(tiny_dir):
    """Prefix caching beside speculative decoding: over three turns of a conversation the speculating,
    caching engine gives the cold engine's greedy tokens, hits the rolling decode snapshots at the same
    positions, and never saves a state inside or at the end of a verify (a save at its end would keep the
    state after drafts that may be rejected: PrefixCache.max_drafts stops the verify short of it). The
    MTP and DFlash drafters stay exclusive with prefix caching (their own KV at a cached position was
    written for another request's continuation)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    target = (tiny_dir, "cpu")
    warm, cold = Run(target, enable_prefix_caching=True, speculative_config=spec), Run(target)
    drafter = warm.eng.drafter = Oracle({}, right=2)  # the cold run's tokens, recorded per turn below
    n0, d0 = len(warm.steps), warm.eng.stats().spec_decode_num_drafts
    rng = np.random.default_rng(2)
    convo, hits = ids(rng, 100), []
    for turn in range(3):
        c = cold.generate(convo, max_tokens=40)
        drafter.plain[tuple(convo)] = cold.tokens(c)
        h = warm.generate(convo, max_tokens=40)
        assert warm.tokens(h) == cold.tokens(c)
        hits.append(warm.cached(h))
        convo = convo + warm.tokens(h) + ids(rng, 30)
    assert hits == [0, 128, 192]  # as without speculation (test_rolling_decode_snapshot_serves_the_next_turn)
    s = warm.eng.stats()
    assert s.spec_decode_num_accepted_tokens > 0
    verifies = 0
    for step, saves in zip(warm.steps[n0:], warm.saves[n0:]):
        for rid, start, n in step:
            if n > 1 and start >= warm.prompt_len[rid]:  # a verify
                verifies += 1
                assert not [p for p in saves if start < p <= start + n], (rid, start, n, saves)
    assert verifies == s.spec_decode_num_drafts - d0 > 0
    warm.assert_idle()
    for spec in ({"method": "mtp", "num_speculative_tokens": 2},
                 {"method": "dflash", "num_speculative_tokens": 2, "model": "x"}):
        with pytest.raises(ValueError, match="prefix caching works with the ngram drafter only"):
            Engine(tiny_dir, start=False, device="cpu", enable_prefix_caching=True, speculative_config=spec)
