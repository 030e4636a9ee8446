// Full-attention layer kernels (spec §5).
//  attn_prep:  q/gate split (per-head [q_h | gate_h]; sqh hd: q alone, the DFlash drafter's; nh 0: no q, K/V
//              only), QK RMSNorm (1 + w), partial NeoX RoPE on the first rd dims, K/V written into the paged
//              cache [blocks, block_size, nkv, hd] at slot_mapping.
//  attn_fwd:   causal paged GQA attention, one block per (key split, kv head, query token) holding all
//              G query heads of the kv head; online softmax per warp, warps merged in shared memory.
//              window > 0: only the last `window` keys up to the token's own (DFlash's sliding layers).
//              nsplit == 1: normalise, apply sigmoid(gate), write bf16. Otherwise write f32 partials
//              and attn_combine merges the splits (split-K over long contexts, flash-decoding style).
#include "common.cuh"

// grid (T, ceil((nh + 2 * nkv) / 4)), 128 threads (4 warps), dynamic smem 4 * hd floats. Jobs per token: nh
// q heads, nkv k heads (normed + roped), nkv v heads (copied); one per warp (a warp walking several of them
// serially was ~10 us per layer at T = 1). q head h starts at qg + t * sqg + h * sqh (2 * hd
// with the gate beside it, hd without).
extern "C" __global__ void __launch_bounds__(128) attn_prep(
    const bf16_t* __restrict__ qg, long long sqg, const bf16_t* __restrict__ k, long long sk,
    const bf16_t* __restrict__ v, long long sv, const float* __restrict__ qw, const float* __restrict__ kw,
    bf16_t* __restrict__ q_out, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
    const int* __restrict__ slot_mapping, const int* __restrict__ positions, const float* __restrict__ inv_freq,
    int nh, int nkv, int hd, int rd, float eps, int sqh)
{
    pdl_enter();
    extern __shared__ float sbuf[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* buf = sbuf + warp * hd;
    const long long t = blockIdx.x;
    const long long slot = slot_mapping[t];
    const float pos = (float)positions[t];
    const int half = rd / 2;
    for (int job = blockIdx.y * 4 + warp; job < nh + 2 * nkv; job += 4 * gridDim.y) {
        const bf16_t* src;
        bf16_t* dst;
        const float* w;
        if (job < nh) {
            src = qg + t * sqg + (long long)job * sqh;
            dst = q_out + (t * nh + job) * hd;
            w = qw;
        } else if (job < nh + nkv) {
            src = k + t * sk + (long long)(job - nh) * hd;
            dst = kc + (slot * nkv + (job - nh)) * hd;
            w = kw;
        } else {
            src = v + t * sv + (long long)(job - nh - nkv) * hd;
            dst = vc + (slot * nkv + (job - nh - nkv)) * hd;
            for (int i = lane; i < hd; i += 32) dst[i] = src[i];
            continue;
        }
        float ss = 0.0f;
        for (int i = lane; i < hd; i += 32) {
            const float x = bf2f(src[i]);
            buf[i] = x;
            ss += x * x;
        }
        const float scale = rsqrtf(warp_sum(ss) / (float)hd + eps);
        __syncwarp();
        for (int i = lane; i < hd; i += 32) buf[i] *= scale * (1.0f + w[i]);
        __syncwarp();
        for (int i = lane; i < half; i += 32) {
            const float x1 = buf[i], x2 = buf[i + half];
            float sn, cs;
            sincosf(pos * inv_freq[i], &sn, &cs);
            dst[i] = f2bf(x1 * cs - x2 * sn);
            dst[i + half] = f2bf(x2 * cs + x1 * sn);
        }
        for (int i = rd + lane; i < hd; i += 32) dst[i] = f2bf(buf[i]);
        __syncwarp();
    }
}

template <int E>
__device__ __forceinline__ void load_row(const bf16_t* p, float (&f)[E]) {
    if constexpr (E == 8) {
        unpack8(*reinterpret_cast<const uint4*>(p), f);
    } else if constexpr (E == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        f[0] = lo_bf(u.x); f[1] = hi_bf(u.x); f[2] = lo_bf(u.y); f[3] = hi_bf(u.y);
    } else if constexpr (E == 2) {
        const unsigned u = *reinterpret_cast<const unsigned*>(p);
        f[0] = lo_bf(u); f[1] = hi_bf(u);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) f[e] = bf2f(p[e]);
    }
}

