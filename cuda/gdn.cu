// Gated delta rule (spec §4.3-§4.6), token-recurrent, varlen, state f32 in place by slot.
// Fused: gating g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), value head h -> q/k head
// h / (nv/nk), q/k L2 norm (rsqrt(sum + 1e-6)), q * dk^-0.5, decay, delta update, output o = S^T q.
//
// Tiles: a [DK, 32] column block of one head's state [DK, dv] for one sequence, (dv/32) x nv x B of them
// (column block fastest). 128 threads per tile: lane = state column, warp w = rows [w*DK/4, (w+1)*DK/4),
// DK/4 f32 registers per thread. Sequences of several tokens run here too when they are speculative
// verifies (spec_logs[seq] >= 0 and more than one token). Rollback by replay: a verify leaves the slot's
// state as it was and logs, per token and tile, what its update added (the normalized k, the delta of the
// tile's columns, the decay) in its log set; the sequence's next step (replay[seq] = the a + 1 tokens the
// verify committed) first applies that many logged updates to the loaded state, with the same arithmetic,
// so the result is the state a plain decode of those tokens leaves, bit for bit. A verify that replays
// writes the replayed state to the slot before its own tokens overwrite the log; a decode writes its final
// state. So a verify moves as much state as a decode (one read, at most one write) where per-token state
// rows moved K + 1 times that (docs/benchmarks/NOTES.md, lead 10).
// Grid: min(tiles, GDN_REC_BLOCKS x SMs) blocks, each walking tiles blockIdx.x, + gridDim.x, ...: while it
// computes one tile the next one's state (and the log entries it replays) streams into shared memory (cp.async,
// two buffers: a replay adds no load latency of its own, only its FMAs) and its first
// token's inputs into registers (the slot and token range two tiles ahead), so an SM's state loads do not
// stop while its blocks compute (with one tile per block they ran in lockstep phases: ~60% of copy at B = 32).
#include "common.cuh"
#include "wgmma.cuh"

#define GDN_WARPS 4
#define GDN_REC_BLOCKS 4  // resident blocks per SM (launch bounds; 2 state buffers of 16 KB each at DK 128)
#define GDN_LOG_PAD 36  // a log entry of one tile: normalized k [DK], then delta [32], decay, 3 unused
#define GDN_LOG_W(DK) ((DK) + GDN_LOG_PAD)

template <int DK>
__global__ void __launch_bounds__(128, GDN_REC_BLOCKS) gdn_recurrent(
    const bf16_t* __restrict__ qkv, long long sq,   // [T, 2*nk*DK + nv*dv], row stride sq
    const bf16_t* __restrict__ a, long long sa,     // [T, nv] row stride sa
    const bf16_t* __restrict__ b, long long sb,     // [T, nv] row stride sb
    const float* __restrict__ A_log, const float* __restrict__ dt_bias,  // [nv] f32
    float* state,                                   // [slots, nv, DK, dv] f32
    const int* __restrict__ cu, const int* __restrict__ slots,
    const int* __restrict__ spec_logs,              // [B]: the sequence's log set, or -1
    const int* __restrict__ replay,                 // [B]: logged tokens to apply first (with spec_logs[b] >= 0)
    float* log,                                     // [sets, K1, nv, dv/32, GDN_LOG_W(DK)] f32
    int K1,                                         // log entries a set (drafts per verify + 1)
    bf16_t* __restrict__ out,                       // [T, nv*dv]
    int nk, int nv, int dv, int B)
{
    pdl_enter();
    constexpr int R = DK / GDN_WARPS;
    extern __shared__ __align__(16) float s_tile[];  // [2][DK][32] state tiles, then [2][K1][LW] replayed log entries
    float* s_log = s_tile + 2 * DK * 32;
    __shared__ float s_q[DK], s_k[DK];
    __shared__ float s_red[2][GDN_WARPS];
    __shared__ float s_p[GDN_WARPS][32];
    __shared__ float s_o[GDN_WARPS][32];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int xt = dv / 32, tiles = xt * nv * B;
    const long long row_size = (long long)nv * DK * dv;
    const float qscale = rsqrtf((float)DK);

    // a tile's inputs at token t (q, k of this thread's row, v of its column, the gate inputs a, b)
    struct In { bf16_t q, k, v, a, b; };
    auto load = [&](int tile, int t, In& in) {
        const int h = (tile / xt) % nv, hk = h / (nv / nk), col = (tile % xt) * 32 + lane;
        const bf16_t* row = qkv + (long long)t * sq;
        if (tid < DK) {
            in.q = row[hk * DK + tid];
            in.k = row[nk * DK + hk * DK + tid];
        }
        in.v = row[2 * nk * DK + h * dv + col];
        in.a = a[(long long)t * sa + h];
        in.b = b[(long long)t * sb + h];
    };
    // a tile's sequence: slot, tokens, and log set * 32 + tokens replayed from it (-1: no log set; packed,
    // as three of these are live at once and the DK = 128 instance is at its 128-register bound)
    struct Meta {
        int slot, t0, t1, log;
        __device__ int set() const { return log >> 5; }
        __device__ int replay() const { return log < 0 ? 0 : log & 31; }
    };
    auto meta = [&](int tile) {
        const int seq = tile / (xt * nv), set = spec_logs[seq];
        return Meta{slots[seq], cu[seq], cu[seq + 1], set >= 0 ? set * 32 + replay[seq] : -1};
    };
    constexpr int LW = GDN_LOG_W(DK);
    const int log_entry = nv * xt * LW;  // one token of a set, every tile
    // a tile's state, and the log entries it replays, into buffer bi: one cp.async group
    auto fetch = [&](int tile, const Meta& m, int bi) {
        const float* src = state + (long long)m.slot * row_size + (long long)((tile / xt) % nv) * DK * dv + (tile % xt) * 32;
        float* buf = s_tile + bi * DK * 32;
        for (int j = tid; j < DK * 8; j += 128) {
            const int r = j >> 3, c = (j & 7) * 4;
            cp_async16(smem_addr(buf + r * 32 + c), src + (long long)r * dv + c, 16);
        }
        const float* e = log + (long long)m.set() * K1 * log_entry + (tile % (xt * nv)) * LW;
        float* dst = s_log + bi * K1 * LW;
        for (int j = tid; j < m.replay() * (LW / 4); j += 128) {
            const int r = j / (LW / 4), c = (j % (LW / 4)) * 4;
            cp_async16(smem_addr(dst + r * LW + c), e + (long long)r * log_entry + c, 16);
        }
        cp_async_commit();
    };

    const int step = gridDim.x;
    int tile = blockIdx.x;
    Meta cur = meta(tile), nxt{0, 0, 0, -1};
    In in{}, in_next{};
    fetch(tile, cur, 0);
    if (cur.t0 < cur.t1) load(tile, cur.t0, in);
    if (tile + step < tiles) nxt = meta(tile + step);
    for (int i = 0; tile < tiles; ++i, tile += step) {
        const bool more = tile + step < tiles;
        float* buf = s_tile + (i & 1) * DK * 32;
        Meta after{0, 0, 0, -1};
        if (more) {  // the next tile's state and first inputs; the slot and tokens of the one after
            fetch(tile + step, nxt, (i + 1) & 1);
            if (nxt.t0 < nxt.t1) load(tile + step, nxt.t0, in_next);
            if (tile + 2 * step < tiles) after = meta(tile + 2 * step);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();                            // this tile's state landed for every thread

        const int h = (tile / xt) % nv, col = (tile % xt) * 32 + lane;
        float* S_base = state + (long long)cur.slot * row_size + (long long)h * DK * dv + col;
        const bool logs = cur.log >= 0 && cur.t1 - cur.t0 > 1;  // a verify: its tokens go to the log, the slot keeps its state
        float S[R];
#pragma unroll
        for (int r = 0; r < R; ++r) S[r] = buf[(warp * R + r) * 32 + lane];
        for (int j = 0; j < cur.replay(); ++j) {  // the last verify's committed tokens, as the loop below did them
            const float* e = s_log + ((i & 1) * K1 + j) * LW;  // (landed with the state)
            const float delta = e[DK + lane], decay = e[DK + 32];
#pragma unroll
            for (int r = 0; r < R; ++r) S[r] = __fmaf_rn(e[warp * R + r], delta, __fmul_rn(S[r], decay));
        }
        if (logs && cur.replay()) {  // the log is about to be overwritten: the slot takes the replayed state
#pragma unroll
            for (int r = 0; r < R; ++r) S_base[(long long)(warp * R + r) * dv] = S[r];
        }
        const float A = expf(A_log[h]);
        const float dtb = dt_bias[h];

        // token t + 1's inputs load while token t is computed: a verify's tokens wait for one load latency
        for (int t = cur.t0; t < cur.t1; ++t) {
            const float qv = tid < DK ? bf2f(in.q) : 0.0f, kv = tid < DK ? bf2f(in.k) : 0.0f;
            const float vj = bf2f(in.v);
            const float decay = expf(-A * softplus_f(bf2f(in.a) + dtb));
            const float beta = sigmoid_f(bf2f(in.b));
            if (t + 1 < cur.t1) load(tile, t + 1, in);
            const float sqq = warp_sum(qv * qv), skk = warp_sum(kv * kv);
            if (lane == 0) { s_red[0][warp] = sqq; s_red[1][warp] = skk; }
            __syncthreads();
            float nq = 0.0f, nkk = 0.0f;
#pragma unroll
            for (int w = 0; w < GDN_WARPS; ++w) { nq += s_red[0][w]; nkk += s_red[1][w]; }
            if (tid < DK) {
                s_q[tid] = qv * rsqrtf(nq + 1e-6f) * qscale;
                s_k[tid] = kv * rsqrtf(nkk + 1e-6f);
            }
            __syncthreads();
            float p = 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                S[r] = __fmul_rn(S[r], decay);  // (explicit roundings: the replay above repeats them exactly)
                p += S[r] * s_k[warp * R + r];
            }
            s_p[warp][lane] = p;
            __syncthreads();
            float kS = 0.0f;
#pragma unroll
            for (int w = 0; w < GDN_WARPS; ++w) kS += s_p[w][lane];
            const float delta = beta * (vj - kS);
            float o = 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                S[r] = __fmaf_rn(s_k[warp * R + r], delta, S[r]);
                o += S[r] * s_q[warp * R + r];
            }
            s_o[warp][lane] = o;
            __syncthreads();
            if (warp == 0) {
                float acc = 0.0f;
#pragma unroll
                for (int w = 0; w < GDN_WARPS; ++w) acc += s_o[w][lane];
                out[(long long)t * nv * dv + h * dv + col] = f2bf(acc);
            }
            if (logs) {  // this tile's entry of the token in the sequence's log set
                float* e = log + ((long long)cur.set() * K1 + t - cur.t0) * log_entry + (tile % (xt * nv)) * LW;
                if (tid < DK) e[tid] = s_k[tid];
                if (warp == 0) e[DK + lane] = delta;
                if (tid == 0) e[DK + 32] = decay;
            }
        }
        if (!logs) {
#pragma unroll
            for (int r = 0; r < R; ++r) S_base[(long long)(warp * R + r) * dv] = S[r];
        }
        if (cur.t0 == cur.t1) __syncthreads();     // (no token's barriers) buf is refilled next iteration
        cur = nxt;
        nxt = after;
        in = in_next;
    }
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
template __global__ void gdn_recurrent<32>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, const int*, const int*,
                                           float*, int, bf16_t*, int, int, int, int);
