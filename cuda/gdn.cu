// Gated delta rule (spec §4.3-§4.6), token-recurrent, varlen, state f32 in place by slot.
// Fused: gating g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), value head h -> q/k head
// h / (nv/nk), q/k L2 norm (rsqrt(sum + 1e-6)), q * dk^-0.5, decay, delta update, output o = S^T q.
//
// Grid (dv/32, nv, B), 128 threads. A block owns a [DK, 32] tile of one head's state [DK, dv] for one
// sequence: lane = state column, warp w = rows [w*DK/4, (w+1)*DK/4), DK/4 f32 registers per thread.
#include "common.cuh"

#define GDN_WARPS 4

template <int DK>
__global__ void __launch_bounds__(128) gdn_recurrent(
    const bf16_t* __restrict__ qkv, long long sq,   // [T, 2*nk*DK + nv*dv], row stride sq
    const bf16_t* __restrict__ a, long long sa,     // [T, nv] row stride sa
    const bf16_t* __restrict__ b, long long sb,     // [T, nv] row stride sb
    const float* __restrict__ A_log, const float* __restrict__ dt_bias,  // [nv] f32
    float* state,                                   // [slots, nv, DK, dv] f32
    const int* __restrict__ cu, const int* __restrict__ slots,
    bf16_t* __restrict__ out,                       // [T, nv*dv]
    int nk, int nv, int dv)
{
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
    float* S_base = state + (slot * nv + h) * (long long)DK * dv + col;

    float S[R];
#pragma unroll
    for (int r = 0; r < R; ++r) S[r] = S_base[(long long)(warp * R + r) * dv];

    const float A = expf(A_log[h]);
    const float dtb = dt_bias[h];
    const float qscale = rsqrtf((float)DK);

    for (int t = t0; t < t1; ++t) {
        const bf16_t* row = qkv + (long long)t * sq;
        float qv = 0.0f, kv = 0.0f;
        if (tid < DK) {
            qv = bf2f(row[hk * DK + tid]);
            kv = bf2f(row[nk * DK + hk * DK + tid]);
        }
        const float vj = bf2f(row[2 * nk * DK + h * dv + col]);
        const float decay = expf(-A * softplus_f(bf2f(a[(long long)t * sa + h]) + dtb));
        const float beta = sigmoid_f(bf2f(b[(long long)t * sb + h]));
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
    }
#pragma unroll
    for (int r = 0; r < R; ++r) S_base[(long long)(warp * R + r) * dv] = S[r];
}

template __global__ void gdn_recurrent<32>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, bf16_t*, int, int, int);
template __global__ void gdn_recurrent<64>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                           const float*, const float*, float*, const int*, const int*, bf16_t*, int, int, int);
template __global__ void gdn_recurrent<128>(const bf16_t*, long long, const bf16_t*, long long, const bf16_t*, long long,
                                            const float*, const float*, float*, const int*, const int*, bf16_t*, int, int, int);

// ---- Chunked (WY/UT) form for prefill (spec §4.7), two kernels ----------------------------------
// Chunks of 64 tokens per sequence. gdn_chunk_prep is parallel over (chunk, head, sequence): it builds
// everything that depends on q, k, a, b only, so the serial state pass below is four small matmuls
// per chunk over operands it streams in with cp.async:
//   gam = cumsum(g) in the chunk, D_ij = exp(gam_i - gam_j) (j <= i, <= 1 so never overflows)
//   A = tril(beta_i k_i.k_j D_ij, -1);  [W | U] = (I + A)^-1 [beta k e^gam | beta v]
//   P = tril(q_i.k_j D_ij);  Qs = q e^gam;  Ks = k e^(gam_last - gam)   (q, k L2-normed, q * dk^-0.5)
// written in f32 as W, Qs, Ks [T, nv, DK], U [T, nv, dv], P [T, nv, 64], aux [T, nv, 4] (gam in .x).
// gdn_chunk_state then runs per (32-column state tile, head, sequence), chunk after chunk:
//   v_new = U - W S;  o = Qs S + P v_new;  S = e^gam_last S + Ks^T v_new.
// Rows past a sequence's end are zeros (g = 0, beta = 0), which leaves outputs and state unchanged.
#define GDN_C 64

