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

A speculative verify (`spec_logs[b] >= 0` and more than one new token: speculative decoding) leaves its
slot's GDN state as it was and writes what each of its tokens changes into the cache's log set
spec_logs[b] instead (the conv state after each token; the recurrent update's k, delta and decay). Its
rollback is the sequence's next step: `replay[b]` = the a + 1 tokens the verify committed (a accepted
drafts), which the GDN layers apply from the log before the step's own tokens (gdn.cu), so nothing is
copied and a rejected draft costs nothing. Verifies come after the decodes and before the prefills, and
the GDN layers run them token by token, as decodes.
"""
from __future__ import annotations

import itertools
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
    spec_logs: np.ndarray | None = None  # [B] int32: the log set of a verify or of a replay (-1: none)
    replay: np.ndarray | None = None     # [B] int32: logged tokens applied first (0: none; needs spec_logs[b])

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    # The packed metadata a GPU step uploads in one copy: these int32 fields back to back.
    FIELDS = ("tokens", "positions", "cu_seqlens", "slots", "seq_lens", "slot_mapping", "seq", "logits_rows",
              "save_at", "save_rows", "spec_logs", "replay", "block_tables")

    @staticmethod
    def field_sizes(T: int, B: int, n_logits: int, width: int) -> list[int]:
        """Elements of each of FIELDS for T tokens, B sequences, n_logits sampled rows, block tables `width`
        wide."""
        return [T, T, B + 1, B, B, T, T, n_logits, B, B, B, B, B * width]

    def token_seqs(self) -> np.ndarray:
        """Per token the index of its sequence."""
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), np.diff(self.cu_seqlens))

    def token_blocks(self, block_size: int, seq: np.ndarray | None = None) -> np.ndarray:
        """Per token the KV page its position falls in (seq: token_seqs(), when the caller has it)."""
        return self.block_tables[self.token_seqs() if seq is None else seq, self.positions // block_size]

    def packed(self, block_size: int) -> np.ndarray:
        """FIELDS as one int32 array: the step's own, and per token its sequence (`seq`) and its flat KV row
        (`slot_mapping`: block * block_size + offset); save_at / save_rows / replay 0 and spec_logs -1 when unset."""
        B = self.num_seqs
        seq = self.token_seqs()
        slot_mapping = self.token_blocks(block_size, seq).astype(np.int64) * block_size + self.positions % block_size
        assert slot_mapping.max(initial=0) < 2 ** 31
        unset = np.zeros(B, np.int32)
        parts = [self.tokens, self.positions, self.cu_seqlens, self.slots, self.seq_lens, slot_mapping, seq,
                 self.logits_rows, unset if self.save_at is None else self.save_at,
                 unset if self.save_rows is None else self.save_rows,
                 np.full(B, -1, np.int32) if self.spec_logs is None else self.spec_logs,
                 unset if self.replay is None else self.replay, self.block_tables]
        return np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in parts])

    @classmethod
    def build(cls, chunks: list[tuple[list[int], int, int, list[int]]], sample: list[int] | None = None,
              feed: tuple | None = None, saves: dict[int, tuple[int, int]] | None = None,
              spec: dict[int, int] | None = None, replay: dict[int, int] | None = None) -> "Step":
        """chunks: per sequence (new token ids, base_pos, slot, block ids). sample: per sequence how many
        of its last rows need logits (default 1; a bool counts as 0 or 1). saves: sequence index ->
        (new tokens after which its state is saved, the snapshot row). spec: sequence index -> its log set
        (a verify's, or a replaying sequence's); replay: sequence index -> logged tokens to apply first."""
        # one NumPy call per field: the host builds this for every step, on the device's critical path
        # when the step waits for the one before it (speculative decoding)
        B = len(chunks)
        lens = [len(c[0]) for c in chunks]
        ends = list(itertools.accumulate(lens))
        starts = [c[1] for c in chunks]
        width = max([len(c[3]) for c in chunks] + [1])
        tables = np.full((B, width), DUMMY_BLOCK, np.int32)  # unused entries: the dummy page
        for i, c in enumerate(chunks):
            tables[i, :len(c[3])] = c[3]
        save_at = save_rows = None
        if saves:
            for i, (n, _) in saves.items():
                assert GDN_CHUNK <= n < lens[i] and n % GDN_CHUNK == 0, (i, n)
            save_at = np.array([saves[i][0] if i in saves else 0 for i in range(B)], np.int32)
            save_rows = np.array([saves[i][1] if i in saves else 0 for i in range(B)], np.int32)
        spec_logs = np.array([spec.get(i, -1) for i in range(B)], np.int32) if spec else None
        if replay:
            assert spec and all(spec.get(i, -1) >= 0 for i in replay), "a replay reads its log set"
        replay = np.array([replay.get(i, 0) for i in range(B)], np.int32) if replay else None
        # each token's index in the step, shifted by its sequence's base - first row
        positions = np.arange(ends[-1] if B else 0, dtype=np.int32)
        positions += np.repeat(np.array(starts, np.int32) - np.array([0] + ends[:-1], np.int32), lens)
        if sample is None:
            logits_rows = np.array([e - 1 for e in ends], np.int32)
        else:
            logits_rows = np.array([r for e, s in zip(ends, sample) for r in range(e - s, e)], np.int32)
        return cls(
            tokens=np.array([t for c in chunks for t in c[0]], np.int32), positions=positions,
            cu_seqlens=np.array([0] + ends, np.int32), slots=np.array([c[2] for c in chunks], np.int32),
            block_tables=tables, seq_lens=np.array([s + n for s, n in zip(starts, lens)], np.int32),
            logits_rows=logits_rows,
            feed=feed, save_at=save_at, save_rows=save_rows, spec_logs=spec_logs, replay=replay,
        )
