"""How a small mixed step (decodes and a few prompt chunks) is laid out in its CUDA graph (decode_graph.py).

A graph fixes every shape, so the step is padded to its graph's: P decode rows (the decodes, then padding rows
that decode token 0 at position 0 of the dummy slot and page, as a decode graph's), MIXED_SEQS chunk
sequences (the step's prompt chunks, then empty ones in the dummy slot), and a filler sequence in the dummy
slot and page that takes the tokens left up to the cap: T = P + cap tokens, P + MIXED_SEQS + 1 sequences and
P + MIXED_SEQS logits rows (the step's own first; the rest read row 0 and are never used). Padding never
touches a real slot or page, and a real row's results do not depend on the padding rows (every kernel works
per row or per sequence). NumPy only: the CPU tests run the padded step on the NumPy backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..step import Step
from .prefill_tiles import PF_ROWS, leading_singles, prefill_tiles

MIXED_SEQS = 4  # prompt chunks a mixed step's graph holds (a chunk that ends a prompt lets the next one in)
# the largest cap the engine replays mixed steps for: from ~1024 prompt tokens on a mixed step is device-bound
# eagerly (session27-h100.md), and a graph pads every shorter step to its cap
MIXED_MAX_CAP = 512


@dataclass(frozen=True)
class MixedLayout:
    cap: int           # prompt tokens of a mixed step (the scheduler's prefill_budget_with_decodes); > MIXED_SEQS
    max_num_seqs: int  # most decodes
    max_ctx: int       # longest context (a graph's block tables are max_ctx / block_size wide)
    width: int         # block-table width
    dummy_slot: int
    dummy_block: int
    group: int         # query heads per KV head (attn_prefill's tiles)
    wave: int = 0      # attn_prefill's tiles per KV head at once (prefill_tiles splits the keys of fewer)

    def __post_init__(self):
        if self.cap <= MIXED_SEQS:  # more tokens than logits rows, or model.py would take every row as sampled
            raise ValueError(f"a mixed step's cap ({self.cap}) must be > {MIXED_SEQS}")
        if self.cap > self.max_ctx:  # the filler's positions 0 .. cap - 1 need that many keys of block table
            raise ValueError(f"a mixed step's cap ({self.cap}) must be <= the graphs' context ({self.max_ctx})")

    @property
    def num_tiles(self) -> int:
        """attn_prefill's tiles of any mixed step: sum over its sequences of ceil(len * G / PF_ROWS), plus the
        parts of split tiles (at most a wave more), <= this."""
        return -(-self.cap * self.group // PF_ROWS) + MIXED_SEQS + 1 + self.wave

    def fits(self, step: Step) -> bool:
        """A small mixed step: leading decodes, every one sampled (a one-token chunk right after them counts as
        one, as in the eager path), then at most MIXED_SEQS prompt chunks of at most cap tokens in all, each
        sampling at most its last token; no verify or replay, no fed token outside the decodes."""
        if not step.num_seqs or (step.spec_logs is not None and step.spec_logs.max() >= 0):
            return False
        cu, rows = step.cu_seqlens, step.logits_rows
        nd = leading_singles(np.diff(cu))
        if (nd > self.max_num_seqs or step.num_seqs - nd > MIXED_SEQS or cu[-1] - nd > self.cap
                or len(rows) < nd or (nd and rows[nd - 1] != nd - 1)  # (ascending rows: these are 0 .. nd - 1)
                or not np.isin(rows[nd:], cu[nd + 1:] - 1).all() or step.seq_lens.max() > self.max_ctx):
            return False
        return step.feed is None or not len(step.feed[0]) or step.feed[0][-1] < nd

    @staticmethod
    def decodes(step: Step) -> int:
        return leading_singles(np.diff(step.cu_seqlens))

    def lay_out(self, step: Step | None, P: int) -> tuple[Step, np.ndarray]:
        """The step (None: none, all padding) laid out as the graph of decode bucket P holds it, and attn_prefill's
        tile list for it [num_tiles, 8], padded with empty tiles (n = 0)."""
        S, cap, W = MIXED_SEQS, self.cap, self.width
        T, B = P + cap, P + S + 1
        tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
        slots = np.full(B, self.dummy_slot, np.int32)
        seq_lens = np.zeros(B, np.int32)  # empty sequences: no context
        seq_lens[:P] = 1  # padding decode rows: position 0 of the dummy page
        tables = np.full((B, W), self.dummy_block, np.int32)
        rows = np.zeros(P + S, np.int32)
        pf = np.zeros(S + 1, np.int32)    # tokens of the chunk sequences and the filler
        save_at = save_rows = None
        nd = n_pf = 0
        if step is not None:
            lens = np.diff(step.cu_seqlens)
            nd = leading_singles(lens)
            n_pf = len(step.tokens) - nd
            pf[:step.num_seqs - nd] = lens[nd:]
            tokens[:nd], positions[:nd] = step.tokens[:nd], step.positions[:nd]
            tokens[P:P + n_pf], positions[P:P + n_pf] = step.tokens[nd:], step.positions[nd:]
            at = np.r_[0:nd, P:P + step.num_seqs - nd]  # where the step's sequences go
            slots[at], seq_lens[at] = step.slots, step.seq_lens
            w = min(step.block_tables.shape[1], W)  # wider tables: fits() made sure the extra columns are unused
            tables[at, :w] = step.block_tables[:, :w]
            if step.save_at is not None:
                save_at, save_rows = np.zeros(B, np.int32), np.zeros(B, np.int32)
                save_at[at], save_rows[at] = step.save_at, step.save_rows
            lr = step.logits_rows
            rows[:len(lr)] = np.where(lr < nd, lr, lr + P - nd)
        pf[S] = seq_lens[P + S] = cap - n_pf
        positions[P + n_pf:] = np.arange(cap - n_pf, dtype=np.int32)
        cu = np.concatenate([np.arange(P + 1), P + np.cumsum(pf)]).astype(np.int32)
        pstep = Step(tokens=tokens, positions=positions, cu_seqlens=cu, slots=slots, block_tables=tables,
                     seq_lens=seq_lens, logits_rows=rows, feed=None if step is None else step.feed,
                     save_at=save_at, save_rows=save_rows)
        tiles = np.zeros((self.num_tiles, 8), np.int32)
        t, _ = prefill_tiles(pstep, self.group, P, self.wave)
        if t is not None:
            tiles[:len(t)] = t
        return pstep, tiles
