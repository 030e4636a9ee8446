// Gated delta rule (spec §4.3-§4.6), token-recurrent, varlen, state f32 in place by slot.
// Fused: gating g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), value head h -> q/k head
// h / (nv/nk), q/k L2 norm (rsqrt(sum + 1e-6)), q * dk^-0.5, decay, delta update, output o = S^T q.
//
// Tiles: a [DK, 32] column block of one head's state [DK, dv] for one sequence, (dv/32) x nv x B of them
// (column block fastest). 128 threads per tile: lane = state column, warp w = rows [w*DK/4, (w+1)*DK/4),
// DK/4 f32 registers per thread. Sequences of several tokens run here too when they are speculative
// verifies (spec_rows[seq] >= 0): the state after each of their tokens but the last also goes to rows
// spec_rows[seq] + 0, 1, ..., so a verify that accepts a of its drafts is rolled back by copying row
// spec_rows[seq] + a into the slot.
// Grid: min(tiles, GDN_REC_BLOCKS x SMs) blocks, each walking tiles blockIdx.x, + gridDim.x, ...: while it
// computes one tile the next one's state streams into shared memory (cp.async, two buffers) and its first
// token's inputs into registers (the slot and token range two tiles ahead), so an SM's state loads do not
// stop while its blocks compute (with one tile per block they ran in lockstep phases: ~60% of copy at B = 32).
#include "common.cuh"

#define GDN_WARPS 4
#define GDN_REC_BLOCKS 4  // resident blocks per SM (launch bounds; 2 state buffers of 16 KB each at DK 128)

template <int DK>
__global__ void __launch_bounds__(128, GDN_REC_BLOCKS) gdn_recurrent(
    const bf16_t* __restrict__ qkv, long long sq,   // [T, 2*nk*DK + nv*dv], row stride sq
    const bf16_t* __restrict__ a, long long sa,     // [T, nv] row stride sa
    const bf16_t* __restrict__ b, long long sb,     // [T, nv] row stride sb
    const float* __restrict__ A_log, const float* __restrict__ dt_bias,  // [nv] f32
    float* state,                                   // [slots, nv, DK, dv] f32
    const int* __restrict__ cu, const int* __restrict__ slots,
    const int* __restrict__ spec_rows,              // [B]: first per-token state row, or -1
    bf16_t* __restrict__ out,                       // [T, nv*dv]
    int nk, int nv, int dv, int B)
{
    pdl_enter();
    constexpr int R = DK / GDN_WARPS;
    extern __shared__ __align__(16) float s_tile[];  // [2][DK][32] state tiles
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
    auto fetch_state = [&](int tile, int slot, float* buf) {  // one cp.async group
        const float* src = state + (long long)slot * row_size + (long long)((tile / xt) % nv) * DK * dv + (tile % xt) * 32;
        for (int j = tid; j < DK * 8; j += 128) {
            const int r = j >> 3, c = (j & 7) * 4;
            cp_async16(smem_addr(buf + r * 32 + c), src + (long long)r * dv + c, 16);
        }
        cp_async_commit();
    };
    struct Meta { int slot, t0, t1; };
    auto meta = [&](int tile) {
        const int seq = tile / (xt * nv);
        return Meta{slots[seq], cu[seq], cu[seq + 1]};
    };

    const int step = gridDim.x;
    int tile = blockIdx.x;
    Meta cur = meta(tile), nxt{0, 0, 0};
    In in{}, in_next{};
    fetch_state(tile, cur.slot, s_tile);
    if (cur.t0 < cur.t1) load(tile, cur.t0, in);
    if (tile + step < tiles) nxt = meta(tile + step);
    for (int i = 0; tile < tiles; ++i, tile += step) {
        const bool more = tile + step < tiles;
        float* buf = s_tile + (i & 1) * DK * 32;
        Meta after{0, 0, 0};
        if (more) {  // the next tile's state and first inputs; the slot and tokens of the one after
            fetch_state(tile + step, nxt.slot, s_tile + ((i + 1) & 1) * DK * 32);
            if (nxt.t0 < nxt.t1) load(tile + step, nxt.t0, in_next);
            if (tile + 2 * step < tiles) after = meta(tile + 2 * step);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();                            // this tile's state landed for every thread

        const int h = (tile / xt) % nv, seq = tile / (xt * nv), col = (tile % xt) * 32 + lane;
        float* S_base = state + (long long)cur.slot * row_size + (long long)h * DK * dv + col;
        // the next per-token state row (a verify), or null
        float* S_next = spec_rows[seq] >= 0 ? S_base + (spec_rows[seq] - cur.slot) * row_size : nullptr;
        float S[R];
#pragma unroll
        for (int r = 0; r < R; ++r) S[r] = buf[(warp * R + r) * 32 + lane];
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
                S[r] *= decay;
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
                S[r] += s_k[warp * R + r] * delta;
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
            if (S_next && t + 1 < cur.t1) {
#pragma unroll
                for (int r = 0; r < R; ++r) S_next[(long long)(warp * R + r) * dv] = S[r];
                S_next += row_size;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) S_base[(long long)(warp * R + r) * dv] = S[r];
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
                                           const float*, const float*, float*, const int*, const int*, const int*, bf16_t*,
                                           int, int, int, int);
template __global__ void gdn_recurrent<64>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, const int*, bf16_t*,
                                           int, int, int, int);
template __global__ void gdn_recurrent<128>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                            const float*, const float*, float*, const int*, const int*, const int*, bf16_t*,
                                            int, int, int, int);
