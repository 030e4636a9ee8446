"""CUDA backend on CuPy: the op interface of engine/ops.py as thin launchers of the cuda/*.cu kernels
(gpu/kernels.py compiles and loads them) and cublasLt GEMMs (gpu/gemm.py).

Conventions
- bf16 is stored as raw bits in uint16 arrays (CuPy has no bf16 dtype). Activations are bf16 between
  ops; kernels accumulate in f32; the GDN recurrent state is f32.
- `weight()`: 2-D bf16 matrices stay bf16; f32 stays f32; 1-D vectors (norm weights, dt_bias, A_log)
  become f32, which is exact for bf16 and lets every small-vector kernel read f32.
- Fused projection outputs arrive as column views (`proj[:, :c]`): kernels take the view's data
  pointer and its row stride (strides[0] / 2); the column stride must be 1 element.
- Cache layouts are the NumPy backend's: conv state bf16 [slots, K-1, conv_dim] (each of the K-1 rows
  contiguous over channels, so conv reads/writes coalesce), recurrent state f32 [slots, nv, dk, dv]
  (HF/FLA layout; a block owns a [dk, 32] column tile, 128-byte rows per warp), paged KV bf16
  [blocks, block_size, nkv, hd] (each token-head row of hd contiguous: 512 B at hd 256, one 16-byte
  load per lane), addressed as flat rows by slot_mapping = block * block_size + offset.
- Dynamic shared-memory sizes are computed here from the padded row strides the kernels carve their
  shared memory into (commented at each launch); the constants come from the sources (kernels.define).
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from ..arrays import bf16_to_f32
from ..backend_numpy import argmax_finite
from ..ops import Cache
from ..step import Step
from . import kernels
from .gemm import gemm, get_gemm
from .gemv_plan import GEMV_MAX_M, GEMV_MAX_M_INVARIANT, gemv_nw, gemv_plan
from .prefill_tiles import PF_KEYS, PF_ROWS, leading_singles, prefill_tiles

LOGITS_ROWS = 100_000  # more output rows than any projection (max 2 * 17408): the vocabulary
GDN_REC_BLOCKS = kernels.define("gdn.cu", "GDN_REC_BLOCKS")  # resident gdn_recurrent blocks per SM
GDN_C = kernels.define("gdn.cu", "GDN_C")  # tokens per chunk of the WY prefill form (config.GDN_CHUNK)
GDN_STATE_WARPS = kernels.define("gdn.cu", "GDN_STATE_WARPS")
GDN_WG_STAGE = kernels.define("gdn.cu", "GDN_WG_STAGE")  # gdn_chunk_state_wg's bytes per chunk stage
# a block's time per chunk of the two chunked GDN state passes (CudaBackend._gdn_state_wg; bench_gdn_state.py)
GDN_CHUNK_US, GDN_WG_CHUNK_US = 3.7, 4.3
GDN_LOG_PAD = kernels.define("gdn.cu", "GDN_LOG_PAD")  # a tile's log entry: dk + GDN_LOG_PAD floats
ATTN_MIN_SPLIT_KEYS = kernels.define("attention.cu", "ATTN_MIN_SPLIT_KEYS")  # attn_fwd's smallest key split
# attn_combine's launch: a block per (row, ATTN_COMBINE_DIMS dims), of ATTN_COMBINE_THREADS threads
ATTN_COMBINE_DIMS = kernels.define("attention.cu", "ATTN_COMBINE_DIMS")
ATTN_COMBINE_THREADS = kernels.define("attention.cu", "ATTN_COMBINE_THREADS")
GI_BM, GI_BN = kernels.define("gemv.cu", "GI_BM"), kernels.define("gemv.cu", "GI_BN")  # gemm_inv: x rows x W rows
# Batch-invariant decode attention: keys per split, fixed (the default split follows the batch size and
# the longest context, so a row's partial sums would change with its neighbours)
INVARIANT_SPLIT_KEYS = 256
i32, i64, f32 = np.int32, np.int64, np.float32
NULL = np.uint64(0)  # a null pointer argument
# linear_add_rms_norm fuses the residual norm into the GEMV up to this many rows: its last block normalizes
# all M rows alone (cuda/gemv.cu OUT = 3)
GEMV_FUSED_NORM_MAX_M = 4
GEMV_MAX_GROUPS, RMS_MAX_VEC = kernels.define("gemv.cu", "GEMV_MAX_GROUPS"), kernels.define("norm.cu", "RMS_MAX_VEC")
# argmax_finite: up to this many rows each row's entries are split over blocks of ARGMAX_CHUNK
ARGMAX_SPLIT_ROWS, ARGMAX_CHUNK = kernels.define("argmax.cu", "ARGMAX_SPLIT_ROWS"), kernels.define("argmax.cu", "ARGMAX_CHUNK")
ARGMAX_THREADS = kernels.define("argmax.cu", "ARGMAX_THREADS")
CONV_THREADS = kernels.define("conv1d.cu", "CONV_THREADS")  # conv1d_fwd's block, 8 channels a thread


def _pf_smem(hd: int) -> int:
    """attn_prefill's dynamic shared memory: Q, two stages of K and V, 1024-byte alignment."""
    return (PF_ROWS + 4 * PF_KEYS) * hd * 2 + 1024


def _log_args(log, meta, entry: tuple, dtype) -> tuple:
    """A GDN layer's log set array (Cache.conv_log / rec_log: [sets, K1, *entry]) as kernel arguments:
    (pointer, K1); (null, 0) without one, which a step with log sets may not be."""
    if log is None:
        if meta.spec:
            raise ValueError("a step with speculative log sets (Step.spec_logs) needs a cache with logs")
        return NULL, i32(0)
    assert log.dtype == dtype and log.shape[2:] == entry and log.flags.c_contiguous, (log.shape, entry)
    return log, i32(log.shape[1])


