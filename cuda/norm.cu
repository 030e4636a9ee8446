// RMSNorm (1 + w) fused with the residual add (spec §6), and the GDN gated RMSNorm (plain w x silu(z), §4.8).
#include "common.cuh"

// One block per row. x, res, y: [rows, H] contiguous bf16, H % 8 == 0; w: f32 [H].
// has_res: res = bf16(res + x), then y = norm(res); else y = norm(x) (the first layer: residual = x).
extern "C" __global__ void __launch_bounds__(256) add_rms_norm_kernel(
    const bf16_t* __restrict__ x, bf16_t* res, bf16_t* __restrict__ y, const float* __restrict__ w,
    int H, float eps, int has_res)
{
    pdl_enter();
    __shared__ float red[33];
    const long long row = blockIdx.x;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * H);
    uint4* rr = reinterpret_cast<uint4*>(res + row * H);
    uint4* yr = reinterpret_cast<uint4*>(y + row * H);
    const int nvec = H >> 3;
    float ss = 0.0f;
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
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += a[e] * a[e];
    }
    const float scale = rsqrtf(block_sum(ss, red) / (float)H + eps);
    const uint4* src = has_res ? rr : xr;  // this thread re-reads only what it wrote itself
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        float a[8];
        unpack8(src[i], a);
        const float4 w0 = reinterpret_cast<const float4*>(w)[2 * i];
        const float4 w1 = reinterpret_cast<const float4*>(w)[2 * i + 1];
        a[0] *= scale * (1.0f + w0.x); a[1] *= scale * (1.0f + w0.y);
        a[2] *= scale * (1.0f + w0.z); a[3] *= scale * (1.0f + w0.w);
        a[4] *= scale * (1.0f + w1.x); a[5] *= scale * (1.0f + w1.y);
        a[6] *= scale * (1.0f + w1.z); a[7] *= scale * (1.0f + w1.w);
        yr[i] = pack8(a);
    }
}

// One warp per (token, value head) row of dv <= 256. o, y: [T, nh*dv] contiguous; z: row stride zs
// (a column view of the fused projection); w: f32 [dv], the plain weight.
extern "C" __global__ void __launch_bounds__(128) gated_rms_norm_kernel(
    const bf16_t* __restrict__ o, const bf16_t* __restrict__ z, long long zs, bf16_t* __restrict__ y,
    const float* __restrict__ w, int rows, int nh, int dv, float eps)
{
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const long long t = row / nh, h = row % nh;
    const bf16_t* orow = o + row * (long long)dv;
    const bf16_t* zrow = z + t * zs + h * dv;
    bf16_t* yrow = y + row * (long long)dv;
    float v[8];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int i = lane + 32 * k;
        v[k] = i < dv ? bf2f(orow[i]) : 0.0f;
        ss += v[k] * v[k];
    }
    const float scale = rsqrtf(warp_sum(ss) / (float)dv + eps);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int i = lane + 32 * k;
        if (i < dv) yrow[i] = f2bf(v[k] * scale * w[i] * silu_f(bf2f(zrow[i])));
    }
}
