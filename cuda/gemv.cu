// Small-M bf16 GEMM ("GEMV" shape) for decode: y[M, N] = x[M, K] @ W[N, K]^T, M <= 16.
// W row-major [N, K] bf16 bits (contiguous); x [M, K] bf16 bits with row stride sx (elements);
// f32 accumulation; y [M, N] contiguous, bf16 (OUT = 0) or f32 (OUT = 1, the lm_head logits); OUT = 2 is
// the MLP's SwiGLU: W is gate|up with rows interleaved in blocks of 8 (16b + e: gate row 8b + e, e < 8;
// up row 8b + e - 8 otherwise; CudaBackend.weight_gate_up) and y [M, N / 2] = silu(gate) * up, each GEMM
// output rounded to bf16 first: bit-identical to OUT = 0 followed by silu_mul_kernel.
//
// Why tensor cores and not FFMA. At M rows the FFMA form needs M FMAs plus a bf16 unpack per weight
// element; streaming W at 4.3 TB/s is ~8.3 weight elements per SM clock, so M = 16 would need
// ~8.3 * 17 = 140 issued instructions per SM clock against 128: issue-bound before bandwidth-bound.
// One mma.sync.m16n8k16 instead multiplies 16 W rows x 16 k by 8 x rows (2048 MACs) with no unpack;
// at M = 16 the whole kernel issues < 0.5 instructions per 16-byte W load. W is the mma's A operand
// (16 output features), x^T its B operand (n = 8 batch rows per tile; MT tiles cover M <= 8 * MT).
//
// Data path. A warp owns 16 * R W rows and a contiguous slice of the K dimension; K is walked in
// 32-element "steps". Lane (g = lane / 4, tg = lane % 4) loads, per step, one 16-byte uint4 of W rows
// g and g + 8 of each 16-row group at k = step * 32 + 8 * tg (a warp instruction reads 8 rows x 64
// contiguous bytes: whole 32-byte sectors) with ld.global.nc.L1::no_allocate (W is streamed once and
// must not evict x from L1), and one uint4 of x row g (+ 8 for the second tile) at the same k. Because
// the mma's k slots may be any permutation of k applied to both operands, these raw loads are the
// fragments directly: words 0,1 feed the first k16 mma, words 2,3 the second (no shuffles, no shared
// memory on the input side). Each iteration issues U steps of loads before any mma: 2 * R * U
// independent 16-byte W loads per thread in flight (4 or 8: 2 or 4 KiB per warp, plus x). x is NOT staged in shared memory:
// with K split across a block's warps every x element is used by exactly one warp of the block, so
// staging would add a copy and a barrier without reuse; it comes through L1 (it is <= 295 KiB in all
// and shared by all blocks on an SM). x traffic is M / (16 * R) of W traffic; R = 2 halves it at
// larger M (the host picks R; it does not change any result).
//
// Block = NW warps (run time, NW = blockDim.x / 32, <= 16) sharing one group of 16R rows, warp w
// taking steps [w * S / NW, (w + 1) * S / NW) of the S = K / 32 steps. Partials (per warp: 16R x 8MT
// f32) go to shared memory and one thread per output sums them over w = 0 .. NW-1 in order.
// Grid = ceil(N / (16 R)) blocks. The host (gemv_plan in engine/gpu/gemv_plan.py) picks NW from (N, K)
// and the variant from (M, NW): e.g. 4B down (N = 2560, only 160 row groups) runs 16 warps per block.
//
// Determinism and M-invariance. An output y[m, n] is: per warp, the mma chain over its k slice in step
// order (each tensor-core output element depends only on its own A row, B column and accumulator),
// then the in-order sum over the block's NW warps. NW is chosen from (N, K) only, never from M, and
// neither MT (tile count), R (rows per warp), U (load batching) nor masked rows change that order: a
// row's result is bit-identical whatever batch (M <= 16) it is computed in. (The cublasLt path used
// above the threshold rounds differently.) No atomics, no allocation, no sync: graph-capturable.
//
// M buckets: MT = 1 for M <= 8, MT = 2 for M <= 16 (not one instantiation per M): the mma's n is 8
// wide, so M = 1..8 issue the same instructions and only the x loads scale with M. A batch-invariant
// backend also runs MT = 4 and 8 (M <= 32, 64: its decode buckets; same K slices, so the same bits). Rows m >= M and
// n >= N are clamped to a valid row (the tensor core keeps rows and columns apart, so they only feed
// outputs that are not stored); K must be a multiple of 8 (a uint4 is either in or out; K % 32 != 0
// is one predicated tail step of the last warp), x's row stride a multiple of 8 and both base
// pointers 16-byte aligned (the host checks).
#include "common.cuh"

