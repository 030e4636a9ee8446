"""Drafters: what a speculating request proposes to verify next (spec-decode-spec.md §3).

A drafter's `propose(reqs, rooms)` returns up to rooms[i] draft tokens for each request about to decode;
the engine calls it once per step with all of them (engine.py: one batch, so a drafter with weights can run
one forward for the batch), and the verify path (runner.py, verify.py) checks the drafts against the
target. An empty proposal is fine: that request decodes plainly this step. Test oracles
(tests/test_spec_decode.py) implement the same `propose`.

A drafter that reads the target's activations (MTP: the post-norm hidden; mtp.py) names them in
`capture`: the runner then has every forward keep them (model.Capture) with where each request's rows
are (`StepRecord`), and the engine hands each step's record to `observe()` before it asks for the next
proposals: a verify's once its tokens are collected (how many of its rows commit is known then), any
other step's as soon as its sampling is launched (every row commits; the tokens it samples are on the
device, `StepRecord.sampled`), so that steps in which no request drafts need not wait for the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SpeculativeConfig
from .model import Capture
from .request import Request, Status


@dataclass
class StepRecord:
    """One launched step, for a drafter: the forward's captured arrays (model.Capture's keys, every row
    of the step) and, per scheduled request, (req, base_pos, first_row, num_rows): its rows
    first_row.. of the step are positions base_pos.. ."""
    captured: dict
    rows: list[tuple[Request, int, int, int]]
    sampled: tuple | None = None  # (request -> row, token ids [R] on the device): what the step samples

    def committed(self) -> list[tuple[Request, int, int, int]]:
        """(req, base_pos, first_row, rows committed) per request still running with at least one committed
        row. A verify that accepted a of k drafts commits a + 1 rows (known once its tokens are collected),
        a decode or a prefill chunk all of them (req.num_computed counts what the target committed)."""
        out = []
        for req, base, first, n in self.rows:
            n = min(n, req.num_computed - base)
            if req.status is Status.RUNNING and n > 0:
                out.append((req, base, first, n))
        return out


class Drafter:
    """The interface the engine drives (engine.py: _propose, step())."""
    capture: Capture | None = None  # what the target's forwards keep for observe() (None: nothing)

    def bind(self, cache) -> None:
        """The target's cache, once allocated (after the memory plan, which counts the drafter's weights and
        its Qwen35Model.draft_kv_layers)."""

    def weight_bytes(self) -> int:
        """Bytes of the drafter's own weights (the memory plan's log line)."""
        return 0

    def kv_bytes(self, block_size: int) -> tuple[int, int]:
        """Bytes of paged KV the drafter allocates itself at bind() (DFlash: dflash.py): per block of the
        target's pool, and fixed. The memory plan counts them."""
        return 0, 0

    def observe(self, record: StepRecord) -> None:
        """A launched step, before the next one is (only with a capture): a verify once collected, any other
        step once its sampling is launched."""

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] draft tokens to follow each request's tokens (the last one is its pending token)."""
        raise NotImplementedError

    def forget(self, req: Request) -> None:
        """req has ended: drop what the drafter keeps for it."""


class NgramDrafter(Drafter):
    """vLLM's `ngram` (prompt lookup): find the longest suffix of n tokens (n from prompt_lookup_max
    down to prompt_lookup_min) that occurred earlier in prompt + output, at its most recent earlier
    occurrence, and propose the up to k tokens that followed it. No match: no drafts.

    It runs on the host between a verify's tokens and the next launch, for every speculating request, so
    it keeps each request's tokens as an array (appending what each step added) and matches from the
    occurrences of the last token (one vectorized compare) instead of comparing every window."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[Request, tuple[np.ndarray, int]] = {}  # request -> (its tokens so far, how many)

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        return [self._propose(req, k) for req, k in zip(reqs, rooms)]

    def forget(self, req: Request) -> None:
        self._tokens.pop(req, None)

    def _propose(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        t = self._known(req)
        L = len(t)
        ends = np.flatnonzero(t[:L - 1] == t[L - 1])  # earlier occurrences of the last token
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # a window of n ending at e matches the suffix iff its n - 1 tokens before e match too
            hits = ends[ends >= n - 1]
            for j in range(1, n):
                hits = hits[t[hits - j] == t[L - 1 - j]]
            if len(hits):
                start = int(hits[-1]) + 1
                return t[start:start + k].tolist()
        return []

    def _known(self, req: Request) -> np.ndarray:
        """prompt + output as an array, extended by the tokens output since the last call."""
        n = len(req.prompt_ids) + len(req.output_ids)
        buf, have = self._tokens.get(req, (None, 0))
        if buf is None or n < have or n > len(buf):
            buf, have = np.empty(max(n, req.lifetime_tokens), np.int64), 0
        if have < n:
            p = len(req.prompt_ids)
            if have < p:
                buf[have:p] = req.prompt_ids[have:]
                have = p
            buf[have:n] = req.output_ids[have - p:]
        self._tokens[req] = (buf, n)
        return buf[:n]


def make_drafter(cfg: SpeculativeConfig, model, weights: dict, max_num_seqs: int) -> Drafter:
    """model: the target; weights: its checkpoint tensors (for "mtp" with the mtp.* head); max_num_seqs: the
    most requests one propose() drafts for."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "mtp":
        from .mtp import MtpDrafter  # mtp.py builds on this module
        return MtpDrafter(model, weights)
    if cfg.method == "dflash":
        from .dflash import DFlashDrafter, load_dflash
        return DFlashDrafter(*load_dflash(cfg.model, model.cfg), model, cfg.num_speculative_tokens, max_num_seqs)
    raise ValueError(f"no drafter for method {cfg.method!r}")  # SpeculativeConfig.parse refuses it first
