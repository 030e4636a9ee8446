"""The work list of cuda/attention_prefill.cu: each prefilling sequence cut into tiles of query rows."""
from __future__ import annotations

import numpy as np

from ..step import Step
from .kernels import define

PF_ROWS = define("attention_prefill.cu", "PF_ROWS")  # query rows (token, q head) per tile


def leading_singles(lens: np.ndarray) -> int:
    """Sequences before the first without exactly one new token: the step's decodes (they come first)."""
    other = lens != 1
    return int(np.argmax(other)) if other.any() else len(lens)


def prefill_tiles(step: Step, G: int, n_lead: int | None = None) -> tuple[np.ndarray | None, int]:
    """(tiles, n_dec): the tokens of the n_lead leading sequences (default: the single-token ones; the
    CUDA backend passes its decodes and verifies, whose few tokens each are decode-sized queries), rows
    0..n_dec-1, stay on attn_fwd; every later sequence with tokens is cut into tiles of PF_ROWS flattened
    (token, q head of the kv group) rows, listed as (seq, first row, first token, n tokens), most keys
    first (the longest tiles start first). tiles is None (and n_dec = T) when no later sequence has tokens."""
    cu = np.asarray(step.cu_seqlens, np.int64)
    lens = np.diff(cu)
    n_lead = leading_singles(lens) if n_lead is None else n_lead
    seqs = np.arange(n_lead, lens.size)
    seqs = seqs[lens[seqs] > 0]
    if not seqs.size:
        return None, int(cu[-1])
    n_dec = n_lead
    nt = -(-lens[seqs] * G // PF_ROWS)
    b = np.repeat(seqs, nt)
    r0 = (np.arange(int(nt.sum())) - np.repeat(np.cumsum(nt) - nt, nt)) * PF_ROWS
    n = lens[b]
    keys = np.asarray(step.positions, np.int64)[cu[b]] + (np.minimum(r0 + PF_ROWS, n * G) - 1) // G + 1
    order = np.argsort(-keys, kind="stable")
    tiles = np.stack([b, r0, cu[b], n], 1)[order].astype(np.int32)
    assert tiles.shape[0] < 65536, "grid.y limit"
    return tiles, int(cu[n_dec])
