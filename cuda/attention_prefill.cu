// Prefill / chunked-prefill attention on the tensor cores (spec §5), flash-attention-2 style.
//
// attn_prefill<HD>: causal paged GQA attention of each sequence's new tokens (positions base..base+n-1)
// over its paged KV cache (keys 0..own position; the new tokens' K/V are already in the cache), then
// softmax(q k^T / sqrt(HD)) v * sigmoid(gate) written bf16 [T, nh*HD].
//
// Layout: one CTA (8 warps) per (64-row tile, kv head). The rows of a kv head's work in one sequence are
// its (token, q head) pairs flattened token-major: row r = tok * G + g (q heads kvh*G + g, adjacent in
// q [T, nh, HD]). Why: the G q heads that share a kv head read each K/V block from shared memory once,
// and a tile is 64 useful rows whatever G is (4 or 6: no per-head padding); a short sequence wastes at
// most one partial tile. Tiles never straddle sequences; the host lists them (seq, first row), most keys
// first. The CTA's two 4-warp groups split the tile's key blocks (even / odd), each with its own K/V
// buffers and named barrier, and merge (O, m, l) through shared memory at the end: the causal tail (the
// last tile of a sequence has the most keys) finishes twice as fast as with one group per tile.
// Each warp owns 16 rows and the full HD-wide output (HD/8 m16n8 accumulators: 128 f32 registers at
// HD 256); Q stays in shared memory (ldmatrix per k-step) to leave room for that.
// Per 64-key block: S = Q K^T (mma.sync m16n8k16 bf16 -> f32; K row-major [key][dim] is the "col" B
// operand directly), causal/prefix mask (key <= base + tok of the row), online softmax in f32 with
// exp2 of log2e-prescaled scores, P rounded to bf16 and fed from registers as the A operand of
// O += P V (V [key][dim] through ldmatrix .trans). K and V blocks arrive by cp.async (zero-filled past
// the tile's last key), single-buffered per group: V(j) loads under S(j) and the softmax, K(j+2) under
// P V(j). Shared memory rows are HD*2 bytes with 16-byte chunks XOR-swizzled by (row & 7), so every
// ldmatrix phase and every cp.async row write is bank-conflict free. 160 KB of shared memory at HD 256
// (one CTA per SM). The epilogue stages O / l in f32 through shared memory for 16-byte coalesced
// gate reads and output stores.
#include "common.cuh"

#define PF_ROWS 64  // query rows (token, head pairs) per CTA: 4 warps x 16 (in each key group)
#define PF_KEYS 64  // keys per block

// Issue the cp.async copies of key block kb (64 keys x HD) of one cache (K or V) into dst; gtid: the
// thread's index in its 128-thread group.
template <int HD>
__device__ __forceinline__ void pf_load_kv(const bf16_t* __restrict__ cache, unsigned dst, int kb, int n_keys,
                                           const int* __restrict__ table, int bs_shift, int nkv, int kvh,
                                           int gtid) {
    constexpr int CPR = HD / 8;  // 16-byte chunks per row
    const int bs_mask = (1 << bs_shift) - 1;
#pragma unroll 4
    for (int it = 0; it < PF_KEYS * CPR / 128; ++it) {
        const int idx = gtid + it * 128;
        const int row = idx / CPR, c = idx % CPR;
        const int j = kb * PF_KEYS + row;
        const bf16_t* src = cache;
        int bytes = 0;
        if (j < n_keys) {
            const long long page = table[j >> bs_shift];
            src = cache + ((((page << bs_shift) + (j & bs_mask)) * nkv + kvh) * HD + c * 8);
            bytes = 16;
        }
        cp_async16(dst + row * (HD * 2) + ((c ^ (row & 7)) << 4), src, bytes);
    }
}

// barrier of one 128-thread key group (ids 1, 2; 0 is __syncthreads)
__device__ __forceinline__ void pf_group_sync(int grp) {
    if (grp) asm volatile("bar.sync 2, 128;\n" ::: "memory");
    else asm volatile("bar.sync 1, 128;\n" ::: "memory");
}