// Shared memory: q and k rows, then (once A, P, Qs, Ks are out) the same space holds X = [W | U], so two
// blocks fit on an SM. A/P are a 64x64 product over DK done in 4x4 register tiles; the triangular solve
// gives each thread whole columns of X, so it needs no barriers.
template <int DK>
__global__ void __launch_bounds__(256, 2) gdn_chunk_prep(
    const bf16_t* __restrict__ qkv, long long sq, const bf16_t* __restrict__ a, long long sa,
    const bf16_t* __restrict__ b, long long sb, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const int* __restrict__ cu, float* __restrict__ W, float* __restrict__ U, float* __restrict__ P,
    float* __restrict__ Qs, float* __restrict__ Ks, float* __restrict__ aux, int nk, int nv, int dv)
{
    extern __shared__ __align__(16) float smem[];
    constexpr int KS = DK + 1;                  // padded row: column reads across rows are conflict-free
    const int XS = DK + dv;                     // X = [W | U] row
    float* sq_ = smem;                          // [64][KS] normed, scaled q
    float* sk = sq_ + GDN_C * KS;               // [64][KS] normed k
    float* sX = smem;                           // [64][XS], over sq_/sk once they are dead
    float* sA = smem + max(2 * GDN_C * KS, GDN_C * XS);  // [64][65]
    float* s_gam = sA + GDN_C * 65;             // [64]
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
                sA[i * 65 + j] = j < i ? s_beta[i] * kk[u][v] * D : 0.0f;
                pr[v] = qk[u][v] * D;
            }
            if (i < L)
                *reinterpret_cast<float4*>(P + ((long long)(t0 + i) * nv + h) * GDN_C + tj * 4) =
                    make_float4(pr[0], pr[1], pr[2], pr[3]);
        }
    }
    // Qs, Ks out; then each thread takes its X columns' right-hand sides into registers before the
    // barrier that lets X overwrite q/k: X = [beta e^gam k | beta v]
    const float g_last = s_gam[L - 1];
    for (int idx = tid; idx < L * DK; idx += 256) {
        const int i = idx / DK, c = idx - i * DK;
        const long long o = ((long long)(t0 + i) * nv + h) * DK + c;
        Qs[o] = sq_[i * KS + c] * expf(s_gam[i]);
        Ks[o] = sk[i * KS + c] * expf(g_last - s_gam[i]);
    }
    float rk_[GDN_C];                            // thread tid < DK: its k column of the right-hand side
    if (tid < DK) {
#pragma unroll
        for (int i = 0; i < GDN_C; ++i) rk_[i] = s_beta[i] * expf(s_gam[i]) * sk[i * KS + tid];
    }
    __syncthreads();
    if (tid < DK) {
#pragma unroll
        for (int i = 0; i < GDN_C; ++i) sX[i * XS + tid] = rk_[i];
    }
    for (int idx = tid; idx < GDN_C * dv; idx += 256) {
        const int i = idx / dv, c = idx - i * dv;
        sX[i * XS + DK + c] = i < L ? s_beta[i] * bf2f(qkv[(long long)(t0 + i) * sq + 2 * nk * DK + h * dv + c]) : 0.0f;
    }
    __syncthreads();
    // forward substitution (I + A) X = R, column by column
    for (int c = tid; c < XS; c += 256) {
        for (int i = 1; i < L; ++i) {
            float x0 = 0.0f, x1 = 0.0f;          // two chains halve the dependent-FMA latency
            int j = 0;
            for (; j + 1 < i; j += 2) {
                x0 += sA[i * 65 + j] * sX[j * XS + c];
                x1 += sA[i * 65 + j + 1] * sX[(j + 1) * XS + c];
            }
            if (j < i) x0 += sA[i * 65 + j] * sX[j * XS + c];
            sX[i * XS + c] -= x0 + x1;
        }
        for (int i = 0; i < L; ++i) {
            const long long t = t0 + i;
            if (c < DK) W[(t * nv + h) * DK + c] = sX[i * XS + c];
            else U[(t * nv + h) * dv + (c - DK)] = sX[i * XS + c];
        }
    }
    if (tid < L) aux[((long long)(t0 + tid) * nv + h) * 4] = s_gam[tid];
}

