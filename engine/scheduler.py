"""Continuous-batching scheduler: pure Python over Request objects, never touches arrays.

Admission reserves a request's whole lifetime (prompt + max_tokens) of KV blocks plus one state
slot, so a running request can never run out of cache and nothing is ever preempted. Waiting
requests are admitted strictly FCFS: the head waits until it fits, later ones wait behind it
(so a big request is never starved by a stream of small ones).

A request's latest token may still be pending (sampled on the device, not yet seen by the host:
engine.py overlaps the host's work with the next forward); it is scheduled like any other, except
when that token is its last (max_tokens).

Speculative decoding: a decoding request with `drafts` (engine.py proposes them before schedule())
is scheduled as a verify, its pending token and the drafts, 1 + k tokens (the drafts cut to what the
budget leaves after one token for every decoding request); verifies go after the plain decodes, so
single-token sequences still lead the step.
With prefix caching a verify never reaches a position whose state is saved (PrefixCache.max_drafts).
After a verify that rejected drafts, `rewind` takes back their positions (the runner rolled the state
back to the last accepted token).

With a PrefixCache (prefix_cache.py) admission first looks the prompt up: a hit starts the request
at num_computed = cached_tokens with the hit's blocks shared, and reserves only the blocks it does
not share (cached blocks no request holds count as free, so taking them counts too). Prompt chunks
end at the positions whose state the request saves; `plan` holds the step's state copies.
"""
from __future__ import annotations

import time
from collections import deque

from .kv_blocks import KVBlockManager
from .prefix_cache import Plan, PrefixCache
from .request import Request, Status
from .state_slots import SpecLogPool, StateSlotPool


class AdmissionError(ValueError):
    """The request can never run (too long for the model or for the whole KV pool)."""


class OverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 503)."""


class Scheduler:
    def __init__(self, kv: KVBlockManager, slots: StateSlotPool, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_waiting_requests: int, prefill_budget_with_decodes: int = 0,
                 chunk_align: int = 1, prefix: PrefixCache | None = None, spec_logs: SpecLogPool | None = None):
        """prefill_budget_with_decodes: prompt tokens in a step that also decodes (0: no cap but the step's
        budget). A step's device time grows with its prompt tokens and every decoding request waits for
        the whole step, so this bounds their inter-token latency while prompts arrive; a step with no
        decodes (a wave arriving together, a lone long prompt) still takes the whole budget.
        chunk_align: a prompt cut into chunks is cut at multiples of this many tokens, never leaving a
        last chunk of one token (a batch-invariant engine passes the GDN chunk, 64: a prompt then takes
        the same kernels and chunk boundaries however the budget splits it).
        prefix: prefix caching over kv (None: off, and nothing here changes).
        spec_logs: speculative decoding's log sets; a request admitted when none is free runs without
        speculation (None: speculation off)."""
        if chunk_align > 1 and max_num_batched_tokens < max_num_seqs + 2 * chunk_align:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({max_num_seqs}) + {2 * chunk_align} when prompts are cut at multiples of "
                             f"{chunk_align} tokens (batch_invariant), so a chunk always fits beside the decodes")
        if 0 < prefill_budget_with_decodes < 2 * chunk_align:
            raise ValueError(f"prefill_budget_with_decodes ({prefill_budget_with_decodes}) must be 0 or at least "
                             f"{2 * chunk_align} (prompts are cut at multiples of {chunk_align} tokens)")
        if prefix is not None and prefix.kv is not kv:
            raise ValueError("the prefix cache must own the scheduler's KV block manager")
        self.kv, self.slots, self.chunk_align, self.prefix, self.spec_logs = kv, slots, chunk_align, prefix, spec_logs
        self.plan: Plan | None = None  # prefix caching: the state copies of the batch schedule() returned
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.max_num_batched_tokens, self.max_waiting_requests = max_num_batched_tokens, max_waiting_requests
        self.prefill_budget_with_decodes = prefill_budget_with_decodes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises AdmissionError for a request that could never be admitted."""
        total = prompt_tokens + max_tokens
        if prompt_tokens < 1:
            raise AdmissionError("the prompt is empty")
        if total > self.max_model_len:
            raise AdmissionError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                 f"requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} max tokens).")
        cap = self.kv.capacity * self.kv.block_size
        if total > cap:
            raise AdmissionError(f"request needs {total} tokens of KV cache ({prompt_tokens} in the prompt, "
                                 f"{max_tokens} max tokens) but the whole KV pool holds {cap} tokens")

    def check_queue(self, waiting: int) -> None:
        """Raises OverloadedError when `waiting` requests (submitted, not yet admitted) fill the queue.
        The engine asks at submit time, counting those still on their way to add()."""
        if waiting >= self.max_waiting_requests:
            raise OverloadedError(f"The request queue is full ({self.max_waiting_requests} waiting requests).")

    def add(self, req: Request) -> None:
        self.check_fits(len(req.prompt_ids), req.max_tokens)
        if self.prefix is not None:
            self.prefix.track(req)
        self.waiting.append(req)

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, new tokens) for this step: decodes first, then prefill chunks (running
        partial prefills, then newly admitted requests) within the token budget (and, beside decodes,
        within prefill_budget_with_decodes)."""
        budget = self.max_num_batched_tokens
        decodes, verifies, prefills = [], [], []
        decoding = [req for req in self.running if req.num_tokens - req.num_computed == 1 and not req.at_limit]
        spare = budget - len(decoding)  # drafts get what every decode's own token leaves (none starves)
        for req in decoding:
            if budget > 0:
                if req.drafts and self.prefix is not None:
                    del req.drafts[self.prefix.max_drafts(req, len(req.drafts)):]
                del req.drafts[max(spare, 0):]
                spare -= len(req.drafts)
                take = self._take(req, 1 + len(req.drafts), budget)
                (verifies if req.drafts else decodes).append((req, take))
                budget -= take
        if (decodes or verifies) and self.prefill_budget_with_decodes:
            budget = min(budget, self.prefill_budget_with_decodes)
        for req in self.running:
            n = req.num_tokens - req.num_computed
            if n > 1 and budget > 0:
                take = self._take(req, n, budget)
                if not take:
                    # FCFS: nothing overtakes a prefill that must wait
                    return self._planned(decodes + verifies + prefills)
                prefills.append((req, take))
                budget -= take
        while self.waiting and self._admit(self.waiting[0], budget):
            req = self.waiting.popleft()
            prefills.append((req, self._take(req, req.num_tokens - req.num_computed, budget)))
            budget -= prefills[-1][1]
        return self._planned(decodes + verifies + prefills)

    def _planned(self, batch: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        if self.prefix is not None:
            self.plan = self.prefix.plan(batch)
        return batch

    def _take(self, req: Request, n: int, budget: int) -> int:
        """Tokens of req's n left to compute that go in this step: the budget's cut, or an earlier one at
        a position whose state the prefix cache saves."""
        take = self._chunk(n, budget, req.num_computed)
        if take and self.prefix is not None:
            take = self.prefix.cut(req, take)
        return take

    def _chunk(self, n: int, budget: int, start: int) -> int:
        """Tokens of an n-token prefill starting at position start that fit in budget (0: none this step)."""
        if n <= budget:
            return n
        a = self.chunk_align
        take = budget // a * a
        if a > 1 and n - take == 1:  # a one-token last chunk would take the decode kernels
            take -= a
        elif a == 1 and self.prefix is not None and take >= 8 * self.prefix.chunk:
            # end a cut chunk on the GDN chunk grid (losing < 1/8 of the take): the next chunk then starts on it
            # and the kernels can save a prefix boundary inside it (prefix_cache.cut would otherwise end that
            # chunk early at the boundary: one more step)
            take = (start + take) // self.prefix.chunk * self.prefix.chunk - start
        return max(take, 0)

    def _admit(self, req: Request, budget: int) -> bool:
        """Admits the head if its first chunk fits the budget and its whole lifetime fits the pools."""
        m = self.prefix.match(req) if self.prefix is not None else None
        cached, shared = (m.tokens, m.blocks) if m is not None else (0, [])
        if not self._chunk(req.num_tokens - cached, budget, cached):
            return False
        need = self.kv.blocks_for(req.lifetime_tokens) - len(shared)
        if (len(self.running) >= self.max_num_seqs or not self.slots.num_free
                or need + self.kv.num_idle(shared) > self.kv.num_free):
            return False
        # shared first: allocate() may evict idle cached blocks, never the ones just taken
        req.slot, req.block_ids = self.slots.allocate(), self.kv.share(shared) + self.kv.allocate(need)
        if self.spec_logs is not None:
            req.spec_log = self.spec_logs.allocate()
        req.num_computed = req.cached_tokens = cached
        if self.prefix is not None:
            self.prefix.admit(req, m)
        req.status = Status.RUNNING
        req.scheduled_at = time.monotonic()
        self.running.append(req)
        return True

    def advance(self, req: Request, num_new: int) -> None:
        req.num_computed += num_new

    def rewind(self, req: Request, num: int) -> None:
        """A verify rejected its last num drafts: its GDN state is that after its last accepted token once
        its next step replays (step.py), so those positions are computed again (their KV is dead until
        rewritten)."""
        req.num_computed -= num

    def finish(self, req: Request) -> None:
        """Drops the request wherever it is and frees its blocks and slot together (cached blocks stay
        findable; the prefix cache discards what the request had not published)."""
        if self.prefix is not None:
            self.prefix.release(req)
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self.kv.free(req.block_ids)
            self.slots.free(req.slot)
            if req.spec_log is not None:
                self.spec_logs.free(req.spec_log)
            req.block_ids, req.slot, req.spec_log, req.replay = [], None, None, 0
        req.status = Status.FINISHED
