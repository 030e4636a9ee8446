"""Oracle drafters for benchmarking speculative decoding (tools/bench_spec.py): they propose the target's
own greedy continuation, recorded from a plain run of the same prompts, so the acceptance rate is set by
construction rather than by a draft model. A Drafter (engine/drafter.py) that needs no capture; or one
that runs a real drafter as usual (its observes, its proposals computed and brought to the host) and then
proposes the oracle's drafts instead: the real drafter's cost at a controlled acceptance."""
from __future__ import annotations

import numpy as np

from engine.drafter import Drafter


class RecordedOracle(Drafter):
    """Each draft is the recorded token with probability p, independently per position (seeded), else
    (t + 1) % vocab, which the target never emits there; p = 1 is the accept-all oracle. A request whose
    prompt was not recorded, or that has run past its recording, gets no drafts (it decodes plainly)."""

    def __init__(self, recorded: dict[tuple, list[int]], p: float, vocab: int, seed: int = 0):
        self.recorded, self.p, self.vocab = recorded, p, vocab
        self.rng = np.random.default_rng(seed)
        self._by_id: dict[str, list[int]] = {}  # request id -> its recording: a prompt is hashed once

    def propose(self, reqs, rooms: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, rooms):
            rec = self._by_id.get(req.request_id)
            if rec is None:
                rec = self._by_id[req.request_id] = self.recorded.get(tuple(req.prompt_ids), [])
            want = rec[len(req.output_ids):len(req.output_ids) + k]
            right = self.rng.random(len(want)) < self.p
            out.append([t if ok else (t + 1) % self.vocab for t, ok in zip(want, right)])
        return out


class OracleOverDrafter(Drafter):
    """`inner` (a drafter with weights) observes and proposes as it would in the engine; the oracle's drafts
    are what the engine verifies."""

    def __init__(self, inner: Drafter, oracle: Drafter):
        self.inner, self.oracle, self.capture = inner, oracle, inner.capture

    def observe(self, record) -> None:
        self.inner.observe(record)

    def propose(self, reqs, rooms: list[int]) -> list[list[int]]:
        self.inner.propose(reqs, rooms)
        return self.oracle.propose(reqs, rooms)

    def forget(self, req) -> None:
        self.inner.forget(req)
