"""Drafters: what a speculating request proposes to verify next (spec-decode-spec.md §3).

A drafter's `propose(reqs, rooms)` returns up to rooms[i] draft tokens for each request about to decode;
the engine calls it once per step with all of them (engine.py: one batch, so a drafter with weights can run
one forward for the batch), and the verify path (runner.py, verify.py) checks the drafts against the
target. An empty proposal is fine: that request decodes plainly this step. Test oracles
(tests/test_spec_decode.py) implement the same `propose`.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import SpeculativeConfig
from .request import Request


class NgramDrafter:
    """vLLM's `ngram` (prompt lookup): find the longest suffix of n tokens (n from prompt_lookup_max
    down to prompt_lookup_min) that occurred earlier in prompt + output, at its most recent earlier
    occurrence, and propose the up to k tokens that followed it. No match: no drafts."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        return [self._propose(req, k) for req, k in zip(reqs, rooms)]

    def _propose(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        tokens = np.asarray(req.prompt_ids + req.output_ids, np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows starting at 0 .. len-n-1: every occurrence but the suffix itself
            hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


def make_drafter(cfg: SpeculativeConfig):
    if cfg.method == "ngram":
        return NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    raise ValueError(f"no drafter for method {cfg.method!r}")  # SpeculativeConfig.parse refuses it first