#define ATTN_WARPS 4
#define ATTN_MIN_SPLIT_KEYS 16

// q: [T, nh, HD] contiguous; gate: [T, nh, HD] with strides (sg_t, sg_h, 1); kc/vc: [blocks, bs, nkv, HD].
// block_tables: [B, bt_stride]; tok_seq[t]: sequence of token t; positions[t]: its absolute position
// (it attends keys 0..pos, or pos - window + 1..pos when window > 0); chunk: keys per split, or 0 (see below).
// out: [T, nh*HD].
// part_acc: [T, nh, nsplit, HD], part_ml: [T, nh, nsplit, 2].
template <int HD, int G>
__global__ void __launch_bounds__(128, (G * HD / 32 >= 32) ? 2 : 4) attn_fwd(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ gate, long long sg_t, long long sg_h,
    const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ tok_seq,
    const int* __restrict__ positions, int nkv, int bs, int chunk, int window, float scale,
    bf16_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml)
{
    pdl_enter();
    constexpr int E = HD / 32;
    __shared__ float s_m[ATTN_WARPS][G], s_l[ATTN_WARPS][G];
    __shared__ float s_acc[ATTN_WARPS][G][HD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = blockIdx.x, nsplit = gridDim.x, kvh = blockIdx.y;
    const long long t = blockIdx.z;
    const int nh = nkv * G;
    const int n_keys = positions[t] + 1;
    const int first = window > 0 ? max(n_keys - window, 0) : 0;  // the token's first key
    // chunk > 0: keys per split at fixed offsets (batch-invariant mode). 0: this token's own keys split
    // evenly over the grid's splits, so every split has work however far the context is below the
    // max_ctx that sized the grid (a decode graph's grid is sized for max_model_len), but at least
    // ATTN_MIN_SPLIT_KEYS each: the later splits of a short context stay empty (cheaper than tiny ones)
    const int per = chunk > 0 ? chunk : max((n_keys - first + nsplit - 1) / nsplit, ATTN_MIN_SPLIT_KEYS);
    const int j0 = chunk > 0 ? max(split * per, first) : first + split * per;
    const int j1 = min((chunk > 0 ? split * per : j0) + per, n_keys);
    const int* table = block_tables + (long long)tok_seq[t] * bt_stride;

    float qr[G][E], acc[G][E], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        load_row<E>(q + (t * nh + kvh * G + g) * HD + lane * E, qr[g]);
#pragma unroll
        for (int e = 0; e < E; ++e) { qr[g][e] *= scale; acc[g][e] = 0.0f; }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    for (int j = j0 + warp; j < j1; j += ATTN_WARPS) {
        const long long page = table[j / bs];
        const long long off = ((page * bs + (j % bs)) * nkv + kvh) * HD + lane * E;
        float kr[E], vr[E];
        load_row<E>(kc + off, kr);
        load_row<E>(vc + off, vr);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) s += qr[g][e] * kr[e];
            s = warp_sum(s);
            const float mn = fmaxf(m[g], s);
            const float c = expf(m[g] - mn), p = expf(s - mn);
            l[g] = l[g] * c + p;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * c + p * vr[e];
            m[g] = mn;
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
#pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) M = fmaxf(M, s_m[w][g]);
        float L = 0.0f, A = 0.0f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                const float c = expf(s_m[w][g] - M);
                L += s_l[w][g] * c;
                A += s_acc[w][g][d] * c;
            }
        }
        const int h = kvh * G + g;
        if (nsplit == 1) {
            const float gt = bf2f(gate[t * sg_t + h * sg_h + d]);
            out[(t * nh + h) * HD + d] = f2bf(A / L * sigmoid_f(gt));
        } else {
            const long long pi = (t * nh + h) * nsplit + split;
            part_acc[pi * HD + d] = A;
            if (d == 0) { part_ml[2 * pi] = M; part_ml[2 * pi + 1] = L; }
        }
    }
}