template __global__ void gdn_recurrent<64>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, const int*, const int*,
                                           float*, int, bf16_t*, int, int, int, int);
template __global__ void gdn_recurrent<128>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                            const float*, const float*, float*, const int*, const int*, const int*, const int*,
                                            float*, int, bf16_t*, int, int, int, int);
#endif

// ---- Chunked (WY/UT) form for prefill (spec §4.7), two kernels ----------------------------------
// Chunks of 64 tokens per sequence. gdn_chunk_prep is parallel over (chunk, head, sequence): it builds
// everything that depends on q, k, a, b only, so the serial state pass below is four small matmuls
// per chunk over operands it streams in:
//   gam = cumsum(g) in the chunk, D_ij = exp(gam_i - gam_j) (j <= i, <= 1 so never overflows)
//   A = tril(beta_i k_i.k_j D_ij, -1);  [W | U] = (I + A)^-1 [beta k e^gam | beta v]
//   P = tril(q_i.k_j D_ij);  Qs = q e^gam;  Ks = k e^(gam_last - gam)   (q, k L2-normed, q * dk^-0.5)
// W [nv, T, DK] and P [nv, T, 64] are written in bf16x3 pairs (below: a row of X values is X bf16 hi then
// X bf16 lo, x = hi + lo to ~2^-16; rows padded by 8 bf16, as the state pass keeps them in shared memory),
// U in f32 as [nv, dv/32, T, 32] (a state tile's columns of a chunk are one range), aux [nv, T, 4] f32 = (gam, sq, sk, 0) with Qs = sq q and Ks = sk k for the raw
// (conv output, bf16) q and k rows: the state pass reads those rows themselves, exact as bf16 operands,
// and applies the row scales to its products.
// gdn_chunk_state then runs per (32-column state tile, head, sequence), chunk after chunk:
//   v_new = U - W S;  o = sq (q S) + P v_new;  S = e^gam_last S + k^T (sk v_new)
// on tensor cores (below). Rows past a sequence's end are zeros (g = 0, beta = 0), which leaves outputs
// and state unchanged.
#define GDN_C 64

// (x0, x1) -> bf16x2 hi and bf16x2 lo = the rounded remainders
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - lo_bf(hi), x1 - hi_bf(hi));
}

