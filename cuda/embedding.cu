// Row gather: the embedding lookup (no scaling, spec §3), and the logits-row gather.
#include "common.cuh"

// out[i] = table[idx[i]]; rows of H bf16, H % 8 == 0, table rows contiguous.
extern "C" __global__ void gather_rows_kernel(const int* __restrict__ idx, const bf16_t* __restrict__ table,
                                              bf16_t* __restrict__ out, int H)
{
    pdl_enter();
    const long long src = idx[blockIdx.x];
    const uint4* s = reinterpret_cast<const uint4*>(table + src * H);
    uint4* d = reinterpret_cast<uint4*>(out + (long long)blockIdx.x * H);
    for (int i = threadIdx.x; i < (H >> 3); i += blockDim.x) d[i] = s[i];
}