// grid (nkv, ntiles), 256 threads, dynamic smem 5 * 64 * HD * 2 bytes (Q, then K and V of each key group).
// q [T, nh, HD] contiguous; gate [T, nh, HD] with strides (sg_t, sg_h, 1); kc/vc [blocks, 1 << bs_shift, nkv, HD];
// block_tables [B, bt_stride]; tiles [ntiles, 4] int32: (sequence b, first flat row r0, first token t0, n new
// tokens); positions[t0] is the sequence's base. out [T, nh * HD].
template <int HD>
__global__ void __launch_bounds__(256, 1) attn_prefill(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ gate, long long sg_t, long long sg_h,
    const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, const int* __restrict__ block_tables,
    int bt_stride, const int* __restrict__ tiles, const int* __restrict__ positions, int nkv, int G, int bs_shift,
    float scale_log2, bf16_t* __restrict__ out)
{
    pdl_enter();
    constexpr int CPR = HD / 8;   // 16-byte chunks per smem row
    constexpr int RB = HD * 2;    // bytes per smem row
    constexpr int KS = HD / 16;   // k-steps of Q K^T
    constexpr int ND = HD / 8;    // n8 tiles of the output
    extern __shared__ __align__(16) unsigned char pf_smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = warp >> 2, wq = warp & 3, gtid = tid & 127;  // key group; the warp's 16-row slice
    const unsigned sQ = smem_addr(pf_smem);
    const unsigned sK = sQ + PF_ROWS * RB + grp * 2 * PF_KEYS * RB, sV = sK + PF_KEYS * RB;

    const int kvh = blockIdx.x;
    const int4 tl = reinterpret_cast<const int4*>(tiles)[blockIdx.y];
    const int b = tl.x, r0 = tl.y, t0 = tl.z, n = tl.w;
    const int nh = nkv * G;
    const int base = positions[t0];
    const int rows_end = n * G;                          // flat rows of this sequence (per kv head)
    const int nrows = min(PF_ROWS, rows_end - r0);
    const int n_keys = base + (r0 + nrows - 1) / G + 1;  // keys 0 .. position of the tile's last token
    const int min_lim = base + r0 / G;                   // keys <= this need no mask for any row
    const int nblocks = (n_keys + PF_KEYS - 1) / PF_KEYS;
    const int* table = block_tables + (long long)b * bt_stride;

    // ---- Q tile (rows past the sequence's end are zero), each group's first K block
#pragma unroll
    for (int it = 0; it < PF_ROWS * CPR / 256; ++it) {
        const int idx = tid + it * 256;
        const int row = idx / CPR, c = idx % CPR;
        const int fr = r0 + row;
        const bf16_t* src = q;
        int bytes = 0;
        if (fr < rows_end) {
            const int tok = fr / G, g = fr - tok * G;
            src = q + (((long long)(t0 + tok) * nh + kvh * G + g) * HD + c * 8);
            bytes = 16;
        }
        cp_async16(sQ + row * RB + ((c ^ (row & 7)) << 4), src, bytes);
    }
    if (grp < nblocks) pf_load_kv<HD>(kc, sK, grp, n_keys, table, bs_shift, nkv, kvh, gtid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // Q (written by both groups) visible to all

    // ---- per-thread constants
    // mma C fragment rows of this thread: g8 and g8 + 8 of the warp's 16; columns 2 * (lane & 3) + {0, 1}
    const int g8 = lane >> 2, c2 = 2 * (lane & 3);
    int lim[2];  // last key each of the thread's two rows may see
#pragma unroll
    for (int i = 0; i < 2; ++i) lim[i] = min(base + (r0 + wq * 16 + g8 + 8 * i) / G, n_keys - 1);
    // ldmatrix lane addressing. Q (A operand, x4 = rows 0-7/8-15 x k 0-7/8-15) and V (.trans B operand,
    // x4 = keys 0-7/8-15 x dims d/d+8): lane row l & 15, logical chunk 2 * step + (l >> 4).
    // K (B operand, x4 = keys 0-7 k-lo, keys 0-7 k-hi, keys 8-15 k-lo, keys 8-15 k-hi): lane row
    // (l & 7) + 8 * (l >> 4), logical chunk 2 * step + ((l >> 3) & 1). Physical chunk = logical ^ (row & 7),
    // row & 7 == lane & 7 for both; 2 * step is even so (2 * step + bit) ^ r == (2 * step) ^ (bit ^ r).
    const int xq = (lane >> 4) ^ (lane & 7), xk = ((lane >> 3) & 1) ^ (lane & 7);
    unsigned oq[4], ok[4];  // byte offsets of chunk (2i) ^ x, i = step & 3 (the higher bits of 2 * step pass)
#pragma unroll
    for (int i = 0; i < 4; ++i) { oq[i] = ((2 * i) ^ xq) << 4; ok[i] = ((2 * i) ^ xk) << 4; }
    const unsigned q_row = sQ + (wq * 16 + (lane & 15)) * RB;
    const unsigned v_row = sV + (lane & 15) * RB;
    const unsigned k_row = sK + ((lane & 7) + 8 * (lane >> 4)) * RB;

    float o[ND][4];
#pragma unroll
    for (int d = 0; d < ND; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.0f, 0.0f};

    // group grp takes key blocks grp, grp + 2, ... (its own K/V buffers and barrier)
    for (int kb = grp; kb < nblocks; kb += 2) {
        cp_async_wait<0>();
        pf_group_sync(grp);  // K(kb) landed for the whole group; the group is done with V(kb - 2)
        pf_load_kv<HD>(vc, sV, kb, n_keys, table, bs_shift, nkv, kvh, gtid);
        cp_async_commit();

        // S = Q K^T: 16 rows x 64 keys per warp, 8 n8 tiles
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const unsigned hi = ((2 * ks) & ~7) << 4;
            unsigned a0, a1, a2, a3;
            ldsm_x4(q_row + hi + oq[ks & 3], a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                unsigned b0, b1, b2, b3;
                ldsm_x4(k_row + np * 16 * RB + hi + ok[ks & 3], b0, b1, b2, b3);
                mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
                mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }

        // causal / prefix mask (also hides the zero-filled keys past n_keys)
        const int k0 = kb * PF_KEYS;
        if (k0 + PF_KEYS - 1 > min_lim) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (k0 + 8 * j + c2 + (e & 1) > lim[e >> 1]) s[j][e] = NEG_INF;
        }

        // online softmax; a row is spread over the 4 lanes of a quad
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = m_r[i];
#pragma unroll
            for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float ms = mx == NEG_INF ? 0.0f : mx * scale_log2;
            const float corr = exp2f(m_r[i] * scale_log2 - ms);
            m_r[i] = mx;
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float p0 = exp2f(fmaf(s[j][2 * i], scale_log2, -ms));
                const float p1 = exp2f(fmaf(s[j][2 * i + 1], scale_log2, -ms));
                s[j][2 * i] = p0;
                s[j][2 * i + 1] = p1;
                rs += p0 + p1;
            }
            l_r[i] = l_r[i] * corr + rs;
#pragma unroll
            for (int d = 0; d < ND; ++d) { o[d][2 * i] *= corr; o[d][2 * i + 1] *= corr; }
        }
        // P as bf16 A fragments: k-step kk covers keys 16kk..16kk+15 = n8 tiles 2kk, 2kk+1
        unsigned pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            pa[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }

        cp_async_wait<0>();
        pf_group_sync(grp);  // V(kb) landed for the whole group; the group is done with K(kb)
        if (kb + 2 < nblocks) {
            pf_load_kv<HD>(kc, sK, kb + 2, n_keys, table, bs_shift, nkv, kvh, gtid);
            cp_async_commit();
        }

        // O += P V
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int dp = 0; dp < HD / 16; ++dp) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(v_row + kk * 16 * RB + (((2 * dp) & ~7) << 4) + oq[dp & 3], b0, b1, b2, b3);
                mma_bf16(o[2 * dp], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
                mma_bf16(o[2 * dp + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b2, b3);
            }
        }
    }

    // ---- merge the two key groups, normalise; O staged in f32 for the epilogue (row stride HD + 8
    // floats: the float2 accesses are conflict free). Group 1 hands (O, m, l) to group 0 through smem.
    constexpr int OS = HD + 8;
    float* so = reinterpret_cast<float*>(pf_smem);
    float* sml = so + PF_ROWS * OS;  // [64][2] m, l of group 1
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 1);
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 2);
    }
    __syncthreads();  // both groups are done with Q, K, V
    if (grp == 1) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = wq * 16 + g8 + 8 * i;
            float* dst = so + row * OS + c2;