// Shared memory: the chunk's raw q, k and v rows (bf16, by cp.async; zero past the end) and A, then X
// over them (the launcher sizes it for both: 1280 + max(64 (2 RQ + RV + 4 AS), 256 (DK + dv)) bytes). K K^T and
// Q K^T run on tensor cores (mma.sync m16n8k16) over the raw rows: bf16 products are exact in the f32
// accumulators, and the L2 norms, 1/sqrt(dk), beta and decays are diagonal scalings applied afterwards.
// The triangular solve gives each thread one column of X = [W | U] in registers, so it needs no
// barriers and reads A as float4 broadcasts. The q/k rows need 16-byte alignment (the launcher checks).
template <int DK>
__global__ void __launch_bounds__(256, 2) gdn_chunk_prep(
    const bf16_t* __restrict__ qkv, long long sq, const bf16_t* __restrict__ a, long long sa,
    const bf16_t* __restrict__ b, long long sb, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const int* __restrict__ cu, bf16_t* __restrict__ W, float* __restrict__ U, bf16_t* __restrict__ P,
    float* __restrict__ aux, int T, int nk, int nv, int dv)
{
    pdl_enter();
    extern __shared__ __align__(16) char smem_c[];
    constexpr int RQ = (DK + 8) * 2;            // raw row bytes, padded: ldmatrix phases are conflict-free
    constexpr int AS = GDN_C + 4;               // A row: float4 reads
    const int RV = (dv + 8) * 2;
    float* s_gam = reinterpret_cast<float*>(smem_c);  // [64] gate cumsum
    float* s_beta = s_gam + GDN_C;              // [64]
    float* s_rq = s_beta + GDN_C;               // [64] q's 1 / (|q| sqrt(dk))
    float* s_rk = s_rq + GDN_C;                 // [64] k's 1 / |k|
    float* s_cw = s_rk + GDN_C;                 // [64] W's right-hand side scale: beta e^gam / |k|
    char* sQr = reinterpret_cast<char*>(s_cw + GDN_C);  // [64][RQ] raw q
    char* sKr = sQr + GDN_C * RQ;               // [64][RQ] raw k
    char* sVr = sKr + GDN_C * RQ;               // [64][RV] raw v
    float* sA = reinterpret_cast<float*>(sVr + GDN_C * RV);  // [64][AS]
    float* sX = reinterpret_cast<float*>(sQr);  // [64][DK + dv] X = [W | U] after the solve, over the above

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, seq = blockIdx.z;
    const int hk = h / (nv / nk);
    const int t0 = cu[seq] + blockIdx.x * GDN_C, t_end = cu[seq + 1];
    if (t0 >= t_end) return;
    const int L = min(GDN_C, t_end - t0);

    for (int idx = tid; idx < GDN_C * DK / 8; idx += 256) {
        const int i = idx / (DK / 8), c = (idx - i * (DK / 8)) * 8;
        const bool ok = i < L;
        const bf16_t* row = qkv + (long long)(t0 + i) * sq + hk * DK + c;
        cp_async16(smem_addr(sQr + i * RQ + c * 2), ok ? row : qkv, ok ? 16 : 0);
        cp_async16(smem_addr(sKr + i * RQ + c * 2), ok ? row + nk * DK : qkv, ok ? 16 : 0);
    }
    for (int idx = tid; idx < GDN_C * dv / 8; idx += 256) {
        const int i = idx / (dv / 8), c = (idx - i * (dv / 8)) * 8;
        const bool ok = i < L;
        const bf16_t* row = qkv + (long long)(t0 + i) * sq + 2 * nk * DK + h * dv + c;
        cp_async16(smem_addr(sVr + i * RV + c * 2), ok ? row : qkv, ok ? 16 : 0);
    }
    cp_async_commit();
    if (tid < GDN_C) {
        float g_ = 0.0f, beta = 0.0f;
        if (tid < L) {
            const long long tt = t0 + tid;
            g_ = -expf(A_log[h]) * softplus_f(bf2f(a[tt * sa + h]) + dt_bias[h]);
            beta = sigmoid_f(bf2f(b[tt * sb + h]));
        }
        s_gam[tid] = g_;
        s_beta[tid] = beta;
    }
    cp_async_wait<0>();
    __syncthreads();
    if (warp == 0) {                            // inclusive prefix sum of the 64 gates, two per lane
        const float g0 = s_gam[2 * lane], g1 = s_gam[2 * lane + 1];
        float sum = g0 + g1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, sum, o);
            if (lane >= o) sum += y;
        }
        s_gam[2 * lane] = sum - g1;
        s_gam[2 * lane + 1] = sum;
    }
    for (int r = warp; r < GDN_C; r += 8) {     // one warp per row: the L2 norms
        float ssq = 0.0f, skk = 0.0f;
        for (int c = 2 * lane; c < DK; c += 64) {
            const unsigned q2 = *reinterpret_cast<const unsigned*>(sQr + r * RQ + c * 2);
            const unsigned k2 = *reinterpret_cast<const unsigned*>(sKr + r * RQ + c * 2);
            ssq += lo_bf(q2) * lo_bf(q2) + hi_bf(q2) * hi_bf(q2);
            skk += lo_bf(k2) * lo_bf(k2) + hi_bf(k2) * hi_bf(k2);
        }
        ssq = warp_sum(ssq);
        skk = warp_sum(skk);
        if (lane == 0) {
            s_rq[r] = rsqrtf(ssq + 1e-6f) * rsqrtf((float)DK);
            s_rk[r] = rsqrtf(skk + 1e-6f);
        }
    }
    __syncthreads();
    if (tid < GDN_C) {  // (read after the barrier below, "sA complete")
        const float gam = s_gam[tid];
        s_cw[tid] = s_beta[tid] * expf(gam) * s_rk[tid];
        if (tid < L)
            *reinterpret_cast<float4*>(aux + ((long long)h * T + t0 + tid) * 4) =
                make_float4(gam, s_rq[tid] * expf(gam), s_rk[tid] * expf(s_gam[L - 1] - gam), 0.0f);
    }

    {   // K K^T and Q K^T: warp w takes rows 16 (w % 4).. and columns 32 (w / 4).. (4 n8 tiles)
        const int mb = (warp & 3) * 16, nb = (warp >> 2) * 32;
        float kk[4][4] = {}, qk[4][4] = {};
        if (nb <= mb + 15) {                    // else wholly above the diagonal: zeros
            const unsigned aK = smem_addr(sKr + (mb + (lane & 15)) * RQ + (lane >> 4) * 16);
            const unsigned aQ = smem_addr(sQr + (mb + (lane & 15)) * RQ + (lane >> 4) * 16);
            // B = K^T from k rows (n-major, as stored): x4 = rows 0-7 k-lo, k-hi, rows 8-15 k-lo, k-hi
            const unsigned bK = smem_addr(sKr + (nb + (lane & 7) + (lane >> 4) * 8) * RQ + ((lane >> 3) & 1) * 16);
#pragma unroll
            for (int k = 0; k < DK; k += 16) {
                unsigned ka[4], qa[4];
                ldsm_x4(aK + k * 2, ka[0], ka[1], ka[2], ka[3]);
                ldsm_x4(aQ + k * 2, qa[0], qa[1], qa[2], qa[3]);
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    unsigned bb[4];
                    ldsm_x4(bK + p * 16 * RQ + k * 2, bb[0], bb[1], bb[2], bb[3]);
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        mma_bf16(kk[2 * p + e], ka[0], ka[1], ka[2], ka[3], bb[2 * e], bb[2 * e + 1]);
                        mma_bf16(qk[2 * p + e], qa[0], qa[1], qa[2], qa[3], bb[2 * e], bb[2 * e + 1]);
                    }
                }
            }
        }
        // A = tril(beta_i k_i.k_j D_ij, -1) to shared memory; P = tril(q_i.k_j D_ij) out (normed rows)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = mb + g + 8 * hh;
            const float gi = s_gam[i], bi = s_beta[i] * s_rk[i], qi = s_rq[i];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                float pr[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = nb + 8 * n + 2 * t + e;
                    const float D = j <= i ? expf(gi - s_gam[j]) * s_rk[j] : 0.0f;
                    sA[i * AS + j] = j < i ? bi * kk[n][2 * hh + e] * D : 0.0f;
                    pr[e] = qi * qk[n][2 * hh + e] * D;
                }
                if (i < L) {
                    unsigned* dst = reinterpret_cast<unsigned*>(P + ((long long)h * T + t0 + i) * (2 * GDN_C + 8) + nb + 8 * n + 2 * t);
                    split_bf16x2(pr[0], pr[1], dst[0], dst[GDN_C / 2]);
                }
            }
        }
    }
    __syncthreads();                            // sA, s_cw complete
    // (I + A) X = R by forward substitution, one column of X = [W | U] per thread, held in registers:
    // R = [beta e^gam k | beta v] (k normed; both rows from shared memory, zeros past the end, where beta
    // is 0 too): rows past the end are zero and stay zero. The two kinds of column run the same code (a
    // branch on the kind made ptxas keep two copies of the unrolled solve: the instruction cache missed).
    {   // DK + dv <= 256 (the launcher checks): one column per thread
        const int c = tid;
        const bool wcol = c < DK;
        const float* coef = wcol ? s_cw : s_beta;
        const char* col = wcol ? sKr + 2 * c : sVr + 2 * min(c - DK, dv - 1);  // (threads past DK + dv: unused)
        const int rs = wcol ? RQ : RV;
        float x[GDN_C];
#pragma unroll
        for (int i = 0; i < GDN_C; ++i) x[i] = coef[i] * bf2f(*reinterpret_cast<const bf16_t*>(col + i * rs));
#pragma unroll
        for (int i = 1; i < GDN_C; ++i) {
            float s4[4] = {};                   // four chains: the row's dependent-FMA latency / 4
#pragma unroll
            for (int j = 0; j + 4 <= i; j += 4) {
                const float4 a4 = *reinterpret_cast<const float4*>(sA + i * AS + j);
                s4[0] += a4.x * x[j]; s4[1] += a4.y * x[j + 1]; s4[2] += a4.z * x[j + 2]; s4[3] += a4.w * x[j + 3];
            }
#pragma unroll
            for (int j = i & ~3; j < i; ++j) s4[j & 3] += sA[i * AS + j] * x[j];
            x[i] -= (s4[0] + s4[1]) + (s4[2] + s4[3]);
        }
        // X to shared memory (over the raw rows and A, which every thread has read), then out in rows
        const int n = DK + dv;
        __syncthreads();
        if (c < n) {
#pragma unroll
            for (int i = 0; i < GDN_C; ++i) sX[i * n + c] = x[i];
        }
        __syncthreads();
        for (int idx = tid; idx < L * n / 4; idx += 256) {
            const int i = idx / (n / 4), cc = 4 * (idx - i * (n / 4));
            const float4 v = *reinterpret_cast<const float4*>(sX + i * n + cc);
            if (cc < DK) {                      // W: bf16 hi, lo
                uint2 hi, lo;
                split_bf16x2(v.x, v.y, hi.x, lo.x);
                split_bf16x2(v.z, v.w, hi.y, lo.y);
                bf16_t* dst = W + ((long long)h * T + t0 + i) * (2 * DK + 8) + cc;
                *reinterpret_cast<uint2*>(dst) = hi;
                *reinterpret_cast<uint2*>(dst + DK) = lo;
            } else {
                const int cv = cc - DK;
                *reinterpret_cast<float4*>(U + (((long long)h * (dv / 32) + cv / 32) * T + t0 + i) * 32 + (cv & 31)) = v;
            }
        }
    }
}