#endif

// ---- Chunked (WY/UT) form for prefill (spec §4.7), two kernels ----------------------------------
// Chunks of 64 tokens per sequence. gdn_chunk_prep is parallel over (chunk, head, sequence): it builds
// everything that depends on q, k, a, b only, so the serial state pass below is four small matmuls
// per chunk over operands it streams in with cp.async:
//   gam = cumsum(g) in the chunk, D_ij = exp(gam_i - gam_j) (j <= i, <= 1 so never overflows)
//   A = tril(beta_i k_i.k_j D_ij, -1);  [W | U] = (I + A)^-1 [beta k e^gam | beta v]
//   P = tril(q_i.k_j D_ij);  Qs = q e^gam;  Ks = k e^(gam_last - gam)   (q, k L2-normed, q * dk^-0.5)
// written as W, Qs, Ks [T, nv, DK] and P [T, nv, 64] in bf16x3 pairs (below: a row of X values is X bf16
// hi then X bf16 lo, x = hi + lo to ~2^-16), U [T, nv, dv] and aux [T, nv, 4] (gam in .x) in f32.
// gdn_chunk_state then runs per (32-column state tile, head, sequence), chunk after chunk:
//   v_new = U - W S;  o = Qs S + P v_new;  S = e^gam_last S + Ks^T v_new
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
    bf16_t* __restrict__ Qs, bf16_t* __restrict__ Ks, float* __restrict__ aux, int nk, int nv, int dv)
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
        s_cw[tid] = s_beta[tid] * expf(s_gam[tid]) * s_rk[tid];
        if (tid < L) aux[((long long)(t0 + tid) * nv + h) * 4] = s_gam[tid];
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
                    unsigned* dst = reinterpret_cast<unsigned*>(P + ((long long)(t0 + i) * nv + h) * 2 * GDN_C + nb + 8 * n + 2 * t);
                    split_bf16x2(pr[0], pr[1], dst[0], dst[GDN_C / 2]);
                }
            }
        }
    }
    // Qs = q e^gam, Ks = k e^(gam_last - gam) (normed rows) out
    const float g_last = s_gam[L - 1];
    for (int idx = tid; idx < L * DK / 2; idx += 256) {
        const int i = idx / (DK / 2), c = 2 * (idx - i * (DK / 2));
        const long long o = ((long long)(t0 + i) * nv + h) * 2 * DK + c;
        const float eq = s_rq[i] * expf(s_gam[i]), ek = s_rk[i] * expf(g_last - s_gam[i]);
        const unsigned q2 = *reinterpret_cast<const unsigned*>(sQr + i * RQ + c * 2);
        const unsigned k2 = *reinterpret_cast<const unsigned*>(sKr + i * RQ + c * 2);
        unsigned* qd = reinterpret_cast<unsigned*>(Qs + o);
        unsigned* kd = reinterpret_cast<unsigned*>(Ks + o);
        split_bf16x2(lo_bf(q2) * eq, hi_bf(q2) * eq, qd[0], qd[DK / 2]);
        split_bf16x2(lo_bf(k2) * ek, hi_bf(k2) * ek, kd[0], kd[DK / 2]);
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
                bf16_t* dst = W + ((long long)(t0 + i) * nv + h) * 2 * DK + cc;
                *reinterpret_cast<uint2*>(dst) = hi;
                *reinterpret_cast<uint2*>(dst + DK) = lo;
            } else {
                *reinterpret_cast<float4*>(U + ((long long)(t0 + i) * nv + h) * dv + cc - DK) = v;
            }
        }
    }
}

