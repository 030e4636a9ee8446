// Shared helpers for the qwen35 kernels. bf16 is carried as raw 16-bit bits (unsigned short):
// CuPy has no bf16 dtype, and raw bits keep the kernels free of any header dependency under NVRTC.
#pragma once

#define NEG_INF (__int_as_float(0xff800000))

typedef unsigned short bf16_t;

// Programmatic dependent launch (engine/gpu/launch.py), the first thing every kernel does: wait until the
// kernels before it in the stream have finished (their writes visible), then let the next kernel's blocks be
// scheduled. Both are no-ops for a kernel launched without the PDL attribute.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

// round to nearest even (as torch does); NaN stays NaN
__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float lo_bf(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned pack2(float a, float b) { return (unsigned)f2bf(a) | ((unsigned)f2bf(b) << 16); }

__device__ __forceinline__ void unpack8(const uint4 u, float (&f)[8]) {
    f[0] = lo_bf(u.x); f[1] = hi_bf(u.x); f[2] = lo_bf(u.y); f[3] = hi_bf(u.y);
    f[4] = lo_bf(u.z); f[5] = hi_bf(u.z); f[6] = lo_bf(u.w); f[7] = hi_bf(u.w);
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 u;
    u.x = pack2(f[0], f[1]); u.y = pack2(f[2], f[3]); u.z = pack2(f[4], f[5]); u.w = pack2(f[6], f[7]);
    return u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Whether this block is the last of n to arrive at *count (a zeroed counter the last block re-zeroes when done:
// a kernel whose last block reduces every block's partials). Called by the whole block once its partials are
// written: the barrier orders them before thread 0's acq_rel atomic (release is cumulative), whose acquire in
// the last block makes the other blocks' partials visible (a per-thread __threadfence made gemv's tail ~1 us
// longer). Read them with __ldcg (L2), not through L1.
__device__ __forceinline__ bool last_block_in(unsigned* count, unsigned n) {
    __shared__ bool s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned old;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
        s_last = old == n - 1;
    }
    __syncthreads();
    return s_last;
}

// RMSNorm's sum of squares in one fixed order, so that every kernel computing a row's norm gets the same bits
// (add_rms_norm_kernel, and gemv_bf16's fused norm: its producer GEMV writes the 16-column group sums, its
// consumer reduces them): a group's sum is sumsq8(first 8) + sumsq8(last 8); the row's sum is row_sumsq
// over the groups.
__device__ __forceinline__ float sumsq8(const float* a) {
    float s = __fmul_rn(a[0], a[0]);
#pragma unroll
    for (int e = 1; e < 8; ++e) s = __fmaf_rn(a[e], a[e], s);
    return s;
}

// Called by a whole warp (every lane gets the sum): lane l adds groups l, l + 32, ... in order, then the
// warp's butterfly. group(j): the sum of 16-column group j, j < G <= MAXG. Every group's value is fetched
// before the first add (the zeros past G add nothing: the same bits as a loop up to G).
template <int MAXG, class F>
__device__ __forceinline__ float row_sumsq(F group, int G) {
    const int lane = threadIdx.x & 31;
    float v[MAXG / 32];
#pragma unroll
    for (int i = 0; i < MAXG / 32; ++i) v[i] = lane + 32 * i < G ? group(lane + 32 * i) : 0.0f;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXG / 32; ++i) q += v[i];
    return warp_sum(q);
}

__device__ __forceinline__ float rms_scale(float ss, int H, float eps) { return rsqrtf(ss / (float)H + eps); }

// Gemma-style (1 + w) RMSNorm of 8 values whose weights are w0, w1.
__device__ __forceinline__ void rms_apply8(float (&a)[8], float scale, const float4 w0, const float4 w1) {
    a[0] *= scale * (1.0f + w0.x); a[1] *= scale * (1.0f + w0.y);
    a[2] *= scale * (1.0f + w0.z); a[3] *= scale * (1.0f + w0.w);
    a[4] *= scale * (1.0f + w1.x); a[5] *= scale * (1.0f + w1.y);
    a[6] *= scale * (1.0f + w1.z); a[7] *= scale * (1.0f + w1.w);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Asynchronous 16-byte global -> shared copies (sm_80+), bypassing registers. src_bytes = 0 writes zeros
// and reads nothing. cp_async_wait<N>: wait until at most N committed groups are still in flight.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- tensor-core fragments (mma.sync m16n8k16, bf16 in, f32 accumulate) ----------------------------
// ldmatrix x4: lane l gives the row address of matrix l / 8, row l % 8; .trans delivers the transposes.
// volatile: they read shared memory that the block rewrites between barriers.
__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// d += A[16 x 16] * B[16 x 8] (row-major A fragment, column-major B)
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// two floats -> bf16x2 (round to nearest even), lo in the low half
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---- mbarriers, thread-block clusters and bulk copies ------------------------------------------------
// An mbarrier completes a phase when its arrivals (and, on sm_90, its expected transaction bytes) are in;
// waiters wait on the phase parity. On sm_90a a bulk copy moves a contiguous global range into shared
// memory on the async proxy and counts its bytes on an mbarrier (complete_tx); .multicast::cluster lands
// the bytes at the same offset in every CTA of the mask, each one's mbarrier at the same offset signalled.
// Without sm_90a features: clusters of one (rank 0 of 1, the cluster barrier a block barrier).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .pred p;\n"
                 "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "\t@!p bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
#else
    asm volatile("{\n\t.reg .pred p;\n"
                 "WAIT:\n\tmbarrier.test_wait.parity.shared.b64 p, [%0], %1;\n"
                 "\t@!p bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
#endif
}
// a named barrier for the first `threads` threads of the block (barrier 0 is __syncthreads')
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// the calling thread's cp.async copies issued so far arrive on `bar` when they complete (one arrival)
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(bar) : "memory");
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_size() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
// every thread of every CTA in the cluster; orders shared-memory accesses before it with those after it
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// generic-proxy writes to shared memory before it, ordered before async-proxy (bulk copy) accesses after it
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }
// one arrival on the mbarrier at shared offset `bar` of cluster CTA `rank` (release at CTA scope, as
// CUTLASS's consumer release: .relaxed needs PTX 8.6, .release.cluster is a MEMBAR per call)
__device__ __forceinline__ void mbar_arrive_at(unsigned bar, unsigned rank) {
    asm volatile("{\n\t.reg .b32 r;\n\tmapa.shared::cluster.u32 r, %0, %1;\n"
                 "\tmbarrier.arrive.shared::cluster.b64 _, [r];\n}" ::"r"(bar), "r"(rank) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy_mc(unsigned dst, const void* src, unsigned bytes, unsigned bar,
                                             unsigned short mask) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1], %2, [%3], %4;" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
#else
__device__ __forceinline__ unsigned cluster_size() { return 1; }
// every thread of the block, also from different places in the code (barrier.sync without .aligned)
__device__ __forceinline__ void cluster_sync() { asm volatile("barrier.sync 0;" ::: "memory"); }
__device__ __forceinline__ void mbar_init_fence() {}
__device__ __forceinline__ void fence_proxy_async() {}
__device__ __forceinline__ void mbar_arrive_at(unsigned bar, unsigned) {
    asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
#endif