// ---- gdn_chunk_state: the four products on tensor cores (mma.sync m16n8k16 bf16x3) -----------------
// HF runs this math in f32, so every product is bf16x3: x = hi + lo (both bf16, lo the rounded remainder,
// x to ~2^-16 relative) and a*b ~ ah*bh + (ah*bl + al*bh), three bf16 mma per k16 with f32 accumulation;
// two where A is exact in bf16 (the raw q and k rows). Prep writes W and P already split (a row of X values
// is X hi then X lo bf16: the bytes of f32); the kernel splits S and v_new as it stores them to shared
// memory for the next product.

// acc (16 rows x 16 columns: two n8 C fragments) += A (16 x K) . B (K x 16), B bf16x3 and A bf16x3 (A_LO)
// or bf16, in shared memory. a, b: this lane's ldmatrix addresses of the hi halves at k = 0, stepped by
// a_step / b_step bytes per k16; the lo halves are a_lo / b_lo bytes further. B is stored k-major ([k][n]
// rows: .trans); A row-major ([m][k] rows) or, with A_T, k-major ([k][m] rows: .trans). The small terms go
// to `cor`, their own dependency chain, which the caller adds to acc.
template <bool A_T, bool A_LO>
__device__ __forceinline__ void mma3_frags(unsigned (&f)[16], unsigned a, int a_lo, unsigned b, int b_lo) {
    if (A_T) ldsm_x4_t(a, f[0], f[1], f[2], f[3]);
    else ldsm_x4(a, f[0], f[1], f[2], f[3]);
    if (A_LO) {
        if (A_T) ldsm_x4_t(a + a_lo, f[4], f[5], f[6], f[7]);
        else ldsm_x4(a + a_lo, f[4], f[5], f[6], f[7]);
    }
    ldsm_x4_t(b, f[8], f[9], f[10], f[11]);
    ldsm_x4_t(b + b_lo, f[12], f[13], f[14], f[15]);
}
template <bool A_T, bool A_LO, int K>
__device__ __forceinline__ void mma3(float (&acc)[2][4], float (&cor)[2][4], unsigned a, int a_step, int a_lo,
                                     unsigned b, int b_step, int b_lo) {
    unsigned f[2][16];                          // k16 step k's fragments, the next step's loaded under its mma
    mma3_frags<A_T, A_LO>(f[0], a, a_lo, b, b_lo);
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
        unsigned (&x)[16] = f[k & 1];
        if (k + 1 < K / 16) mma3_frags<A_T, A_LO>(f[(k + 1) & 1], a + (k + 1) * a_step, a_lo, b + (k + 1) * b_step, b_lo);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            mma_bf16(acc[n], x[0], x[1], x[2], x[3], x[8 + 2 * n], x[9 + 2 * n]);
            mma_bf16(cor[n], x[0], x[1], x[2], x[3], x[12 + 2 * n], x[13 + 2 * n]);
            if (A_LO) mma_bf16(cor[n], x[4], x[5], x[6], x[7], x[8 + 2 * n], x[9 + 2 * n]);
        }
    }
}

// C fragments v (rows r0 + g (+8), columns c0 + 8n + 2t (+1)) split into bf16 hi (columns [0, 32)) and lo
// (columns [32, 64)) of shared rows of GDN_RS bytes at `base`
#define GDN_RS 144  // (2 x 32 + 8) bf16: 16 mod 128 bytes, so ldmatrix and these stores are conflict-free
__device__ __forceinline__ void store_split(char* base, int r0, int c0, const float (&v)[2][4]) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            unsigned* p = reinterpret_cast<unsigned*>(base + (r0 + g + 8 * j) * GDN_RS + (c0 + 8 * n + 2 * t) * 2);
            split_bf16x2(v[n][2 * j], v[n][2 * j + 1], p[0], p[16]);
        }
}

// One chunk's operands for a state tile, a stage of shared memory: rows [0, 64) of W (bf16x3), raw q and k
// (bf16), P (bf16x3), the tile's U columns (f32) and aux. Padded rows (16 mod 128 bytes) keep the ldmatrix
// phases conflict-free; prep writes W and P with the same padding, so a chunk of them is one range.
template <int DK>
struct ChunkStage {
    static constexpr int RW = (2 * DK + 8) * 2, RQ = (DK + 8) * 2, RP = (2 * GDN_C + 8) * 2, RU = 32 * 4;
    static constexpr int W = 0, Q = W + GDN_C * RW, K = Q + GDN_C * RQ, P = K + GDN_C * RQ, U = P + GDN_C * RP,
                         AUX = U + GDN_C * RU, BYTES = AUX + GDN_C * 16;
    static constexpr int ROW_IN = RW + 4 * DK + RP + RU + 16;  // bytes copied per token row
};

