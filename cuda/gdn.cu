// Gated delta rule (spec §4.3-§4.6), token-recurrent, varlen, state f32 in place by slot.
// Fused: gating g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), value head h -> q/k head
// h / (nv/nk), q/k L2 norm (rsqrt(sum + 1e-6)), q * dk^-0.5, decay, delta update, output o = S^T q.
//
// Grid (dv/32, nv, B), 128 threads. A block owns a [DK, 32] tile of one head's state [DK, dv] for one
// sequence: lane = state column, warp w = rows [w*DK/4, (w+1)*DK/4), DK/4 f32 registers per thread.
// Sequences of several tokens run here too when they are speculative verifies (spec_rows[seq] >= 0):
// the state after each of their tokens but the last also goes to rows spec_rows[seq] + 0, 1, ..., so a
// verify that accepts a of its drafts is rolled back by copying row spec_rows[seq] + a into the slot.
#include "common.cuh"

#define GDN_WARPS 4

template <int DK>
__global__ void __launch_bounds__(128, 4) gdn_recurrent(
    const bf16_t* __restrict__ qkv, long long sq,   // [T, 2*nk*DK + nv*dv], row stride sq
    const bf16_t* __restrict__ a, long long sa,     // [T, nv] row stride sa
    const bf16_t* __restrict__ b, long long sb,     // [T, nv] row stride sb
    const float* __restrict__ A_log, const float* __restrict__ dt_bias,  // [nv] f32
    float* state,                                   // [slots, nv, DK, dv] f32
    const int* __restrict__ cu, const int* __restrict__ slots,
    const int* __restrict__ spec_rows,              // [B]: first per-token state row, or -1
    bf16_t* __restrict__ out,                       // [T, nv*dv]
    int nk, int nv, int dv)
{
    pdl_enter();
    constexpr int R = DK / GDN_WARPS;
    __shared__ float s_q[DK], s_k[DK];
    __shared__ float s_red[2][GDN_WARPS];
    __shared__ float s_p[GDN_WARPS][32];
    __shared__ float s_o[GDN_WARPS][32];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col = blockIdx.x * 32 + lane;
    const int h = blockIdx.y, seq = blockIdx.z;
    const int hk = h / (nv / nk);
    const int t0 = cu[seq], t1 = cu[seq + 1];
    const long long slot = slots[seq];
    const long long row_size = (long long)nv * DK * dv;
    float* S_base = state + slot * row_size + (long long)h * DK * dv + col;
    // the next per-token state row (a verify), or null
    float* S_next = spec_rows[seq] >= 0 ? S_base + (spec_rows[seq] - slot) * row_size : nullptr;

    float S[R];
#pragma unroll
    for (int r = 0; r < R; ++r) S[r] = S_base[(long long)(warp * R + r) * dv];

    const float A = expf(A_log[h]);
    const float dtb = dt_bias[h];
    const float qscale = rsqrtf((float)DK);

    // token t's inputs (q, k of this thread's row, v of its column, the gate inputs a, b) are loaded while
    // token t - 1 is computed: a verify's tokens then wait for one load latency, not one each
    bf16_t in_q = 0, in_k = 0, in_v = 0, in_a = 0, in_b = 0;
    auto load = [&](int t) {
        const bf16_t* row = qkv + (long long)t * sq;
        if (tid < DK) {
            in_q = row[hk * DK + tid];
            in_k = row[nk * DK + hk * DK + tid];
        }
        in_v = row[2 * nk * DK + h * dv + col];
        in_a = a[(long long)t * sa + h];
        in_b = b[(long long)t * sb + h];
    };
    if (t0 < t1) load(t0);
    for (int t = t0; t < t1; ++t) {
        const float qv = tid < DK ? bf2f(in_q) : 0.0f, kv = tid < DK ? bf2f(in_k) : 0.0f;
        const float vj = bf2f(in_v);
        const float decay = expf(-A * softplus_f(bf2f(in_a) + dtb));
        const float beta = sigmoid_f(bf2f(in_b));
        if (t + 1 < t1) load(t + 1);
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
        if (S_next && t + 1 < t1) {
#pragma unroll
            for (int r = 0; r < R; ++r) S_next[(long long)(warp * R + r) * dv] = S[r];
            S_next += row_size;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) S_base[(long long)(warp * R + r) * dv] = S[r];
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
template __global__ void gdn_recurrent<32>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, const int*, bf16_t*,
                                           int, int, int);
template __global__ void gdn_recurrent<64>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, const int*, bf16_t*,
                                           int, int, int);