def _rs(x: cupy.ndarray) -> np.int64:
    """Row stride in elements of a 2-D (or row-major N-D) view whose last dim is contiguous."""
    assert x.strides[-1] == x.itemsize, f"column stride {x.strides} not supported"
    return i64(x.strides[0] // x.itemsize)


@dataclass
class Meta:
    step: Step
    T: int
    B: int
    max_ctx: int
    tokens: cupy.ndarray
    positions: cupy.ndarray
    cu_seqlens: cupy.ndarray
    slots: cupy.ndarray
    seq_lens: cupy.ndarray
    slot_mapping: cupy.ndarray
    tok_seq: cupy.ndarray
    logits_rows: cupy.ndarray
    save_at: cupy.ndarray       # [B] Step.save_at (zeros: no saves)
    save_rows: cupy.ndarray     # [B]
    spec_logs: cupy.ndarray     # [B] Step.spec_logs (-1: none)
    replay: cupy.ndarray        # [B] Step.replay (0: none)
    block_tables: cupy.ndarray  # [B, width]
    max_new: int = 1  # the most new tokens of one sequence (1: a decode step)
    spec: bool = False  # some sequence verifies or replays (a log set)
    n_dec: int = 0    # leading single-token sequences (decodes come first): the decode kernels take them
    n_rec: int = 0    # leading decodes and verifies (verifies come next): the GDN token recurrence takes them
    # attention()'s prefill work list for this step, built on first use: ((G, wave), tiles [n, 8] int32 or None,
    # number of leading rows on attn_fwd: the decodes' and verifies')
    prefill_tiles: tuple | None = None
    # delta_rule()'s chunked-form sequences, views from n_rec on (cu_seqlens, slots, save_at, save_rows), made by
    # the first GDN layer (~2 us of host per CuPy view). Views only, never a buffer: a Meta may serve several
    # forwards under different memory pools (DecodeGraphs.capture)
    chunked: tuple | None = None
    # those sequences' chunks in all: _gdn_state_wg's input, on first use
    gdn_chunks: int | None = None


class CudaBackend:
    name = "cuda"
    decode_graphs = True
    needs_warm_up = True  # GEMM plans, CuPy's own kernels and the memory pool are made at first use
    gdn_state_wg: bool | None = None  # tests and benchmarks force one chunked GDN state pass (_gdn_state_wg)

    def __init__(self, poison: bool = False, batch_invariant: bool = False):
        self.poison = poison  # tests: fill every fresh output with NaN so unwritten elements show
        # A row's results independent of the rest of its step (at a prefill speed cost): GEMMs of every M
        # in gemv_bf16's summation order (gemm_inv), decode attention split at fixed key offsets.
        self.batch_invariant = batch_invariant
        self._inv_freq: dict[tuple, cupy.ndarray] = {}
        self._ungated: dict[int, cupy.ndarray] = {}
        dev = cupy.cuda.Device()
        self.num_sms = dev.attributes["MultiProcessorCount"]
        self.kernels = kernels.Kernels(dev.compute_capability)
        self._fn = self.kernels.fn
        # the fused norm's GEMVs' block counter (gemv.cu OUT = 3; its last block re-zeroes it): one for all,
        # as every kernel runs on the one current stream, in order
        self._gemv_count = cupy.zeros(1, cupy.uint32)
        self._argmax_count = cupy.zeros(ARGMAX_SPLIT_ROWS, cupy.uint32)  # argmax_finite's, per split row; likewise
        # attn_prefill's wave and split-key workspace per (hd, nkv): _pf_parts()
        self._pf_work: dict[tuple, tuple] = {}
        # The cublasLt workspace now, not at the first GEMM of more than GEMV_MAX_M rows (which may come
        # long after start-up): device memory in use is then flat from the first request on.
        get_gemm()

    def _empty(self, shape, dtype=cupy.uint16):
        a = cupy.empty(shape, dtype)
        if self.poison:
            if dtype == cupy.uint16:
                a.fill(0xFFFF)  # bf16 NaN
            else:
                a.fill(np.nan)
        return a

    # ---- weights and state -------------------------------------------------------------
    def weight(self, arr) -> cupy.ndarray:
        """A list of bf16 matrices is fused on the device, each part copied into its rows (the host never
        holds the concatenation: most of the weights are fused)."""
        if isinstance(arr, list):
            parts = [np.ascontiguousarray(p) for p in arr]
            if parts[0].ndim != 2 or any(p.dtype != np.uint16 for p in parts):
                return self.weight(np.concatenate(parts))
            out = cupy.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), cupy.uint16)
            r = 0
            for p in parts:
                out[r:r + p.shape[0]].set(p)
                r += p.shape[0]
            return out
        arr = np.ascontiguousarray(arr)
        if arr.ndim == 1:
            if arr.dtype == np.uint16:
                arr = bf16_to_f32(arr)
            return cupy.asarray(arr, dtype=cupy.float32)
        if arr.dtype == np.uint16:
            return cupy.asarray(arr)
        return cupy.asarray(arr, dtype=cupy.float32)

    def weight_gate_up(self, gate, up) -> cupy.ndarray:
        """gate|up with rows interleaved in blocks of 8 (rows 16b.. +7 are gate rows 8b.., the next 8 the up
        rows 8b..): the GEMV's epilogue then holds both halves of a feature (cuda/gemv.cu, OUT = 2). Interleaved
        on the host, one layer at a time, so the device holds no second copy."""
        F, H = gate.shape
        if F % 8 or up.shape != (F, H):
            raise ValueError(f"MLP gate {gate.shape} / up {up.shape}: equal shapes, width a multiple of 8")
        return self.weight(np.stack([np.reshape(gate, (F // 8, 8, H)), np.reshape(up, (F // 8, 8, H))], 1)
                           .reshape(2 * F, H))

    def alloc_cache(self, cfg, num_slots: int, num_blocks: int, block_size: int, spec_logs: int = 0,
                    spec_tokens: int = 0) -> Cache:
        """rec_log entries: per value head and 32-column state tile, gdn.cu's GDN_LOG_W floats."""
        nlin, nfull = len(cfg.linear_layers), len(cfg.full_layers)
        conv = [cupy.zeros((num_slots, cfg.conv_kernel - 1, cfg.conv_dim), cupy.uint16) for _ in range(nlin)]
        rec = [cupy.zeros((num_slots, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), cupy.float32)
               for _ in range(nlin)]
        arrays = conv + rec  # copy_slots' table: base pointers, row bytes (rows are contiguous, 16-byte multiples)
        assert all(a.strides[0] % 16 == 0 for a in arrays)
        rows = (cupy.asarray(np.array([a.data.ptr for a in arrays], np.uint64)),
                cupy.asarray(np.array([a.strides[0] for a in arrays], np.int64)),
                max((a.strides[0] for a in arrays), default=0))  # no state arrays: the DFlash drafter's cache
        n, logs = 1 + spec_tokens, nlin if spec_logs else 0
        return Cache(
            conv=conv, rec=rec,
            k=[cupy.zeros((num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim), cupy.uint16) for _ in range(nfull)],
            v=[cupy.zeros((num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim), cupy.uint16) for _ in range(nfull)],
            block_size=block_size, rows=rows,
            conv_log=[cupy.zeros((spec_logs, n, cfg.conv_kernel - 1, cfg.conv_dim), cupy.uint16) for _ in range(logs)],
            rec_log=[cupy.zeros((spec_logs, n, cfg.lin_num_v_heads, cfg.lin_v_dim // 32, cfg.lin_k_dim + GDN_LOG_PAD),
                                cupy.float32) for _ in range(logs)])

    def reset_slots(self, cache: Cache, slots) -> None:
        idx = cupy.asarray(np.asarray(list(slots), np.int64))
        for a in cache.conv + cache.rec:
            a[idx] = 0

    def copy_slots(self, cache: Cache, src, dst) -> None:
        """One copy_rows launch over every layer's conv and recurrent array and every (src, dst) pair (for
        the 4B a row is 24 x (2 MiB + 48 KiB)), on the current stream; several pairs go up in one small
        copy, a single pair (the usual restore or save) rides in the arguments."""
        if not len(src):
            return
        bases, row_bytes, longest = cache.rows
        if len(src) == 1:
            pairs, s0, d0 = np.uint64(0), int(src[0]), int(dst[0])
        else:
            pairs, s0, d0 = cupy.asarray(np.array([x for p in zip(src, dst) for x in p], np.int32)), 0, 0
        grid = (min(-(-longest // (16 * 256)), 64), len(bases), len(src))
        self._fn("state_copy.cu", "copy_rows")(grid, (256,), (bases, row_bytes, pairs, i32(s0), i32(d0)))

    def cache_budget(self, cfg, max_num_batched_tokens: int, max_num_seqs: int, utilization: float) -> int:
        """What `utilization` of the device leaves after the weights (already loaded) and a rough reserve
        for one step's activations and logits."""
        free, total = cupy.cuda.runtime.memGetInfo()
        per_token = 4 * (4 * cfg.intermediate_size + 2 * cfg.conv_dim + 8 * cfg.hidden_size)
        # + the chunked GDN prefill's workspace (W, P as bf16 hi/lo pairs in rows padded by 16 bytes, U, aux
        # f32: 4 bytes an element)
        per_token += 4 * cfg.lin_num_v_heads * (cfg.lin_k_dim + cfg.lin_v_dim + GDN_C + 4 + 8)
        logits = 8 * max_num_seqs * cfg.vocab_size
        return int(free - (1 - utilization) * total - max_num_batched_tokens * per_token - logits)

    def load_kernels(self, cfg) -> None:
        self.kernels.prefetch(kernels.needed(cfg, self.batch_invariant), report=True)

    @staticmethod
    def meta_size(T: int, B: int, n_logits: int, width: int) -> int:
        """int32 elements of the packed metadata buffer prepare() uploads (Step.packed)."""
        return sum(Step.field_sizes(T, B, n_logits, width))

    def prepare(self, step: Step, cache: Cache, out: cupy.ndarray | None = None, max_ctx: int | None = None) -> Meta:
        """Uploads the step's metadata in one host-to-device copy (Step.packed; views into one int32 buffer).

        out: a preallocated contiguous int32 device buffer of exactly meta_size(...) elements to upload
        into (on the current stream) instead of a fresh array, so the metadata lives at fixed addresses
        (CUDA-graph capture). max_ctx: the context bound (>= every seq_len) that sizes the attention split-K
        instead of max(seq_lens), so that decision does not change between replays."""
        B = step.num_seqs
        T = int(step.cu_seqlens[-1])
        host = step.packed(cache.block_size)
        if out is None:
            dev = cupy.asarray(host)
        else:
            if out.dtype != cupy.int32 or out.ndim != 1 or out.size != host.size or not out.flags.c_contiguous:
                raise ValueError(f"prepare: out must be a contiguous int32 [{host.size}] buffer, got "
                                 f"{out.dtype} {out.shape}")
            out.set(host)
            dev = out
        views, o = [], 0
        for n in Step.field_sizes(T, B, len(step.logits_rows), step.block_tables.shape[1]):
            views.append(dev[o:o + n])
            o += n
        views[-1] = views[-1].reshape(step.block_tables.shape)
        self.feed(views[0], step.feed)
        spec_logs = step.spec_logs if step.spec_logs is not None else np.full(B, -1, np.int32)
        ctx = int(step.seq_lens.max(initial=0))
        if max_ctx is not None:
            if max_ctx < ctx:
                raise ValueError(f"prepare: max_ctx {max_ctx} < longest context {ctx}")
            ctx = int(max_ctx)
        lens = np.diff(step.cu_seqlens)
        n_dec = leading_singles(lens)
        n_rec = n_dec + int(np.cumprod(spec_logs[n_dec:] >= 0).sum())  # (after the decodes a log set: a verify)
        return Meta(step, T, B, ctx, *views, max_new=int(lens.max(initial=0)), spec=bool(spec_logs.max(initial=-1) >= 0),
                    n_dec=n_dec, n_rec=n_rec)

    @staticmethod
    def feed(tokens: cupy.ndarray, feed) -> None:
        """Step.feed: tokens sampled on the device by the previous step, written into the uploaded tokens
        (after the copy, in stream order)."""
        if feed is None:
            return
        rows, ids = feed
        ids = cupy.asarray(ids).astype(cupy.int32, copy=False)
        if len(rows) and rows[-1] == len(rows) - 1:  # rows 0..k-1 (decodes come first): no index upload
            tokens[:len(rows)] = ids
        else:
            tokens[cupy.asarray(rows)] = ids

    def memory_used(self) -> int:
        return cupy.get_default_memory_pool().used_bytes()

    def to_host(self, x) -> np.ndarray:
        if isinstance(x, cupy.ndarray):
            if x.dtype == cupy.uint16:
                return bf16_to_f32(cupy.asnumpy(x))
            return cupy.asnumpy(x).astype(np.float32, copy=False)
        return np.asarray(x, np.float32)

    @staticmethod
    def mark():
        """An event recorded on the current stream: where the device is in the enqueued work."""
        e = cupy.cuda.Event()
        e.record()
        return e

    @staticmethod
    def elapsed_ms(a, b) -> float:
        """Device time between two marks (waits for the later one)."""
        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b)

    def argmax_finite(self, x):
        """NumPy's argmax_finite for f32 logits rows, left on the device: one launch (cuda/argmax.cu).
        Host arrays (a test hook's) take the NumPy path."""
        if isinstance(x, np.ndarray):
            return argmax_finite(x)
        assert x.dtype == cupy.float32 and x.ndim == 2 and x.strides[1] == 4, (x.dtype, x.strides)
        B, V = x.shape
        out = cupy.empty((B, 2), cupy.int32)
        if B:
            S = -(-V // ARGMAX_CHUNK) if B <= ARGMAX_SPLIT_ROWS else 1
            part = cupy.empty(3 * B * S, cupy.int32) if S > 1 else NULL
            self._fn("argmax.cu", "argmax_finite_kernel")((S, B), (ARGMAX_THREADS,),
                                                          (x, i64(x.strides[0] // 4), i32(V), out, part,
                                                           self._argmax_count))
        return out

    # ---- ops ---------------------------------------------------------------------------
    def _gather(self, table: cupy.ndarray, idx: cupy.ndarray) -> cupy.ndarray:
        n, H = idx.size, table.shape[1]
        assert H % 8 == 0 and table.flags.c_contiguous
        out = self._empty((n, H))
        if n:
            self._fn("embedding.cu", "gather_rows_kernel")((n,), (min(256, max(32, H // 8)),),
                                                          (idx, table, out, i32(H)))
        return out

    def embed(self, table, meta: Meta):
        return self._gather(table, meta.tokens)

    def gather_rows(self, x, rows):
        if isinstance(rows, np.ndarray):
            rows = cupy.asarray(rows.astype(np.int32))
        x = cupy.ascontiguousarray(x)
        return self._gather(x, rows.astype(cupy.int32, copy=False))

    def add_rms_norm(self, x, residual, w, eps):
        """residual += x (in place, bf16); returns (RMSNorm1p(residual), residual). None: first layer."""
        x = cupy.ascontiguousarray(x)
        T, H = x.shape
        assert H % 16 == 0 and H <= 8 * RMS_MAX_VEC, f"add_rms_norm: width {H}"
        y = self._empty((T, H))
        has_res = residual is not None
        if has_res:
            assert residual.flags.c_contiguous and residual.shape == x.shape
        res = residual if has_res else x
        if T:
            self._fn("norm.cu", "add_rms_norm_kernel")((T,), (min(256, max(32, ((H // 8 + 31) // 32) * 32)),),
                                                  (x, res, y, w, i32(H), f32(eps), i32(has_res)))
        return y, res

    def linear_add_rms_norm(self, x, w_proj, residual, w, eps):
        """add_rms_norm(linear(x, w_proj), residual, w, eps). Up to GEMV_FUSED_NORM_MAX_M rows one GEMV does
        it all (gemv.cu OUT = 3: the add into residual, then its last block's norm; the same bits as the two
        ops), so the norm's own launch (~3 us; 64 per 4B decode step) is gone."""
        M, H = x.shape[0], w_proj.shape[0]
        if (residual is not None and 1 <= M <= GEMV_FUSED_NORM_MAX_M and H % 16 == 0 and H // 16 <= GEMV_MAX_GROUPS
                and residual.flags.c_contiguous and residual.shape == (M, H)):
            gx = self._gemv_input(x, w_proj)
            if gx is not None:
                h = self._empty((M, H))
                part = self._empty((M, H // 16), cupy.float32)  # the rows' 16-column group sums of squares
                self._gemv(*gx, w_proj, residual, kernels.GEMV_OUT["residual"],
                           norm=(part, w, f32(eps), h, self._gemv_count))
                return h, residual
        return self.add_rms_norm(self.linear(x, w_proj), residual, w, eps)

    def linear(self, x, w):
        """y = x @ w^T. bf16 out, except f32 for the lm_head (the only weight with >= LOGITS_ROWS rows):
        logits of magnitude ~10 would lose up to 0.03 nat to bf16 rounding. Decode-sized M (1..GEMV_MAX_M)
        runs the weight-streaming tensor-core GEMV of cuda/gemv.cu (bit-identical rows whatever M; an x
        view its 16-byte loads cannot read in place is copied first); larger M, K % 8 != 0 or an unaligned
        weight go to cublasLt; with batch_invariant the GEMV runs up to GEMV_MAX_M_INVARIANT rows (its decode
        buckets) and gemm_inv above (gemv_bf16's results for any M)."""
        f32_out = w.shape[0] >= LOGITS_ROWS
        M, K = x.shape
        N = w.shape[0]
        small = 1 <= M <= (GEMV_MAX_M_INVARIANT if self.batch_invariant else GEMV_MAX_M)
        gx = self._gemv_input(x, w) if small or (self.batch_invariant and M) else None
        if gx is None:
            return gemm(x, w, f32_out=f32_out)
        out = self._empty((M, N), cupy.float32 if f32_out else cupy.uint16)
        if small:
            self._gemv(*gx, w, out, kernels.GEMV_OUT["f32" if f32_out else "bf16"])
        else:
            self._fn("gemv.cu", f"gemm_inv<{int(f32_out)}>")((-(-M // GI_BM), -(-N // GI_BN)), (256,),
                                                        (*gx, w, out, i32(M), i32(N), i32(K), i32(gemv_nw(N, K))))
        return out

    def swiglu(self, x, gate_up):
        """silu(gate) * up of x @ gate_up^T (weight_gate_up's row order). Decode-sized M: one GEMV with the
        activation in its epilogue; else the GEMM, then silu_mul_kernel. Both give the same bits."""
        M = x.shape[0]
        gx = self._gemv_input(x, gate_up) if 1 <= M <= GEMV_MAX_M else None
        if gx is None:
            return self._silu_mul(self.linear(x, gate_up))
        assert gate_up.shape[0] % 16 == 0, "swiglu: not a weight_gate_up weight"
        out = self._empty((M, gate_up.shape[0] // 2))
        self._gemv(*gx, gate_up, out, kernels.GEMV_OUT["swiglu"])
        return out

    @staticmethod
    def _gemv_input(x, w):
        """(x, its row stride in elements) for cuda/gemv.cu's 16-byte loads, or None where the weight or K
        rule the GEMV out. An x view those loads cannot read in place is copied (the engine's never is)."""
        M, K = x.shape
        if not (x.dtype == cupy.uint16 and w.dtype == cupy.uint16 and w.shape[1] == K and K % 8 == 0
                and w.flags.c_contiguous and w.data.ptr % 16 == 0):
            return None
        if x.strides[1] != 2 or x.data.ptr % 16 or (M > 1 and x.strides[0] % 16):
            x = x.copy()
        return x, i64(x.strides[0] // 2) if M > 1 else i64(K)

    def _gemv(self, x, sx, w, out, mode: int, norm: tuple = (NULL, NULL, f32(0), NULL, NULL)) -> None:
        """gemv_bf16: out = x @ w^T in form mode (kernels.GEMV_OUT); norm: the residual form's (group sums,
        norm weight, eps, normalized output, block counter)."""
        M, K = x.shape
        N = w.shape[0]
        name, blocks, nw, smem = gemv_plan(M, N, K, mode)
        self._fn("gemv.cu", name, smem)((blocks,), (32 * nw,), (x, sx, w, out, i32(M), i32(N), i32(K), *norm),
                                        shared_mem=smem)

    def _silu_mul(self, gate_up):
        """silu(gate) * up of a GEMM output in weight_gate_up's column order (blocks of 8 gate, 8 up)."""
        T, F2 = gate_up.shape
        F = F2 // 2
        assert F % 8 == 0
        sgu = _rs(gate_up)
        assert sgu % 8 == 0
        out = self._empty((T, F))
        n = T * (F // 8)
        if n:
            grid = min((n + 255) // 256, self.num_sms * 16)
            self._fn("activation.cu", "silu_mul_kernel")((grid,), (256,), (gate_up, sgu, out, i32(T), i32(F)))
        return out

    def conv1d(self, x, w, state, meta: Meta, log=None):
        """x [T, C] (column view), w bf16 [C, K], state bf16 [slots, K-1, C] updated in place."""
        T, C = x.shape
        K = w.shape[1]
        if K not in kernels.CONV_K:
            raise ValueError(f"conv1d: kernel size {K} not supported (instantiated: {kernels.CONV_K})")
        assert C % 8 == 0 and w.dtype == cupy.uint16 and state.dtype == cupy.uint16 and w.flags.c_contiguous
        out = self._empty((T, C))
        if T:
            if x.strides[1] != 2 or x.strides[0] % 16 or x.data.ptr % 16:
                x = cupy.ascontiguousarray(x)  # 16-byte loads: a fused width that is not a multiple of 8 (tiny3)
            sx = _rs(x)
            logs = _log_args(log, meta, (K - 1, C), cupy.uint16)
            # a step of decodes and verifies only (no prefill, hence no snapshot saves): conv1d_fwd writes the new
            # state and a verify's per-token states itself, a sequence's tokens (tt: a power of two >= the most,
            # at most the block's threads) in one block (one launch instead of two). Otherwise tokens per thread:
            # 16 in a prefill (each x row read once), halved until the grid has two blocks per SM (a small mixed
            # step: 16 decode rows + 64 prompt tokens ran 40 blocks, 21 us a layer on an H100). Any tiling gives
            # the same sums.
            update = meta.n_rec == meta.B and meta.max_new <= CONV_THREADS
            if update:
                tt = 1 << (meta.max_new - 1).bit_length()
                grid = (-(-C // (8 * CONV_THREADS // tt)), meta.B)
            else:
                bx, tt = -(-C // (8 * CONV_THREADS)), 16
                while tt > 1 and -(-T // tt) * bx < 2 * self.num_sms:
                    tt //= 2
                grid = (bx, -(-T // tt))
            self._fn("conv1d.cu", f"conv1d_fwd<{K}>")(grid, (CONV_THREADS,),
                                                 (x, sx, w, state, out, meta.tok_seq, meta.cu_seqlens, meta.slots,
                                                  meta.spec_logs, meta.replay, *logs, i32(T), i32(C), i32(tt),
                                                  i32(update)))
            if not update:
                self._fn("conv1d.cu", "conv1d_state_update")(((C + 255) // 256, meta.B), (256,),
                                                        (x, sx, state, meta.cu_seqlens, meta.slots, meta.save_at,
                                                         meta.save_rows, meta.spec_logs, meta.replay, *logs, i32(C),
                                                         i32(K)))
        return out

    def delta_rule(self, qkv, a, b, A_log, dt_bias, state, meta: Meta, log=None):
        """Gated delta rule for every sequence: the token recurrence for the leading decodes and verifies
        (a verify logs its tokens, a replay applies them first: step.py), the chunked WY form for the rest
        (prefill, chunked prefill). A decode row thus takes the same kernel in a decode step and in a mixed
        one."""
        nv, dk, dv = state.shape[1:]
        nk = (qkv.shape[1] - nv * dv) // (2 * dk)
        T = qkv.shape[0]
        assert dk in kernels.GDN_DK and dv % 32 == 0 and nv % nk == 0 and state.dtype == cupy.float32
        assert A_log.dtype == cupy.float32 and dt_bias.dtype == cupy.float32
        assert state.flags.c_contiguous and state.data.ptr % 16 == 0  # 16-byte cp.async of state rows
        out = self._empty((T, nv * dv))
        if not T:
            return out
        nd = meta.n_rec
        if nd:  # blocks walk the (dv / 32) x nv x nd state tiles, the next one's state prefetched (gdn.cu)
            logs = _log_args(log, meta, (nv, dv // 32, dk + GDN_LOG_PAD), cupy.float32)
            # two state tiles, and two sets of the log entries a tile replays (K1 of them at most)
            tiles, smem = dv // 32 * nv * nd, 2 * dk * 32 * 4 + 2 * int(logs[1]) * (dk + GDN_LOG_PAD) * 4
            self._fn("gdn.cu", f"gdn_recurrent<{dk}>", smem)(
                (min(tiles, GDN_REC_BLOCKS * self.num_sms),), (128,),
                (qkv, _rs(qkv), a, _rs(a), b, _rs(b), A_log, dt_bias, state, meta.cu_seqlens, meta.slots,
                 meta.spec_logs, meta.replay, *logs, out, i32(nk), i32(nv), i32(dv), i32(nd)), shared_mem=smem)
        if nd == meta.B:
            return out
        C = GDN_C
        n_chunks = -(-meta.max_new // C)
        if meta.chunked is None:
            meta.chunked = meta.cu_seqlens[nd:], meta.slots[nd:], meta.save_at[nd:], meta.save_rows[nd:]
        cu, slots, save_at, save_rows = meta.chunked
        W = self._empty((nv, T, 2 * dk + 8))  # bf16 hi | lo pairs, rows padded as the state pass stages them (gdn.cu)
        U = self._empty((nv, dv // 32, T, 32), cupy.float32)
        P = self._empty((nv, T, 2 * C + 8))
        aux = self._empty((nv, T, 4), cupy.float32)
        # prep copies q, k and v rows in 16-byte pieces, the state pass q and k rows; one thread per column of [W | U]
        assert _rs(qkv) % 8 == 0 and qkv.data.ptr % 16 == 0 and dv % 8 == 0, \
            "gdn_chunk_prep: q/k/v rows not 16-byte aligned"
        assert dk + dv <= 256, "gdn_chunk_prep: one thread per column of [W | U]"
        # the per-row scalars, then the padded raw q, k, v rows and A, or X over them (gdn.cu)
        smem = 4 * 5 * C + max(C * (2 * (dk + 8) * 2 + (dv + 8) * 2 + 4 * (C + 4)), 4 * C * (dk + dv))
        self._fn("gdn.cu", f"gdn_chunk_prep<{dk}>", smem)((n_chunks, nv, meta.B - nd), (256,),
             (qkv, _rs(qkv), a, _rs(a), b, _rs(b), A_log, dt_bias, cu, W, U, P, aux,
              i32(T), i32(nk), i32(nv), i32(dv)), shared_mem=smem)
        if self._gdn_state_wg(meta, nv, dk, dv):  # a warpgroup per 64 state columns (gdn.cu)
            smem = 2 * GDN_WG_STAGE + C * 64 * 2 + 64 * dk * 2 + 1024  # two stages, o's transpose, S^T lo, alignment
            self._fn("gdn.cu", f"gdn_chunk_state_wg<{dk}>", smem)((dv // 64, nv, meta.B - nd), (128,),
                (W, U, P, qkv, _rs(qkv), aux, state, cu, slots, save_at, save_rows, out, i32(T), i32(nk), i32(nv)),
                shared_mem=smem)
            return out
        # S, v_new, sk v_new (padded bf16 hi | lo rows), the stages of W, q, k, P, U, aux (GDN_STAGES: two on
        # sm_90a, else one), 4 mbarriers (gdn.cu); on sm_90a the state tiles run in clusters that share their
        # loads, of a size that divides them
        hopper = self.kernels.arch == kernels.SM90A
        rs = (2 * 32 + 8) * 2
        stage = C * ((2 * dk + 8) * 2 + 2 * (dk + 8) * 2 + (2 * C + 8) * 2 + 32 * 4 + 16)
        smem = dk * rs + 2 * C * rs + (2 if hopper else 1) * stage + 32
        cl = max(c for c in kernels.GDN_CLUSTERS if dv // 32 % c == 0) if hopper else 1
        self._fn("gdn.cu", f"gdn_chunk_state<{dk}, {cl}>", smem)(
            (dv // 32, nv, meta.B - nd), (32 * GDN_STATE_WARPS + 32,),
            (W, U, P, qkv, _rs(qkv), aux, state, cu, slots, save_at, save_rows, out, i32(T), i32(nk), i32(nv),
             i32(dv)), shared_mem=smem)
        return out

    def _gdn_state_wg(self, meta, nv, dk, dv):
        """Whether the chunked state pass runs as gdn_chunk_state_wg (sm_90a, dk = dv = 128) rather than
        gdn_chunk_state: the one with less time per SM by a fluid model of its blocks (one block per SM for
        both, sequences' chunks walked in order). gdn_chunk_state's blocks take 32 columns of a head's state a
        chunk in ~3.7 us, gdn_chunk_state_wg's 64 in ~4.3 (H100, 4B shapes): one sequence of the 4B's 32 heads
        fills the SMs with the first and half of them with the second; several fill both. Batch-invariant
        mode keeps gdn_chunk_state: the choice depends on the step's other sequences, and the numbers on it."""
        if self.kernels.arch != kernels.SM90A or not dk == dv == kernels.GDN_WG_D or self.batch_invariant:
            return False
        if self.gdn_state_wg is not None:
            return self.gdn_state_wg
        if meta.gdn_chunks is None:  # ~20 us of NumPy calls: once a step, not once a layer
            meta.gdn_chunks = int((-(-np.diff(meta.step.cu_seqlens[meta.n_rec:]) // GDN_C)).sum())
        longest, per_sm = -(-meta.max_new // GDN_C), meta.gdn_chunks * nv * dv / self.num_sms
        return GDN_WG_CHUNK_US * max(longest, per_sm / 64) < GDN_CHUNK_US * max(longest, per_sm / 32)

    def gated_rms_norm(self, o, z, w, eps):
        dv = w.shape[0]
        o = cupy.ascontiguousarray(o)
        T, W = o.shape
        nh = W // dv
        assert dv in (32, 64, 128, 256) and w.dtype == cupy.float32, "gated_rms_norm: dv / 8 lanes a row"
        if z.strides[1] != 2 or z.strides[0] % 16 or z.data.ptr % 16:
            z = cupy.ascontiguousarray(z)  # 16-byte loads
        y = self._empty((T, W))
        rows = T * nh
        if rows:
            self._fn("norm.cu", "gated_rms_norm_kernel")((-(-rows * dv // 8 // 128),), (128,),
                                                    (o, z, _rs(z), y, w, i32(rows), i32(nh), i32(dv), f32(eps)))
        return y

    def _freqs(self, rd, theta):
        key = (rd, float(theta))
        if key not in self._inv_freq:  # as HF computes it: f32 of 1 / theta ** (arange(0, rd, 2) / rd)
            inv = (1.0 / (theta ** (np.arange(0, rd, 2, dtype=np.int64).astype(np.float32) / rd))).astype(np.float32)
            self._inv_freq[key] = cupy.asarray(inv)
        return self._inv_freq[key]

    def attn_prep(self, q_gate, k, v, q_norm, k_norm, k_cache, v_cache, meta: Meta, rotary_dim, theta, eps,
                  gated=True):
        """Returns (q [T, nh, hd] contiguous, gate: a [T, nh, hd] strided view into q_gate, no copy).
        gated False: q_gate is q alone (per-head stride hd; gate None), or None (K/V only: no q jobs)."""
        hd = k_norm.shape[0]
        T = k.shape[0]
        nkv = k_cache.shape[2]
        nh = 0 if q_gate is None else q_gate.shape[1] // ((2 if gated else 1) * hd)
        q = self._empty((T, nh, hd)) if nh else None
        sqg = _rs(q_gate) if nh else i64(0)
        gate = None
        if gated and nh:
            gate = cupy.ndarray((T, nh, hd), cupy.uint16, q_gate.data + hd * 2, strides=(int(sqg) * 2, 2 * hd * 2, 2))
        if T:
            self._fn("attention.cu", "attn_prep")(
                (T, -(-(nh + 2 * nkv) // 4)), (128,),
                (k if q_gate is None else q_gate, sqg, k, _rs(k), v, _rs(v), k_norm if q_norm is None else q_norm,
                 k_norm, k if q is None else q, k_cache, v_cache, meta.slot_mapping, meta.positions,
                 self._freqs(rotary_dim, theta), i32(nh), i32(nkv), i32(hd), i32(rotary_dim), f32(eps),
                 i32((2 if gated else 1) * hd)), shared_mem=4 * hd * 4)
        return q, gate

    def _no_gate(self, hd: int) -> cupy.ndarray:
        """A gate of bf16 +inf for every (token, head), as a [1, 1, hd] row read with zero strides:
        sigmoid(+inf) = 1 exactly, so the attention kernels' output is ungated (DFlash)."""
        if hd not in self._ungated:
            self._ungated[hd] = cupy.full((1, 1, hd), 0x7F80, cupy.uint16)
        return self._ungated[hd]

    def attention(self, q, gate, k_cache, v_cache, meta: Meta, causal=True, window=0):
        """Decode rows: attn_fwd (tensor cores, split-K over long contexts; each row sees the keys up to its own
        position). A step with a sequence of more than one new token: the leading decodes and verifies (a
        verify's 1 + k rows are decode-sized queries) still go to attn_fwd, every later sequence to
        attn_prefill (wgmma, cuda/attention_prefill.cu) on sm_90 when hd and the block size allow it. Not causal
        or windowed (the DFlash drafter's 16-token blocks): attn_fwd for every token, given each token's last
        key (its sequence's, when not causal) and the window."""
        T, nh, hd = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        G = nh // nkv
        assert hd in kernels.ATTN_HD and G in kernels.ATTN_G and q.flags.c_contiguous
        if gate is None:
            gate = cupy.ndarray((T, nh, hd), cupy.uint16, self._no_gate(hd).data, strides=(0, 0, 2))
        if gate.ndim == 2:
            gate = gate.reshape(T, nh, hd)
        sg_t, sg_h = gate.strides[0] // 2, gate.strides[1] // 2
        assert gate.strides[2] == 2
        out = self._empty((T, nh * hd))
        if not T:
            return out
        bt = meta.block_tables
        n_dec = T  # tokens 0 .. n_dec - 1 go to attn_fwd
        if (causal and not window and meta.max_new > 1 and self.kernels.arch == kernels.SM90A
                and hd in kernels.PREFILL_HD and bs & (bs - 1) == 0):
            wave, part_o, part_ml, counters = self._pf_parts(hd, nkv)
            key = (G, wave)  # the parts' workspace slots are the wave's of (hd, nkv)
            if meta.prefill_tiles is None or meta.prefill_tiles[0] != key:
                tiles, n_pf_dec = prefill_tiles(meta.step, G, meta.n_rec, wave)
                meta.prefill_tiles = (key, None if tiles is None else cupy.asarray(tiles), n_pf_dec)
            _, tiles, n_pf_dec = meta.prefill_tiles
            if tiles is not None:
                n_dec = n_pf_dec
                self._fn("attention_prefill.cu", f"attn_prefill<{hd}>", _pf_smem(hd))(
                    (nkv, tiles.shape[0]), (256,),
                    (q, gate, i64(sg_t), i64(sg_h), k_cache, v_cache, bt, i32(bt.shape[1]), tiles, meta.positions,
                     i32(nkv), i32(G), i32(bs.bit_length() - 1), f32(hd ** -0.5 * np.log2(np.e)), out,
                     part_o, part_ml, counters),
                    shared_mem=_pf_smem(hd))
        if not n_dec:
            return out
        chunk, nsplit = self._attn_split(meta, hd, G, nkv, n_dec)
        if nsplit > 1:
            part_acc = cupy.empty((n_dec, nh, nsplit, hd), cupy.float32)
            part_ml = cupy.empty((n_dec, nh, nsplit, 2), cupy.float32)
        else:
            part_acc = part_ml = out  # unused
        last = meta.positions if causal else meta.seq_lens[meta.tok_seq] - 1  # each token's last key
        self._fn("attention.cu", f"attn_fwd<{hd}, {G}>")(
            (nsplit, nkv, n_dec), (128,),
            (q, gate, i64(sg_t), i64(sg_h), k_cache, v_cache, bt, i32(bt.shape[1]), meta.tok_seq, last,
             i32(nkv), i32(bs), i32(chunk), i32(window), f32(hd ** -0.5), out, part_acc, part_ml))
        if nsplit > 1:
            self._fn("attention.cu", "attn_combine")((n_dec * nh, hd // ATTN_COMBINE_DIMS), (ATTN_COMBINE_THREADS,),
                                                (part_acc, part_ml, gate, i64(sg_t), i64(sg_h), out, i32(nh), i32(hd),
                                                 i32(nsplit)))
        return out

    def prefill_wave(self, hd: int, nkv: int) -> int:
        """attn_prefill's tiles per KV head that run at once (prefill_tiles splits the keys of fewer tiles
        into parts up to that many; 0 in batch-invariant mode: a tile's split would follow the rest of the
        step). Makes the parts' workspace on first use: an eager call, before any graph capture."""
        return self._pf_parts(hd, nkv)[0]

    def _pf_parts(self, hd: int, nkv: int) -> tuple:
        """(wave, part_o, part_ml, counters): prefill_wave() and the split parts' workspace (NULLs when
        nothing splits), made once per (hd, nkv) (attention() asks every layer)."""
        got = self._pf_work.get((hd, nkv))
        if got is None:
            wave = 0
            if not self.batch_invariant and self.kernels.arch == kernels.SM90A and hd in kernels.PREFILL_HD:
                wave = self.num_sms * self.kernels.resident("attention_prefill.cu", f"attn_prefill<{hd}>", 256,
                                                            _pf_smem(hd)) // nkv
            slots = wave * nkv
            got = self._pf_work[hd, nkv] = (wave, cupy.empty((slots, PF_ROWS, hd), cupy.float32),
                                            cupy.empty((slots, PF_ROWS, 2), cupy.float32),
                                            cupy.zeros(slots, cupy.int32)) if wave else (0, NULL, NULL, NULL)
        return got

    def _attn_split(self, meta: Meta, hd: int, G: int, nkv: int, n_dec: int):
        """attn_fwd's key split for the step's first n_dec rows: (keys per split, or 0 for even splits; number
        of splits)."""
        if self.batch_invariant:  # splits at fixed key offsets (an empty split changes nothing in attn_combine)
            chunk = INVARIANT_SPLIT_KEYS
            nsplit = -(-meta.max_ctx // chunk)
        else:  # as many splits as the GPU holds at once (one full wave: 320 blocks over 264 slots ran the
            # b16 step's attention at 57% of copy); each token's keys spread evenly over them (chunk 0).
            # Counted per sequence when the rows are the decodes' and verifies': a verify's rows then split as
            # the decode of the same position in a step of as many sequences would (the same sums: greedy
            # speculation follows plain decoding's numerics there)
            lead = int(meta.step.cu_seqlens[meta.n_rec])
            base = (meta.n_rec if n_dec == lead else n_dec) * nkv
            slots = self.num_sms * self.kernels.resident("attention.cu", f"attn_fwd<{hd}, {G}>", 128)
            nsplit = max(1, min(slots // base, -(-meta.max_ctx // ATTN_MIN_SPLIT_KEYS)))
            chunk = 0
        return chunk, nsplit