// The producer warp: chunk t0's rows [0, L) into the stage at `st`, counted on the stage's `full` barrier.
// On sm_90a by bulk copies: the CTAs of the cluster (the head's state tiles) each copy a share of the W and
// P rows and of the q and k rows, multicast to all of them, rank 0 the aux rows, each its own U tile (one
// arrival: the expect_tx). Elsewhere by cp.async, 16 bytes a thread, rows past L zeroed (32 arrivals).
// Rows past L are otherwise stale: the consumers zero those rows of v_new, and k's were zeroed at the start.
template <int DK>
__device__ __forceinline__ void chunk_load(char* st, unsigned full, int t0, int L, const bf16_t* W, const float* U,
                                           const bf16_t* P, const bf16_t* qkv, long long sq, const float* aux,
                                           int T, int nk, int nv, int dv, int h, int tile) {
    using S = ChunkStage<DK>;
    const int lane = threadIdx.x & 31;
    const char* srcW = reinterpret_cast<const char*>(W) + ((long long)h * T + t0) * S::RW;
    const char* srcP = reinterpret_cast<const char*>(P) + ((long long)h * T + t0) * S::RP;
    const char* srcQ = reinterpret_cast<const char*>(qkv + (long long)t0 * sq + h / (nv / nk) * DK);
    const char* srcK = srcQ + nk * DK * 2;
    const char* srcU = reinterpret_cast<const char*>(U + (((long long)h * (dv / 32) + tile) * T + t0) * 32);
    const char* srcA = reinterpret_cast<const char*>(aux + ((long long)h * T + t0) * 4);
    const long long ldQ = sq * 2;
    const unsigned d = smem_addr(st);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const unsigned rank = cluster_rank(), n = cluster_size();
    const unsigned short all = (unsigned short)((1u << n) - 1);
    if (lane == 0) {
        const int per = GDN_C / n, i0 = rank * per, i1 = min(L, i0 + per);
        mbar_expect_tx(full, L * S::ROW_IN);
        bulk_copy(d + S::U, srcU, L * S::RU, full);
        if (rank == 0) bulk_copy_mc(d + S::AUX, srcA, L * 16, full, all);
        if (i1 > i0) {
            bulk_copy_mc(d + S::W + i0 * S::RW, srcW + i0 * S::RW, (i1 - i0) * S::RW, full, all);
            bulk_copy_mc(d + S::P + i0 * S::RP, srcP + i0 * S::RP, (i1 - i0) * S::RP, full, all);
        }
    }
    for (int i = rank + n * lane; i < L; i += 32 * n) {
        bulk_copy_mc(d + S::Q + i * S::RQ, srcQ + i * ldQ, 2 * DK, full, all);
        bulk_copy_mc(d + S::K + i * S::RQ, srcK + i * ldQ, 2 * DK, full, all);
    }
#else
    const char* src[6] = {srcW, srcQ, srcK, srcP, srcU, srcA};
    const long long ld[6] = {S::RW, ldQ, ldQ, S::RP, S::RU, 16};
    const int off[6] = {S::W, S::Q, S::K, S::P, S::U, S::AUX}, dld[6] = {S::RW, S::RQ, S::RQ, S::RP, S::RU, 16};
    const int n16[6] = {S::RW / 16, 2 * DK / 16, 2 * DK / 16, S::RP / 16, S::RU / 16, 1};
#pragma unroll
    for (int a = 0; a < 6; ++a)
        for (int idx = lane; idx < GDN_C * n16[a]; idx += 32) {
            const int i = idx / n16[a], c = (idx - i * n16[a]) * 16;
            const bool ok = i < L;
            cp_async16(d + off[a] + i * dld[a] + c, ok ? src[a] + i * ld[a] + c : src[a], ok ? 16 : 0);
        }
    cp_async_arrive(full);
#endif
}