#define GEMV_MAX_WARPS 16
#define GEMV_MAX_GROUPS 512  // OUT = 3: 16-column groups per row (N <= 8192)
#define GEMV_NORM_BATCH 4    // OUT = 3: residual vectors a thread of the last block loads at once

// W loads skip L1 (W is read once; x stays cached). PF = 1 adds the .L2::256B prefetch-size hint: it
// pays off for the U = 4 plans, whose warps read 256 contiguous bytes per row per iteration, and costs
// on the 16-warp plans of N = 2560 (the sweep: docs/benchmarks/NOTES.md). NC = 0 (the batch issued before
// the PDL wait) drops .nc: ptxas moves the wait above .nc loads, not above coherent ones.
template <int PF, int NC = 1>
__device__ __forceinline__ uint4 gemv_ld_w(const bf16_t* p) {
    uint4 r;
#define GEMV_LD_W(Q) asm volatile("ld.global" Q ".v4.u32 {%0, %1, %2, %3}, [%4];" \
                                  : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p))
    if (PF && NC) GEMV_LD_W(".nc.L1::no_allocate.L2::256B");
    else if (NC) GEMV_LD_W(".nc.L1::no_allocate");
    else if (PF) GEMV_LD_W(".L1::no_allocate.L2::256B");
    else GEMV_LD_W(".L1::no_allocate");
#undef GEMV_LD_W
    return r;
}