template __global__ void gdn_recurrent<128>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                            const float*, const float*, float*, const int*, const int*, const int*, bf16_t*,
                                            int, int, int);
#endif

// ---- Chunked (WY/UT) form for prefill (spec §4.7), two kernels ----------------------------------
// Chunks of 64 tokens per sequence. gdn_chunk_prep is parallel over (chunk, head, sequence): it builds
// everything that depends on q, k, a, b only, so the serial state pass below is four small matmuls
// per chunk over operands it streams in with cp.async:
//   gam = cumsum(g) in the chunk, D_ij = exp(gam_i - gam_j) (j <= i, <= 1 so never overflows)
//   A = tril(beta_i k_i.k_j D_ij, -1);  [W | U] = (I + A)^-1 [beta k e^gam | beta v]
//   P = tril(q_i.k_j D_ij);  Qs = q e^gam;  Ks = k e^(gam_last - gam)   (q, k L2-normed, q * dk^-0.5)
// written in f32 as W, Qs, Ks [T, nv, DK], U [T, nv, dv], P [T, nv, 64], aux [T, nv, 4] (gam in .x).
// gdn_chunk_state then runs per (32-column state tile, head, sequence), chunk after chunk:
//   v_new = U - W S;  o = Qs S + P v_new;  S = e^gam_last S + Ks^T v_new
// on tensor cores (below). Rows past a sequence's end are zeros (g = 0, beta = 0), which leaves outputs
// and state unchanged.
#define GDN_C 64