// Grid (dv/32, nv, B), 16 consumer warps and a producer warp, in clusters of CL blocks along x. On sm_90a
// the launcher takes CL = 2 where dv/32 is even: a head's state tiles in pairs, which share one load of each chunk's W, q, k, P and aux (each tile fetching the same
// ~120 KB per chunk from L2 was the bound: 576 -> 398 us at 8192 tokens on an H100). The consumers, as two sets of 8 that split the tile's 32
// columns (one block per SM for the shared memory below, so the warps are what hides the mma latency): the
// block's state tile S [DK][32] lives in registers as mma accumulators (warp w owns rows 16 (w % 8)..+15 of
// its 16 columns, if w % 8 < DK/16), with a split copy in shared memory for the products that read it. Per
// chunk, with q = w % 8: warps q < 4 compute W S (rows 16q..), q >= 4 q S; the first turn theirs into
// v_new = U - W S (split into shared memory, plain and scaled by sk); then the second add P v_new to o and
// store it, while the owners update S = e^gam_last S + k^T (sk v_new). The producer fills one stage while
// the consumers read the other (GDN_STAGES = 2; one stage elsewhere): `full` counts a stage's bytes in,
// `empty` the CTAs of the cluster done with it.
#define GDN_STATE_WARPS 16
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GDN_STAGES 2  // 227 KB at DK 128: Hopper's shared memory (the host mirrors this per arch)
#else
#define GDN_STAGES 1  // 132 KB at DK 128 (A100: 164 KB); loads then wait for the chunk before
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GDN_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)  // fixed at compile time: a plain launch forms them
#else
#define GDN_CLUSTER_DIMS(n)
#endif
template <int DK, int CL>
__global__ void __launch_bounds__(32 * (GDN_STATE_WARPS + 1)) GDN_CLUSTER_DIMS(CL) gdn_chunk_state(
    const bf16_t* __restrict__ W, const float* __restrict__ U, const bf16_t* __restrict__ P,
    const bf16_t* __restrict__ qkv, long long sq, const float* __restrict__ aux, float* state,
    const int* __restrict__ cu, const int* __restrict__ slots, const int* __restrict__ save_at,
    const int* __restrict__ save_rows, bf16_t* __restrict__ out, int T, int nk, int nv, int dv)
{
    pdl_enter();
    using CS = ChunkStage<DK>;
    constexpr int RS = GDN_RS, NC = 32 * GDN_STATE_WARPS;  // consumer threads
    extern __shared__ __align__(16) char smem_c[];
    char* sS = smem_c;                          // [DK][RS]   S
    char* sV = sS + DK * RS;                    // [64][RS]   v_new
    char* sVs = sV + GDN_C * RS;                // [64][RS]   sk v_new
    char* stage = sVs + GDN_C * RS;             // GDN_STAGES x ChunkStage
    const unsigned full = smem_addr(stage + GDN_STAGES * CS::BYTES), empty = full + 16;  // mbarriers per stage

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x, col0 = tile * 32, h = blockIdx.y, seq = blockIdx.z;
    const int t_beg = cu[seq], t_end = cu[seq + 1], n_chunks = (t_end - t_beg + GDN_C - 1) / GDN_C;
    const unsigned n_cta = cluster_size();

    for (int i = threadIdx.x; i < GDN_STAGES * GDN_C * CS::RQ / 16; i += blockDim.x) {  // k rows: finite past the end
        const int s = i / (GDN_C * CS::RQ / 16), j = i - s * (GDN_C * CS::RQ / 16);
        reinterpret_cast<uint4*>(stage + s * CS::BYTES + CS::K)[j] = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();
    if (threadIdx.x == 0) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        const unsigned full_arrivals = 1;       // the producer's expect_tx
#else
        const unsigned full_arrivals = 32;      // the producer lanes' cp.async completions
#endif
        for (int s = 0; s < GDN_STAGES; ++s) {
            mbar_init(full + 8 * s, full_arrivals);
            mbar_init(empty + 8 * s, n_cta);
        }
        mbar_init_fence();
    }

    if (warp == GDN_STATE_WARPS) {              // the producer
        cluster_sync();                         // every CTA's barriers and zeros are in place
        for (int c = 0; c < n_chunks; ++c) {
            const int s = c % GDN_STAGES, t0 = t_beg + c * GDN_C;
            if (c >= GDN_STAGES)  // the stage's last chunk released everywhere
                mbar_wait(empty + 8 * s, (c / GDN_STAGES - 1) & 1);
            chunk_load<DK>(stage + s * CS::BYTES, full + 8 * s, t0, min(GDN_C, t_end - t0), W, U, P, qkv, sq, aux,
                           T, nk, nv, dv, h, tile);
        }
        __syncwarp();
        cluster_sync();                         // no CTA exits while a peer may still signal its barriers
        return;
    }

    float* S_g = state + ((long long)slots[seq] * nv + h) * DK * dv + col0;
    const int save_end = t_beg + save_at[seq];  // prefix caching: S after this chunk also goes to a snapshot row
    float* S_save = state + ((long long)save_rows[seq] * nv + h) * DK * dv + col0;
    const int q = warp & 7, c0 = (warp >> 3) * 16;  // row role, first column
    const bool owner = q < DK / 16;
    const int r0 = (q & 3) * 16;                // this warp's rows of W S / q S / P v_new
    float S[2][4];                              // owned S tile: rows 16q + g (+8), columns c0 + 8n + 2t (+1)

    // this lane's ldmatrix addresses in stage 0: A row-major (rows r0.., k 0), A k-major (k^T rows 16q..,
    // k 0), B k-major (k 0, columns c0..)
    const int a_row = lane & 15, a_col = (lane >> 4) * 8;
    const int at_row = (lane & 7) + (lane >> 4) * 8, at_col = ((lane >> 3) & 1) * 8;
    const int b_row = (lane & 7) + ((lane >> 3) & 1) * 8, b_col = c0 + (lane >> 4) * 8;
    const unsigned aW = smem_addr(stage + CS::W + (r0 + a_row) * CS::RW + a_col * 2);
    const unsigned aQ = smem_addr(stage + CS::Q + (r0 + a_row) * CS::RQ + a_col * 2);
    const unsigned aP = smem_addr(stage + CS::P + (r0 + a_row) * CS::RP + a_col * 2);
    const unsigned aK = smem_addr(stage + CS::K + at_row * CS::RQ + (q * 16 + at_col) * 2);
    const unsigned bS = smem_addr(sS + b_row * RS + b_col * 2);
    const unsigned bV = smem_addr(sV + b_row * RS + b_col * 2);
    const unsigned bVs = smem_addr(sVs + b_row * RS + b_col * 2);

    if (owner) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                S[n][i] = S_g[(long long)(q * 16 + g + (i >> 1) * 8) * dv + c0 + n * 8 + 2 * t + (i & 1)];
        store_split(sS, q * 16, c0, S);
    }
    cluster_sync();

    for (int c = 0; c < n_chunks; ++c) {
        const int t0 = t_beg + c * GDN_C, L = min(GDN_C, t_end - t0), s = c % GDN_STAGES;
        const char* st = stage + s * CS::BYTES;
        const unsigned so = s * CS::BYTES;
        bar_sync(1, NC);                        // last chunk's S is in sS, its readers of sV / sVs are done
        if (c > 0 && threadIdx.x < n_cta)       // ... and of its stage: tell every producer of the cluster
            mbar_arrive_at(empty + 8 * ((c - 1) % GDN_STAGES), threadIdx.x);
        mbar_wait(full + 8 * s, (c / GDN_STAGES) & 1);  // this chunk's operands have landed
        const float* sa = reinterpret_cast<const float*>(st + CS::AUX);  // (gam, sq, sk, 0) per row
        float acc[2][4] = {}, cor[2][4] = {};   // q < 4: W S; q >= 4: q S, then sq (q S) + P v_new = o
        if (q < 4) {
            mma3<false, true, DK>(acc, cor, aW + so, 32, 2 * DK, bS, 16 * RS, 64);
            float u[2][4], us[2][4];            // v_new = U - W S and sk v_new, zero past the end
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int r = r0 + g + 8 * j;
                const bool in = r < L;
                const float sk = sa[r * 4 + 2];
                const float* src = reinterpret_cast<const float*>(st + CS::U) + r * 32 + c0 + 2 * t;
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const float2 v = *reinterpret_cast<const float2*>(src + 8 * n);
                    u[n][2 * j] = in ? v.x - (acc[n][2 * j] + cor[n][2 * j]) : 0.0f;
                    u[n][2 * j + 1] = in ? v.y - (acc[n][2 * j + 1] + cor[n][2 * j + 1]) : 0.0f;
                    us[n][2 * j] = in ? sk * u[n][2 * j] : 0.0f;
                    us[n][2 * j + 1] = in ? sk * u[n][2 * j + 1] : 0.0f;
                }
            }
            store_split(sV, r0, c0, u);
            store_split(sVs, r0, c0, us);
        } else {
            mma3<false, false, DK>(acc, cor, aQ + so, 32, 0, bS, 16 * RS, 64);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float sq_r = sa[(r0 + g + 8 * j) * 4 + 1];
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        acc[n][2 * j + e] = sq_r * (acc[n][2 * j + e] + cor[n][2 * j + e]);
                        cor[n][2 * j + e] = 0.0f;
                    }
            }
        }
        bar_sync(1, NC);                        // v_new ready; sS is free
        if (q >= 4) {
            mma3<false, true, GDN_C>(acc, cor, aP + so, 32, 2 * GDN_C, bV, 16 * RS, 64);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int r = r0 + g + j * 8;
                if (r < L) {
                    unsigned* o = reinterpret_cast<unsigned*>(out + (long long)(t0 + r) * nv * dv + h * dv + col0 + c0 + 2 * t);
#pragma unroll
                    for (int n = 0; n < 2; ++n)
                        o[n * 4] = pack2(acc[n][2 * j] + cor[n][2 * j], acc[n][2 * j + 1] + cor[n][2 * j + 1]);
                }
            }
        }
        if (owner) {
            const float decay = expf(sa[(L - 1) * 4]);
            float c2[2][4] = {};
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) S[n][i] *= decay;
            mma3<true, false, GDN_C>(S, c2, aK + so, 16 * CS::RQ, 0, bVs, 16 * RS, 64);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) S[n][i] += c2[n][i];
            store_split(sS, q * 16, c0, S);
            if (save_at[seq] && t0 + L == save_end) {
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        S_save[(long long)(q * 16 + g + (i >> 1) * 8) * dv + c0 + n * 8 + 2 * t + (i & 1)] = S[n][i];
            }
        }
    }
    if (owner) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                S_g[(long long)(q * 16 + g + (i >> 1) * 8) * dv + c0 + n * 8 + 2 * t + (i & 1)] = S[n][i];
    }
    cluster_sync();
}