// Rows [0, 64) x `n4` float4s of a [T, nv, width] tensor's chunk (head h) into smem rows of `width`.
__device__ __forceinline__ void load_rows(float* dst, const float* src, int t0, int L, int nv, int h, int width,
                                          int col0, int n4) {
    for (int idx = threadIdx.x; idx < GDN_C * n4; idx += blockDim.x) {
        const int i = idx / n4, c = (idx - i * n4) * 4;
        const bool ok = i < L;
        cp_async16(smem_addr(dst + i * n4 * 4 + c), ok ? src + ((long long)(t0 + i) * nv + h) * width + col0 + c : src,
                   ok ? 16 : 0);
    }
    cp_async_commit();
}

// Grid (dv/32, nv, B), 32 * gdn_state_warps(DK) threads. The block's state tile S [DK][32] lives in shared
// memory; in the products a thread owns 64/NW rows of one column (lane = column), so the S/v_new column reads are
// conflict-free and the W/Qs/P/Ks row reads are warp broadcasts (float4). W and Qs of the next chunk
// are prefetched while the current one finishes (their buffers are free after v_new).
// 16 warps hide the shared-memory latency of this serial loop better than 8; DK 32 keeps 8 so each
// thread's S rows stay a multiple of 4 (float4 reads).
__host__ __device__ constexpr int gdn_state_warps(int dk) { return dk >= 64 ? 16 : 8; }