// Shared memory: normed q and k rows and A. A/P are a 64x64 product over DK in 4x4 register tiles on
// CUDA cores (a 3xTF32 tensor-core form, as in gdn_chunk_state, was slower: docs/benchmarks/NOTES.md).
// The triangular solve gives each thread one column of X = [W | U] in registers, so it
// needs no barriers and reads A as float4 broadcasts.
template <int DK>
__global__ void __launch_bounds__(256, 2) gdn_chunk_prep(
    const bf16_t* __restrict__ qkv, long long sq, const bf16_t* __restrict__ a, long long sa,
    const bf16_t* __restrict__ b, long long sb, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const int* __restrict__ cu, float* __restrict__ W, float* __restrict__ U, float* __restrict__ P,
    float* __restrict__ Qs, float* __restrict__ Ks, float* __restrict__ aux, int nk, int nv, int dv)
{
    pdl_enter();
    extern __shared__ __align__(16) float smem[];
    constexpr int KS = DK + 1;                  // padded row: column reads across rows are conflict-free
    constexpr int AS = GDN_C + 4;               // A row: float4 reads
    float* sq_ = smem;                          // [64][KS] normed, scaled q
    float* sk = sq_ + GDN_C * KS;               // [64][KS] normed k
    float* sA = sk + GDN_C * KS;                // [64][AS]
    float* s_gam = sA + GDN_C * AS;             // [64]
    float* s_beta = s_gam + GDN_C;              // [64]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y, seq = blockIdx.z;
    const int hk = h / (nv / nk);
    const int t0 = cu[seq] + blockIdx.x * GDN_C, t_end = cu[seq + 1];
    if (t0 >= t_end) return;
    const int L = min(GDN_C, t_end - t0);
    const float qscale = rsqrtf((float)DK);

    for (int r = warp; r < GDN_C; r += 8) {     // one warp per row: load, L2-norm
        float qv[DK / 32], kv[DK / 32], ssq = 0.0f, skk = 0.0f;
        const bf16_t* row = qkv + (long long)(t0 + r) * sq;
#pragma unroll
        for (int i = 0; i < DK / 32; ++i) {
            qv[i] = r < L ? bf2f(row[hk * DK + i * 32 + lane]) : 0.0f;
            kv[i] = r < L ? bf2f(row[nk * DK + hk * DK + i * 32 + lane]) : 0.0f;
            ssq += qv[i] * qv[i];
            skk += kv[i] * kv[i];
        }
        const float rq = rsqrtf(warp_sum(ssq) + 1e-6f) * qscale, rk = rsqrtf(warp_sum(skk) + 1e-6f);
#pragma unroll
        for (int i = 0; i < DK / 32; ++i) {
            sq_[r * KS + i * 32 + lane] = qv[i] * rq;
            sk[r * KS + i * 32 + lane] = kv[i] * rk;
        }
    }
    if (tid < GDN_C) {
        float g = 0.0f, beta = 0.0f;
        if (tid < L) {
            const long long t = t0 + tid;
            g = -expf(A_log[h]) * softplus_f(bf2f(a[t * sa + h]) + dt_bias[h]);
            beta = sigmoid_f(bf2f(b[t * sb + h]));
        }
        s_gam[tid] = g;
        s_beta[tid] = beta;
    }
    __syncthreads();
    if (tid == 0) {                             // 64-term prefix sum: serial is cheapest here
        float acc = 0.0f;
        for (int i = 0; i < GDN_C; ++i) { acc += s_gam[i]; s_gam[i] = acc; }
    }
    __syncthreads();

    {   // A and P, rows 4*ti.., columns 4*tj..; tiles wholly above the diagonal are zero
        const int ti = tid >> 4, tj = tid & 15;
        float kk[4][4] = {}, qk[4][4] = {};
        if (tj <= ti) {
#pragma unroll 4
            for (int d = 0; d < DK; ++d) {
                float ki[4], qi[4], kj[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    ki[u] = sk[(ti * 4 + u) * KS + d];
                    qi[u] = sq_[(ti * 4 + u) * KS + d];
                    kj[u] = sk[(tj * 4 + u) * KS + d];
                }
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int v = 0; v < 4; ++v) {
                        kk[u][v] += ki[u] * kj[v];
                        qk[u][v] += qi[u] * kj[v];
                    }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = ti * 4 + u;
            float pr[4];
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int j = tj * 4 + v;
                const float D = j <= i ? expf(s_gam[i] - s_gam[j]) : 0.0f;
                sA[i * AS + j] = j < i ? s_beta[i] * kk[u][v] * D : 0.0f;
                pr[v] = qk[u][v] * D;
            }
            if (i < L)
                *reinterpret_cast<float4*>(P + ((long long)(t0 + i) * nv + h) * GDN_C + tj * 4) =
                    make_float4(pr[0], pr[1], pr[2], pr[3]);
        }
    }
    // Qs, Ks out
    const float g_last = s_gam[L - 1];
    for (int idx = tid; idx < L * DK; idx += 256) {
        const int i = idx / DK, c = idx - i * DK;
        const long long o = ((long long)(t0 + i) * nv + h) * DK + c;
        Qs[o] = sq_[i * KS + c] * expf(s_gam[i]);
        Ks[o] = sk[i * KS + c] * expf(g_last - s_gam[i]);
    }
    __syncthreads();                            // sA complete
    // (I + A) X = R by forward substitution, one column of X = [W | U] per thread, held in registers:
    // R = [beta e^gam k | beta v]; rows past the end are zero and stay zero.
    for (int c = tid; c < DK + dv; c += 256) {
        float x[GDN_C];
#pragma unroll
        for (int i = 0; i < GDN_C; ++i)
            x[i] = c < DK ? s_beta[i] * expf(s_gam[i]) * sk[i * KS + c]
                          : (i < L ? s_beta[i] * bf2f(qkv[(long long)(t0 + i) * sq + 2 * nk * DK + h * dv + c - DK]) : 0.0f);
#pragma unroll
        for (int i = 1; i < GDN_C; ++i) {
            float s[4] = {};                    // four chains: the row's dependent-FMA latency / 4
#pragma unroll
            for (int j = 0; j + 4 <= i; j += 4) {
                const float4 a4 = *reinterpret_cast<const float4*>(sA + i * AS + j);
                s[0] += a4.x * x[j]; s[1] += a4.y * x[j + 1]; s[2] += a4.z * x[j + 2]; s[3] += a4.w * x[j + 3];
            }
#pragma unroll
            for (int j = i & ~3; j < i; ++j) s[j & 3] += sA[i * AS + j] * x[j];
            x[i] -= (s[0] + s[1]) + (s[2] + s[3]);
        }
        float* dst = c < DK ? W + (long long)h * DK + c : U + (long long)h * dv + c - DK;
        const long long ld = (long long)nv * (c < DK ? DK : dv);
#pragma unroll
        for (int i = 0; i < GDN_C; ++i)
            if (i < L) dst[(t0 + i) * ld] = x[i];
    }
    if (tid < L) aux[((long long)(t0 + tid) * nv + h) * 4] = s_gam[tid];
}