// ---- gdn_chunk_state_wg: the state pass on warpgroup tensor cores (sm_90a, dk = 128) -------------------
// gdn_chunk_state's math (bf16x3 products, the same hi | lo operands), per (64 state columns, head, sequence)
// in one warpgroup, on wgmma: the state is held transposed, S^T [64 v columns, 128 k rows] f32, as two m64n64
// accumulators (64 registers a thread), its bf16 hi half the A operand in registers of the products that read
// it (FlashInfer's layout) and its lo half an A operand in shared memory (rewritten after each chunk's update:
// both halves in registers would spill). Per chunk, with prep's W, P, U, aux:
//   WS^T = S^T W^T, QS^T = S^T q^T                (B = W, q rows: K-major)
//   v_new^T = U^T - WS^T (zero past the end);  o^T = sq QS^T + v_new^T P^T    (B = P rows: K-major)
//   S^T = e^gam_last S^T + (sk v_new)^T k           (B = k rows, read MN-major)
// where a product of two split operands is ah bh + al bh + ah bl and one with raw q or k (exact in bf16) ah b +
// al b. A chunk's rows arrive by cp.async (zero past the end) into one of two stages, the next chunk's issued
// as the current one starts; o^T is transposed through shared memory for coalesced stores. Half the blocks of
// gdn_chunk_state, each ~1.16x its time a chunk: the host runs it where gdn_chunk_state's blocks would take
// more than a wave of the SMs (several prompts in a step, or the 27B's 48 heads; backend _gdn_state_wg).
#define GDN_WG_STAGE 99328  // bytes: W hi, W lo, q, k [64][128] bf16 swizzled (16 KB each), P hi, P lo [64][64], U [2][64][32] f32, aux [64][4]
template <int DK>
__global__ void __launch_bounds__(128, 1) gdn_chunk_state_wg(
    const bf16_t* __restrict__ W, const float* __restrict__ U, const bf16_t* __restrict__ P,
    const bf16_t* __restrict__ qkv, long long sq, const float* __restrict__ aux, float* state,
    const int* __restrict__ cu, const int* __restrict__ slots, const int* __restrict__ save_at,
    const int* __restrict__ save_rows, bf16_t* __restrict__ out, int T, int nk, int nv)
{
    pdl_enter();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(DK == 128, "two 64-column blocks of k per row");
    constexpr int DV = 128;  // (the launcher checks dv: a constant stride keeps the state's addresses immediates)
    constexpr int RW = (2 * DK + 8) * 2, RP = (2 * GDN_C + 8) * 2;  // prep's padded hi | lo rows, bytes
    // stage offsets: W hi, W lo, q, k, P hi, P lo (swizzled tiles), U, aux
    constexpr int OWH = 0, OWL = 16384, OQ = 32768, OK = 49152, OPH = 65536, OPL = 73728, OU = 81920, OA = 98304;
    extern __shared__ __align__(16) unsigned char wg_smem[];
    const unsigned s0 = (smem_addr(wg_smem) + 1023) & ~1023u;
    unsigned char* base = wg_smem + (s0 - smem_addr(wg_smem));
    bf16_t* sO = reinterpret_cast<bf16_t*>(base + 2 * GDN_WG_STAGE);  // o [64 tokens][64 columns]
    const unsigned sSL = s0 + 2 * GDN_WG_STAGE + 8192;  // S^T lo [64][128] bf16, swizzled

    const int tid = threadIdx.x, lane = tid & 31, w4 = tid >> 5, g8 = lane >> 2, c2 = 2 * (lane & 3);
    const int col0 = blockIdx.x * 64, h = blockIdx.y, seq = blockIdx.z;
    const int t_beg = cu[seq], t_end = cu[seq + 1], n_chunks = (t_end - t_beg + GDN_C - 1) / GDN_C;
    const long long qoff = (long long)(h / (nv / nk)) * DK;

    // one chunk's rows into its stage (16-byte pieces; rows at or past L zero-filled from row 0: an empty
    // sequence's t0 may be T). A swizzled tile's piece p of row r: column block p / 8, chunk (p % 8) ^ (r % 8).
    auto swz = [](int r, int p) { return (p >> 3) * (64 * 128) + r * 128 + (((p & 7) ^ (r & 7)) << 4); };
    auto load = [&](int c) {  // (unrolled by 4: all of its addresses would be hoisted out of the chunk loop, spilling)
        const int t0 = t_beg + c * GDN_C, L = min(GDN_C, t_end - t0);
        const unsigned st = s0 + (c & 1) * GDN_WG_STAGE;
#pragma unroll 4
        for (int it = 0; it < 16; ++it) {  // W: 64 rows x 32 pieces (hi, then lo)
            const int idx = tid + it * 128, r = idx >> 5, p = idx & 31;
            const bool ok = r < L;
            cp_async16(st + (p < 16 ? OWH : OWL) + swz(r, p & 15),
                       reinterpret_cast<const char*>(W) + ((long long)h * T + (ok ? t0 + r : 0)) * RW + p * 16, ok ? 16 : 0);
        }
#pragma unroll 4
        for (int it = 0; it < 8; ++it) {  // q, k: 64 rows x 16 pieces; P: 64 rows x 16 pieces (hi, then lo)
            const int idx = tid + it * 128, r = idx >> 4, p = idx & 15;
            const bool ok = r < L;
            const long long t = ok ? t0 + r : 0;
            const bf16_t* qrow = qkv + t * sq + qoff;
            cp_async16(st + OQ + swz(r, p), qrow + p * 8, ok ? 16 : 0);
            cp_async16(st + OK + swz(r, p), qrow + nk * DK + p * 8, ok ? 16 : 0);
            cp_async16(st + (p < 8 ? OPH : OPL) + swz(r, p & 7),
                       reinterpret_cast<const char*>(P) + ((long long)h * T + t) * RP + p * 16, ok ? 16 : 0);
        }
#pragma unroll 4
        for (int it = 0; it < 8; ++it) {  // U: this block's two 32-column tiles, 64 rows x 8 pieces each
            const int idx = tid + it * 128, u = idx >> 9, r = (idx >> 3) & 63, p = idx & 7;
            const bool ok = r < L;
            cp_async16(st + OU + u * 8192 + r * 128 + p * 16,
                       U + (((long long)h * (DV / 32) + col0 / 32 + u) * T + (ok ? t0 + r : 0)) * 32 + p * 4, ok ? 16 : 0);
        }
        if (tid < 64) {
            const bool ok = tid < L;
            cp_async16(st + OA + tid * 16, aux + ((long long)h * T + (ok ? t0 + tid : 0)) * 4, ok ? 16 : 0);
        }
        cp_async_commit();
    };
    load(0);

    // S^T: Sa[d][e] is S^T[row m][k column 64 d + n], m = 16 w4 + g8 + 8 ((e >> 1) & 1), n = 8 (e >> 2) + c2 +
    // (e & 1): the m64n64 accumulator layout, its rows the state's v columns
    float* S_g = state + ((long long)slots[seq] * nv + h) * DK * DV + col0;
    float* S_save = state + ((long long)save_rows[seq] * nv + h) * DK * DV + col0;
    const int save_end = t_beg + save_at[seq];
    auto at = [&](int d, int e) {
        return (64 * d + 8 * (e >> 2) + c2 + (e & 1)) * DV + 16 * w4 + g8 + 8 * ((e >> 1) & 1);
    };
    float Sa[2][32];
#pragma unroll
    for (int d = 0; d < 2; ++d)
#pragma unroll
        for (int e = 0; e < 32; ++e) Sa[d][e] = S_g[at(d, e)];
    // S^T's lo half into sSL: the pair (n, n + 1) of row m at column block d, chunk n / 8 (swizzled), word (n % 8) / 2
    auto store_lo = [&]() {
#pragma unroll
        for (int d = 0; d < 2; ++d)
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
                const int m = 16 * w4 + g8 + 8 * ((e >> 1) & 1), n = 8 * (e >> 2) + c2;
                unsigned hi, lo;
                split_bf16x2(Sa[d][e], Sa[d][e + 1], hi, lo);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sSL + d * (64 * 128) + m * 128 + (((n >> 3) ^ (m & 7)) << 4)
                                                                 + (n & 7) * 2), "r"(lo) : "memory");
            }
    };
    store_lo();

    // K-major operands (W, q, P; S^T lo as an A operand) and MN-major ones (k)
    const WgDesc dK_(s0, 16, 1024), dSL(sSL, 16, 1024), dMN(s0, 64 * 128, 1024);
    for (int c = 0; c < n_chunks; ++c) {
        const int t0 = t_beg + c * GDN_C, L = min(GDN_C, t_end - t0);
        const unsigned so = (c & 1) * GDN_WG_STAGE;
        const unsigned char* st = base + so;
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> wgmma reads
        __syncthreads();  // the stage has landed everywhere; the other one (chunk c - 1's) is free
        if (c + 1 < n_chunks) load(c + 1);

        unsigned sh[8][4];  // S^T's bf16 hi half as A fragments, k16 step 4 d + kk over the k rows
#pragma unroll
        for (int d = 0; d < 2; ++d)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) sh[4 * d + kk][r] = pack_bf16x2(Sa[d][8 * kk + 2 * r], Sa[d][8 * kk + 2 * r + 1]);
        float ws[32], qs[32];
