"""What one forward step computes: the batch layout every backend and the model share.

A step holds the new tokens of B sequences back to back (varlen, no padding). Sequences that
decode one token come first, then prefills (whole prompts or chunks resuming at base_pos > 0).

A decode token may not be on the host yet: the previous step sampled it on the device and the next
forward is launched before the host has seen it (engine.py). `feed` names those rows and the
device array their tokens come from; `tokens` holds 0 there until the backend's prepare() copies
them in, on the device, in stream order.

Prefix caching may ask for a sequence's state part-way through its chunk as well (`save_at`): the
GDN layers also write the conv and recurrent state after that many of its new tokens (a multiple of
the GDN chunk, where the chunked pass has it anyway) into another cache row, a snapshot.

A speculative verify (`spec_rows`, speculative decoding) keeps the state after each of its new tokens
but the last as well, in consecutive cache rows: a verify that accepted a drafts is rolled back by
copying row spec_rows[b] + a into its slot. Verifies come after the decodes and before the prefills,
and the GDN layers run them token by token, as decodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import GDN_CHUNK
from .kv_blocks import DUMMY_BLOCK


@dataclass
class Step:
    tokens: np.ndarray        # [T] int32, new tokens of all sequences, concatenated
    positions: np.ndarray     # [T] int32, absolute position of each new token
    cu_seqlens: np.ndarray    # [B+1] int32, row offsets of each sequence's tokens
    slots: np.ndarray         # [B] int32, recurrent/conv state slot of each sequence
    block_tables: np.ndarray  # [B, max_blocks] int32, KV pages of each sequence
    seq_lens: np.ndarray      # [B] int32, context length after this step (base_pos + new tokens)
    logits_rows: np.ndarray   # [n] int32, rows whose logits are wanted (each sampled sequence's last
                              # token; a verify's last 1 + k: speculative decoding, verify.py)
    feed: tuple | None = None  # (rows [k] ascending, token ids [k] on the backend's device) to fill in tokens
    save_at: np.ndarray | None = None    # [B] int32: also save the state after this many new tokens (0: none)
    save_rows: np.ndarray | None = None  # [B] int32: the cache row (a snapshot) that state goes to
    spec_rows: np.ndarray | None = None  # [B] int32: a verify's first per-token state row (-1: not a verify)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    # The packed metadata a GPU step uploads in one copy: these int32 fields back to back.
    FIELDS = ("tokens", "positions", "cu_seqlens", "slots", "seq_lens", "slot_mapping", "seq", "logits_rows",
              "save_at", "save_rows", "spec_rows", "block_tables")

    @staticmethod
    def field_sizes(T: int, B: int, n_logits: int, width: int) -> list[int]:
        """Elements of each of FIELDS for T tokens, B sequences, n_logits sampled rows, block tables `width`
        wide."""
        return [T, T, B + 1, B, B, T, T, n_logits, B, B, B, B * width]

    def token_seqs(self) -> np.ndarray:
        """Per token the index of its sequence."""
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), np.diff(self.cu_seqlens))

    def token_blocks(self, block_size: int, seq: np.ndarray | None = None) -> np.ndarray:
        """Per token the KV page its position falls in (seq: token_seqs(), when the caller has it)."""
        return self.block_tables[self.token_seqs() if seq is None else seq, self.positions // block_size]

    def packed(self, block_size: int) -> np.ndarray:
        """FIELDS as one int32 array: the step's own, and per token its sequence (`seq`) and its flat KV row
        (`slot_mapping`: block * block_size + offset); save_at / save_rows 0 and spec_rows -1 when unset."""
        B = self.num_seqs
        seq = self.token_seqs()
        slot_mapping = self.token_blocks(block_size, seq).astype(np.int64) * block_size + self.positions % block_size
        assert slot_mapping.max(initial=0) < 2 ** 31
        unset = np.zeros(B, np.int32)
        parts = [self.tokens, self.positions, self.cu_seqlens, self.slots, self.seq_lens, slot_mapping, seq,
                 self.logits_rows, unset if self.save_at is None else self.save_at,
                 unset if self.save_rows is None else self.save_rows,
                 np.full(B, -1, np.int32) if self.spec_rows is None else self.spec_rows, self.block_tables]
        return np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in parts])

    @classmethod
    def build(cls, chunks: list[tuple[list[int], int, int, list[int]]], sample: list[int] | None = None,
              feed: tuple | None = None, saves: dict[int, tuple[int, int]] | None = None,
              spec: dict[int, int] | None = None) -> "Step":
        """chunks: per sequence (new token ids, base_pos, slot, block ids). sample: per sequence how many
        of its last rows need logits (default 1; a bool counts as 0 or 1). saves: sequence index ->
        (new tokens after which its state is saved, the snapshot row). spec: verifying sequence index ->
        its first per-token state row."""
        lens = [len(c[0]) for c in chunks]
        cu = np.zeros(len(chunks) + 1, np.int32)
        cu[1:] = np.cumsum(lens)
        width = max([len(c[3]) for c in chunks] + [1])
        tables = np.full((len(chunks), width), DUMMY_BLOCK, np.int32)  # unused entries: the dummy page
        for i, c in enumerate(chunks):
            tables[i, :len(c[3])] = c[3]
        sample = sample if sample is not None else [True] * len(chunks)
        save_at = save_rows = None
        if saves:
            save_at, save_rows = np.zeros(len(chunks), np.int32), np.zeros(len(chunks), np.int32)
            for i, (n, row) in saves.items():
                assert GDN_CHUNK <= n < len(chunks[i][0]) and n % GDN_CHUNK == 0, (i, n)
                save_at[i], save_rows[i] = n, row
        spec_rows = None
        if spec:
            spec_rows = np.full(len(chunks), -1, np.int32)
            for i, row in spec.items():
                spec_rows[i] = row
        return cls(
            tokens=np.array([t for c in chunks for t in c[0]], np.int32),
            positions=np.concatenate([np.arange(c[1], c[1] + len(c[0])) for c in chunks]).astype(np.int32),
            cu_seqlens=cu, slots=np.array([c[2] for c in chunks], np.int32), block_tables=tables,
            seq_lens=np.array([c[1] + len(c[0]) for c in chunks], np.int32),
            logits_rows=np.array([r for i in range(len(chunks)) for r in range(cu[i + 1] - sample[i], cu[i + 1])],
                                 np.int32),
            feed=feed, save_at=save_at, save_rows=save_rows, spec_rows=spec_rows,
        )
