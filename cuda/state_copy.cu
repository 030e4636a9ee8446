// Row copies between the GDN state arrays' rows (prefix caching: a snapshot restored into a slot, a
// slot saved into a snapshot): one launch for every
// layer's conv and recurrent array and every pair, instead of a memcpy per row and array. Array a has base
// bases[a] and rows of row_bytes[a] bytes (a multiple of 16: each row is contiguous); pairs = [src0, dst0,
// src1, dst1, ...] row ids, or null for the one pair (src0, dst0) given by value (no upload).
// grid = (blocks over the longest row, arrays, pairs).
#include "common.cuh"

extern "C" __global__ void copy_rows(const unsigned long long* __restrict__ bases,
                                     const long long* __restrict__ row_bytes, const int* __restrict__ pairs,
                                     int src0, int dst0)
{
    pdl_enter();
    const int a = blockIdx.y, p = blockIdx.z;
    const long long bytes = row_bytes[a], n = bytes / 16;
    const long long s = pairs ? pairs[2 * p] : src0, d = pairs ? pairs[2 * p + 1] : dst0;
    const uint4* src = reinterpret_cast<const uint4*>(bases[a] + s * bytes);
    uint4* dst = reinterpret_cast<uint4*>(bases[a] + d * bytes);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
