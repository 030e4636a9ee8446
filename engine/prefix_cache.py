"""Prefix caching for a hybrid model: shared KV blocks plus GDN state snapshots, restored together.

A sequence's state after token p-1 is the KV of [0, p) (full-attention layers) and the conv +
recurrent state of every GDN layer. KV is cached by block (kv_blocks.py: chain-hashed, shared by
refcount); the GDN state cannot be rebuilt from KV, so it is cached as snapshots at a few positions
(state_snapshots.py). A request resumes at p only where both exist: p a multiple of `align` =
lcm(GDN chunk 64, block size) (a resumed prefill then cuts its 64-token GDN chunks where a cold one
does, and p ends a block), every block of [0, p) cached, and a snapshot keyed by the chain hash at p.
At least `min_tail` prompt tokens are recomputed (the last one's logits are needed).

Which positions get a snapshot (`boundaries`), and why:
  - the last boundary of each prompt, floor(len - min_tail): the same prompt again (regenerate, n > 1,
    retries, a fixed prompt) and the next turn when the template does not re-render the output as
    generated (Qwen3.5's drops earlier turns' thinking);
  - rolling: every aligned position past that which the request computes (an aligned prompt end,
    then one every 64 decode tokens, a copy with no extra step); a newer one demotes the request's
    previous one to evict first, so after the request ends its newest, floor(prompt + output), is
    what stays: the next turn (prompt + output + new message) resumes there;
  - branch points: when the KV match goes deeper than the snapshot found, floor(min(KV depth,
    len - min_tail)): the second request with a new shared prefix (a system prompt, a document)
    leaves a snapshot where it leaves the shared part, and the third on hits. A 64-token prefix of
    100-500-token prompts thus hits (vLLM's align mode: never below 528). No snapshot every N tokens
    (SGLang: 256): each costs pool space and a chunk cut; branch points give the same hits, one miss
    later, only where sharing was seen.
Saves inside a chunk: the chunked GDN pass has the state at every 64-token boundary of a chunk, so a
boundary p that falls inside a prefill chunk is saved by the kernels themselves (Step.save_at: the conv
and recurrent state after p - start tokens also go to the snapshot's row) and the chunk is not cut: a
cold prompt takes the same steps with the cache on as off. The scheduler cuts a chunk at p only where
the kernels cannot save it: p - start not a multiple of 64 (a chunk the budget split off mid-chunk; the
scheduler ends budget cuts of 512 tokens or more on the grid, so only smaller ones), or a second
boundary in one chunk (one in-chunk save per sequence and step). A save at a chunk's end
is a slot -> snapshot copy after the step.
min_tail = 2 in batch-invariant mode: a hit then never leaves a one-token last chunk (which would take
the decode kernels), so cold with the cache on, cold with it off and a hit are bit-equal.

What is held when: the KV blocks of a hit are shared (refcount) for the request's life; its snapshot
is pinned from admission until the request's first step commits (or it ends). A save's id is reserved
when the scheduler plans it (invisible to lookups) and published when the step that computed it has
completed (`commit`), with the request's KV block hashes up to that step's end: a request that ends
first (abort, error) has its reservations discarded by `release`, a failed step's by `abandon`, so
nothing half-computed is ever found. Pool full: the save is skipped (and no chunk cut); a request that
finds no snapshot is served cold.

How the engine drives it (docs/architecture.md, "Prefix caching"):
  - engine.py builds it when `enable_prefix_caching` (`--enable-prefix-caching`): `SnapshotPool(first_id=
    num_slots, count=num_state_snapshots)` over cache rows after the slots (memory.py plans them),
    min_tail 2 when batch-invariant.
  - each step's `scheduler.plan` goes to `runner.forward`, which copies (`ops.copy_slots`) the restores
    before the forward, passes in-chunk saves to the step (Step.save_at) and copies chunk-end saves
    after it (eager or a decode graph's replay), in stream order; the
    engine commits a plan once a sampling launched after its forward is collected, before that
    sampling's tokens can finish requests, and abandons the plans of a failed step.
  - with speculative decoding (the n-gram drafter) a verify saves nothing: `max_drafts` cuts its drafts
    short of the next rolling save.
  - a hit's first chunk starts at `num_computed == cached_tokens > 0` (restored, not zeroed); events carry
    `cached_tokens` (-> usage.prompt_tokens_details.cached_tokens); `queries` / `hits` (tokens, as vLLM
    counts them) -> `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm

from .kv_blocks import ROOT_HASH, KVBlockManager, chain_hashes
from .request import Request
from .state_snapshots import SnapshotPool


@dataclass
class Match:
    tokens: int             # cached tokens (a multiple of align; 0: a miss)
    blocks: list[int]       # the cached KV blocks of [0, tokens)
    snapshot: int | None    # the GDN state after token tokens - 1
    kv_tokens: int          # depth of the cached KV run (>= tokens): deeper is a branch point


@dataclass
class Plan:
    """The state copies of one scheduled step, and what it computes (published by commit)."""
    restore: list[tuple[int, int]] = field(default_factory=list)    # (snapshot, slot): before the forward
    save: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, snapshot, pos): the state after pos-1
    ends: list[tuple[Request, int]] = field(default_factory=list)   # (request, num_computed after the step)

    @property
    def restore_ids(self) -> tuple[list[int], list[int]]:
        return [s for s, _ in self.restore], [d for _, d in self.restore]


@dataclass(eq=False)
class _Seq:
    """What the cache knows of one request."""
    hashes: list[bytes]                       # chain hashes of its known full blocks
    limit: int                                # len(prompt) - min_tail: the deepest prompt boundary
    boundaries: list[int] = field(default_factory=list)   # prompt positions still to save, ascending
    restore: int | None = None                # snapshot to copy into the slot before the first chunk
    pinned: int | None = None
    saves: dict[int, int] = field(default_factory=dict)   # pos -> reserved snapshot, not yet published
    published: int = 0                        # leading blocks published or shared
    rolling: tuple[int, bytes] | None = None  # its newest published rolling snapshot (id, key)
    dead: bool = False                        # in a failed step: publishes nothing more


class PrefixCache:
    def __init__(self, kv: KVBlockManager, snapshots: SnapshotPool, *, chunk: int = 64, min_tail: int = 1):
        if min_tail < 1:
            raise ValueError(f"min_tail must be >= 1 (the last prompt token's logits are needed), got {min_tail}")
        self.kv, self.snaps, self.min_tail, self.chunk = kv, snapshots, min_tail, chunk
        self.bs, self.align = kv.block_size, lcm(chunk, kv.block_size)
        self.queries = self.hits = 0              # prompt tokens looked up / found, at admission
        self._seqs: dict[Request, _Seq] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)

    def track(self, req: Request) -> None:
        """req is queued (Scheduler.add): hash its prompt once; release() forgets it."""
        if req not in self._seqs:
            self._seqs[req] = self._new(req)

    def _new(self, req: Request) -> _Seq:
        return _Seq(chain_hashes(req.prompt_ids, self.bs), len(req.prompt_ids) - self.min_tail)

    def _key(self, s: _Seq, pos: int) -> bytes:
        return s.hashes[pos // self.bs - 1]

    def match(self, req: Request) -> Match:
        """The longest usable prefix of a request's prompt. No side effects."""
        s = self._seqs.get(req) or self._new(req)
        limit = max(s.limit, 0)
        blocks = self.kv.lookup(s.hashes[:limit // self.bs])
        kv_tokens = len(blocks) * self.bs
        for p in range(kv_tokens // self.align * self.align, 0, -self.align):
            sid = self.snaps.lookup(self._key(s, p))
            if sid is not None:
                return Match(p, blocks[:p // self.bs], sid, kv_tokens)
        return Match(0, [], None, kv_tokens)

    def admit(self, req: Request, m: Match) -> None:
        """The scheduler admitted req at num_computed = m.tokens with m.blocks shared: pin its snapshot and
        choose the prompt boundaries it saves."""
        self.track(req)
        s = self._seqs[req]
        self.queries += len(req.prompt_ids)
        self.hits += m.tokens
        if m.snapshot is not None:
            self.snaps.pin(m.snapshot)
            s.restore = s.pinned = m.snapshot
        s.published = m.tokens // self.bs
        a = self.align
        want = {s.limit // a * a, min(m.kv_tokens, s.limit) // a * a}  # the last prompt boundary, a branch point
        s.boundaries = sorted(p for p in want if p > m.tokens and self.snaps.lookup(self._key(s, p)) is None)

    def cut(self, req: Request, take: int) -> int:
        """Called for each (req, take) the scheduler puts in a step, before the step is built: reserves the
        saves the chunk reaches (prompt boundaries, a rolling one at an aligned end) and ends the chunk
        early at a boundary the kernels cannot save inside it (see above). Returns the new take."""
        s = self._seqs[req]
        start, end = req.num_computed, req.num_computed + take
        inside = False
        while s.boundaries and s.boundaries[0] <= end:
            p = s.boundaries.pop(0)
            if p <= start:
                continue
            sid = self.snaps.reserve()
            if sid is None:        # pool full: not saved, not cut
                continue
            s.saves[p] = sid
            if p < end:
                if inside or (p - start) % self.chunk:
                    return p - start
                inside = True
        if end % self.align == 0 and end > s.limit and end not in s.saves:
            sid = self.snaps.reserve()
            if sid is not None:
                s.saves[end] = sid
        return take

    def max_drafts(self, req: Request, k: int) -> int:
        """How many of k drafts a decoding request's verify may carry (speculative decoding): a verify saves
        no state. The kernels cannot save inside one (its GDN rows run the token recurrence), and a save at
        its end would keep the state after drafts that may be rejected. A decoding request's saves are the
        rolling ones at multiples of `align` (its prompt boundaries are behind it): the verify stops short
        of the next, which a plain decode step then reaches and saves. Its KV needs nothing: publish() hashes
        only known tokens, and a rejected draft's position never is one before the step after the verify
        has rewritten it."""
        start = req.num_computed
        nxt = (start // self.align + 1) * self.align  # the next rolling save: the state after nxt tokens
        return k if start + 1 + k < nxt else max(nxt - start - 2, 0)

    def plan(self, batch: list[tuple[Request, int]]) -> Plan:
        """The copies of a scheduled step (call after cut(), before advance)."""
        plan = Plan()
        for req, n in batch:
            s = self._seqs[req]
            if s.restore is not None:
                plan.restore.append((s.restore, req.slot))
                s.restore = None
            start, end = req.num_computed, req.num_computed + n
            plan.save += [(req.slot, sid, p) for p, sid in sorted(s.saves.items()) if start < p <= end]
            plan.ends.append((req, end))
        return plan

    def commit(self, plan: Plan) -> None:
        """The step of plan completed: publish what it computed."""
        for req, end in plan.ends:
            self.publish(req, end)

    def publish(self, req: Request, upto: int) -> None:
        """req's tokens [0, upto) are computed by completed steps: publish its full KV blocks below upto and
        its saves at positions <= upto; unpin the snapshot it restored from."""
        s = self._seqs.get(req)
        if s is None or s.dead:
            return
        if s.pinned is not None:
            self.snaps.unpin(s.pinned)
            s.pinned = None
        nb = upto // self.bs
        if len(s.hashes) < nb:
            start = len(s.hashes) * self.bs
            ids = req.token_ids(start, nb * self.bs)
            s.hashes += chain_hashes(ids, self.bs, s.hashes[-1] if s.hashes else ROOT_HASH)
            nb = len(s.hashes)  # only known tokens (never a pending one) are hashed
        for i in range(s.published, nb):
            self.kv.publish(req.block_ids[i], s.hashes[i])
        s.published = max(s.published, nb)
        for p in sorted(p for p in s.saves if p <= upto and p // self.bs <= len(s.hashes)):
            sid, key = s.saves.pop(p), self._key(s, p)
            if self.snaps.publish(sid, key) and p > s.limit:  # a rolling one supersedes the previous
                if s.rolling is not None:
                    self.snaps.demote(*s.rolling)
                s.rolling = (sid, key)

    def abandon(self, plan: Plan) -> None:
        """The step of plan failed: its requests publish nothing more (they are being ended)."""
        for req, _ in plan.ends:
            s = self._seqs.get(req)
            if s is not None:
                s.dead = True
                for sid in s.saves.values():
                    self.snaps.discard(sid)
                s.saves.clear()

    def release(self, req: Request) -> None:
        """req ended (finished, aborted, failed, or dropped while waiting): unpublished saves are discarded,
        its pin dropped. Its blocks are the scheduler's to free."""
        s = self._seqs.pop(req, None)
        if s is None:
            return
        for sid in s.saves.values():
            self.snaps.discard(sid)
        if s.pinned is not None:
            self.snaps.unpin(s.pinned)
