"""Scheduler, block manager and slot pool: pure Python, no model."""
import pytest

from engine.kv_blocks import DUMMY_BLOCK, KVBlockManager
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import AdmissionError, OverloadedError, Scheduler
from engine.state_slots import DUMMY_SLOT, StateSlotPool


def req(rid, prompt_len, max_tokens=4):
    return Request(str(rid), list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), max_tokens,
                   frozenset(), sink=lambda out: None)


def sched(blocks=64, slots=5, bs=4, max_len=64, seqs=4, budget=16, waiting=8, align=1, with_decodes=0):
    return Scheduler(KVBlockManager(blocks, bs), StateSlotPool(slots), max_model_len=max_len, max_num_seqs=seqs,
                     max_num_batched_tokens=budget, max_waiting_requests=waiting, chunk_align=align,
                     prefill_budget_with_decodes=with_decodes)


def run_step(s, batch, sampled_token=7):
    """What the engine does after a forward: advance, append a token where one was sampled."""
    for r, n in batch:
        s.advance(r, n)
        if r.num_computed == r.num_tokens:
            r.output_ids.append(sampled_token)


def test_dummies_are_never_handed_out():
    kv, sp = KVBlockManager(5, 16), StateSlotPool(3)
    assert kv.capacity == 4 and sp.capacity == 2
    assert DUMMY_BLOCK not in kv.allocate(4) and DUMMY_SLOT not in [sp.allocate(), sp.allocate()]
    with pytest.raises(RuntimeError):
        kv.allocate(1)
    with pytest.raises(RuntimeError):
        sp.allocate()


def test_admission_reserves_whole_lifetime_and_frees_together():
    s = sched()
    r = req(0, 10, max_tokens=7)  # 17 tokens -> 5 blocks of 4
    s.add(r)
    batch = s.schedule()
    assert batch == [(r, 10)] and r.status is Status.RUNNING
    assert len(r.block_ids) == 5 and s.kv.num_free == 63 - 5 and s.slots.num_free == 3
    s.finish(r)
    assert s.kv.num_free == 63 and s.slots.num_free == 4 and r.slot is None and r.block_ids == []


def test_decodes_first_then_chunked_prefill_within_budget():
    s = sched(budget=8)
    a, b = req("a", 3, max_tokens=8), req("b", 20)
    s.add(a)
    run_step(s, s.schedule())                   # a prefilled, has one output token
    s.add(b)
    batch = s.schedule()
    assert batch == [(a, 1), (b, 7)]            # decode first, b gets the rest of the budget
    run_step(s, batch)
    assert b.num_computed == 7 and b.output_ids == []
    batch = s.schedule()
    assert batch == [(a, 1), (b, 7)]            # b resumes at base_pos 7
    run_step(s, batch)
    batch = s.schedule()
    assert batch == [(a, 1), (b, 6)]
    run_step(s, batch)
    assert b.num_computed == 20 and len(b.output_ids) == 1
    assert s.schedule() == [(a, 1), (b, 1)]


def test_aligned_chunks_for_batch_invariance():
    """chunk_align (batch_invariant engines): a prompt that does not fit is cut at a multiple of the
    alignment, never leaving a one-token last chunk; one that fits goes whole; FCFS holds when the
    head's chunk cannot be cut this step."""
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        sched(budget=19, align=8)
    s = sched(blocks=200, max_len=200, budget=20, align=8)
    a, b, c = req("a", 41), req("b", 17), req("c", 3)
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()  # 41 > 20: 16 (not 20); b: 17 > 4 left, a multiple of 8 does not fit: b waits
    assert [(r.request_id, n) for r, n in batch] == [("a", 16)]
    run_step(s, batch)
    batch = s.schedule()  # a: 25 left > 20 -> 16; then b (17 > 4) waits again
    assert [(r.request_id, n) for r, n in batch] == [("a", 16)]
    run_step(s, batch)
    batch = s.schedule()  # a: 9 left fits whole; b: 17 > 11 -> 8 (17 - 8 = 9 left, not 1); c: 3 <= 3 fits
    assert [(r.request_id, n) for r, n in batch] == [("a", 9), ("b", 8), ("c", 3)]
    run_step(s, batch)
    batch = s.schedule()  # a and c decode; b: 9 left <= 18 fits
    assert [(r.request_id, n) for r, n in batch] == [("a", 1), ("c", 1), ("b", 9)]
    assert s._chunk(17, 16, 0) == 8 and s._chunk(9, 8, 0) == 0 and s._chunk(10, 8, 0) == 8  # never a 1-token tail
    assert sched(budget=20)._chunk(17, 16, 0) == 16  # unaligned: the whole budget