// ---- gdn_chunk_state: the four products on tensor cores (mma.sync m16n8k8 tf32) ------------------
// HF runs this math in f32, so every product is 3xTF32: x = hi + lo (both tf32, lo the rounded
// remainder) and a*b ~ ah*bh + ah*bl + al*bh, ~2^-22 relative error per product (f32-like) at 3
// tensor-core ops instead of 1.
__device__ __forceinline__ unsigned tf32_of(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = tf32_of(x);
    lo = tf32_of(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment (16 x 8, lane (g, t) = (lane / 4, lane % 4): rows g, g + 8, columns t, t + 4) of the f32
// matrix M[r][c] = base[r * ld + c] (or base[c * ld + r] with TR), split into tf32 hi/lo.
template <bool TR>
__device__ __forceinline__ void frag_a(const float* base, int ld, int r0, int c0, unsigned (&hi)[4], unsigned (&lo)[4]) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r0 + g + (i & 1) * 8, c = c0 + t + (i >> 1) * 4;
        split_tf32(TR ? base[c * ld + r] : base[r * ld + c], hi[i], lo[i]);
    }
}

// acc[n] (16 rows x 8 columns c0 + n * 8..) += A (16 x K, frag_a) . B (K x 8 NN, pre-split hi/lo rows of
// ldb words)
template <bool TR, int K, int NN>
__device__ __forceinline__ void mma3_rows(float (&acc)[NN][4], const float* a, int lda, int r0,
                                          const unsigned* bh, const unsigned* bl, int ldb, int c0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll 2
    for (int k = 0; k < K; k += 8) {
        unsigned ah[4], al[4];
        frag_a<TR>(a, lda, r0, k, ah, al);
#pragma unroll
        for (int n = 0; n < NN; ++n) {
            const int o0 = (k + t) * ldb + c0 + n * 8 + g, o1 = o0 + 4 * ldb;
            mma_tf32(acc[n], al, bh[o0], bh[o1]);
            mma_tf32(acc[n], ah, bl[o0], bl[o1]);
            mma_tf32(acc[n], ah, bh[o0], bh[o1]);
        }
    }
}

