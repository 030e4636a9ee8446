// Causal depthwise conv1d (kernel K) + SiLU over varlen sequences, continuing from and updating each
// slot's conv state: the last K-1 pre-conv inputs (spec §4.2). Decode is the T=1 case of the same code.
// A step of decodes and verifies only (no prefill, so no snapshot saves): conv1d_fwd writes the new state
// and a verify's per-token states itself (update = 1, below). Otherwise two launches: conv1d_fwd reads the
// old state, then conv1d_state_update writes the new one.
// Kernel sizes 2..4 (Qwen3.5 uses 4) are instantiated.
#include "common.cuh"

#define MAXK 8
#define CONV_BATCH 4  // x rows a prefill thread loads at once (within one sequence)
#define CONV_THREADS 128  // conv1d_fwd's block, 8 channels a thread (the launcher reads it)

// x: [T, C] with row stride sx (a column view; sx % 8 == 0 and a 16-byte aligned base: the host copies
// other views); w: bf16 [C, K]; state: bf16 [slots, K-1, C]; out: [T, C] contiguous. tok_seq[t]: sequence
// of token t; cu: [B+1]; slots: [B]. C % 8 == 0.
// A thread owns 8 channels (16-byte loads and stores) of up to TT consecutive tokens (grid.y = the token
// tiles): it slides the K-1 previous inputs along in registers, so each x row is read once (CONV_BATCH
// rows loaded together where the tile lies in one sequence), and reloads
// them (from the slot's state or x) at the tile's first token and where a new sequence starts (prefill:
// TT = 16). Each output sums w_j * x_j for j = 0 .. K-1 in order.
template <int K>
__device__ __forceinline__ void conv_window(float (&win)[K][8], const bf16_t* x, long long sx, const bf16_t* state,
                                            long long slot, int start, int i, int C, int c) {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {  // the K-1 inputs before token i: concat(state, x_seq)[i .. i+K-2]
        const int m = i + j;
        const bf16_t* p = m < K - 1 ? state + (slot * (K - 1) + m) * C + c : x + (long long)(start + m - (K - 1)) * sx + c;
        unpack8(*reinterpret_cast<const uint4*>(p), win[j]);
    }
}

// one token: its input row xr into the window, out = silu(sum_j w_j x_j), the window slid on
template <int K>
__device__ __forceinline__ void conv_token(float (&win)[K][8], const float (&wv)[K][8], uint4 xr, bf16_t* out) {
    unpack8(xr, win[K - 1]);
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < K; ++j) acc += wv[j][e] * win[j][e];
        o[e] = silu_f(acc);
    }
    *reinterpret_cast<uint4*>(out) = pack8(o);
#pragma unroll
    for (int j = 0; j < K - 1; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) win[j][e] = win[j + 1][e];
}

// w[c .. c+7][0 .. K-1] (contiguous) as [tap][channel]
template <int K>
__device__ __forceinline__ void conv_weights(float (&wv)[K][8], const bf16_t* w, int c) {
    bf16_t wr[8 * K];
#pragma unroll
    for (int q = 0; q < K; ++q) *reinterpret_cast<uint4*>(wr + 8 * q) = *reinterpret_cast<const uint4*>(w + (long long)c * K + 8 * q);
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
        for (int j = 0; j < K; ++j) wv[j][e] = bf2f(wr[e * K + j]);
}

// the window slid past a token is the state after it (its K-1 inputs, exact bf16): into cache row `row`
template <int K>
__device__ __forceinline__ void conv_put(const float (&win)[K][8], bf16_t* state, long long row, int C, int c) {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) *reinterpret_cast<uint4*>(state + (row * (K - 1) + j) * C + c) = pack8(win[j]);
}