__device__ __forceinline__ uint4 gemv_ld_x(const bf16_t* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// One 32-k step: W rows g (lo) and g + 8 (hi) of a 16-row group, x row g; words 0,1 then 2,3.
__device__ __forceinline__ void mma_step(float (&d)[4], const uint4& lo, const uint4& hi, const uint4& xb) {
    mma_bf16(d, lo.x, hi.x, lo.y, hi.y, xb.x, xb.y);
    mma_bf16(d, lo.z, hi.z, lo.w, hi.w, xb.z, xb.w);
}

// MT: 8-row x tiles (M <= 8 * MT); R: 16-row W groups per warp; U: 32-k steps per load batch;
// PF: L2 256-byte prefetch hint on W loads; OUT: 0 bf16, 1 f32, 2 SwiGLU (bf16, N / 2 columns), 3 the
// residual add and RMSNorm after a sublayer's output projection (below).
// Dynamic shared memory: NW * 16R * 8MT floats (OUT = 3: + 16R * 8MT).
//
// OUT = 3 (CudaBackend.linear_add_rms_norm): the residual add and RMSNorm1p that follow o_proj, out_proj
// and down, fused into that GEMV, so the norm's own kernel (one block, ~3 us with its launch) is gone.
// y is the residual [M, N] (bf16, in place): res = bf16(res + bf16(x W^T)); each block writes its rows'
// 16-column group sums of res^2 to part [M][N / 16] (common.cuh's order); the last block to finish (count:
// a zeroed counter it leaves zeroed) reduces them to the row scales and writes xn = RMSNorm1p(res) with
// weight nwt (f32 [N]) and eps: add_rms_norm_kernel's arithmetic in its order, the same bits. The
// normalization needs every column's sum first, hence one block doing it: the host fuses only at few rows
// (GEMV_FUSED_NORM_MAX_M). (Deferring the row scale to the next GEMV instead, y = scale (x' W^T) with
// x' = bf16(res (1 + w)), was 3% faster at one row but rounds elsewhere than HF, and failed the tiny3 HF
// gate: docs/benchmarks/session15-h100.md.)
template <int MT, int R, int U, int PF, int OUT>
__global__ void __launch_bounds__(32 * GEMV_MAX_WARPS) gemv_bf16(
    const bf16_t* __restrict__ x, long long sx,   // [M, K], row stride sx
    const bf16_t* __restrict__ w,                 // [N, K] contiguous
    void* __restrict__ y,                         // [M, N] contiguous, bf16 or f32
    int M, int N, int K,
    float* __restrict__ part, const float* __restrict__ nwt, float eps, bf16_t* __restrict__ xn,  // OUT = 3
    unsigned* __restrict__ count)
{
    constexpr int ROWS = 16 * R, COLS = 8 * MT;
    extern __shared__ float red[];  // [NW][COLS][ROWS]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, kt = 8 * (lane & 3);
    const int n0 = blockIdx.x * ROWS;

    // the full 32-k steps, split over the warps: this warp takes steps [s, s1)
    const int steps = K >> 5;
    const int s1 = (warp + 1) * steps / nw;
    int s = warp * steps / nw;

    // Rows past N (W) and past M (x) are clamped to a valid row instead of masked: a tensor-core output
    // element depends only on its own A row and B column, so the clamped rows only feed outputs that are
    // never stored, and the hot loop carries no predicates (at M = 1 all 8 lane groups read the same x
    // bytes, which the load unit serves once).
    const bf16_t* wp[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = n0 + 16 * r + 8 * h + g;
            wp[r][h] = w + (long long)(row < N ? row : N - 1) * K + s * 32 + kt;
        }
    const bf16_t* xp[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int m = 8 * t + g;
        xp[t] = x + (long long)(m < M ? m : M - 1) * sx + s * 32 + kt;
    }

    float acc[R][MT][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.0f;

    // U steps of loads in flight, then their mmas in k order. The first batch's W is loaded before
    // waiting for the kernel before this one (PDL, common.cuh): no kernel writes W, only x, so the first
    // DRAM round trip of a GEMV overlaps its predecessor's tail (that batch peeled off the loop).
    const unsigned zero = (unsigned)K >> 31;  // 0 (K > 0), opaque to the compiler
    uint4 a[U][R][2];
    auto load_w = [&](bool early) {  // (a constant at each call: the branch folds)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                a[u][r][0] = early ? gemv_ld_w<PF, 0>(wp[r][0] + 32 * u) : gemv_ld_w<PF>(wp[r][0] + 32 * u);
                a[u][r][1] = early ? gemv_ld_w<PF, 0>(wp[r][1] + 32 * u) : gemv_ld_w<PF>(wp[r][1] + 32 * u);
            }
    };
    auto x_and_mma = [&]() {  // the batch's x, then its mmas; steps s .. s + U - 1 done
        uint4 b[U][MT];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int t = 0; t < MT; ++t) b[u][t] = gemv_ld_x(xp[t] + 32 * u);
        // ptxas otherwise sinks each step's loads down to its mmas (one step in flight, not U): make the
        // first mma depend on one word of every load, through a zero the compiler cannot see.
        unsigned dep = 0u;
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int r = 0; r < R; ++r) dep |= a[u][r][0].w | a[u][r][1].w;
#pragma unroll
            for (int t = 0; t < MT; ++t) dep |= b[u][t].w;
        }
        a[0][0][0].x ^= dep & zero;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int t = 0; t < MT; ++t) mma_step(acc[r][t], a[u][r][0], a[u][r][1], b[u][t]);
#pragma unroll
        for (int r = 0; r < R; ++r) { wp[r][0] += 32 * U; wp[r][1] += 32 * U; }
