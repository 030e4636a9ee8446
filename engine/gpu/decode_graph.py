"""CUDA-graph capture and replay of decode steps, verifies and small mixed steps (CUDA backend only).

At batch size 1 a decode step is launch-bound: ~15 kernels per layer, each with its launch's host overhead
(docs/benchmarks/decode-graph-h200.md). DecodeGraphs captures the whole forward (every kernel and
cublasLt GEMM, the final norm and lm_head) once per batch-size bucket and replays it with one cudaGraphLaunch.

How a step is run
- Decode only: every sequence has exactly one new token, and every sequence is sampled. Or, with
  speculative decoding (verify_k = K), a uniform verify: every sequence has 1 + K new tokens, all
  sampled, and a log set (Step.spec_logs); its graph is captured per bucket like a decode's. Either kind
  may replay a verify's logged tokens (Step.replay: data in the metadata, as the slots are).
- Small mixed steps (mixed_cap > 0): the decodes, then at most MIXED_SEQS prompt chunks of at most
  mixed_cap tokens in all (the scheduler's `prefill_budget_with_decodes`). Eagerly such a step is its host's
  enqueue of ~400 launches (~10 ms at 256 tokens), not its device time (docs/benchmarks/session27-h100.md).
  Its graph per decode bucket P is padded to fixed shapes (gpu/mixed_layout.py: padding decode rows, empty
  chunk sequences and a filler up to mixed_cap tokens, all in the dummy slot and page); what prepare() reads
  off a step's lengths (the chunked GDN's grid, attention's rows) the graph fixes by those shapes, and
  attn_prefill's tile list rides in the metadata buffer, padded with empty tiles.
- The step is padded to its bucket (BUCKETS, then +16 up to max_num_seqs). Padded rows decode token 0
  at position 0 (seq_len 1) into the reserved dummy state slot, with block-table row [dummy_block, ...]:
  they write and read only the dummy slot's conv/recurrent state and row 0 of the dummy KV page, so no
  kernel needs a mask and real sequences are never touched. (Several padded rows share the dummy slot,
  so its contents are garbage; nothing real ever reads it.) A padded verify sequence decodes 1 + K
  tokens at positions 0..K of the dummy page and logs them in the dummy log set (dummy_spec_log).
- All metadata (Step.packed: tokens, positions, cu_seqlens, slots, seq_lens, slot_mapping, tok_seq,
  logits_rows, block tables max_blocks_per_seq wide, ...) lives in one static int32 device buffer per
  bucket; run() writes the padded step's layout into a pinned host buffer (the bucket's all-padding
  layout, then the real rows: _stage) and refills the device buffer with one asynchronous H2D copy
  (so run() does not wait for the GPU).
- The attention split-K decision depends only on the bucket and max_ctx = max_blocks_per_seq *
  block_size (fixed at capture), never on the step's actual context lengths. A verify's rows are decode
  queries there too (each sees the keys up to its own position): no host-made work list.
- run() enqueues the metadata copy and the graph launch on CuPy's current stream (the same stream as
  eager work, so ordering with prefills and sampling needs no events). Replays must be serialized
  (one stream, one thread): all graphs share one private memory pool for their intermediates.

Memory: each bucket is first run eagerly on an all-padding step (compiles kernels, builds cublasLt
plans, allocates the GEMM workspace and RoPE tables from the default pool), run once more on the
capture stream under the private pool (so the capture reuses cached blocks), then captured on a
private non-blocking stream with every allocation drawn from a private cupy MemoryPool that lives as
long as this object, so the default pool never hands out an address a graph uses. The logits buffer of
each graph is kept alive by the graph record.

Result of run(): a view [T, vocab] (f32) into the graph's static logits buffer, valid until the next
run() (copy it, or bring it to the host, before replaying again).

Bit-exactness: a replay equals eager execution of the same padded step with the same max_ctx
(DecodeGraphs.eager), bit for bit. It is not bit-identical to an unpadded eager forward: GEMMs with a
different M and a different attention split may round differently.
"""
from __future__ import annotations

import dataclasses
import functools

import cupy
import numpy as np

from ..step import Step
from .mixed_layout import MIXED_SEQS, MixedLayout

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MIXED = -1  # kind() of a small mixed step


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, then +16, all <= max_num_seqs; max_num_seqs itself is the last
    bucket when it is not one of those."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out = [b for b in BUCKETS if b <= max_num_seqs]
    b = BUCKETS[-1] + 16
    while b <= max_num_seqs:
        out.append(b)
        b += 16
    if out[-1] != max_num_seqs:
        out.append(max_num_seqs)
    return out


