"""Prefix caching: hashed KV blocks, the GDN snapshot pool, prefix matching and its scheduling.
Pure Python: `Device` stands in for the runner and the model, and checks the transactional
invariant at every step (a slot holds the state of exactly the tokens before num_computed, every KV
row below it holds its own token's prefix, no shared or published block is written)."""
import random

import pytest

from engine.kv_blocks import DUMMY_BLOCK, KVBlockManager, chain_hashes
from engine.prefix_cache import PrefixCache
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.state_slots import StateSlotPool
from engine.state_snapshots import SnapshotPool, default_num_snapshots

BS = 16


def req(rid, prompt, max_tokens=4):
    return Request(str(rid), list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(),
                   sink=lambda out: None)


def sched(blocks=1024, slots=5, snaps=8, max_len=8192, seqs=4, budget=8192, align=1, min_tail=1):
    kv, sp = KVBlockManager(blocks, BS), StateSlotPool(slots)
    pc = PrefixCache(kv, SnapshotPool(slots, snaps), chunk=64, min_tail=min_tail)
    return Scheduler(kv, sp, max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=budget,
                     max_waiting_requests=64, chunk_align=align, prefix=pc)


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


class Device:
    """The runner and model of the fake: a slot's (or snapshot's) state is (n, hash of tokens [0, n)); the
    KV row of position i is the hash of tokens [0, i]. lag: steps between a step and its commit."""

    def __init__(self, s: Scheduler, lag: int = 0):
        self.s, self.lag, self.state, self.kv, self.plans = s, lag, {}, {}, []
        self.first_chunks = []  # (request id, start, take) of each request's first chunk

    @staticmethod
    def prefix_hashes(ids):
        out, h = [0], 0
        for t in ids:
            h = hash((h, t))
            out.append(h)
        return out

    def step(self):
        s, kvm = self.s, self.s.kv
        batch = s.schedule()
        plan = s.plan
        for snap, slot in plan.restore:
            self.state[slot] = self.state[snap]
        for r, n in batch:
            start = r.num_computed
            if start == r.cached_tokens:
                self.first_chunks.append((r.request_id, start, n))
                if start == 0:
                    self.state[r.slot] = (0, 0)  # a fresh slot is zeroed
            ph = self.prefix_hashes(r.token_ids(0, start + n))
            assert self.state[r.slot] == (start, ph[start]), f"{r.request_id}: slot state is not its prefix"
            for i in range(start):
                assert self.kv[r.block_ids[i // BS], i % BS] == ph[i + 1], f"{r.request_id}: stale KV at {i}"
            for i in range(start, start + n):
                b = r.block_ids[i // BS]
                assert b != DUMMY_BLOCK and kvm.ref_count(b) == 1 and kvm.hash_of(b) is None, "wrote a shared block"
                self.kv[b, i % BS] = ph[i + 1]
            self.state[r.slot] = (start + n, ph[start + n])
        for slot, snap, pos in plan.save:  # at the chunk's end, or inside it (Step.save_at)
            (r, n), = [(r, n) for r, n in batch if r.slot == slot]
            assert r.num_computed < pos <= r.num_computed + n
            self.state[snap] = (pos, self.prefix_hashes(r.token_ids(0, pos))[pos])
        self.plans.append(plan)
        for r, n in batch:
            s.advance(r, n)
        while len(self.plans) > self.lag:
            s.prefix.commit(self.plans.pop(0))
        for r, n in batch:  # sample: a token that depends on the sequence
            if r.status is Status.RUNNING and r.num_computed == r.num_tokens:
                r.output_ids.append(1 + self.state[r.slot][1] % 997)
                if len(r.output_ids) >= r.max_tokens:
                    s.finish(r)
        return batch

    def run(self, *reqs, max_steps=10_000):
        for r in reqs:
            self.s.add(r)
        for _ in range(max_steps):
            if not self.s.running and not self.s.waiting:
                break
            self.step()
        while self.plans:
            self.s.prefix.commit(self.plans.pop(0))
        assert all(r.status is Status.FINISHED for r in reqs)
        return reqs


def assert_idle(s: Scheduler):
    """Nothing held: cached-but-free blocks and snapshots count as free."""
    assert not s.running and not s.waiting
    assert s.kv.num_free == s.kv.capacity and s.kv.num_used == 0
    assert s.slots.num_free == s.slots.capacity
    snaps = s.prefix.snaps
    assert snaps.num_free == snaps.capacity and snaps.num_used == 0
    assert s.prefix.num_tracked == 0


# ---- the pieces ----------------------------------------------------------------------------------
def test_chain_hashes_name_the_whole_prefix():
    a = toks(100, 0)
    h = chain_hashes(a, BS)
    assert len(h) == 6 and all(len(x) == 16 for x in h)          # the partial last block is never hashed
    assert chain_hashes(a[:64], BS) == h[:4]                      # a prefix's hashes are a prefix
    b = a.copy()
    b[3] += 1
    hb = chain_hashes(b, BS)
    assert all(x != y for x, y in zip(h, hb))                     # one token changes every later block
    c = a[16:32] + a[16:32]
    assert chain_hashes(c, BS)[0] != chain_hashes(c, BS)[1]       # same tokens, other position: other hash
    # the same in every process (not Python's randomized hash)
    assert chain_hashes(list(range(16)), BS)[0].hex() == chain_hashes(list(range(16)), BS)[0].hex()


def test_no_cache_path_hands_out_blocks_as_before():
    """Without published blocks the manager is the old free list: same ids, same order."""
    class Old:
        def __init__(self, n):
            self.free = list(range(n - 1, 0, -1))

        def allocate(self, k):
            return [self.free.pop() for _ in range(k)]

        def release(self, blocks):
            self.free.extend(reversed(blocks))

    new, old = KVBlockManager(40, BS), Old(40)
    rng, held = random.Random(1), []
    for _ in range(200):
        if held and rng.random() < 0.45:
            x = held.pop(rng.randrange(len(held)))
            new.free(x)
            old.release(x)
        else:
            k = rng.randrange(1, 6)
            if k <= new.num_free:
                x = new.allocate(k)
                assert x == old.allocate(k)
                held.append(x)
        assert new.num_free == len(old.free) and new.num_used == new.capacity - new.num_free


def test_kv_blocks_share_keep_cached_and_evict_lru():
    kv = KVBlockManager(9, BS)  # 8 usable
    a = kv.allocate(4)
    hs = chain_hashes(toks(64, 0), BS)
    for b, h in zip(a, hs):
        assert kv.publish(b, h)
    assert kv.lookup(hs) == a and kv.lookup(hs[:2]) == a[:2] and kv.lookup([b"x"] + hs) == []
    x = kv.allocate(1)
    assert not kv.publish(x[0], hs[0])                # the hash is taken: x stays private
    kv.free(x)
    kv.free(a)                                        # refcount 0: still findable, counted free
    assert kv.num_free == 8 and kv.num_used == 0 and kv.num_cached == 4 and kv.lookup(hs) == a
    assert kv.num_idle(a[:3]) == 3
    kv.share(a[:2])                                   # revived: no longer free
    assert kv.num_free == 6 and kv.num_idle(a[:3]) == 1 and kv.ref_count(a[0]) == 1
    got = kv.allocate(5)                              # 4 plain free, then the oldest cached: the chain's tail
    assert a[3] in got and a[2] not in got and kv.lookup(hs) == a[:3]
    kv.free(got)
    kv.free(a[:2])
    assert kv.num_free == 8 and kv.num_cached == 3
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.allocate(9)
    with pytest.raises(AssertionError, match="twice"):
        kv.free(a[:1])


def test_snapshot_pool_ids_pins_lru():
    p = SnapshotPool(first_id=5, count=3)
    assert list(p.ids) == [5, 6, 7] and p.num_free == 3
    ids = [p.reserve() for _ in range(3)]
    assert sorted(ids) == [5, 6, 7] and p.reserve() is None and p.num_used == 3
    assert p.lookup(b"a") is None                     # reserved: invisible
    for sid, k in zip(ids, (b"a", b"b", b"c")):
        assert p.publish(sid, k)
    assert p.num_free == 3 and p.num_used == 0 and p.lookup(b"b") == ids[1]
    p.pin(ids[0])                                     # a: pinned, never evicted
    p.pin(ids[0])
    p.unpin(ids[0])
    r = p.reserve()                                   # evicts the LRU unpinned: b
    assert r == ids[1] and p.lookup(b"b") is None and p.lookup(b"a") == ids[0]
    assert not p.publish(r, b"c")                     # c is already there: r is freed
    p.demote(ids[2], b"c")
    assert p.reserve() == ids[1] and p.reserve() == ids[2] and p.reserve() is None  # free first, then demoted c
    p.discard(ids[1])
    p.discard(ids[2])
    p.unpin(ids[0])
    assert p.num_free == 3 and p.num_used == 0 and p.num_cached == 1
    with pytest.raises(ValueError):
        SnapshotPool(0, 4)                            # id 0 is the dummy slot


def test_default_pool_size():
    mib = 1 << 20
    assert default_num_snapshots(32, 49 * mib, 100 << 30) == 128
    assert default_num_snapshots(32, 147 * mib, 10 << 30) == 34      # half of what is left
    assert default_num_snapshots(32, 49 * mib, 0) == 0


# ---- hits ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hit", [64, 128, 1024, 4096])
def test_hit_at_boundary_resumes_into_chunked_prefill(hit):
    s = sched(budget=128)
    d = Device(s)
    base = toks(hit, hit)
    (a,) = d.run(req("a", base + toks(10, 1)))     # last prompt boundary: floor64(hit + 9) = hit
    assert a.cached_tokens == 0
    b = req("b", base + toks(300, 2))
    d.run(b)
    assert b.cached_tokens == hit and s.prefix.hits == hit and s.prefix.queries == hit + 10 + hit + 300
    assert d.first_chunks[-1] == ("b", hit, 128)   # resumed at the hit, chunked by the budget
    cold = sched(budget=128)
    (c,) = Device(cold).run(req("cold", base + toks(300, 2)))
    assert c.cached_tokens == 0 and c.output_ids == b.output_ids   # the tokens follow the state
    assert_idle(s)


def test_hit_equals_cold_and_no_hit_below_one_chunk():
    s = sched()
    d = Device(s)
    p = toks(200, 3)
    a, b = d.run(req("a", p)), d.run(req("b", p))
    assert b[0].cached_tokens == 192 and a[0].output_ids == b[0].output_ids   # the same tokens as cold
    (c,) = d.run(req("c", toks(63, 4)))
    (c2,) = d.run(req("c2", c.prompt_ids))
    assert c2.cached_tokens == 0                   # under one GDN chunk: nothing to resume
    (e,) = d.run(req("e", p[:64]))                 # a hit keeps at least one prompt token to compute
    assert e.cached_tokens == 0
    (f,) = d.run(req("f", p[:65]))
    assert f.cached_tokens == 64
    assert_idle(s)


def test_divergence_inside_a_block_and_at_a_block_boundary():
    s = sched()
    d = Device(s)
    x = toks(200, 5)
    d.run(req("seed1", x[:128] + toks(5, 6)))     # a snapshot at 128
    (seed2,) = d.run(req("seed2", x))              # hits 128; KV of all of x, a snapshot at 192
    assert seed2.cached_tokens == 128
    cases = [("inside", 133, 128, 128),   # diverges inside block [128, 144): KV matches to 128
             ("block", 144, 144, 128),    # at a block boundary, not a chunk one: KV to 144, the state at 128
             ("block2", 160, 160, 128),
             ("chunk", 192, 192, 192)]    # at a chunk boundary
    for rid, at, kv_tokens, hit in cases:
        r = req(rid, x[:at] + toks(50, at))
        m = s.prefix.match(r)
        d.run(r)
        assert (m.kv_tokens, r.cached_tokens) == (kv_tokens, hit), rid
    assert_idle(s)


def test_branch_points():
    s = sched()
    d = Device(s)
    sys_prompt = toks(1024, 10)
    d.run(req("z", sys_prompt[:512] + toks(30, 11)))           # a snapshot at 512
    (a,) = d.run(req("a", sys_prompt + toks(100, 12)))        # hits 512; saves its last boundary, 1088
    assert a.cached_tokens == 512
    b = req("b", sys_prompt + toks(100, 13))
    m = s.prefix.match(b)
    assert (m.tokens, m.kv_tokens) == (512, 1024)              # KV deeper than the snapshot: a branch point
    d.run(b)
    # the branch point 1024 saved inside the chunk, which ends at the second save, its last boundary 1088
    assert b.cached_tokens == 512 and ("b", 512, 576) in d.first_chunks
    (c,) = d.run(req("c", sys_prompt + toks(100, 14)))
    assert c.cached_tokens == 1024
    (e,) = d.run(req("e", sys_prompt + toks(100, 13)[:40] + toks(30, 15)))  # branches off b at 1064
    assert e.cached_tokens == 1024
    assert s.prefix.match(req("f", sys_prompt + toks(100, 13)[:40] + toks(30, 15))).tokens == 1088
    assert_idle(s)


def test_short_prompts_sharing_a_64_token_prefix_hit():
    """vLLM's align mode never hits below 528 tokens; here the third request on hits."""
    s = sched(blocks=400, snaps=4)
    d = Device(s)
    rng, head = random.Random(20), toks(64, 21)
    reqs = [req(i, head + toks(rng.randrange(36, 437), 100 + i)) for i in range(12)]
    for r in reqs:
        d.run(r)
    assert [r.cached_tokens for r in reqs] == [0, 0] + [64] * 10
    concurrent = [req(f"c{i}", head + toks(rng.randrange(36, 437), 200 + i)) for i in range(4)]
    d.run(*concurrent)
    assert all(r.cached_tokens == 64 for r in concurrent)
    assert_idle(s)


def test_multi_turn_resumes_at_prompt_plus_output():
    s = sched()
    d = Device(s)
    convo, hits = toks(100, 30), []
    for turn in range(5):
        (r,) = d.run(req(f"t{turn}", convo, max_tokens=80))
        hits.append(r.cached_tokens)
        computed = len(convo) + 79                 # the last sampled token is never fed
        assert s.prefix.match(req("q", convo + r.output_ids + [7] * 10)).tokens == computed // 64 * 64
        convo = convo + r.output_ids + toks(50, 40 + turn)   # the template re-renders the output as generated
    assert hits == [0, 128, 256, 384, 512]
    assert_idle(s)


def test_identical_prompts_at_once_save_once():
    s = sched()
    d = Device(s)
    p = toks(150, 50)
    d.run(req("a", p), req("b", p))                # both cold, both save 128; the second publish is a duplicate
    assert s.prefix.snaps.num_cached == 1
    (c,) = d.run(req("c", p))
    assert c.cached_tokens == 128
    assert_idle(s)


# ---- scheduling ------------------------------------------------------------------------------------
def test_saves_inside_a_chunk_do_not_cut_it():
    s = sched()
    d = Device(s)
    (a,) = d.run(req("a", toks(300, 59)))
    assert [n for rid, _, n in d.first_chunks if rid == "a"] == [300]   # its boundary 256 saved inside the chunk
    assert s.prefix.match(req("q", toks(300, 59))).tokens == 256
    assert_idle(s)


def test_a_second_boundary_in_a_chunk_cuts_it():
    s = sched()
    d = Device(s)
    d.run(req("a", toks(1024, 60) + toks(100, 61)))
    b = req("b", toks(1024, 60) + toks(200, 62))  # KV cached to 1024, no snapshot there: cold
    s.add(b)
    assert s.schedule() == [(b, 1216)]             # the branch point 1024 inside, its last boundary at the end
    assert [p for _, _, p in s.plan.save] == [1024, 1216] and not s.plan.restore
    s.advance(b, 1216)
    s.prefix.commit(s.plan)
    assert s.schedule() == [(b, 8)] and not s.plan.save
    s.finish(b)
    assert_idle(s)


def prompt_chunks(s: Scheduler, r: Request) -> list[int]:
    """Adds r alone and steps it (each step committed at once) until its prompt is computed: the chunk sizes."""
    s.add(r)
    takes = []
    while r.num_computed < len(r.prompt_ids):
        takes.append(s.schedule()[0][1])
        s.advance(r, takes[-1])
        s.prefix.commit(s.plan)
    return takes


def test_a_boundary_off_the_chunk_grid_cuts_the_chunk():
    """A chunk the budget started mid-chunk (at 100): the kernels have no state at 256 - 100 tokens, so the
    chunk ends at 256."""
    s = sched(budget=100)
    d = Device(s)
    (a,) = d.run(req("a", toks(300, 63)))
    assert [n for rid, _, n in d.first_chunks if rid == "a"] == [100]
    assert s.prefix.match(req("q", toks(300, 63))).tokens == 256
    b = req("b", toks(300, 64))
    assert prompt_chunks(s, b) == [100, 100, 56, 44]
    s.finish(b)
    assert_idle(s)


def test_a_large_budget_cut_ends_on_the_chunk_grid_so_the_next_boundary_is_saved_inside():
    """A budget of 1000 cuts a 1100-token prompt: at 960 (the chunk grid), not at 1000, so the chunk after
    it starts on the grid and the prompt's boundary 1088 is saved inside it: two steps, as with the cache
    off. (Unaligned, the second chunk would start at 1000 and end early at 1088: three.)"""
    s = sched(budget=1000)
    a = req("a", toks(1100, 65))
    assert prompt_chunks(s, a) == [960, 140]
    assert s.prefix.match(req("q", toks(1100, 65))).tokens == 1088
    a.output_ids.append(1)
    s.finish(a)
    assert_idle(s)


def test_batch_invariant_never_leaves_a_one_token_chunk():
    s = sched(align=64, min_tail=2, budget=4 + 128)
    d = Device(s)
    (a,) = d.run(req("a", toks(129, 70)))
    assert [n for rid, _, n in d.first_chunks if rid == "a"] == [129]   # boundary 64 (128 would leave 1 token)
    (b,) = d.run(req("b", toks(129, 70)))
    assert b.cached_tokens == 64 and ("b", 64, 65) in d.first_chunks
    (c,) = d.run(req("c", toks(130, 71)))
    (e,) = d.run(req("e", toks(130, 71)))
    assert e.cached_tokens == 128                   # 2 tokens left: fine
    assert_idle(s)


def test_pool_full_serves_cold_without_cutting():
    s = sched(snaps=1)
    d = Device(s)
    p = toks(300, 80)
    d.run(req("a", p))                              # the one snapshot: 256
    b = req("b", p[:256] + toks(200, 81))          # hits 256, pinned; its own boundary (448) finds no id
    s.add(b)
    assert s.schedule() == [(b, 200)] and s.plan.restore and not s.plan.save   # no cut, no save
    assert s.prefix.snaps.reserve() is None         # the pinned snapshot is not evicted
    s.finish(b)
    s0 = sched(snaps=0)                             # no pool: always cold, always correct
    d0 = Device(s0)
    d0.run(req("a", p))
    (c,) = d0.run(req("c", p))
    assert c.cached_tokens == 0 and s0.prefix.queries == 600 and s0.prefix.hits == 0
    assert_idle(s)
    assert_idle(s0)


def test_eviction_under_pressure_stays_correct():
    """More distinct prefixes than the snapshot pool (3) and the KV pool (60 blocks) hold: LRU eviction
    everywhere, and Device checks every restored state and every KV row still read."""
    s = sched(blocks=61, snaps=3, seqs=3, budget=100)
    d = Device(s)
    prefixes = [toks(128, 90 + i) for i in range(6)]
    rng, done = random.Random(91), []
    for rnd in range(6):
        batch = [req(f"{rnd}.{i}", prefixes[i] + toks(rng.randrange(5, 60), 1000 * rnd + i), max_tokens=4)
                 for i in rng.sample(range(6), 6)]
        done += d.run(*batch)
        assert s.prefix.snaps.num_cached <= 3
    assert 0 < sum(r.cached_tokens > 0 for r in done) < len(done)
    assert_idle(s)


# ---- what is never published -----------------------------------------------------------------------
def test_abort_during_a_prefill_that_would_have_published():
    s = sched(budget=64)
    d = Device(s, lag=1)                           # the engine commits a step one step later
    p = toks(300, 100)
    a = req("a", p)
    s.add(a)
    while not s.plan or not s.plan.save:
        d.step()
    assert s.plan.save[0][2] == 256 and a.num_computed == 256
    s.finish(a)                                     # aborted before the step that computed 256 committed
    while d.plans:                                  # its step completes later: nothing of a is published
        s.prefix.commit(d.plans.pop(0))
    assert s.prefix.snaps.num_cached == 0 and s.prefix.snaps.num_used == 0
    assert s.kv.num_cached == 192 // BS             # only the committed steps' blocks
    b = req("b", p)
    assert s.prefix.match(b).tokens == 0
    d.run(b)
    assert b.cached_tokens == 0 and s.prefix.match(req("c", p)).tokens == 256
    assert_idle(s)


def test_failed_step_publishes_nothing_and_frees_its_hit():
    s = sched()
    d = Device(s)
    p = toks(300, 110)
    d.run(req("a", p))
    b = req("b", p[:256] + toks(300, 111))         # a hit at 256, a save planned at 512
    s.add(b)
    s.schedule()
    plan = s.plan
    assert plan.restore and [q for _, _, q in plan.save] == [512]
    s.prefix.abandon(plan)                          # the step failed: the engine ends its requests
    s.finish(b)
    assert s.prefix.snaps.num_cached == 1 and s.kv.num_cached == 300 // BS
    assert_idle(s)


def test_admission_never_over_commits_with_shared_prefixes():
    """The pool is full of cached-but-free blocks; a request that shares some of them must count them,
    since taking them out of the LRU takes them out of the free count."""
    s = sched(blocks=11, snaps=4, seqs=4, budget=512)  # 10 usable blocks
    d = Device(s)
    p = toks(150, 120)
    d.run(req("a", p, max_tokens=10))              # 10 blocks, all published or plain free
    assert s.kv.num_free == 10
    big = req("big", p[:128] + toks(30, 121), max_tokens=2)   # 160 tokens: 10 blocks, 8 shared idle
    small = req("small", p[:128] + toks(20, 122), max_tokens=1)
    s.add(big)
    s.add(small)
    batch = d.step()
    assert [r.request_id for r, _ in batch] == ["big"] and big.cached_tokens == 128
    assert s.kv.num_free == 0 and len(set(big.block_ids)) == 10
    # small shares the same 8 blocks (held now: not free) and needs 2 more: it must wait
    assert list(s.waiting) == [small]
    d.run()
    assert small.status is Status.FINISHED and small.cached_tokens == 128
    hog = req("hog", toks(150, 123), max_tokens=10)   # 10 new blocks: evicts every cached one
    d.run(hog)
    assert s.kv.num_cached <= 10 and s.prefix.match(req("q", p)).tokens == 0
    assert_idle(s)


def test_accounting_returns_to_idle_after_a_mixed_load():
    s = sched(blocks=200, snaps=5, seqs=4, budget=96)
    d = Device(s, lag=1)
    shared, rng = toks(256, 130), random.Random(131)
    rs = [req(i, shared[:rng.choice([64, 128, 256])] + toks(rng.randrange(1, 200), 140 + i),
              max_tokens=rng.randrange(1, 40)) for i in range(24)]
    for r in rs:
        s.add(r)
    for step in range(100_000):
        if not s.running and not s.waiting:
            break
        d.step()
        if step % 7 == 3 and s.running:
            s.finish(s.running[-1])                 # aborts mid-flight
    while d.plans:
        s.prefix.commit(d.plans.pop(0))
    assert any(r.cached_tokens for r in rs)
    assert_idle(s)