#pragma unroll
        for (int t = 0; t < MT; ++t) xp[t] += 32 * U;
        s += U;
    };
    const bool first = MT <= 4 && s + U <= s1;  // (MT = 8, the invariant mode's 64 rows, would spill)
    if (first) load_w(true);
    pdl_enter();
    const int Mv = M < COLS ? M : COLS;
    if (first) x_and_mma();
    while (s + U <= s1) {
        load_w(false);
        x_and_mma();
    }
    // the rest of the slice one step at a time, then (last warp) a partial step when K % 32 != 0
    const bool tail = warp == nw - 1 && (K & 31);
    for (; s < s1 + (tail ? 1 : 0); ++s) {
        const bool ok = s * 32 + kt < K;
        uint4 a[R][2], b[MT];
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            a[r][0] = ok ? gemv_ld_w<PF>(wp[r][0]) : z;
            a[r][1] = ok ? gemv_ld_w<PF>(wp[r][1]) : z;
            wp[r][0] += 32; wp[r][1] += 32;
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) { b[t] = ok ? gemv_ld_x(xp[t]) : z; xp[t] += 32; }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < MT; ++t) mma_step(acc[r][t], a[r][0], a[r][1], b[t]);
    }

    // accumulator (r, t): [0] (row 16r+g, col 8t+2tg), [1] col +1, [2] row +8, [3] row +8 col +1
    const int c = 2 * (lane & 3);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            float* p = red + (warp * COLS + 8 * t + c) * ROWS + 16 * r + g;
            p[0] = acc[r][t][0];
            p[ROWS] = acc[r][t][1];
            p[8] = acc[r][t][2];
            p[ROWS + 8] = acc[r][t][3];
        }
    __syncthreads();
    auto total = [&](int row, int col) {  // the warps' partial sums of one output, in warp order
        float v = red[col * ROWS + row];
        for (int j = 1; j < nw; ++j) v += red[(j * COLS + col) * ROWS + row];
        return v;
    };
    if (OUT == 2) {  // block rows 16b + e (gate) and 16b + 8 + e (up) -> feature n0 / 2 + 8b + e
        const int valid = Mv * (ROWS / 2);
        for (int i = threadIdx.x; i < valid; i += blockDim.x) {
            const int f = i % (ROWS / 2), col = i / (ROWS / 2);
            const int row = 16 * (f >> 3) + (f & 7);
            if (n0 + row >= N) continue;
            const float gb = bf2f(f2bf(total(row, col))), ub = bf2f(f2bf(total(row + 8, col)));
            static_cast<bf16_t*>(y)[(long long)col * (N / 2) + n0 / 2 + f] = f2bf(silu_f(gb) * ub);
        }
        return;
    }
    const int valid = Mv * ROWS;
    if (OUT == 3) {  // res = bf16(res + bf16(v)) and each row's group sums of res^2; the last block: xn
        float* hs = red + nw * COLS * ROWS;  // [COLS][ROWS]: the new res values
        bf16_t* res = static_cast<bf16_t*>(y);
        for (int i = threadIdx.x; i < valid; i += blockDim.x) {
            const int row = i % ROWS, col = i / ROWS, n = n0 + row;
            if (n >= N) continue;
            const long long o = (long long)col * N + n;
            const float h = bf2f(f2bf(bf2f(f2bf(total(row, col))) + bf2f(res[o])));
            res[o] = f2bf(h);
            hs[col * ROWS + row] = h;
        }
        __syncthreads();
        const int G = N >> 4;
        for (int i = threadIdx.x; i < valid / 16; i += blockDim.x) {
            const int r = i % R, col = i / R, grp = n0 / 16 + r;
            if (grp >= G) continue;
            const float* hp = hs + col * ROWS + 16 * r;
            part[(long long)col * G + grp] = sumsq8(hp) + sumsq8(hp + 8);
        }
        if (!last_block_in(count, gridDim.x)) return;  // the last block to finish reduces every block's group sums
        __shared__ float s_rs[COLS];  // the rows' scales
        for (int m = warp; m < Mv; m += nw) {
            const float* pm = part + (long long)m * G;
            const float ss = row_sumsq<GEMV_MAX_GROUPS>([&](int j) { return __ldcg(pm + j); }, G);
            if (lane == 0) s_rs[m] = rms_scale(ss, N, eps);
        }
        if (threadIdx.x == 0) *count = 0u;  // for the next producer (stream order; PDL waits for this grid)
        __syncthreads();
        // xn = RMSNorm1p(res), 8 columns a thread, GEMV_NORM_BATCH vectors' loads in flight together
        const int nvec = N >> 3, all = Mv * nvec;
        const float4* w4 = reinterpret_cast<const float4*>(nwt);
        for (int i0 = threadIdx.x; i0 < all; i0 += GEMV_NORM_BATCH * blockDim.x) {
            uint4 rv[GEMV_NORM_BATCH];
#pragma unroll
            for (int u = 0; u < GEMV_NORM_BATCH; ++u) {
                const int i = i0 + u * blockDim.x;
                if (i < all) rv[u] = __ldcg(reinterpret_cast<const uint4*>(res) + i);
            }
#pragma unroll
            for (int u = 0; u < GEMV_NORM_BATCH; ++u) {
                const int i = i0 + u * blockDim.x;
                if (i >= all) break;
                const int m = i / nvec, c8 = i - m * nvec;
                float a[8];
                unpack8(rv[u], a);
                rms_apply8(a, s_rs[m], __ldg(w4 + 2 * c8), __ldg(w4 + 2 * c8 + 1));
                reinterpret_cast<uint4*>(xn)[i] = pack8(a);
            }
        }
        return;
    }
    if (OUT < 2) {  // (a guard, not a return after OUT = 3's block: nvcc finds this loop unreachable there)
        for (int i = threadIdx.x; i < valid; i += blockDim.x) {
            const int row = i % ROWS, col = i / ROWS;
            const int n = n0 + row;
            if (n >= N) continue;
            const float v = total(row, col);
            const long long o = (long long)col * N + n;
            if (OUT == 1) static_cast<float*>(y)[o] = v;
            else static_cast<bf16_t*>(y)[o] = f2bf(v);
        }
    }
}