// update = 0: grid (ceil(C / (8 * CONV_THREADS)), ceil(T / TT)), a thread 8 channels of TT consecutive tokens.
// update = 1 (decodes and verifies only): grid (ceil(C / (8 * CONV_THREADS / TT)), B), TT a power of two >= every
// sequence's token count; thread i takes token i % TT of sequence blockIdx.y (8 channels), so a sequence's
// tokens share a block: once all of them have read their window the last one writes the slot's new state,
// the others (a verify's) the state after them into rows spec_rows[b] + i.
template <int K>
__global__ void __launch_bounds__(CONV_THREADS) conv1d_fwd(
    const bf16_t* __restrict__ x, long long sx, const bf16_t* __restrict__ w, bf16_t* __restrict__ state,
    bf16_t* __restrict__ out, const int* __restrict__ tok_seq, const int* __restrict__ cu,
    const int* __restrict__ slots, const int* __restrict__ spec_rows, int T, int C, int TT, int update)
{
    pdl_enter();
    float wv[K][8];  // [tap][channel]
    float win[K][8];  // win[0 .. K-2]: the inputs before token t (oldest first); win[K-1]: token t
    if (update) {
        const int i = threadIdx.x % TT, c = (blockIdx.x * (blockDim.x / TT) + threadIdx.x / TT) * 8;
        const int b = blockIdx.y, start = cu[b], n = cu[b + 1] - start;
        const bool on = c < C && i < n;
        if (on) {
            conv_weights<K>(wv, w, c);
            conv_window<K>(win, x, sx, state, slots[b], start, i, C, c);
            conv_token<K>(win, wv, *reinterpret_cast<const uint4*>(x + (long long)(start + i) * sx + c),
                          out + (long long)(start + i) * C + c);
        }
        __syncthreads();  // every token of the sequence has read the slot's old state
        if (on) {
            if (i == n - 1) conv_put<K>(win, state, slots[b], C, c);
            else if (spec_rows[b] >= 0) conv_put<K>(win, state, (long long)spec_rows[b] + i, C, c);
        }
        return;
    }
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (c >= C) return;
    const int t0 = blockIdx.y * TT, t1 = min(T, t0 + TT);
    conv_weights<K>(wv, w, c);
    const int b0 = tok_seq[t0];
    conv_window<K>(win, x, sx, state, slots[b0], cu[b0], t0 - cu[b0], C, c);
    if (b0 == tok_seq[t1 - 1]) {  // the tile lies in one sequence (the usual case): rows CONV_BATCH at a time
        for (int tg = t0; tg < t1; tg += CONV_BATCH) {
            uint4 xr[CONV_BATCH];
#pragma unroll
            for (int u = 0; u < CONV_BATCH; ++u)
                if (tg + u < t1) xr[u] = *reinterpret_cast<const uint4*>(x + (long long)(tg + u) * sx + c);
#pragma unroll
            for (int u = 0; u < CONV_BATCH; ++u)
                if (tg + u < t1) conv_token<K>(win, wv, xr[u], out + (long long)(tg + u) * C + c);
        }
    } else {
        for (int t = t0; t < t1; ++t) {
            const int b = tok_seq[t], start = cu[b];
            if (t > t0 && t == start) conv_window<K>(win, x, sx, state, slots[b], start, 0, C, c);
            conv_token<K>(win, wv, *reinterpret_cast<const uint4*>(x + (long long)t * sx + c), out + (long long)t * C + c);
        }
    }
}
// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
template __global__ void conv1d_fwd<2>(const bf16_t*, long long, const bf16_t*, bf16_t*, bf16_t*, const int*,
                                       const int*, const int*, const int*, int, int, int, int);
template __global__ void conv1d_fwd<3>(const bf16_t*, long long, const bf16_t*, bf16_t*, bf16_t*, const int*,
                                       const int*, const int*, const int*, int, int, int, int);
template __global__ void conv1d_fwd<4>(const bf16_t*, long long, const bf16_t*, bf16_t*, bf16_t*, const int*,
                                       const int*, const int*, const int*, int, int, int, int);
#endif

// New state = the last K-1 rows of concat(old state, x_seq). Each thread owns one (sequence, channel)
// and reads everything before writing, so the update is in place without races. A speculative verify
// (spec_rows[b] >= 0) also keeps the state after each of its tokens but the last, in rows spec_rows[b] + t
// (gdn.cu's rollback rows: the same row holds that position's conv and recurrent state).
extern "C" __global__ void conv1d_state_update(const bf16_t* __restrict__ x, long long sx, bf16_t* state,
                                               const int* __restrict__ cu, const int* __restrict__ slots,
                                               const int* __restrict__ save_at, const int* __restrict__ save_rows,
                                               const int* __restrict__ spec_rows, int C, int K)
{
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int b = blockIdx.y;
    const int start = cu[b], n = cu[b + 1] - cu[b];
    const long long slot = slots[b];
    const int r = save_at[b];  // prefix caching: also the state after r new tokens (r >= 64 > K - 1), to a snapshot row
    if (r > 0)
        for (int j = 0; j < K - 1; ++j)
            state[((long long)save_rows[b] * (K - 1) + j) * C + c] = x[(long long)(start + r - (K - 1) + j) * sx + c];
    const int spec = spec_rows[b];
    if (spec >= 0)  // after token t: concat(old state, x_seq)[t+1 .. t+K-1]
        for (int t = 0; t + 1 < n; ++t)
            for (int j = 0; j < K - 1; ++j) {
                const int m = t + 1 + j;
                state[((long long)(spec + t) * (K - 1) + j) * C + c] =
                    m < K - 1 ? state[(slot * (K - 1) + m) * C + c] : x[(long long)(start + m - (K - 1)) * sx + c];
            }
    bf16_t v[MAXK];
#pragma unroll
    for (int j = 0; j < MAXK - 1; ++j) {
        if (j < K - 1) {
            const int m = n + j;
            v[j] = m < K - 1 ? state[(slot * (K - 1) + m) * C + c] : x[(long long)(start + m - (K - 1)) * sx + c];
        }
    }
#pragma unroll
    for (int j = 0; j < MAXK - 1; ++j)
        if (j < K - 1) state[(slot * (K - 1) + j) * C + c] = v[j];
}