#pragma unroll
        for (int e = 0; e < 32; ++e) ws[e] = qs[e] = 0.0f;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            const unsigned k16 = (ks >> 2) * (64 * 128) + (ks & 3) * 32;
            wg_rs<0>(ws, sh[ks], dK_.at(so + OWH + k16));
            wg_ss(ws, dSL.at(k16), dK_.at(so + OWH + k16), 1);
            wg_rs<0>(ws, sh[ks], dK_.at(so + OWL + k16));
            wg_rs<0>(qs, sh[ks], dK_.at(so + OQ + k16));
            wg_ss(qs, dSL.at(k16), dK_.at(so + OQ + k16), 1);
        }
        wg_commit();
        wg_wait<0>();
        wg_hold(ws);
        wg_hold(qs);

        // v_new^T = U^T - WS^T (zero past the end) as bf16 hi and lo A fragments over the chunk's tokens; o^T starts
        // as sq QS^T, then += v_new^T P^T
        const float* sU = reinterpret_cast<const float*>(st + OU);
        const float* sA = reinterpret_cast<const float*>(st + OA);
        unsigned vh[4][4], vl[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                float u[2];
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const int e = 8 * kk + 2 * r + x, m = 16 * w4 + g8 + 8 * (r & 1), t = 8 * (e >> 2) + c2 + x;
                    u[x] = t < L ? sU[(m >> 5) * 2048 + t * 32 + (m & 31)] - ws[e] : 0.0f;
                    qs[e] *= sA[t * 4 + 1];
                }
                split_bf16x2(u[0], u[1], vh[kk][r], vl[kk][r]);
            }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            wg_rs<0>(qs, vh[kk], dK_.at(so + OPH + kk * 32));
            wg_rs<0>(qs, vl[kk], dK_.at(so + OPH + kk * 32));
            wg_rs<0>(qs, vh[kk], dK_.at(so + OPL + kk * 32));
        }
        wg_commit();
        wg_wait<0>();
        wg_hold(qs);
        // S^T = e^gam_last S^T + (sk v_new)^T k, sk v_new split again from v_new's halves (hi + lo: v_new to
        // ~2^-17, below the split's own rounding) in the same registers
        const float decay = expf(sA[(L - 1) * 4]);
#pragma unroll
        for (int d = 0; d < 2; ++d)
#pragma unroll
            for (int e = 0; e < 32; ++e) Sa[d][e] *= decay;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int t = 16 * kk + 8 * (r >> 1) + c2;  // the fragment's two tokens: t, t + 1
                const float u0 = lo_bf(vh[kk][r]) + lo_bf(vl[kk][r]), u1 = hi_bf(vh[kk][r]) + hi_bf(vl[kk][r]);
                split_bf16x2(sA[t * 4 + 2] * u0, sA[t * 4 + 6] * u1, vh[kk][r], vl[kk][r]);
            }
        wg_fence();
#pragma unroll
        for (int d = 0; d < 2; ++d)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                wg_rs<1>(Sa[d], vh[kk], dMN.at(so + OK + d * (64 * 128) + kk * 2048));
                wg_rs<1>(Sa[d], vl[kk], dMN.at(so + OK + d * (64 * 128) + kk * 2048));
            }
        wg_commit();
        wg_wait<0>();
        wg_hold(Sa[0]);
        wg_hold(Sa[1]);
        store_lo();  // read by the next chunk's products after its barrier and proxy fence

        // o^T -> sO [token][column], then coalesced 16-byte stores of the chunk's rows
#pragma unroll
        for (int e = 0; e < 32; ++e)
            sO[(8 * (e >> 2) + c2 + (e & 1)) * 64 + 16 * w4 + g8 + 8 * ((e >> 1) & 1)] = f2bf(qs[e]);
        __syncthreads();
#pragma unroll
        for (int it = 0; it < 4; ++it) {
            const int idx = tid + it * 128, r = idx >> 3, p = idx & 7;
            if (r < L)
                *reinterpret_cast<uint4*>(out + ((long long)(t0 + r) * nv + h) * DV + col0 + p * 8) =
                    reinterpret_cast<const uint4*>(sO + r * 64)[p];
        }
        if (save_at[seq] && t0 + L == save_end) {  // prefix caching: the state after this chunk to its snapshot row
#pragma unroll
            for (int d = 0; d < 2; ++d)
#pragma unroll
                for (int e = 0; e < 32; ++e) S_save[at(d, e)] = Sa[d][e];
        }
    }
#pragma unroll
    for (int d = 0; d < 2; ++d)
#pragma unroll
        for (int e = 0; e < 32; ++e) S_g[at(d, e)] = Sa[d][e];
    cp_async_wait<0>();  // an empty sequence's zero-filled first load
#else
    __trap();  // sm_90a only: elsewhere the backend runs gdn_chunk_state
#endif
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
#define GDN_CHUNK_INST(DK)                                                                                   \
    template __global__ void gdn_chunk_prep<DK>(const bf16_t*, long long, const bf16_t*, long long,             \
                                                const bf16_t*, long long, const float*, const float*, const int*, \
                                                bf16_t*, float*, bf16_t*, float*, int, int, int, int);      \
    template __global__ void gdn_chunk_state<DK, 1>(const bf16_t*, const float*, const bf16_t*, const bf16_t*, \
                                                    long long, const float*, float*, const int*, const int*,    \
                                                    const int*, const int*, bf16_t*, int, int, int, int);       \
    template __global__ void gdn_chunk_state<DK, 2>(const bf16_t*, const float*, const bf16_t*, const bf16_t*, \
                                                    long long, const float*, float*, const int*, const int*,    \
                                                    const int*, const int*, bf16_t*, int, int, int, int);
GDN_CHUNK_INST(32)
GDN_CHUNK_INST(64)
GDN_CHUNK_INST(128)
template __global__ void gdn_chunk_state_wg<128>(const bf16_t*, const float*, const bf16_t*, const bf16_t*, long long,
                                                 const float*, float*, const int*, const int*, const int*,
                                                 const int*, bf16_t*, int, int, int);
#endif