// Batch-invariant GEMM for any M (CudaBackend(batch_invariant=True) runs it for M > GEMV_MAX_M): every
// output is bit-identical to gemv_bf16's for the same (N, K, nw), so a row's result is the same in a
// decode step of 1..16 rows (gemv_bf16) and in a prefill or mixed step of thousands (this kernel).
// It reproduces gemv_bf16's order exactly: the same mma fragments (lane (g, tg) holds W rows g and g + 8
// and x row g at k = 32 * step + 8 * tg .. + 7, words 0,1 then 2,3), one mma chain per K slice
// [w * S / nw, (w + 1) * S / nw) of the S = K / 32 steps (the last slice also takes the zero-padded
// partial step when K % 32 != 0) started from zero, and the slices summed in order w = 0 .. nw-1
// (slice 0 taken as is, as gemv's `v = red[0]`). Unlike gemv_bf16 (one slice per warp, W streamed once
// per 16 rows), a CTA walks the slices one after another over a 128 (W rows) x 64 (x rows) tile staged in
// shared memory, so each W and x element is reused 64 and 128 times: a tensor-core GEMM, with a second
// accumulator set for the fold.
// 8 warps as 4 (W rows) x 2 (x rows), each 32 x 32 (2 W groups x 4 x tiles); one 32-k step per pipeline
// stage, GI_STAGES stages of cp.async in flight (zero-filled past N, M and K). Shared rows are 64 bytes
// (one step of one row), so a warp's fragment load (8 rows x 64 contiguous bytes) is conflict free.
// Grid (ceil(M / 64), ceil(N / 128)): the x-row tiles of one W tile run next to each other, so W comes
// from HBM about once and the re-reads hit L2. Requires K % 8 == 0, x's row stride % 8 == 0, 16-byte
// aligned bases (the host checks, as for gemv_bf16).
#define GI_BN 128
#define GI_BM 64
#define GI_STAGES 4

// f(r, t, i) for every accumulator element of a warp's tile (2 W groups x 4 x tiles x 4), unrolled.
template <class F>
__device__ __forceinline__ void gi_each_acc(F f) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) f(r, t, i);
}

