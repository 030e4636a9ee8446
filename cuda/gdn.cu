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
