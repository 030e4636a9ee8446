// Greedy token and finite flag of each logits row, in one pass: what the runner needs from every
// sampled row before (and, for plain greedy rows, instead of) the sampler.
#include "common.cuh"

#define ARGMAX_THREADS 256
#define ARGMAX_LOADS 8                                       // float4 loads a thread has in flight
#define ARGMAX_CHUNK 8192                                    // entries a block takes per pass
static_assert(ARGMAX_CHUNK == 4 * ARGMAX_THREADS * ARGMAX_LOADS, "a pass: one float4 per load per thread");
#define ARGMAX_SPLIT_ROWS 64                                 // rows split over several blocks: count's size

// (value, index) order of the reduction: larger value first, then the lower index (numpy.argmax's
// first occurrence; -0.0 == +0.0 as in any float compare). A total order: any reduction tree gives
// the same result.
__device__ __forceinline__ void argmax_take(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ __forceinline__ void argmax_warp(float& v, int& i, int& bad) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        argmax_take(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
}

// x [B, V] f32 with row stride sx elements (read as float4 when V, sx and x allow it, else element-wise).
// out [B, 2] int32: (argmax over the finite entries, 1 if the whole row is finite else 0).
// Grid (S, B). S = 1: a block walks its whole row (B large enough to fill the GPU). S > 1 (B <=
// ARGMAX_SPLIT_ROWS, S = ceil(V / ARGMAX_CHUNK)): why: one block streams a 1 MB row (the 4B's 248k
// logits) at one SM's share of L2 bandwidth, ~10-40 us on the decode loop's critical path; S blocks take
// a chunk each, write (value, index, bad) to part [B][S][3], and the row's last block to finish (count
// [ARGMAX_SPLIT_ROWS], zeroed, left zeroed) reduces them.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_finite_kernel(
    const float* __restrict__ x, long long sx, int V, int* __restrict__ out, int* __restrict__ part,
    unsigned* __restrict__ count)
{
    pdl_enter();
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32], sbad[ARGMAX_THREADS / 32];
    const int b = blockIdx.y, S = gridDim.x;
    const float* row = x + b * sx;
    const int j0 = S == 1 ? 0 : blockIdx.x * ARGMAX_CHUNK, j1 = S == 1 ? V : min(j0 + ARGMAX_CHUNK, V);
    float best = NEG_INF;
    int bi = 0x7fffffff, bad = 0;
    auto take = [&](float e, int j) {
        if (!isfinite(e)) bad = 1;
        else argmax_take(best, bi, e, j);
    };
    if ((V & 3) == 0 && (sx & 3) == 0 && (reinterpret_cast<unsigned long long>(x) & 15) == 0) {
        for (int j = j0 + 4 * threadIdx.x; j < j1; j += ARGMAX_CHUNK) {
            float4 f[ARGMAX_LOADS];
#pragma unroll
            for (int u = 0; u < ARGMAX_LOADS; ++u) {  // every load issued before the first compare
                const int k = j + 4 * ARGMAX_THREADS * u;
                if (k < j1) f[u] = __ldg(reinterpret_cast<const float4*>(row + k));
            }
#pragma unroll
            for (int u = 0; u < ARGMAX_LOADS; ++u) {
                const int k = j + 4 * ARGMAX_THREADS * u;
                if (k < j1) { take(f[u].x, k); take(f[u].y, k + 1); take(f[u].z, k + 2); take(f[u].w, k + 3); }
            }
        }
    } else {
        for (int j = j0 + threadIdx.x; j < j1; j += ARGMAX_THREADS) take(row[j], j);
    }
    argmax_warp(best, bi, bad);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; sbad[warp] = bad; }
    __syncthreads();
    if (warp == 0) {
        best = lane < ARGMAX_THREADS / 32 ? sv[lane] : NEG_INF;
        bi = lane < ARGMAX_THREADS / 32 ? si[lane] : 0x7fffffff;
        bad = lane < ARGMAX_THREADS / 32 ? sbad[lane] : 0;
        argmax_warp(best, bi, bad);
    }
    if (S > 1) {
        if (threadIdx.x == 0) {
            int* p = part + 3 * ((long long)b * S + blockIdx.x);
            p[0] = __float_as_int(best); p[1] = bi; p[2] = bad;
        }
        if (!last_block_in(count + b, S) || warp != 0) return;
        best = NEG_INF; bi = 0x7fffffff; bad = 0;
        for (int s = lane; s < S; s += 32) {
            const int* q = part + 3 * ((long long)b * S + s);
            argmax_take(best, bi, __int_as_float(__ldcg(q)), __ldcg(q + 1));
            bad |= __ldcg(q + 2);
        }
        argmax_warp(best, bi, bad);
        if (lane == 0) count[b] = 0u;  // for the next launch (stream order)
    }
    if (threadIdx.x == 0) {
        out[2 * b] = bi == 0x7fffffff ? 0 : bi;
        out[2 * b + 1] = !bad;
    }
}