def test_pending_token_is_scheduled_unless_it_is_the_last():
    """A token sampled on the device but not yet seen by the host counts as known: the request decodes
    it next step; once it is the max_tokens-th, the request is not scheduled again."""
    s = sched()
    a = req("a", 3, max_tokens=2)
    s.add(a)
    batch = s.schedule()
    s.advance(a, 3)
    a.pending = 1                               # the first token is on the device
    assert batch == [(a, 3)] and s.schedule() == [(a, 1)] and a.token_ids(3, 4) == []
    s.advance(a, 1)
    a.output_ids.append(7)                      # collected; the second is now pending
    assert a.num_tokens == 5 and a.at_limit and s.schedule() == []


def test_max_num_seqs_and_fcfs_deferral():
    s = sched(seqs=2, budget=64)
    rs = [req(i, 4) for i in range(4)]
    for r in rs:
        s.add(r)
    assert [r for r, _ in s.schedule()] == rs[:2]
    assert list(s.waiting) == rs[2:]
    s.finish(rs[0])
    assert [r for r, _ in s.schedule()] == [rs[1], rs[2]]  # rs[1] prefills again (nothing ran), rs[2] admitted


def test_head_of_line_waits_and_blocks_later_requests():
    s = sched(blocks=9, bs=4, budget=64)
    a, b, c = req("a", 16, 4), req("b", 12, 4), req("c", 1, 1)   # a: 5 blocks, b: 4 blocks, c: 1 block
    for r in (a, b, c):
        s.add(r)
    assert [r for r, _ in s.schedule()] == [a]   # b does not fit now; c waits behind it (strict FCFS)
    assert list(s.waiting) == [b, c]
    s.finish(a)
    assert [r for r, _ in s.schedule()] == [b, c]


def test_never_fitting_is_rejected_with_sizes():
    s = sched(blocks=9, bs=4, max_len=64)
    with pytest.raises(AdmissionError, match=r"maximum context length is 64.*70 tokens \(60 in the prompt, 10 max"):
        s.add(req(0, 60, 10))
    with pytest.raises(AdmissionError, match=r"40 tokens.*30 in the prompt, 10 max tokens.*holds 32 tokens"):
        s.add(req(1, 30, 10))
    with pytest.raises(AdmissionError, match="empty"):
        s.add(req(2, 0, 1))


def test_waiting_queue_is_bounded():
    s = sched(waiting=2)
    s.check_queue(1)
    with pytest.raises(OverloadedError, match="queue is full"):
        s.check_queue(2)


def test_finish_from_waiting_and_running():
    s = sched(seqs=1)
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)                                  # waiting
    s.finish(a)                                  # running
    assert not s.waiting and not s.running and s.kv.num_free == 63 and s.slots.num_free == 4


def with_prefix(s, snaps=8):
    """The same scheduler with prefix caching on (a snapshot pool after its slots)."""
    from engine.prefix_cache import PrefixCache
    from engine.state_snapshots import SnapshotPool
    s.prefix = PrefixCache(s.kv, SnapshotPool(s.slots.num_slots, snaps), chunk=64)
    return s


def drive(s, reqs, seed):
    """A random arrival and abort pattern; returns every batch as (request id, tokens)."""
    import random
    rng, out, pending = random.Random(seed), [], list(reqs)
    for _ in range(500):
        while pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        batch = s.schedule()
        out.append([(r.request_id, n) for r, n in batch])
        run_step(s, batch, sampled_token=rng.randrange(100))
        if s.prefix is not None:
            s.prefix.commit(s.plan)
        for r in list(s.running):
            if len(r.output_ids) >= r.max_tokens or rng.random() < 0.02:
                s.finish(r)
        if not pending and not s.running and not s.waiting:
            break
    return out


