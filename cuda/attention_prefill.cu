// Prefill / chunked-prefill attention on Hopper's warpgroup tensor cores (spec §5), flash-attention style.
//
// attn_prefill<HD>: causal paged GQA attention of each sequence's new tokens (positions base..base+n-1)
// over its paged KV cache (keys 0..own position; the new tokens' K/V are already in the cache), then
// softmax(q k^T / sqrt(HD)) v * sigmoid(gate) written bf16 [T, nh*HD].
//
// Layout: one CTA (2 warpgroups) per (128-row tile, kv head). The rows of a kv head's work in one sequence
// are its (token, q head) pairs flattened token-major: row r = tok * G + g (q heads kvh*G + g, adjacent in
// q [T, nh, HD]). Why: the G q heads that share a kv head read each K/V block from shared memory once,
// and a tile is 128 useful rows whatever G is (4 or 6: no per-head padding); a short sequence wastes at
// most one partial tile. Tiles never straddle sequences; the host lists them (seq, first row), most keys
// first. Each warpgroup owns 64 rows; both read the same K/V blocks (one load from L2 per 128 rows).
// Split keys: a tile of a short chunk over a long context (a mixed step's 256 tokens over 16k keys are 8 tiles
// per kv head, 32 CTAs on 132 SMs walking 256 key blocks each) is cut by the host into parts of consecutive
// key blocks. Each part writes its unnormalized O, row max and row sum to a workspace slot; the part that
// arrives last (a counter per group, re-zeroed by it) merges the group's parts in part order and runs the
// epilogue.
//
// Why wgmma (sm_90a) and not mma.sync: mma.sync takes every B fragment through ldmatrix per 16-row warp
// tile, 256 bytes of shared memory per m16n8k16, the SM's whole shared-memory bandwidth at the tensor
// cores' rate (that kernel ran at 80-155 TFLOP/s on an H100); wgmma reads B once per 64 rows.
// Per 64-key block, per warpgroup: S = Q K^T (HD/16 wgmma m64n64k16, Q and K from shared memory, both
// K-major), causal/prefix mask (key <= base + tok of the row), online softmax in f32 with exp2 of
// log2e-prescaled scores, P rounded to bf16 and fed from registers (the S accumulator layout is the A
// fragment layout) to O += P V (HD/64 wgmma m64n64k16 per 16 keys, V from shared memory MN-major).
// S of block kb and P V of block kb-1 are issued together, so the softmax runs under the tensor cores.
// Shared memory operands use the canonical 128-byte swizzle: a tile of rows x HD is stored as HD/64
// column blocks of [rows][128 bytes], 16-byte chunk c of row r at chunk c ^ (r & 7), atoms 1024-byte
// aligned. K/V blocks arrive by cp.async (zero-filled past the tile's last key), two stages each.
// The kernel is bound by instruction issue (2 warps per scheduler), hence the cheap address math: fixed
// per-thread copy columns, descriptors advanced by an add, O's rescale skipped when no row max moved.
// 192 KB of shared memory at HD 256 (one CTA per SM). The epilogue stages O / l in f32 through shared
// memory for 16-byte coalesced gate reads and output stores.
#include "common.cuh"
#include "wgmma.cuh"

#define PF_ROWS 128  // query rows (token, head pairs) per CTA: 2 warpgroups x 64
#define PF_KEYS 64   // keys per block
#define PF_MAX_PARTS 16  // parts a tile's keys split into at most (the merge's weights: PF_ROWS x this floats)