template <int DK>
__global__ void __launch_bounds__(512) gdn_chunk_state(
    const float* __restrict__ W, const float* __restrict__ U, const float* __restrict__ P,
    const float* __restrict__ Qs, const float* __restrict__ Ks, const float* __restrict__ aux, float* state,
    const int* __restrict__ cu, const int* __restrict__ slots, bf16_t* __restrict__ out, int nv, int dv)
{
    extern __shared__ __align__(16) float smem[];
    float* sS = smem;                           // [DK][32]
    float* sW = sS + DK * 32;                   // [64][DK]
    float* sQ = sW + GDN_C * DK;                // [64][DK]
    float* sK = sQ + GDN_C * DK;                // [64][DK]
    float* sP = sK + GDN_C * DK;                // [64][64]
    float* sU = sP + GDN_C * GDN_C;             // [64][32]
    float* sV = sU + GDN_C * 32;                // [64][32]  v_new

    constexpr int NW = gdn_state_warps(DK), RW = GDN_C / NW, NT = 32 * NW;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = blockIdx.x * 32, h = blockIdx.y, seq = blockIdx.z;
    const int t_beg = cu[seq], t_end = cu[seq + 1];
    float* S_g = state + ((long long)slots[seq] * nv + h) * DK * dv + col0;
    for (int idx = tid; idx < DK * 32; idx += NT) sS[idx] = S_g[(long long)(idx >> 5) * dv + (idx & 31)];
    if (t_beg < t_end) {
        const int L = min(GDN_C, t_end - t_beg);
        load_rows(sW, W, t_beg, L, nv, h, DK, 0, DK / 4);
        load_rows(sQ, Qs, t_beg, L, nv, h, DK, 0, DK / 4);
    }

    for (int t0 = t_beg; t0 < t_end; t0 += GDN_C) {
        const int L = min(GDN_C, t_end - t0);
        __syncthreads();                        // every warp is done with sK, sP, sU, sV of the last chunk
        load_rows(sK, Ks, t0, L, nv, h, DK, 0, DK / 4);
        load_rows(sP, P, t0, L, nv, h, GDN_C, 0, GDN_C / 4);
        load_rows(sU, U, t0, L, nv, h, dv, col0, 8);
        const float decay = expf(aux[((long long)(t0 + L - 1) * nv + h) * 4]);
        cp_async_wait<0>();
        __syncthreads();

        // v_new = U - W S and the first half of o = Qs S  (rows warp*RW .. +RW-1, column lane)
        float acc[RW], o[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) { acc[r] = 0.0f; o[r] = 0.0f; }
        for (int d = 0; d < DK; d += 4) {
            float s[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) s[u] = sS[(d + u) * 32 + lane];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float4 w = *reinterpret_cast<const float4*>(sW + (warp * RW + r) * DK + d);
                const float4 q = *reinterpret_cast<const float4*>(sQ + (warp * RW + r) * DK + d);
                acc[r] += w.x * s[0] + w.y * s[1] + w.z * s[2] + w.w * s[3];
                o[r] += q.x * s[0] + q.y * s[1] + q.z * s[2] + q.w * s[3];
            }
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const int i = warp * RW + r;
            sV[i * 32 + lane] = sU[i * 32 + lane] - acc[r];   // zero rows past the end stay zero
        }
        __syncthreads();                        // sW, sQ free; S still needed until the update below
        if (t0 + GDN_C < t_end) {
            const int Ln = min(GDN_C, t_end - t0 - GDN_C);
            load_rows(sW, W, t0 + GDN_C, Ln, nv, h, DK, 0, DK / 4);
            load_rows(sQ, Qs, t0 + GDN_C, Ln, nv, h, DK, 0, DK / 4);
        }
        // o += P v_new
        for (int j = 0; j < GDN_C; j += 4) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) v[u] = sV[(j + u) * 32 + lane];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float4 p = *reinterpret_cast<const float4*>(sP + (warp * RW + r) * GDN_C + j);
                o[r] += p.x * v[0] + p.y * v[1] + p.z * v[2] + p.w * v[3];
            }
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const int i = warp * RW + r;
            if (i < L) out[(long long)(t0 + i) * nv * dv + h * dv + col0 + lane] = f2bf(o[r]);
        }
        __syncthreads();                        // all S reads done
        // S = e^gam_last S + Ks^T v_new  (rows warp*R .. +R-1, column lane)
        constexpr int R = DK / NW;
        float sacc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) sacc[r] = 0.0f;
        for (int j = 0; j < L; ++j) {
            const float v = sV[j * 32 + lane];
#pragma unroll
            for (int r = 0; r < R; r += 4) {
                const float4 k = *reinterpret_cast<const float4*>(sK + j * DK + warp * R + r);
                sacc[r] += k.x * v; sacc[r + 1] += k.y * v; sacc[r + 2] += k.z * v; sacc[r + 3] += k.w * v;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float* s = sS + (warp * R + r) * 32 + lane;
            *s = decay * *s + sacc[r];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < DK * 32; idx += NT) S_g[(long long)(idx >> 5) * dv + (idx & 31)] = sS[idx];
}

#define GDN_CHUNK_INST(DK)                                                                                   \
    template __global__ void gdn_chunk_prep<DK>(const bf16_t*, long long, const bf16_t*, long long,             \
                                                const bf16_t*, long long, const float*, const float*, const int*, \
                                                float*, float*, float*, float*, float*, float*, int, int, int);  \
    template __global__ void gdn_chunk_state<DK>(const float*, const float*, const float*, const float*,      \
                                                 const float*, const float*, float*, const int*, const int*,   \
                                                 bf16_t*, int, int);
GDN_CHUNK_INST(32)
GDN_CHUNK_INST(64)
GDN_CHUNK_INST(128)
