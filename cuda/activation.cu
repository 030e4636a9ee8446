// SwiGLU activation: out = silu(gate) * up (spec §7) of a GEMM with the gate|up weight of
// CudaBackend.weight_gate_up: its columns come in blocks of 8 gate then 8 up features (gemv.cu's OUT = 2
// computes the same inside the GEMV, for decode-sized M).
#include "common.cuh"

// gu [T, 2F] row stride sgu (elements), F % 8 == 0, sgu % 8 == 0; out [T, F] contiguous.
extern "C" __global__ void silu_mul_kernel(const bf16_t* __restrict__ gu, long long sgu, bf16_t* __restrict__ out,
                                           int T, int F)
{
    pdl_enter();
    const int fv = F >> 3;
    const long long n = (long long)T * fv;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / fv;
        const int c = (int)(i - t * fv);
        const uint4* row = reinterpret_cast<const uint4*>(gu + t * sgu);
        float g[8], u[8];
        unpack8(row[2 * c], g);
        unpack8(row[2 * c + 1], u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = silu_f(g[e]) * u[e];
        reinterpret_cast<uint4*>(out + t * F)[c] = pack8(g);
    }
}