#pragma unroll
            for (int d = 0; d < ND; ++d) *reinterpret_cast<float2*>(dst + 8 * d) = make_float2(o[d][2 * i], o[d][2 * i + 1]);
            if ((lane & 3) == 0) { sml[2 * row] = m_r[i]; sml[2 * row + 1] = l_r[i]; }
        }
    }
    __syncthreads();
    if (grp == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = wq * 16 + g8 + 8 * i;
            // group 0 always saw key 0, so m_r is finite; group 1's m is -inf when it had no block
            const float m1 = sml[2 * row], l1 = sml[2 * row + 1];
            const float M = fmaxf(m_r[i], m1);
            const float c0 = exp2f((m_r[i] - M) * scale_log2), c1 = exp2f((m1 - M) * scale_log2);
            const float inv = 1.0f / (l_r[i] * c0 + l1 * c1);
            const float w0 = c0 * inv, w1 = c1 * inv;
            float* dst = so + row * OS + c2;
#pragma unroll
            for (int d = 0; d < ND; ++d) {
                const float2 x = *reinterpret_cast<const float2*>(dst + 8 * d);
                *reinterpret_cast<float2*>(dst + 8 * d) =
                    make_float2(o[d][2 * i] * w0 + x.x * w1, o[d][2 * i + 1] * w0 + x.y * w1);
            }
        }
    }
    __syncthreads();
#pragma unroll 4
    for (int it = 0; it < PF_ROWS * CPR / 256; ++it) {
        const int idx = tid + it * 256;
        const int row = idx / CPR, c = idx % CPR;
        const int fr = r0 + row;
        if (fr >= rows_end) continue;
        const int tok = fr / G, g = fr - tok * G;
        const long long t = t0 + tok;
        const int h = kvh * G + g;
        const float4 x0 = *reinterpret_cast<const float4*>(so + row * OS + c * 8);
        const float4 x1 = *reinterpret_cast<const float4*>(so + row * OS + c * 8 + 4);
        const bf16_t* gp = gate + t * sg_t + h * sg_h + c * 8;
        float f[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] *= sigmoid_f(bf2f(gp[e]));
        *reinterpret_cast<uint4*>(out + (t * nh + h) * HD + c * 8) = pack8(f);
    }
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
#define PF_INST(HD)                                                                                         \
    template __global__ void attn_prefill<HD>(const bf16_t*, const bf16_t*, long long, long long,          \
                                              const bf16_t*, const bf16_t*, const int*, int, const int*,  \
                                              const int*, int, int, int, float, bf16_t*);
PF_INST(64) PF_INST(128) PF_INST(256)
#endif
