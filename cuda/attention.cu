// Full-attention layer kernels (spec §5).
//  attn_prep:  q/gate split (per-head [q_h | gate_h]; sqh hd: q alone, the DFlash drafter's; nh 0: no q, K/V
//              only), QK RMSNorm (1 + w), partial NeoX RoPE on the first rd dims, K/V written into the paged
//              cache [blocks, block_size, nkv, hd] at slot_mapping.
//  attn_fwd:   causal paged GQA attention for decode-sized queries on tensor cores, one block per (key
//              split, kv head, query token) holding all G query heads of the kv head; each warp walks
//              16-key tiles with an online softmax, warps merged in shared memory.
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

#define ATTN_WARPS 4
#define ATTN_MIN_SPLIT_KEYS 64

// The transpose of an 8 x 8 b16 matrix held as one register per lane (lane g * 4 + t: row g, columns
// 2t and 2t + 1), delivered in the same layout.
__device__ __forceinline__ unsigned movm_trans(unsigned x) {
    unsigned r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

// Decode attention on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate): each warp walks 16-key
// tiles of its split. Lane (g = lane / 4, t = lane % 4) loads 16-byte pieces of keys g and g + 8 (dims
// 32c + 8t .. + 7 of chunk c) straight from the paged cache; a dot product does not care in which order
// its dims come, so Q's fragments are loaded with the same permutation and the pieces are mma operands
// as they are:
//   S = Q K^T: A = Q (rows = the G query heads, zero rows up to 16), B = K^T (the tile's keys 0-7 | 8-15 as
//     two n-tiles); per 16-byte piece .x/.y feed one k16 step, .z/.w the next.
//   O^T = V^T P^T: B = P^T is S's accumulators of rows g (heads) packed to bf16; A = V^T, the V pieces'
//     registers transposed by movmatrix (lane rows = dims, known at the store).
// Online softmax per head in log2 units (q . k * scale * log2 e), over the 4 lanes of a row; the heads'
// rescale factors reach the O^T columns by shuffles. P is rounded to bf16 for its product (as FlashAttention
// does); the row sums l add the f32 p.
// q: [T, nh, HD] contiguous; gate: [T, nh, HD] with strides (sg_t, sg_h, 1); kc/vc: [blocks, bs, nkv, HD].
// block_tables: [B, bt_stride]; tok_seq[t]: sequence of token t; positions[t]: its last key (it attends
// keys 0..pos, or pos - window + 1..pos when window > 0); chunk: keys per split, or 0 (see below).
// out: [T, nh*HD]. part_acc: [T, nh, nsplit, HD], part_ml: [T, nh, nsplit, 2] (m in natural-log units).
template <int HD, int G>
__global__ void __launch_bounds__(128, HD >= 256 ? 2 : HD >= 128 ? 3 : 4) attn_fwd(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ gate, long long sg_t, long long sg_h,
    const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ tok_seq,
    const int* __restrict__ positions, int nkv, int bs, int chunk, int window, float scale,
    bf16_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml)
{
    static_assert(HD % 32 == 0 && G <= 8, "16-byte pieces of 32-dim chunks; the heads fit one n-tile");
    pdl_enter();
    constexpr int NC = HD / 32;
    __shared__ float s_m[ATTN_WARPS][G], s_l[ATTN_WARPS][G];
    __shared__ float s_acc[ATTN_WARPS][G][HD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
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
    const float sl2 = scale * 1.4426950408889634f;

    // the G query rows, shared by the block's warps (registers go to the two tiles in flight)
    __shared__ __align__(16) bf16_t s_q[G][HD];
    for (int i = threadIdx.x; i < G * HD / 8; i += blockDim.x)
        reinterpret_cast<uint4*>(&s_q[0][0])[i] = reinterpret_cast<const uint4*>(q + (t * nh + kvh * G) * HD)[i];
    __syncthreads();
    float o[NC][2][4];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) o[c][i / 4][i % 4] = 0.0f;
    float m = NEG_INF, l = 0.0f;  // head g's

    // A warp's tiles are j0 + 16 * warp + 64 * i. Two-stage register pipeline: the next tile's K is loaded
    // once this tile's S is computed and its V once this tile's P V is, so each load has a whole tile of
    // work to arrive under. Keys j + g and j + 8 + g; past j1 they read the last key (in bounds), masked.
    auto rows = [&](int j, long long& oa, long long& ob) {
        const int ka = min(j + g, j1 - 1), kb = min(j + 8 + g, j1 - 1);
        oa = (((long long)table[ka / bs] * bs + ka % bs) * nkv + kvh) * HD + 8 * tg;
        ob = (((long long)table[kb / bs] * bs + kb % bs) * nkv + kvh) * HD + 8 * tg;
    };
    auto load = [&](const bf16_t* cache, long long oa, long long ob, uint4 (&r)[2][NC]) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            r[0][c] = *reinterpret_cast<const uint4*>(cache + oa + 32 * c);
            r[1][c] = *reinterpret_cast<const uint4*>(cache + ob + 32 * c);
        }
    };
    uint4 kr[2][NC], vr[2][NC];  // [key g | key g + 8][chunk]
    int j = j0 + 16 * warp;
    if (j < j1) {
        long long oa, ob;
        rows(j, oa, ob);
        load(kc, oa, ob, kr);
        load(vc, oa, ob, vr);
    }
    for (; j < j1; j += 16 * ATTN_WARPS) {
        const bool more = j + 16 * ATTN_WARPS < j1;
        long long na = 0, nb = 0;
        if (more) rows(j + 16 * ATTN_WARPS, na, nb);
        float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const uint4 qa = g < G ? *reinterpret_cast<const uint4*>(&s_q[g][32 * c + 8 * tg]) : make_uint4(0u, 0u, 0u, 0u);
            mma_bf16(s0, qa.x, 0u, qa.y, 0u, kr[0][c].x, kr[0][c].y);
            mma_bf16(s0, qa.z, 0u, qa.w, 0u, kr[0][c].z, kr[0][c].w);
            mma_bf16(s1, qa.x, 0u, qa.y, 0u, kr[1][c].x, kr[1][c].y);
            mma_bf16(s1, qa.z, 0u, qa.w, 0u, kr[1][c].z, kr[1][c].w);
        }
        if (more) load(kc, na, nb, kr);
        // row g: s0[0..1] = keys j + 2t, +1; s1[0..1] = keys j + 8 + 2t, +1 (s*[2..3]: zero rows)
        const int k0 = j + 2 * tg;
        float x[4] = {k0 < j1 ? s0[0] * sl2 : NEG_INF, k0 + 1 < j1 ? s0[1] * sl2 : NEG_INF,
                      k0 + 8 < j1 ? s1[0] * sl2 : NEG_INF, k0 + 9 < j1 ? s1[1] * sl2 : NEG_INF};
        float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx);  // finite: key j < j1 is in the tile
        const float corr = exp2f(m - mn);
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = exp2f(x[i] - mn);
        l = l * corr + (x[0] + x[1]) + (x[2] + x[3]);
        m = mn;
        const unsigned pb0 = pack_bf16x2(x[0], x[1]), pb1 = pack_bf16x2(x[2], x[3]);
        // O^T columns 2t, 2t + 1 are heads 2t, 2t + 1, whose factors live in lanes 8t and 8t + 4
        const float c0 = __shfl_sync(0xffffffffu, corr, 8 * tg), c1 = __shfl_sync(0xffffffffu, corr, 8 * tg + 4);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const unsigned a[2][4] = {{vr[0][c].x, vr[0][c].y, vr[0][c].z, vr[0][c].w},
                                      {vr[1][c].x, vr[1][c].y, vr[1][c].z, vr[1][c].w}};
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                float (&acc)[4] = o[c][jj];
                acc[0] *= c0; acc[1] *= c1; acc[2] *= c0; acc[3] *= c1;
                mma_bf16(acc, movm_trans(a[0][2 * jj]), movm_trans(a[0][2 * jj + 1]), movm_trans(a[1][2 * jj]),
                         movm_trans(a[1][2 * jj + 1]), pb0, pb1);
            }
        }
        if (more) load(vc, na, nb, vr);
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tg == 0 && g < G) { s_m[warp][g] = m * 0.6931471805599453f; s_l[warp][g] = l; }
    // o[c][jj]: rows g / g + 8 are dims 32c + 8(g / 2) + 4jj + (g & 1) and that + 2; columns heads 2t, 2t + 1
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int d = 32 * c + 8 * (g >> 1) + 4 * jj + (g & 1);
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (2 * tg + e < G) {
                    s_acc[warp][2 * tg + e][d] = o[c][jj][e];
                    s_acc[warp][2 * tg + e][d + 2] = o[c][jj][2 + e];
                }
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

