// RMSNorm (1 + w) fused with the residual add (spec §6), and the GDN gated RMSNorm (plain w x silu(z), §4.8).
#include "common.cuh"

// One block per row. x, res, y: [rows, H] contiguous bf16, H % 16 == 0, H <= 8 * RMS_MAX_VEC; w: f32 [H].
// has_res: res = bf16(res + x), then y = norm(res); else y = norm(x) (the first layer: residual = x).
// The sum of squares in common.cuh's fixed order: the same bits as gemv_bf16's fused norm (gemv.cu).
#define RMS_MAX_VEC 1024
extern "C" __global__ void __launch_bounds__(256) add_rms_norm_kernel(
    const bf16_t* __restrict__ x, bf16_t* res, bf16_t* __restrict__ y, const float* __restrict__ w,
    int H, float eps, int has_res)
{
    pdl_enter();
    __shared__ float s8[RMS_MAX_VEC];  // sumsq8 of each 8-column vector
    __shared__ float s_scale;
    const long long row = blockIdx.x;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * H);
    uint4* rr = reinterpret_cast<uint4*>(res + row * H);
    uint4* yr = reinterpret_cast<uint4*>(y + row * H);
    const int nvec = H >> 3;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        float a[8];
        unpack8(xr[i], a);
        if (has_res) {
            float b[8];
            unpack8(rr[i], b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] = bf2f(f2bf(a[e] + b[e]));  // the residual stream is bf16
            rr[i] = pack8(a);
        }
        s8[i] = sumsq8(a);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const float ss = row_sumsq<RMS_MAX_VEC / 2>([&](int j) { return s8[2 * j] + s8[2 * j + 1]; }, H >> 4);
        if (threadIdx.x == 0) s_scale = rms_scale(ss, H, eps);
    }
    __syncthreads();
    const float scale = s_scale;
    const uint4* src = has_res ? rr : xr;  // this thread re-reads only what it wrote itself
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        float a[8];
        unpack8(src[i], a);
        rms_apply8(a, scale, __ldg(reinterpret_cast<const float4*>(w) + 2 * i),
                   __ldg(reinterpret_cast<const float4*>(w) + 2 * i + 1));
        yr[i] = pack8(a);
    }
}

// A row per dv/8 lanes (dv in 32, 64, 128, 256: a power of two lanes), a 16-byte vector of o, z and y each.
// o, y: [rows = T*nh, dv] contiguous; z: row stride zs (a column view of the fused projection; zs % 8 == 0
// and a 16-byte aligned base); w: f32 [dv], the plain weight.
extern "C" __global__ void __launch_bounds__(128) gated_rms_norm_kernel(
    const bf16_t* __restrict__ o, const bf16_t* __restrict__ z, long long zs, bf16_t* __restrict__ y,
    const float* __restrict__ w, int rows, int nh, int dv, float eps)
{
    pdl_enter();
    const int lpr = dv >> 3, gid = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = gid / lpr, c = (gid - row * lpr) * 8;
    float a[8] = {};
    float ss = 0.0f;
    if (row < rows) {
        unpack8(*reinterpret_cast<const uint4*>(o + (long long)row * dv + c), a);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += a[e] * a[e];
    }
    for (int m = lpr >> 1; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);  // within the row's lanes
    if (row >= rows) return;
    const float scale = rsqrtf(ss / (float)dv + eps);
    const long long t = row / nh, h = row - t * nh;
    float zz[8];
    unpack8(*reinterpret_cast<const uint4*>(z + t * zs + h * dv + c), zz);
    const float4 w0 = *reinterpret_cast<const float4*>(w + c), w1 = *reinterpret_cast<const float4*>(w + c + 4);
    const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = a[e] * scale * wv[e] * silu_f(zz[e]);
    *reinterpret_cast<uint4*>(y + (long long)row * dv + c) = pack8(a);
}