template <int F32>
__global__ void __launch_bounds__(256, 2) gemm_inv(
    const bf16_t* __restrict__ x, long long sx, const bf16_t* __restrict__ w, void* __restrict__ y,
    int M, int N, int K, int nw)
{
    pdl_enter();
    __shared__ uint4 sm[GI_STAGES][(GI_BN + GI_BM) * 4];  // per stage: W rows, then x rows; 4 uint4 per row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tg = lane & 3;
    const int m0 = blockIdx.x * GI_BM, n0 = blockIdx.y * GI_BN;
    const int wn = (warp & 3) * 32, wm = (warp >> 2) * 32;
    const int S = K >> 5, nsteps = S + ((K & 31) ? 1 : 0);

    // this thread's three 16-byte copies per stage: W rows 0..127 (idx < 512), then x rows 0..63
    const bf16_t* src[3];
    bool row_ok[3];
    int dst[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        const int idx = tid + 256 * i, c = idx & 3;
        if (idx < 4 * GI_BN) {
            const int n = n0 + (idx >> 2);
            row_ok[i] = n < N;
            src[i] = w + (long long)(row_ok[i] ? n : 0) * K + 8 * c;
        } else {
            const int m = m0 + ((idx - 4 * GI_BN) >> 2);
            row_ok[i] = m < M;
            src[i] = x + (long long)(row_ok[i] ? m : 0) * sx + 8 * c;
        }
        dst[i] = idx;
    }
    auto load = [&](int step) {
        uint4* st = sm[step % GI_STAGES];
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            const int k = 32 * step + 8 * (dst[i] & 3);
            const bool ok = row_ok[i] && k < K;
            cp_async16(smem_addr(st + dst[i]), ok ? src[i] + 32 * step : src[i], ok ? 16 : 0);
        }
    };

    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][t][i] = tot[r][t][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < GI_STAGES - 1; ++s) {
        if (s < nsteps) load(s);
        cp_async_commit();
    }
    int slice = 0, slice_end = nw == 1 ? nsteps : S / nw;
    for (int s = 0; s < nsteps; ++s) {
        cp_async_wait<GI_STAGES - 2>();
        __syncthreads();  // step s landed for every thread; everyone is done with step s - 1's buffer
        if (s + GI_STAGES - 1 < nsteps) load(s + GI_STAGES - 1);
        cp_async_commit();
        const uint4* st = sm[s % GI_STAGES];
        uint4 a[2][2], b[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            a[r][0] = st[(wn + 16 * r + g) * 4 + tg];
            a[r][1] = st[(wn + 16 * r + 8 + g) * 4 + tg];
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) b[t] = st[(GI_BN + wm + 8 * t + g) * 4 + tg];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int t = 0; t < 4; ++t) mma_step(acc[r][t], a[r][0], a[r][1], b[t]);
        while (s + 1 == slice_end) {  // fold the finished slice into the total, in slice order
            gi_each_acc([&](int r, int t, int i) {
                tot[r][t][i] = slice == 0 ? acc[r][t][i] : tot[r][t][i] + acc[r][t][i];
                acc[r][t][i] = 0.0f;
            });
            if (++slice >= nw) break;
            slice_end = slice == nw - 1 ? nsteps : (slice + 1) * S / nw;
        }
    }

    // accumulator (r, t): [0] (W row 16r+g, x row 8t+2tg), [1] x row +1, [2] W row +8, [3] both
    gi_each_acc([&](int r, int t, int i) {
        const int n = n0 + wn + 16 * r + g + 8 * (i >> 1), m = m0 + wm + 8 * t + 2 * tg + (i & 1);
        if (n >= N || m >= M) return;
        const long long o = (long long)m * N + n;
        if (F32) static_cast<float*>(y)[o] = tot[r][t][i];
        else static_cast<bf16_t*>(y)[o] = f2bf(tot[r][t][i]);
    });
}
// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
template __global__ void gemm_inv<0>(const bf16_t*, long long, const bf16_t*, void*, int, int, int, int);
template __global__ void gemm_inv<1>(const bf16_t*, long long, const bf16_t*, void*, int, int, int, int);

#define GEMV_SIG(MT, R, U, PF, OUT) \
    template __global__ void gemv_bf16<MT, R, U, PF, OUT>(const bf16_t*, long long, const bf16_t*, void*, int, int, int, \
                                                         float*, const float*, float, bf16_t*, unsigned*);
// every output form (OUT = 3 at few rows only, but instantiating it per variant keeps the plan free)
#define GEMV_INST(MT, R, U, PF) \
    GEMV_SIG(MT, R, U, PF, 0) GEMV_SIG(MT, R, U, PF, 1) GEMV_SIG(MT, R, U, PF, 2) GEMV_SIG(MT, R, U, PF, 3)
#define GEMV_INST_INVARIANT(MT, R, U, PF) GEMV_SIG(MT, R, U, PF, 0) GEMV_SIG(MT, R, U, PF, 1)
GEMV_INST(1, 1, 4, 1) GEMV_INST(2, 1, 4, 1) GEMV_INST(1, 1, 2, 0) GEMV_INST(1, 2, 2, 0) GEMV_INST(2, 2, 2, 0)
// batch-invariant decode buckets of 17..64 rows (no SwiGLU or fused-norm form)
GEMV_INST_INVARIANT(4, 1, 2, 0) GEMV_INST_INVARIANT(8, 1, 1, 0)
#endif