// (Two CTAs per SM at HD 64: the merge's registers would otherwise push it past 128.)
// grid (nkv, ntiles), 256 threads, dynamic smem PF_ROWS * HD * 2 (Q) + 2 stages x 2 x PF_KEYS * HD * 2 (K, V)
// + 1024 (alignment). q [T, nh, HD] contiguous; gate [T, nh, HD] with strides (sg_t, sg_h, 1);
// kc/vc [blocks, 1 << bs_shift, nkv, HD]; block_tables [B, bt_stride]; tiles [ntiles, 8] int32: (sequence b,
// first flat row r0, first token t0, n new tokens; n = 0: empty, skipped), then (first and end key block,
// the group's first workspace slot or -1 when the tile is whole, part p << 16 | parts); positions[t0] is the
// sequence's base. Split parts: part_o [slots * nkv, PF_ROWS, HD] and part_ml [slots * nkv, PF_ROWS, 2] f32,
// slot (first + p) * nkv + kvh; counters [slots * nkv] int32, zero between launches. out [T, nh * HD].
template <int HD>
__global__ void __launch_bounds__(256, HD == 64 ? 2 : 1) attn_prefill(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ gate, long long sg_t, long long sg_h,
    const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, const int* __restrict__ block_tables,
    int bt_stride, const int* __restrict__ tiles, const int* __restrict__ positions, int nkv, int G, int bs_shift,
    float scale_log2, bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    int* __restrict__ counters)
{
    pdl_enter();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CPR = HD / 8;         // 16-byte chunks per row
    constexpr int KS = HD / 16;         // k-steps of Q K^T
    constexpr int NB = HD / 64;         // 64-wide column blocks (of the operands and of O)
    constexpr int WQ = 64 * HD * 2;     // bytes of one warpgroup's Q
    constexpr int KVB = PF_KEYS * HD * 2;  // bytes of one K or V block
    extern __shared__ __align__(16) unsigned char pf_smem[];
    static_assert(PF_ROWS * (HD + 8) * 4 + PF_MAX_PARTS * PF_ROWS * 4 <= (PF_ROWS + 4 * PF_KEYS) * HD * 2,
                  "the epilogue's staging and the merge weights fit in Q's and the K/V stages' shared memory");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, w4 = warp & 3;  // warpgroup; the warp's 16-row slice of it
    const unsigned s0 = (smem_addr(pf_smem) + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
    const unsigned sQ = s0, sKV = s0 + 2 * WQ;                 // Q of both warpgroups, then the K/V stages

    const int kvh = blockIdx.x;
    const int4 tl = reinterpret_cast<const int4*>(tiles)[2 * blockIdx.y];
    const int4 sp = reinterpret_cast<const int4*>(tiles)[2 * blockIdx.y + 1];
    const int b = tl.x, r0 = tl.y, t0 = tl.z, n = tl.w;
    const int kb0 = sp.x, nblocks = sp.y - sp.x;  // this part's key blocks (a whole tile: all of them)
    if (n == 0) return;  // an empty tile: a mixed step's graph pads its tile list with them (gpu/mixed_layout.py)
    const int nh = nkv * G;
    const int base = positions[t0];
    const int rows_end = n * G;                          // flat rows of this sequence (per kv head)
    const int nrows = min(PF_ROWS, rows_end - r0);
    const int n_keys = base + (r0 + nrows - 1) / G + 1;  // keys 0 .. position of the tile's last token
    const int min_lim = base + r0 / G;                   // keys <= this need no mask for any row
    const int* table = block_tables + (long long)b * bt_stride;

    // ---- Q tile (rows past the sequence's end are zero) and the first K block
#pragma unroll 4
    for (int it = 0; it < PF_ROWS * CPR / 256; ++it) {
        const int idx = tid + it * 256;
        const int row = idx / CPR, c = idx % CPR, lr = row & 63;
        const int fr = r0 + row;
        const bf16_t* src = q;
        int bytes = 0;
        if (fr < rows_end) {
            const int tok = fr / G, g = fr - tok * G;
            src = q + (((long long)(t0 + tok) * nh + kvh * G + g) * HD + c * 8);
            bytes = 16;
        }
        cp_async16(sQ + (row >> 6) * WQ + (c >> 3) * (64 * 128) + lr * 128 + (((c & 7) ^ (lr & 7)) << 4), src,
                   bytes);
    }
    // K/V block copies: a warp copies 32 / CPR whole key rows per instruction (16 bytes a lane), so a
    // thread's column chunk, and with it its swizzled offset in a row, stays fixed
    constexpr int RPW = 32 / CPR;  // key rows per warp instruction
    const int lrow = warp * RPW + lane / CPR, lc = lane % CPR;  // the thread's first row; its chunk
    const unsigned ldst = (lc >> 3) * (PF_KEYS * 128) + lrow * 128 + (((lc & 7) ^ (lrow & 7)) << 4);
    const int bs_mask = (1 << bs_shift) - 1;
    const long long slot_stride = (long long)nkv * HD;  // elements from one cache slot to the next
    const bf16_t* kbase = kc + kvh * HD + lc * 8;
    const bf16_t* vbase = vc + kvh * HD + lc * 8;
    auto copy_block = [&](const bf16_t* cache, unsigned dst, int kb) {  // zero-filled past n_keys
#pragma unroll
        for (int it = 0; it < PF_KEYS / (8 * RPW); ++it) {
            const int j = kb * PF_KEYS + lrow + it * 8 * RPW;
            const bool ok = j < n_keys;
            const int page = ok ? table[j >> bs_shift] : 0;
            cp_async16(dst + ldst + it * 8 * RPW * 128, cache + ((page << bs_shift) + (j & bs_mask)) * slot_stride,
                       ok ? 16 : 0);
        }
    };
    copy_block(kbase, sKV, kb0);
    cp_async_commit();

    // mma C fragment rows of this thread: g8 and g8 + 8 of the warp's 16; columns 2 * (lane & 3) + {0, 1}
    const int g8 = lane >> 2, c2 = 2 * (lane & 3);
    int lim[2];  // last key each of the thread's two rows may see
#pragma unroll
    for (int i = 0; i < 2; ++i) lim[i] = min(base + (r0 + wg * 64 + w4 * 16 + g8 + 8 * i) / G, n_keys - 1);

    float o[NB][32];
#pragma unroll
    for (int d = 0; d < NB; ++d)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[d][e] = 0.0f;
    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.0f, 0.0f};
    unsigned pa[4][4];  // P of the previous block as bf16 A fragments (k-step kk: keys 16kk..16kk+15)
    // operand descriptors: Q (this warpgroup's) and K are K-major, V MN-major (8-key groups 1024 bytes apart)
    const WgDesc dq(sQ + wg * WQ, 16, 1024), dkv(sKV, 16, 1024), dv(sKV, 64 * 128, 1024);

    // Block kb: S(kb) = Q K(kb)^T is issued together with O += P(kb-1) V(kb-1); the softmax of S(kb) runs
    // while P V(kb-1) is on the tensor cores, and O is rescaled once that is done. K and V have two stages
    // each: at the top of block kb, K(kb) and V(kb-1) have landed and every warpgroup is done with K(kb-1)
    // and V(kb-2), whose stages then receive K(kb+1) and V(kb). Stage s: K at sKV + s KVB, V at
    // sKV + (2 + s) KVB. (One loop body for every block: ptxas serializes wgmma whose groups differ by path.)
    // kb counts the part's blocks; its keys start at block kb0 + kb.
    auto top = [&]() {
        cp_async_wait<0>();
        // cp.async writes -> wgmma reads. A MEMBAR: it waits for every load in flight, so the loads of the
        // next blocks are issued after it
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    };
    // issued after the block's wgmma: the warps' page-table reads then wait under the tensor cores' work
    auto load = [&](int kb) {
        if (kb + 1 < nblocks) copy_block(kbase, sKV + ((kb + 1) & 1) * KVB, kb0 + kb + 1);
        if (kb < nblocks) copy_block(vbase, sKV + (2 + (kb & 1)) * KVB, kb0 + kb);
        cp_async_commit();
    };
    auto issue_s = [&](float (&s)[32], int kb) {  // S = Q K^T: 64 rows x 64 keys per warpgroup
        const unsigned sk = (kb & 1) * KVB;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const unsigned off = (ks >> 2) * (64 * 128) + (ks & 3) * 32;
            wg_ss(s, dq.at(off), dkv.at(sk + off), ks);
        }
        wg_commit();
    };
    auto issue_pv = [&](int kb) {  // O += P V: V column block d's keys 16kk.. start at sV + d 64 128 + kk 16 128
        const unsigned sv = (2 + (kb & 1)) * KVB;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int d = 0; d < NB; ++d) wg_rs(o[d], pa[kk], dv.at(sv + d * (64 * 128) + kk * 2048));
        wg_commit();
    };
    // mask, online softmax: s becomes P (f32), l and m advance; corr: the factor O still needs
    auto softmax = [&](float (&s)[32], int kb, float (&corr)[2]) {
        // causal / prefix mask (also hides the zero-filled keys past n_keys); s[4j + e]: row g8 + 8 (e >> 1),
        // key 8j + c2 + (e & 1)
        const int k0 = (kb0 + kb) * PF_KEYS;
        if (k0 + PF_KEYS - 1 > min_lim) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (k0 + 8 * j + c2 + (e & 1) > lim[e >> 1]) s[4 * j + e] = NEG_INF;
        }
        // a row is spread over the 4 lanes of a quad
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = m_r[i];
#pragma unroll
            for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float ms = mx == NEG_INF ? 0.0f : mx * scale_log2;
            corr[i] = exp2f(m_r[i] * scale_log2 - ms);
            m_r[i] = mx;
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float p0 = exp2f(fmaf(s[4 * j + 2 * i], scale_log2, -ms));
                const float p1 = exp2f(fmaf(s[4 * j + 2 * i + 1], scale_log2, -ms));
                s[4 * j + 2 * i] = p0;
                s[4 * j + 2 * i + 1] = p1;
                rs += p0 + p1;
            }
            l_r[i] = l_r[i] * corr[i] + rs;
        }
    };
    auto rescale_pack = [&](const float (&s)[32], const float (&corr)[2]) {  // O *= corr; P -> bf16 fragments
        if (!__all_sync(0xffffffffu, corr[0] == 1.0f && corr[1] == 1.0f)) {  // (x 1 is exact: skipped)
#pragma unroll
            for (int d = 0; d < NB; ++d)
#pragma unroll
                for (int e = 0; e < 32; ++e) o[d][e] *= corr[(e >> 1) & 1];
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = pack_bf16x2(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    };
    auto hold_o = [&]() {
#pragma unroll
        for (int d = 0; d < NB; ++d) wg_hold(o[d]);
    };

    float s[32], corr[2];
    top();
    wg_fence();
    issue_s(s, 0);
    load(0);
    wg_wait<0>();
    wg_hold(s);
    softmax(s, 0, corr);
    rescale_pack(s, corr);
    for (int kb = 1; kb < nblocks; ++kb) {
        top();
        wg_fence();
        issue_s(s, kb);
        issue_pv(kb - 1);
        load(kb);
        wg_wait<1>();  // S(kb) done, P V(kb-1) may still run
        wg_hold(s);
        softmax(s, kb, corr);
        wg_wait<0>();  // P V(kb-1) done: O and the P fragments are free
        hold_o();
        wg_hold(s);  // the packing reads s: it stays below the wait too
        rescale_pack(s, corr);
    }
    top();
    wg_fence();
    issue_pv(nblocks - 1);
    wg_wait<0>();
    hold_o();
    __syncthreads();  // the staging below overlays the V stages the other warpgroup's last P V may still read

    // ---- O / l staged in f32 for the epilogue (row stride HD + 8 floats: the float2 accesses are conflict
    // free); a split part's O goes to its workspace slot first, and the group's last part stages the merge
    constexpr int OS = HD + 8;
    float* so = reinterpret_cast<float*>(pf_smem + (s0 - smem_addr(pf_smem)));
    const int first = sp.z;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 1);
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 2);
    }
    if (first < 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float inv = 1.0f / l_r[i];  // key 0 is visible to every row: l > 0
            float* dst = so + (wg * 64 + w4 * 16 + g8 + 8 * i) * OS + c2;
#pragma unroll
            for (int d = 0; d < NB; ++d)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    *reinterpret_cast<float2*>(dst + 64 * d + 8 * j) =
                        make_float2(o[d][4 * j + 2 * i] * inv, o[d][4 * j + 2 * i + 1] * inv);
        }
    } else {
        const int parts = sp.w & 0xFFFF, p = sp.w >> 16;
        const long long slot = (long long)(first + p) * nkv + kvh, slot0 = (long long)first * nkv + kvh;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = wg * 64 + w4 * 16 + g8 + 8 * i;
            if (row >= nrows) continue;
            float* dst = part_o + (slot * PF_ROWS + row) * HD + c2;
#pragma unroll
            for (int d = 0; d < NB; ++d)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    *reinterpret_cast<float2*>(dst + 64 * d + 8 * j) =
                        make_float2(o[d][4 * j + 2 * i], o[d][4 * j + 2 * i + 1]);
            if ((lane & 3) == 0)
                *reinterpret_cast<float2*>(part_ml + (slot * PF_ROWS + row) * 2) = make_float2(m_r[i], l_r[i]);
        }
        __shared__ int last;
        __threadfence();  // this part's writes, then its arrival
        __syncthreads();
        if (tid == 0) {
            last = atomicAdd(counters + slot0, 1) == parts - 1;
            if (last) counters[slot0] = 0;  // every part has arrived: zero for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        // row weights: part q's O counts exp2((m_q - M) scale) over the sum of that times l_q (M: the row's max
        // over the parts; key 0, in part 0, is visible to every row, so M is finite)
        const long long pstride = (long long)nkv * PF_ROWS;  // workspace rows from one part's slot to the next
        float* wgt = so + PF_ROWS * OS;
        if (tid < nrows) {
            const float* ml = part_ml + (slot0 * PF_ROWS + tid) * 2;
            float m = NEG_INF, l = 0.0f;
            for (int q = 0; q < parts; ++q) m = fmaxf(m, __ldcg(ml + q * pstride * 2));
            const float ms = m * scale_log2;
            for (int q = 0; q < parts; ++q) {
                const float2 v = __ldcg(reinterpret_cast<const float2*>(ml + q * pstride * 2));
                const float w = exp2f(fmaf(v.x, scale_log2, -ms));
                wgt[q * PF_ROWS + tid] = w;
                l = fmaf(v.y, w, l);
            }
            const float inv = 1.0f / l;
            for (int q = 0; q < parts; ++q) wgt[q * PF_ROWS + tid] *= inv;
        }
        __syncthreads();
        for (int idx = tid; idx < nrows * (HD / 4); idx += 256) {
            const int row = idx / (HD / 4), c = (idx % (HD / 4)) * 4;
            const float4* src = reinterpret_cast<const float4*>(part_o + (slot0 * PF_ROWS + row) * HD + c);
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int q = 0; q < parts; ++q) {
                const float w = wgt[q * PF_ROWS + row];
                const float4 v = __ldcg(src + q * pstride * (HD / 4));
                acc.x = fmaf(w, v.x, acc.x), acc.y = fmaf(w, v.y, acc.y);
                acc.z = fmaf(w, v.z, acc.z), acc.w = fmaf(w, v.w, acc.w);
            }
            *reinterpret_cast<float4*>(so + row * OS + c) = acc;
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
#else
    __trap();  // sm_90a only: the backend sends prefill rows to attn_fwd on other GPUs
#endif
}

// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
#define PF_INST(HD)                                                                                         \
    template __global__ void attn_prefill<HD>(const bf16_t*, const bf16_t*, long long, long long,          \
                                              const bf16_t*, const bf16_t*, const int*, int, const int*,  \
                                              const int*, int, int, int, float, bf16_t*, float*, float*, int*);
PF_INST(64) PF_INST(128) PF_INST(256)
#endif