def _tiles_at(n: int) -> int:
    """Where a mixed graph's tile list starts after n int32 of metadata: 16-byte aligned (attn_prefill reads
    a tile as two int4)."""
    return -(-n // 4) * 4


@functools.lru_cache(maxsize=None)
def _offsets(P: int, n: int, W: int) -> dict[str, int]:
    """Where each Step.FIELDS field starts in a graph's packed metadata: P sequences of n tokens, all sampled."""
    return dict(zip(Step.FIELDS, np.cumsum([0] + Step.field_sizes(P * n, P, P * n, W)).tolist()))


@dataclasses.dataclass
class _Captured:
    bucket: int
    k: int                 # drafts per sequence (0: a decode step; MIXED: a small mixed step)
    buf: cupy.ndarray      # static int32 metadata buffer (CudaBackend.prepare layout; a mixed step's tiles after)
    graph: object          # cupy.cuda.graph.Graph
    logits: cupy.ndarray   # static [bucket * (1 + k), vocab] f32 output (mixed: [bucket + MIXED_SEQS, vocab])
    captured: dict | None  # static activations a drafter reads (DecodeGraphs.keep), every row
    staging: np.ndarray    # pinned host copy of buf's contents, the source of each step's async H2D copy
    copied: object         # cupy Event recorded after the last copy out of staging
    pinned: object         # the pinned allocation behind staging
    template: np.ndarray   # buf's contents for an all-padding step (Step.packed): what run() writes rows over
                           # (a mixed step's run() writes all of staging)
    T: int                 # the graph's tokens (the head of buf: Step.feed's rows)


class DecodeGraphs:
    def __init__(self, model, cache, max_num_seqs: int, dummy_slot: int, dummy_block: int,
                 max_blocks_per_seq: int, capture_now: bool = False, verify_k: int = 0,
                 dummy_spec_log: int | None = None, capture=None, mixed_cap: int = 0):
        """model: a Qwen35Model on a CudaBackend; cache: the cache the graphs are bound to (its arrays'
        addresses are baked into the graphs); max_blocks_per_seq: block-table width of every graph
        (the longest context a replay supports is max_blocks_per_seq * block_size). capture_now:
        capture every bucket here (largest first) instead of on first use. verify_k: also replay uniform
        verifies of that many drafts (0: none); dummy_spec_log: the log set padded verify rows write
        to. capture: a model.Capture every graph also keeps
        (a speculative drafter's: run(..., with_capture=True)). mixed_cap: also replay small mixed steps of
        at most that many prompt tokens (0: none; not with a capture, whose rows a mixed graph would pad)."""
        if not getattr(model.ops, "decode_graphs", False):
            raise ValueError(f"DecodeGraphs needs a backend that captures CUDA graphs, not {model.ops.name!r}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.model, self.ops, self.cache = model, model.ops, cache
        self.max_num_seqs = int(max_num_seqs)
        self.dummy_slot, self.dummy_block = int(dummy_slot), int(dummy_block)
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.block_size = cache.block_size
        self.max_ctx = self.max_blocks_per_seq * self.block_size
        self.buckets = bucket_sizes(self.max_num_seqs)
        self.pool = cupy.cuda.MemoryPool()             # every capture-time allocation; lives with the graphs
        self.stream = cupy.cuda.Stream(non_blocking=True)  # capture only; replays go to the current stream
        self.graphs: dict[tuple[int, int], _Captured] = {}
        if verify_k and not (1 <= verify_k < self.block_size and dummy_spec_log is not None):
            raise ValueError(f"verify_k {verify_k} needs 1 <= verify_k < block_size ({self.block_size}) (padded "
                             "rows fit the dummy page) and dummy_spec_log")
        self.verify_k, self.dummy_spec_log, self.keep = verify_k, dummy_spec_log, capture
        if mixed_cap and capture is not None:
            raise ValueError("mixed steps' graphs keep no capture (their rows are padded within the step)")
        cfg = model.cfg
        self.mixed = (MixedLayout(int(mixed_cap), self.max_num_seqs, self.max_ctx, self.max_blocks_per_seq,
                                  self.dummy_slot, self.dummy_block, cfg.num_heads // cfg.num_kv_heads,
                                  self.ops.prefill_wave(cfg.head_dim, cfg.num_kv_heads))
                      if mixed_cap else None)
        if capture_now:
            self.capture_all()

    # ---- shapes --------------------------------------------------------------------------
    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"decode batch {batch} exceeds max_num_seqs {self.max_num_seqs}")

    def kind(self, step: Step) -> int | None:
        """The step's graph kind: 0 for a pure decode step, K for a uniform verify of verify_k drafts, MIXED for
        a small mixed step (with a mixed_cap), None for any other step (it runs eagerly)."""
        B, T = step.num_seqs, len(step.tokens)
        if not B:
            return None
        if len(step.logits_rows) != T:
            return MIXED if self.mixed is not None and self.mixed.fits(step) else None
        if T == B:
            return 0
        k = self.verify_k
        if not k or T != B * (1 + k) or step.spec_logs is None or step.spec_logs.min() < 0:
            return None
        return k if step.cu_seqlens.tolist() == list(range(0, T + 1, 1 + k)) else None

    def pad(self, step: Step, bucket: int | None = None) -> Step:
        """The step (a decode or a uniform verify) padded to its bucket (or `bucket`), block tables
        max_blocks_per_seq wide."""
        k, _ = self._check(step)
        return self._padded(step, self.bucket_for(step.num_seqs) if bucket is None else bucket, k)

    def _padded(self, step: Step | None, P: int, k: int) -> Step:
        """step's rows (None: none) then padding rows, to P sequences of 1 + k tokens."""
        n, W = 1 + k, self.max_blocks_per_seq
        if step is None:  # all padding (capture)
            step = Step(tokens=np.zeros(0, np.int32), positions=np.zeros(0, np.int32), cu_seqlens=np.zeros(1, np.int32),
                        slots=np.zeros(0, np.int32), block_tables=np.zeros((0, W), np.int32),
                        seq_lens=np.zeros(0, np.int32), logits_rows=np.zeros(0, np.int32),
                        spec_logs=np.zeros(0, np.int32))
        B = step.num_seqs
        tables = np.full((P, W), self.dummy_block, np.int32)
        w = min(step.block_tables.shape[1], W)  # wider tables: _check made sure the extra columns are unused
        tables[:B, :w] = step.block_tables[:, :w]
        tokens = np.zeros(P * n, np.int32)
        tokens[:B * n] = step.tokens
        positions = np.tile(np.arange(n, dtype=np.int32), P)  # padded rows: positions 0..k of the dummy page
        positions[:B * n] = step.positions
        slots = np.full(P, self.dummy_slot, np.int32)
        slots[:B] = step.slots
        seq_lens = np.full(P, n, np.int32)
        seq_lens[:B] = step.seq_lens
        spec_logs = replay = None
        if k or step.spec_logs is not None:  # padded rows: the dummy set (a verify's) or none, no replay
            spec_logs = np.full(P, self.dummy_spec_log if k else -1, np.int32)
            spec_logs[:B] = step.spec_logs
        if step.replay is not None:
            replay = np.zeros(P, np.int32)
            replay[:B] = step.replay
        return Step(tokens=tokens, positions=positions, cu_seqlens=np.arange(P + 1, dtype=np.int32) * n, slots=slots,
                    block_tables=tables, seq_lens=seq_lens, logits_rows=np.arange(P * n, dtype=np.int32),
                    feed=step.feed, spec_logs=spec_logs, replay=replay)

    def _check(self, step: Step, k: int | None = None) -> tuple[int, np.ndarray]:
        """Validates a step for replay; returns its kind (kind(), or the caller's k from it) and each token's
        KV page (Step.token_blocks, which _stage reuses)."""
        B = step.num_seqs
        if B < 1 or B > self.max_num_seqs:
            raise ValueError(f"decode batch of {B} sequences: need 1..{self.max_num_seqs}")
        k = self.kind(step) if k is None else k
        if k is None:
            raise ValueError("DecodeGraphs runs pure decode steps (one new token per sequence, every one sampled)"
                             f" and uniform verifies of {self.verify_k} drafts only")
        # small arrays: Python lists cost less than NumPy calls here (a synchronous step waits for the host)
        n, pos, lens = 1 + k, step.positions.tolist(), step.seq_lens.tolist()
        if lens != [p + 1 for p in pos[n - 1::n]]:
            raise ValueError("decode step: seq_lens must be positions + 1")
        if max(lens) > self.max_ctx:
            raise ValueError(f"context {max(lens)} > max_ctx {self.max_ctx} of the graphs")
        blocks = step.token_blocks(self.block_size, np.arange(B, dtype=np.int32).repeat(n))  # (uniform: n a sequence)
        self._check_no_dummies(step, blocks)
        return k, blocks

    def _check_no_dummies(self, step: Step, blocks: np.ndarray) -> None:
        """The step uses neither the dummy slot nor the dummy page (blocks: each token's KV page)."""
        if self.dummy_slot in step.slots.tolist():
            raise ValueError(f"slot {self.dummy_slot} is the dummy slot, reserved for padding")
        if self.dummy_block in blocks.tolist():
            raise ValueError(f"block {self.dummy_block} is the dummy KV page, reserved for padding")

    # ---- capture ---------------------------------------------------------------------------
    def _meta_size(self, pstep: Step) -> int:
        """int32 elements of a padded step's packed metadata (before a mixed step's tiles)."""
        return self.ops.meta_size(len(pstep.tokens), pstep.num_seqs, len(pstep.logits_rows), pstep.block_tables.shape[1])

    def _meta(self, pstep: Step, cache, out=None, tiles: np.ndarray | None = None):
        """prepare()'s Meta of a padded step, uploaded into out (a graph's static buffer) or a fresh one. A mixed
        step's (tiles: its tile list, uploaded after the metadata) gets the fields prepare() reads off the step's
        lengths from its graph's shape instead, the same for every step that graph replays."""
        n = self._meta_size(pstep)
        meta = self.ops.prepare(pstep, cache, out=None if out is None else out[:n], max_ctx=self.max_ctx)
        if out is not None:  # the final gather reads its rows from the static buffer, not the host
            meta.step = dataclasses.replace(pstep, logits_rows=meta.logits_rows)
        if tiles is not None:
            P = pstep.num_seqs - MIXED_SEQS - 1
            if out is None:
                dev = cupy.asarray(tiles)
            else:
                dev = out[_tiles_at(n):].reshape(tiles.shape)
                dev.set(tiles)
            meta.n_dec = meta.n_rec = P  # (a one-token chunk is a chunk here: the filler could be one)
            meta.max_new = self.mixed.cap
            meta.prefill_tiles = ((self.mixed.group, self.mixed.wave), dev, P)
        return meta

    def capture(self, bucket: int, k: int = 0) -> _Captured:
        if (bucket, k) in self.graphs:
            return self.graphs[bucket, k]
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not a bucket ({self.buckets})")
        if k not in (0, self.verify_k) and not (k == MIXED and self.mixed is not None):
            raise ValueError(f"graphs of {k} drafts: only 0 and verify_k ({self.verify_k}), or MIXED with a mixed_cap")
        if k == MIXED:  # an all-padding mixed step: padding decode rows and the filler, every chunk empty
            dummy, tiles = self.mixed.lay_out(None, bucket)
            size = _tiles_at(self._meta_size(dummy)) + tiles.size
        else:  # an all-padding step: every row decodes into the dummy slot / page
            dummy, tiles = self._padded(None, bucket, k), None
            size = self._meta_size(dummy)
        T = len(dummy.tokens)
        buf = cupy.zeros(size, cupy.int32)
        meta = self._meta(dummy, self.cache, out=buf, tiles=tiles)
        # warm-up: kernels, GEMM plans, workspace, RoPE tables
        self.model.forward_meta(meta, self.cache, self.keep)
        cupy.cuda.get_current_stream().synchronize()
        s = self.stream
        with cupy.cuda.using_allocator(self.pool.malloc), s:
            # primes the private pool on the capture stream, so the capture finds its blocks cached (no cudaMalloc)
            self.model.forward_meta(meta, self.cache, self.keep)
            s.synchronize()
            s.begin_capture()
            try:
                out = self.model.forward_meta(meta, self.cache, self.keep)
            except BaseException:
                try:
                    s.end_capture()
                except Exception:  # noqa: BLE001 - the capture is invalid anyway; report the first error
                    pass
                raise
            graph = s.end_capture()
        graph.upload(cupy.cuda.get_current_stream())
        mem = cupy.cuda.alloc_pinned_memory(buf.nbytes)
        staging = np.frombuffer(mem, np.int32, buf.size)
        logits, captured = out if self.keep is not None else (out, None)
        g = self.graphs[bucket, k] = _Captured(bucket, k, buf, graph, logits, captured, staging,
                                               cupy.cuda.Event(disable_timing=True), mem,
                                               dummy.packed(self.block_size), T)
        return g

    def capture_all(self) -> None:
        for k in ([MIXED] if self.mixed is not None else []) + sorted({0, self.verify_k}, reverse=True):
            for b in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its pool memory
                self.capture(b, k)

    # ---- replay ------------------------------------------------------------------------------
    def run(self, step: Step, with_capture: bool = False, kind: int | None = None):
        """Logits [T, vocab] f32 of a pure decode step or a uniform verify, replayed from the bucket's graph
        (captured on first use). A view into the graph's static output, valid until the next run().
        with_capture: (logits, the capture's arrays of the step's T rows), views likewise. kind: the step's
        kind() when the caller has it (it is not computed again). A small mixed step's logits are those of its
        logits_rows."""
        if (self.kind(step) if kind is None else kind) == MIXED:
            pstep, tiles, P = self._check_mixed(step)
            g = self.capture(P, MIXED)
            g.copied.synchronize()
            packed = pstep.packed(self.block_size)
            g.staging[:len(packed)] = packed
            g.staging[_tiles_at(len(packed)):] = tiles.reshape(-1)
            self._launch(g, step)
            return g.logits[:len(step.logits_rows)]
        k, blocks = self._check(step, kind)
        g = self.capture(self.bucket_for(step.num_seqs), k)
        g.copied.synchronize()  # the previous copy out of the staging buffer has been read
        self._stage(g, step, blocks)
        self._launch(g, step)
        T = len(step.tokens)
        if with_capture:
            return g.logits[:T], {name: a[:T] for name, a in g.captured.items()}
        return g.logits if T == len(g.logits) else g.logits[:T]  # (a full bucket: no view to make on the host)

    def _launch(self, g: _Captured, step: Step) -> None:
        """The staged metadata up to g's buffer, the fed tokens into it, then g's replay: on the current stream."""
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(g.buf.data.ptr, g.pinned.ptr, g.staging.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        if step.feed is not None:
            self.ops.feed(g.buf[:g.T], step.feed)
        g.copied.record(stream)
        g.graph.launch(stream)

    def _check_mixed(self, step: Step) -> tuple[Step, np.ndarray, int]:
        """Validates a small mixed step (kind() MIXED) for replay; returns its layout in its graph (MixedLayout) and
        that graph's decode bucket."""
        self._check_no_dummies(step, step.token_blocks(self.block_size))
        P = self.bucket_for(max(self.mixed.decodes(step), 1))
        return *self.mixed.lay_out(step, P), P

    def _stage(self, g: _Captured, step: Step, blocks: np.ndarray) -> None:
        """g.staging := Step.packed of the step padded to g's bucket (what _padded then packed would give),
        written directly: the bucket's all-padding template, then the step's own rows over it (each field
        holds the real sequences' rows first; cu_seqlens, seq, logits_rows and the saves are the template's
        for a uniform step). blocks: each token's KV page (_check's)."""
        P, n, W, B, bs = g.bucket, 1 + g.k, self.max_blocks_per_seq, step.num_seqs, self.block_size
        st = g.staging
        st[...] = g.template
        f = _offsets(P, n, W)
        t = B * n
        w = min(step.block_tables.shape[1], W)  # wider tables: _check made sure the extra columns are unused
        tables = st[f["block_tables"]:f["block_tables"] + B * W].reshape(B, W)
        tables[:, :w] = step.block_tables[:, :w]
        for name, rows in (("tokens", step.tokens), ("positions", step.positions), ("slots", step.slots),
                           ("seq_lens", step.seq_lens)):
            st[f[name]:f[name] + len(rows)] = rows
        st[f["slot_mapping"]:f["slot_mapping"] + t] = blocks * bs + step.positions % bs
        for name in ("spec_logs", "replay"):  # (a decode's may be unset: the template's -1 and 0 stand)
            rows = getattr(step, name)
            if rows is not None:
                st[f[name]:f[name] + B] = rows

    def eager(self, step: Step, cache=None, with_capture: bool = False):
        """What run() computes, executed eagerly (padded, same max_ctx) on `cache` (default: the bound
        one): the bit-exact reference for a replay. Returns fresh logits [T, vocab] (and the capture's)."""
        cache = self.cache if cache is None else cache
        if self.kind(step) == MIXED:
            pstep, tiles, _ = self._check_mixed(step)
            return self.model.forward_meta(self._meta(pstep, cache, tiles=tiles), cache)[:len(step.logits_rows)]
        T = len(step.tokens)
        out = self.model.forward_meta(self._meta(self.pad(step), cache), cache, self.keep if with_capture else None)
        if with_capture:
            return out[0][:T], {name: a[:T] for name, a in out[1].items()}
        return out[:T]