// Rows [0, 64) x `n4` float4s of a [T, nv, width] tensor's chunk (head h, from column col0) into smem
// rows of `ld` floats.
__device__ __forceinline__ void load_rows(float* dst, int ld, const float* src, int t0, int L, int nv, int h,
                                             int width, int col0, int n4) {
    for (int idx = threadIdx.x; idx < GDN_C * n4; idx += blockDim.x) {
        const int i = idx / n4, c = (idx - i * n4) * 4;
        const bool ok = i < L;
        cp_async16(smem_addr(dst + i * ld + c), ok ? src + ((long long)(t0 + i) * nv + h) * width + col0 + c : src,
                   ok ? 16 : 0);
    }
    cp_async_commit();
}

// Grid (dv/32, nv, B), 512 threads: 16 warps, as two sets of 8 that split the tile's 32 columns (one
// block per SM for the shared memory below, so the warps are what hides the mma and load latency). The
// block's state tile S [DK][32] lives in registers as mma accumulators (warp w owns rows 16 (w % 8)..
// +15 of its columns, if w % 8 < DK/16), with a hi/lo split copy in shared memory for the products that
// read it. Per chunk, with q = w % 8: warps q < 4 compute W S (rows 16q..), q >= 4 Qs S; the first
// turn theirs into v_new = U - W S (split into shared memory); then the second add P v_new to o and
// store it, while the owners update S = e^gam_last S + Ks^T v_new. Padded row strides keep fragment
// reads conflict-free (W/Qs/P rows read as A: ld % 32 = 4; Ks read transposed: ld % 32 = 8; S/v_new: 8).
#define GDN_STATE_WARPS 16
template <int DK>
__global__ void __launch_bounds__(32 * GDN_STATE_WARPS) gdn_chunk_state(
    const float* __restrict__ W, const float* __restrict__ U, const float* __restrict__ P,
    const float* __restrict__ Qs, const float* __restrict__ Ks, const float* __restrict__ aux, float* state,
    const int* __restrict__ cu, const int* __restrict__ slots, const int* __restrict__ save_at,
    const int* __restrict__ save_rows, bf16_t* __restrict__ out, int nv, int dv)
{
    pdl_enter();
    constexpr int LW = DK + 4, LK = DK + 8, LP = GDN_C + 4, LN = 40;
    extern __shared__ __align__(16) float smem[];
    unsigned* sSh = reinterpret_cast<unsigned*>(smem);   // [DK][LN] S, hi
    unsigned* sSl = sSh + DK * LN;                       //          lo
    float* sW = reinterpret_cast<float*>(sSl + DK * LN); // [64][LW]
    float* sQ = sW + GDN_C * LW;                         // [64][LW]
    float* sK = sQ + GDN_C * LW;                         // [64][LK]
    float* sP = sK + GDN_C * LK;                         // [64][LP]
    float* sU = sP + GDN_C * LP;                         // [64][LN]
    unsigned* sVh = reinterpret_cast<unsigned*>(sU + GDN_C * LN);  // [64][LN] v_new, hi
    unsigned* sVl = sVh + GDN_C * LN;                              //                lo

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int col0 = blockIdx.x * 32, h = blockIdx.y, seq = blockIdx.z;
    const int t_beg = cu[seq], t_end = cu[seq + 1];
    float* S_g = state + ((long long)slots[seq] * nv + h) * DK * dv + col0;
    const int save_end = t_beg + save_at[seq];  // prefix caching: S after this chunk also goes to a snapshot row
    float* S_save = state + ((long long)save_rows[seq] * nv + h) * DK * dv + col0;
    constexpr int NN = 32 / 8 / (GDN_STATE_WARPS / 8);  // 8-column mma tiles per warp
    const int q = warp & 7, c0 = (warp >> 3) * NN * 8;  // row role, first column
    const bool owner = q < DK / 16;
    const int r0 = (q & 3) * 16;                // this warp's rows of W S / Qs S / P v_new
    float S[NN][4];                             // owned S tile: rows 16q + g (+8), columns c0 + 8n + 2t (+1)

    if (owner) {
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = q * 16 + g + (i >> 1) * 8, c = c0 + n * 8 + 2 * t + (i & 1);
                S[n][i] = S_g[(long long)r * dv + c];
                split_tf32(S[n][i], sSh[r * LN + c], sSl[r * LN + c]);
            }
    }
    if (t_beg < t_end) {
        const int L = min(GDN_C, t_end - t_beg);
        load_rows(sW, LW, W, t_beg, L, nv, h, DK, 0, DK / 4);
        load_rows(sQ, LW, Qs, t_beg, L, nv, h, DK, 0, DK / 4);
    }

    for (int t0 = t_beg; t0 < t_end; t0 += GDN_C) {
        const int L = min(GDN_C, t_end - t0);
        __syncthreads();                        // last chunk's readers of sK, sP, sU, sV are done
        load_rows(sK, LK, Ks, t0, L, nv, h, DK, 0, DK / 4);
        load_rows(sP, LP, P, t0, L, nv, h, GDN_C, 0, GDN_C / 4);
        load_rows(sU, LN, U, t0, L, nv, h, dv, col0, 8);
        const float decay = expf(aux[((long long)(t0 + L - 1) * nv + h) * 4]);
        cp_async_wait<0>();
        __syncthreads();

        float acc[NN][4] = {};                  // q < 4: W S; q >= 4: Qs S, then + P v_new = o
        mma3_rows<false, DK, NN>(acc, q < 4 ? sW : sQ, LW, r0, sSh, sSl, LN, c0);
        if (q < 4) {
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int o = (r0 + g + (i >> 1) * 8) * LN + c0 + n * 8 + 2 * t + (i & 1);
                    split_tf32(sU[o] - acc[n][i], sVh[o], sVl[o]);  // zero rows past the end stay zero
                }
        }
        __syncthreads();                        // v_new ready; sW, sQ and S's split copy are free
        if (t0 + GDN_C < t_end) {
            const int Ln = min(GDN_C, t_end - t0 - GDN_C);
            load_rows(sW, LW, W, t0 + GDN_C, Ln, nv, h, DK, 0, DK / 4);
            load_rows(sQ, LW, Qs, t0 + GDN_C, Ln, nv, h, DK, 0, DK / 4);
        }
        if (q >= 4) {
            mma3_rows<false, GDN_C, NN>(acc, sP, LP, r0, sVh, sVl, LN, c0);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = r0 + g + i * 8;
                if (r < L) {
                    unsigned* o = reinterpret_cast<unsigned*>(out + (long long)(t0 + r) * nv * dv + h * dv + col0 + c0 + 2 * t);
#pragma unroll
                    for (int n = 0; n < NN; ++n) o[n * 4] = pack2(acc[n][2 * i], acc[n][2 * i + 1]);
                }
            }
        }
        if (owner) {
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) S[n][i] *= decay;
            mma3_rows<true, GDN_C, NN>(S, sK, LK, q * 16, sVh, sVl, LN, c0);
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int o = (q * 16 + g + (i >> 1) * 8) * LN + c0 + n * 8 + 2 * t + (i & 1);
                    split_tf32(S[n][i], sSh[o], sSl[o]);
                }
            if (save_at[seq] && t0 + L == save_end) {
#pragma unroll
                for (int n = 0; n < NN; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        S_save[(long long)(q * 16 + g + (i >> 1) * 8) * dv + c0 + n * 8 + 2 * t + (i & 1)] = S[n][i];
            }
        }
    }
    if (owner) {
#pragma unroll
        for (int n = 0; n < NN; ++n)
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
                                                float*, float*, float*, float*, float*, float*, int, int, int);  \
    template __global__ void gdn_chunk_state<DK>(const float*, const float*, const float*, const float*,      \
                                                 const float*, const float*, float*, const int*, const int*,   \
                                                 const int*, const int*, bf16_t*, int, int);
GDN_CHUNK_INST(32)
GDN_CHUNK_INST(64)
GDN_CHUNK_INST(128)
#endif