// ---- gdn_chunk_state: the four products on tensor cores (mma.sync m16n8k16 bf16x3) -----------------
// HF runs this math in f32, so every product is bf16x3: x = hi + lo (both bf16, lo the rounded remainder,
// x to ~2^-16 relative) and a*b ~ ah*bh + (ah*bl + al*bh), three bf16 mma per k16 with f32 accumulation.
// Prep writes its operands already split (a row of X values is X hi then X lo bf16: the bytes of f32); the
// kernel splits S and v_new as it stores them to shared memory for the next product.

// acc (16 rows x 16 columns: two n8 C fragments) += A (16 x K) . B (K x 16), both bf16x3 in shared memory.
// a, b: this lane's ldmatrix addresses of the hi halves at k = 0, stepped by a_step / b_step bytes per k16;
// the lo halves are a_lo / b_lo bytes further. B is stored k-major ([k][n] rows: .trans); A row-major
// ([m][k] rows) or, with A_T, k-major ([k][m] rows: .trans). The small terms go to `cor`, their own
// dependency chain, which the caller adds to acc.
template <bool A_T, int K>
__device__ __forceinline__ void mma3(float (&acc)[2][4], float (&cor)[2][4], unsigned a, int a_step, int a_lo,
                                     unsigned b, int b_step, int b_lo) {
#pragma unroll
    for (int k = 0; k < K; k += 16, a += a_step, b += b_step) {
        unsigned ah[4], al[4], bh[4], bl[4];
        if (A_T) {
            ldsm_x4_t(a, ah[0], ah[1], ah[2], ah[3]);
            ldsm_x4_t(a + a_lo, al[0], al[1], al[2], al[3]);
        } else {
            ldsm_x4(a, ah[0], ah[1], ah[2], ah[3]);
            ldsm_x4(a + a_lo, al[0], al[1], al[2], al[3]);
        }
        ldsm_x4_t(b, bh[0], bh[1], bh[2], bh[3]);
        ldsm_x4_t(b + b_lo, bl[0], bl[1], bl[2], bl[3]);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            mma_bf16(acc[n], ah[0], ah[1], ah[2], ah[3], bh[2 * n], bh[2 * n + 1]);
            mma_bf16(cor[n], ah[0], ah[1], ah[2], ah[3], bl[2 * n], bl[2 * n + 1]);
            mma_bf16(cor[n], al[0], al[1], al[2], al[3], bh[2 * n], bh[2 * n + 1]);
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

// cp.async rows [0, 64) of a chunk of a [T, nv, row_bytes] tensor (head h; n16 16-byte pieces from byte
// col0 of each row) into shared rows of `ld` bytes at dst; rows past L are zero-filled.
__device__ __forceinline__ void load_rows(unsigned dst, int ld, const void* src, int t0, int L, int nv, int h,
                                          int row_bytes, int col0, int n16) {
    const char* s = static_cast<const char*>(src);
    for (int idx = threadIdx.x; idx < GDN_C * n16; idx += blockDim.x) {
        const int i = idx / n16, c = (idx - i * n16) * 16;
        const bool ok = i < L;
        cp_async16(dst + i * ld + c, ok ? s + ((long long)(t0 + i) * nv + h) * row_bytes + col0 + c : s, ok ? 16 : 0);
    }
    cp_async_commit();
}

// Grid (dv/32, nv, B), 512 threads: 16 warps, as two sets of 8 that split the tile's 32 columns (one
// block per SM for the shared memory below, so the warps are what hides the mma and load latency). The
// block's state tile S [DK][32] lives in registers as mma accumulators (warp w owns rows 16 (w % 8)..
// +15 of its 16 columns, if w % 8 < DK/16), with a split copy in shared memory for the products that
// read it. Per chunk, with q = w % 8: warps q < 4 compute W S (rows 16q..), q >= 4 Qs S; the first
// turn theirs into v_new = U - W S (split into shared memory); then the second add P v_new to o and
// store it, while the owners update S = e^gam_last S + Ks^T v_new. Loads run under the products: Ks and
// P (cp.async) under W S / Qs S, the next chunk's W and Qs under the second half, U straight to registers.
// Shared rows are hi | lo | 8 bf16 of padding (16 mod 128 bytes: ldmatrix phases are conflict-free).
#define GDN_STATE_WARPS 16
template <int DK>
__global__ void __launch_bounds__(32 * GDN_STATE_WARPS) gdn_chunk_state(
    const bf16_t* __restrict__ W, const float* __restrict__ U, const bf16_t* __restrict__ P,
    const bf16_t* __restrict__ Qs, const bf16_t* __restrict__ Ks, const float* __restrict__ aux, float* state,
    const int* __restrict__ cu, const int* __restrict__ slots, const int* __restrict__ save_at,
    const int* __restrict__ save_rows, bf16_t* __restrict__ out, int nv, int dv)
{
    pdl_enter();
    constexpr int RW = (2 * DK + 8) * 2, RP = (2 * GDN_C + 8) * 2, RS = GDN_RS;  // row bytes
    extern __shared__ __align__(16) char smem_c[];
    char* sS = smem_c;                          // [DK][RS]   S
    char* sW = sS + DK * RS;                    // [64][RW]   W
    char* sQ = sW + GDN_C * RW;                 // [64][RW]   Qs
    char* sK = sQ + GDN_C * RW;                 // [64][RW]   Ks
    char* sP = sK + GDN_C * RW;                 // [64][RP]   P
    char* sV = sP + GDN_C * RP;                 // [64][RS]   v_new

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int col0 = blockIdx.x * 32, h = blockIdx.y, seq = blockIdx.z;
    const int t_beg = cu[seq], t_end = cu[seq + 1];
    float* S_g = state + ((long long)slots[seq] * nv + h) * DK * dv + col0;
    const int save_end = t_beg + save_at[seq];  // prefix caching: S after this chunk also goes to a snapshot row
    float* S_save = state + ((long long)save_rows[seq] * nv + h) * DK * dv + col0;
    const int q = warp & 7, c0 = (warp >> 3) * 16;  // row role, first column
    const bool owner = q < DK / 16;
    const int r0 = (q & 3) * 16;                // this warp's rows of W S / Qs S / P v_new
    float S[2][4];                              // owned S tile: rows 16q + g (+8), columns c0 + 8n + 2t (+1)

    // this lane's ldmatrix addresses: A row-major (rows r0.., k 0), A k-major (Ks^T rows 16q.., k 0),
    // B k-major (k 0, columns c0..)
    const int a_row = lane & 15, a_col = (lane >> 4) * 8;
    const int at_row = (lane & 7) + (lane >> 4) * 8, at_col = ((lane >> 3) & 1) * 8;
    const int b_row = (lane & 7) + ((lane >> 3) & 1) * 8, b_col = c0 + (lane >> 4) * 8;
    const unsigned aWQ = smem_addr((q < 4 ? sW : sQ) + (r0 + a_row) * RW + a_col * 2);
    const unsigned aP = smem_addr(sP + (r0 + a_row) * RP + a_col * 2);
    const unsigned aK = smem_addr(sK + at_row * RW + (q * 16 + at_col) * 2);
    const unsigned bS = smem_addr(sS + b_row * RS + b_col * 2);
    const unsigned bV = smem_addr(sV + b_row * RS + b_col * 2);

    if (owner) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                S[n][i] = S_g[(long long)(q * 16 + g + (i >> 1) * 8) * dv + c0 + n * 8 + 2 * t + (i & 1)];
        store_split(sS, q * 16, c0, S);
    }
    if (t_beg < t_end) {
        const int L = min(GDN_C, t_end - t_beg);
        load_rows(smem_addr(sW), RW, W, t_beg, L, nv, h, 4 * DK, 0, DK / 4);
        load_rows(smem_addr(sQ), RW, Qs, t_beg, L, nv, h, 4 * DK, 0, DK / 4);
    }

    for (int t0 = t_beg; t0 < t_end; t0 += GDN_C) {
        const int L = min(GDN_C, t_end - t0);
        cp_async_wait<0>();                     // this chunk's W and Qs
        __syncthreads();                        // ... everyone's; last chunk's readers of sK, sP, sV are done
        load_rows(smem_addr(sK), RW, Ks, t0, L, nv, h, 4 * DK, 0, DK / 4);
        load_rows(smem_addr(sP), RP, P, t0, L, nv, h, 4 * GDN_C, 0, GDN_C / 4);
        const float decay = expf(aux[((long long)(t0 + L - 1) * nv + h) * 4]);
        float u[2][4] = {};                     // q < 4: this lane's U (zero past the end)
        if (q < 4) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int r = r0 + g + 8 * j;
                if (r < L) {
                    const float* src = U + ((long long)(t0 + r) * nv + h) * dv + col0 + c0 + 2 * t;
#pragma unroll
                    for (int n = 0; n < 2; ++n) {
                        const float2 v = *reinterpret_cast<const float2*>(src + 8 * n);
                        u[n][2 * j] = v.x;
                        u[n][2 * j + 1] = v.y;
                    }
                }
            }
        }

        float acc[2][4] = {}, cor[2][4] = {};   // q < 4: W S; q >= 4: Qs S, then + P v_new = o
        mma3<false, DK>(acc, cor, aWQ, 32, 2 * DK, bS, 16 * RS, 64);
        if (q < 4) {
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) u[n][i] -= acc[n][i] + cor[n][i];  // zero rows stay zero
            store_split(sV, r0, c0, u);
        }
        cp_async_wait<0>();                     // Ks, P
        __syncthreads();                        // v_new, Ks, P ready; sW, sQ and sS are free
        if (t0 + GDN_C < t_end) {
            const int Ln = min(GDN_C, t_end - t0 - GDN_C);
            load_rows(smem_addr(sW), RW, W, t0 + GDN_C, Ln, nv, h, 4 * DK, 0, DK / 4);
            load_rows(smem_addr(sQ), RW, Qs, t0 + GDN_C, Ln, nv, h, 4 * DK, 0, DK / 4);
        }
        if (q >= 4) {
            mma3<false, GDN_C>(acc, cor, aP, 32, 2 * GDN_C, bV, 16 * RS, 64);
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
            float c2[2][4] = {};
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) S[n][i] *= decay;
            mma3<true, GDN_C>(S, c2, aK, 16 * RW, 2 * DK, bV, 16 * RS, 64);
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
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
#define GDN_CHUNK_INST(DK)                                                                                   \
    template __global__ void gdn_chunk_prep<DK>(const bf16_t*, long long, const bf16_t*, long long,             \
                                                const bf16_t*, long long, const float*, const float*, const int*, \
                                                bf16_t*, float*, bf16_t*, bf16_t*, bf16_t*, float*, int, int, int); \
    template __global__ void gdn_chunk_state<DK>(const bf16_t*, const float*, const bf16_t*, const bf16_t*,   \
                                                 const bf16_t*, const float*, float*, const int*, const int*,  \
                                                 const int*, const int*, bf16_t*, int, int);
GDN_CHUNK_INST(32)
GDN_CHUNK_INST(64)
GDN_CHUNK_INST(128)
#endif