// grid (T*nh, hd / ATTN_COMBINE_DIMS), ATTN_COMBINE_THREADS threads: merge the splits of ATTN_COMBINE_DIMS
// dims of one (token, head), apply the gate.
// Latency-bound (a decode graph's grid has ~66 splits for even a short context, and at batch 1 only nh
// rows): the threads first take the maximum M of the splits' m; then 16 groups of 16 threads sum splits
// j, j + 16, .. (group j), each thread 4 dims by one float4 load, loads that do not wait on each other,
// so the whole walk is ~2 L2 round trips (one warp per 4 x 64 dims walking every split took ~8 us);
// the groups' sums are merged last, in group order. An empty split (m = -inf) weighs 0 and its zero
// partials add nothing.
#define ATTN_COMBINE_GROUPS 16
#define ATTN_COMBINE_DIMS 64      // dims per block: 16 threads x 4 (the launcher reads it)
#define ATTN_COMBINE_THREADS 256  // ATTN_COMBINE_GROUPS x 16 (the launcher reads it)
extern "C" __global__ void __launch_bounds__(ATTN_COMBINE_THREADS) attn_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const bf16_t* __restrict__ gate,
    long long sg_t, long long sg_h, bf16_t* __restrict__ out, int nh, int hd, int nsplit)
{
    static_assert(ATTN_COMBINE_THREADS == ATTN_COMBINE_GROUPS * ATTN_COMBINE_DIMS / 4, "a group: 4 dims a thread");
    pdl_enter();
    constexpr int NW = ATTN_COMBINE_THREADS / 32, GT = ATTN_COMBINE_DIMS / 4;  // warps; threads per group
    __shared__ float s_red[NW], s_l[ATTN_COMBINE_GROUPS];
    __shared__ float4 s_acc[ATTN_COMBINE_GROUPS][GT];
    const long long row = blockIdx.x;  // t * nh + h
    const long long t = row / nh, h = row % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = threadIdx.x / GT, q = threadIdx.x % GT;
    const float* ml = part_ml + 2 * row * nsplit;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < nsplit; s += blockDim.x) M = fmaxf(M, ml[2 * s]);
    M = warp_max(M);
    if (lane == 0) s_red[warp] = M;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_red[w]);
    float L = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4* pa = reinterpret_cast<const float4*>(part_acc + row * nsplit * hd + blockIdx.y * ATTN_COMBINE_DIMS) + q;
    for (int s0 = grp; s0 < nsplit; s0 += 4 * ATTN_COMBINE_GROUPS) {  // 4 splits' loads issued together
        float ms[4], ls[4];
        float4 a[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = s0 + u * ATTN_COMBINE_GROUPS;
            const bool ok = s < nsplit;
            ms[u] = ok ? ml[2 * s] : NEG_INF;
            ls[u] = ok ? ml[2 * s + 1] : 0.0f;
            a[u] = ok ? pa[(long long)s * (hd / 4)] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float c = expf(ms[u] - M);  // 0 for an empty split (m = -inf; M is finite)
            L += ls[u] * c;
            acc.x += a[u].x * c; acc.y += a[u].y * c; acc.z += a[u].z * c; acc.w += a[u].w * c;
        }
    }
    s_acc[grp][q] = acc;
    if (q == 0) s_l[grp] = L;
    __syncthreads();
    if (threadIdx.x < ATTN_COMBINE_DIMS) {
        float A = 0.0f, Lt = 0.0f;
#pragma unroll
        for (int j = 0; j < ATTN_COMBINE_GROUPS; ++j) {
            A += reinterpret_cast<const float*>(&s_acc[j][threadIdx.x >> 2])[threadIdx.x & 3];
            Lt += s_l[j];
        }
        const int d = blockIdx.y * ATTN_COMBINE_DIMS + threadIdx.x;
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
