"""The work list of cuda/attention_prefill.cu: each prefilling sequence cut into tiles of query rows, and a few
tiles' keys into parts when the tiles are too few to fill the GPU."""
from __future__ import annotations

import numpy as np

from ..step import Step
from .kernels import define

PF_ROWS = define("attention_prefill.cu", "PF_ROWS")  # query rows (token, q head) per tile
PF_KEYS = define("attention_prefill.cu", "PF_KEYS")  # keys per block
PF_MAX_PARTS = define("attention_prefill.cu", "PF_MAX_PARTS")
# the fewest key blocks a part gets: below that the parts' workspace round trip and merge outweigh the split
PF_MIN_PART_BLOCKS = 8


def leading_singles(lens: np.ndarray) -> int:
    """Sequences before the first without exactly one new token: the step's decodes (they come first)."""
    other = lens != 1
    return int(np.argmax(other)) if other.any() else len(lens)


def split_parts(nb: np.ndarray, wave: int) -> np.ndarray:
    """Parts each tile's nb key blocks are cut into: none while the tiles alone fill a wave (wave: tiles per
    KV head that the GPU runs at once; 0: never split), else parts of about total / wave blocks, so the parts
    of all tiles are at most one wave."""
    if not wave or len(nb) >= wave:
        return np.ones(len(nb), np.int64)
    size = max(PF_MIN_PART_BLOCKS, -(-int(nb.sum()) // wave))
    return np.clip(nb // size, 1, PF_MAX_PARTS)


def prefill_tiles(step: Step, G: int, n_lead: int | None = None, wave: int = 0) -> tuple[np.ndarray | None, int]:
    """(tiles, n_dec): the tokens of the n_lead leading sequences (default: the single-token ones; the
    CUDA backend passes its decodes and verifies, whose few tokens each are decode-sized queries), rows
    0..n_dec-1, stay on attn_fwd; every later sequence with tokens is cut into tiles of PF_ROWS flattened
    (token, q head of the kv group) rows, and a tile's key blocks into split_parts(.., wave) parts. Each part is
    listed as (seq, first row, first token, n tokens, first key block, end key block, the tile's first
    workspace slot or -1 when it is whole, part << 16 | parts), most key blocks first (the longest start
    first). tiles is None (and n_dec = T) when no later sequence has tokens."""
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
    nb = -(-keys // PF_KEYS)
    parts = split_parts(nb, wave)
    tile = np.repeat(np.arange(len(nb)), parts)
    p = np.arange(len(tile)) - np.repeat(np.cumsum(parts) - parts, parts)  # part index within its tile
    S = parts[tile]
    slots = np.where(parts > 1, parts, 0)  # a split tile's parts each take a workspace slot
    first = np.where(S > 1, (np.cumsum(slots) - slots)[tile], -1)
    kb0, kb1 = nb[tile] * p // S, nb[tile] * (p + 1) // S
    out = np.stack([b[tile], r0[tile], cu[b][tile], n[tile], kb0, kb1, first, p << 16 | S], 1)
    out = out[np.argsort(-(kb1 - kb0), kind="stable")].astype(np.int32)
    assert out.shape[0] < 65536, "grid.y limit"
    return out, int(cu[n_dec])
