// Greedy token and finite flag of each logits row, in one pass: what the runner needs from every
// sampled row before (and, for plain greedy rows, instead of) the sampler.
#include "common.cuh"

#define ARGMAX_THREADS 512

// (value, index) order of the reduction: larger value first, then the lower index (numpy.argmax's
// first occurrence; -0.0 == +0.0 as in any float compare).
__device__ __forceinline__ void argmax_take(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

// One block per row. x [B, V] f32 with row stride sx elements (rows read as float4 when V, sx and x
// allow it, else element-wise). out [B, 2] int32: (argmax over the finite entries, 1 if the
// whole row is finite else 0).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_finite_kernel(
    const float* __restrict__ x, long long sx, int V, int* __restrict__ out)
{
    pdl_enter();
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32], sbad[ARGMAX_THREADS / 32];
    const float* row = x + blockIdx.x * sx;
    float best = NEG_INF;
    int bi = 0x7fffffff, bad = 0;
    if ((V & 3) == 0 && (sx & 3) == 0 && (reinterpret_cast<unsigned long long>(x) & 15) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        for (int j = threadIdx.x; j < (V >> 2); j += ARGMAX_THREADS) {
            const float4 f = __ldg(r4 + j);
            const float e[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (!isfinite(e[u])) bad = 1;
                else argmax_take(best, bi, e[u], 4 * j + u);
            }
        }
    } else {
        for (int j = threadIdx.x; j < V; j += ARGMAX_THREADS) {
            const float e = row[j];
            if (!isfinite(e)) bad = 1;
            else argmax_take(best, bi, e, j);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        argmax_take(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; sbad[warp] = bad; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) { argmax_take(best, bi, sv[w], si[w]); bad |= sbad[w]; }
        out[2 * blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
        out[2 * blockIdx.x + 1] = !bad;
    }
}