// grid T*nh, 128 threads: merge the splits of one (token, head), apply the gate. All threads first turn
// ATTN_COMBINE_TILE splits' maxima into weights exp(m_s - M) in shared memory; then warp w sums splits
// w, w + 4, .. with every lane holding hd / 32 elements, loads that do not wait on each other (a decode
// graph's grid has ~66 splits for even a short context: one thread per element walking them all with a
// dependent chain took ~15 us); the 4 warps' sums are merged last. An empty split (m = -inf) weighs 0 and
// its zero partials add nothing.
#define ATTN_COMBINE_TILE 128
extern "C" __global__ void __launch_bounds__(128) attn_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const bf16_t* __restrict__ gate,
    long long sg_t, long long sg_h, bf16_t* __restrict__ out, int nh, int hd, int nsplit)
{
    pdl_enter();
    __shared__ float s_c[ATTN_COMBINE_TILE], s_red[4], s_acc[4][256];  // hd <= 256
    const long long row = blockIdx.x;  // t * nh + h
    const long long t = row / nh, h = row % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* ml = part_ml + 2 * row * nsplit;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < nsplit; s += blockDim.x) M = fmaxf(M, ml[2 * s]);
    M = warp_max(M);
    if (lane == 0) s_red[warp] = M;
    __syncthreads();
    M = fmaxf(fmaxf(s_red[0], s_red[1]), fmaxf(s_red[2], s_red[3]));
    float L = 0.0f, acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    for (int s0 = 0; s0 < nsplit; s0 += ATTN_COMBINE_TILE) {
        const int n = min(nsplit - s0, ATTN_COMBINE_TILE);
        __syncthreads();  // the previous tile's weights (and s_red) are read
        if (threadIdx.x < n) {
            const float ms = ml[2 * (s0 + threadIdx.x)];
            s_c[threadIdx.x] = ms == NEG_INF ? 0.0f : expf(ms - M);
        }
        __syncthreads();
#pragma unroll 2
        for (int s = warp; s < n; s += 4) {
            const float c = s_c[s];
            L += ml[2 * (s0 + s) + 1] * c;
            const float* pa = part_acc + (row * nsplit + s0 + s) * hd + lane;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i * 32 < hd) acc[i] += pa[i * 32] * c;
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (i * 32 < hd) s_acc[warp][i * 32 + lane] = acc[i];
    __syncthreads();  // every warp has read s_red (M) long before: it now holds the warps' L
    if (lane == 0) s_red[warp] = L;
    __syncthreads();
    const float Lt = s_red[0] + s_red[1] + s_red[2] + s_red[3];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float A = s_acc[0][d] + s_acc[1][d] + s_acc[2][d] + s_acc[3][d];
        out[row * hd + d] = f2bf(A / Lt * sigmoid_f(bf2f(gate[t * sg_t + h * sg_h + d])));
    }
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
#define ATTN_INST(HD, G)                                                                                       \
    template __global__ void attn_fwd<HD, G>(const bf16_t*, const bf16_t*, long long, long long, const bf16_t*, \
                                             const bf16_t*, const int*, int, const int*, const int*, int, int,  \
                                             int, int, float, bf16_t*, float*, float*);
ATTN_INST(64, 1) ATTN_INST(64, 2) ATTN_INST(64, 3) ATTN_INST(64, 4) ATTN_INST(64, 6) ATTN_INST(64, 8)
ATTN_INST(128, 1) ATTN_INST(128, 2) ATTN_INST(128, 3) ATTN_INST(128, 4) ATTN_INST(128, 6) ATTN_INST(128, 8)
ATTN_INST(256, 1) ATTN_INST(256, 2) ATTN_INST(256, 3) ATTN_INST(256, 4) ATTN_INST(256, 6) ATTN_INST(256, 8)
#endif