@pytest.mark.parametrize("budget, max_prompt", [(4096, 300), (96, 64)])
def test_prefix_cache_without_reuse_schedules_as_before(budget, max_prompt):
    """Nothing shared: the same batches as with caching off (saves are written inside the chunks or copied
    after them; a chunk is cut only at a boundary off the 64-token grid of a chunk the budget split, and a
    prompt of up to 64 tokens has no boundary)."""
    import random
    rng = random.Random(max_prompt)
    specs = [(1000 * i + 1, rng.randrange(1, max_prompt), rng.randrange(1, 30)) for i in range(30)]
    def make():
        return [Request(str(i), [first] + list(range(n - 1)), SamplingParams(max_tokens=m), m, frozenset(),
                        sink=lambda out: None) for i, (first, n, m) in enumerate(specs)]
    kw = dict(blocks=200, bs=16, max_len=400, seqs=4, budget=budget, waiting=64)
    off, on = sched(**kw), with_prefix(sched(**kw))
    assert drive(off, make(), 7) == drive(on, make(), 7)
    assert on.kv.num_free == on.kv.capacity and on.prefix.snaps.num_used == 0


def test_prefix_hit_does_not_overtake_a_waiting_head():
    s = with_prefix(sched(blocks=20, bs=16, max_len=300, seqs=4, budget=512))
    shared = list(range(100))
    a = req("a", 0)
    a.prompt_ids = shared
    s.add(a)
    run_step(s, s.schedule())
    s.prefix.commit(s.plan)
    run_step(s, s.schedule())
    s.prefix.commit(s.plan)
    s.finish(a)                                  # its blocks [0, 96) stay cached, a snapshot at 64
    holder, big, hit = req("holder", 20), req("big", 250, 50), req("hit", 0)  # big: all 19 blocks
    hit.prompt_ids = shared[:70]
    for r in (holder, big, hit):
        s.add(r)
    assert [r for r, _ in s.schedule()] == [holder]  # holder running keeps big waiting
    assert list(s.waiting) == [big, hit] and s.prefix.match(hit).tokens == 64  # hit would fit, but FCFS holds
    s.finish(holder)
    assert [r for r, _ in s.schedule()] == [big]


def test_prefill_budget_with_decodes_caps_prompt_tokens_only_beside_decodes():
    s = sched(budget=32, with_decodes=6)
    a, b, c = req("a", 20, max_tokens=8), req("b", 30), req("c", 3)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch == [(a, 20), (b, 12)]          # nothing decodes yet: the whole budget
    run_step(s, batch)
    s.add(c)
    batch = s.schedule()
    assert batch == [(a, 1), (b, 6)]            # beside a decode: 6 prompt tokens, c waits behind b (FCFS)
    run_step(s, batch)
    s.finish(a)
    batch = s.schedule()
    assert batch == [(b, 12), (c, 3)]           # no decode left: the whole budget again


def test_prefill_budget_with_decodes_keeps_chunk_alignment():
    with pytest.raises(ValueError, match="at least 8"):
        sched(budget=64, align=4, with_decodes=7)
    s = sched(budget=64, align=4, with_decodes=10, max_len=128, blocks=128)
    a, b = req("a", 4, max_tokens=8), req("b", 40)
    s.add(a)
    run_step(s, s.schedule())
    s.add(b)
    assert s.schedule() == [(a, 1), (b, 8)]     # 10 capped to a multiple of the alignment


def test_verifies_after_decodes_and_drafts_cut_so_no_decode_starves():
    """Speculative decoding: a decoding request with drafts is a 1 + k verify, after the plain decodes;
    drafts get only what one token for every decoding request leaves; rewind takes back rejected drafts."""
    s = sched(budget=8, seqs=4)
    a, b, c = req("a", 2, max_tokens=8), req("b", 2, max_tokens=8), req("c", 2, max_tokens=8)
    for r in (a, b, c):
        s.add(r)
    run_step(s, s.schedule())                   # all three prefilled, one output token each
    a.drafts, b.drafts = [1, 2, 3], [4, 5, 6]
    batch = s.schedule()
    assert batch == [(c, 1), (a, 4), (b, 3)]    # 8 = 3 decodes + a's 3 drafts + b's 2 (cut)
    assert a.drafts == [1, 2, 3] and b.drafts == [4, 5]
    s.advance(a, 4)
    s.rewind(a, 2)                              # 1 of 3 drafts accepted
    assert a.num_computed == 4
