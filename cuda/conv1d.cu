// Causal depthwise conv1d (kernel K) + SiLU over varlen sequences, continuing from and updating each
// slot's conv state: the last K-1 pre-conv inputs (spec §4.2). Decode is the T=1 case of the same code.
// A step of decodes and verifies only (no prefill, so no snapshot saves): conv1d_fwd writes the new state
// and a verify's per-token states itself (update = 1, below). Otherwise two launches: conv1d_fwd reads the
// old state, then conv1d_state_update writes the new one.
// Speculative verifies (spec_logs[b] >= 0, more than one token; gdn.cu's rollback by replay): a verify writes
// the state after each of its tokens to its log set's rows (set * K1 + t) and leaves the slot as it was; the
// sequence's next step reads its old state from the row of the last token the verify committed
// (replay[b] = a + 1: row set * K1 + a) instead of the slot.
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
// A sequence's old state: [K-1][C] in the slot, or in a log row (replay: the last verify's committed token)
template <int K>
__device__ __forceinline__ const bf16_t* conv_old(const bf16_t* state, const bf16_t* log, const int* slots,
                                                  const int* spec_logs, const int* replay, int K1, int b, int C) {
    const int set = spec_logs[b], r = set >= 0 ? replay[b] : 0;
    const long long row = r ? (long long)set * K1 + r - 1 : (long long)slots[b];
    return (r ? log : state) + row * (K - 1) * C;
}

template <int K>
__device__ __forceinline__ void conv_window(float (&win)[K][8], const bf16_t* x, long long sx, const bf16_t* old,
                                            int start, int i, int C, int c) {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {  // the K-1 inputs before token i: concat(old, x_seq)[i .. i+K-2]
        const int m = i + j;
        const bf16_t* p = m < K - 1 ? old + (long long)m * C + c : x + (long long)(start + m - (K - 1)) * sx + c;
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
// tokens share a block: once all of them have read their window (which may be in the log row they rewrite)
// the last one writes the slot's new state, or (a verify) each the state after it into its log row.
template <int K>
__global__ void __launch_bounds__(CONV_THREADS) conv1d_fwd(
    const bf16_t* __restrict__ x, long long sx, const bf16_t* __restrict__ w, bf16_t* state,
    bf16_t* __restrict__ out, const int* __restrict__ tok_seq, const int* __restrict__ cu,
    const int* __restrict__ slots, const int* __restrict__ spec_logs, const int* __restrict__ replay, bf16_t* log,
    int K1, int T, int C, int TT, int update)
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
            conv_window<K>(win, x, sx, conv_old<K>(state, log, slots, spec_logs, replay, K1, b, C), start, i, C, c);
            conv_token<K>(win, wv, *reinterpret_cast<const uint4*>(x + (long long)(start + i) * sx + c),
                          out + (long long)(start + i) * C + c);
        }
        __syncthreads();  // every token of the sequence has read the slot's old state
        if (on) {
            if (spec_logs[b] >= 0 && n > 1) conv_put<K>(win, log, (long long)spec_logs[b] * K1 + i, C, c);
            else if (i == n - 1) conv_put<K>(win, state, slots[b], C, c);
        }
        return;
    }
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (c >= C) return;
    const int t0 = blockIdx.y * TT, t1 = min(T, t0 + TT);
    conv_weights<K>(wv, w, c);
    const int b0 = tok_seq[t0];
    conv_window<K>(win, x, sx, conv_old<K>(state, log, slots, spec_logs, replay, K1, b0, C), cu[b0], t0 - cu[b0], C, c);
    if (b0 == tok_seq[t1 - 1]) {  // the tile lies in one sequence (the usual case): rows CONV_BATCH at a time,
        // the next group's loads issued before this group's tokens, so the loads stay in flight during the math
        uint4 xr[CONV_BATCH], xn[CONV_BATCH];
#pragma unroll
        for (int u = 0; u < CONV_BATCH; ++u)
            if (t0 + u < t1) xr[u] = *reinterpret_cast<const uint4*>(x + (long long)(t0 + u) * sx + c);
        for (int tg = t0; tg < t1; tg += CONV_BATCH) {
#pragma unroll
            for (int u = 0; u < CONV_BATCH; ++u)
                if (tg + CONV_BATCH + u < t1) xn[u] = *reinterpret_cast<const uint4*>(x + (long long)(tg + CONV_BATCH + u) * sx + c);
#pragma unroll
            for (int u = 0; u < CONV_BATCH; ++u)
                if (tg + u < t1) conv_token<K>(win, wv, xr[u], out + (long long)(tg + u) * C + c);
#pragma unroll
            for (int u = 0; u < CONV_BATCH; ++u) xr[u] = xn[u];
        }
    } else {
        for (int t = t0; t < t1; ++t) {
            const int b = tok_seq[t], start = cu[b];
            if (t > t0 && t == start)
                conv_window<K>(win, x, sx, conv_old<K>(state, log, slots, spec_logs, replay, K1, b, C), start, 0, C, c);
            conv_token<K>(win, wv, *reinterpret_cast<const uint4*>(x + (long long)t * sx + c), out + (long long)t * C + c);
        }
    }
}
// Explicit instances for the offline nvcc build (CI's compile and spill check); NVRTC instantiates each
// by name instead (engine/gpu/kernels.py INSTANCES, which tests/test_kernel_table.py holds equal).
#ifndef __CUDACC_RTC__
template __global__ void conv1d_fwd<2>(const bf16_t*, long long, const bf16_t*, bf16_t*, bf16_t*, const int*,
                                       const int*, const int*, const int*, const int*, bf16_t*, int, int, int, int, int);
template __global__ void conv1d_fwd<3>(const bf16_t*, long long, const bf16_t*, bf16_t*, bf16_t*, const int*,
                                       const int*, const int*, const int*, const int*, bf16_t*, int, int, int, int, int);
template __global__ void conv1d_fwd<4>(const bf16_t*, long long, const bf16_t*, bf16_t*, bf16_t*, const int*,
                                       const int*, const int*, const int*, const int*, bf16_t*, int, int, int, int, int);
#endif

// New state = the last K-1 rows of concat(old state, x_seq), old state from conv_old (the slot, or a log row).
// Each thread owns one (sequence, channel) and reads the old state before writing, so the update is in place
// without races. A speculative verify (spec_logs[b] >= 0, n > 1) writes the state after each of its tokens to
// its log rows instead of the slot (conv1d_fwd's update = 1 does the same).
extern "C" __global__ void conv1d_state_update(const bf16_t* __restrict__ x, long long sx, bf16_t* state,
                                               const int* __restrict__ cu, const int* __restrict__ slots,
                                               const int* __restrict__ save_at, const int* __restrict__ save_rows,
                                               const int* __restrict__ spec_logs, const int* __restrict__ replay,
                                               bf16_t* log, int K1, int C, int K)
{
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int b = blockIdx.y;
    const int start = cu[b], n = cu[b + 1] - cu[b];
    const int set = spec_logs[b], r0 = set >= 0 ? replay[b] : 0;
    const bf16_t* src = r0 ? log + ((long long)set * K1 + r0 - 1) * (K - 1) * C : state + (long long)slots[b] * (K - 1) * C;
    bf16_t old[MAXK - 1];
#pragma unroll
    for (int j = 0; j < MAXK - 1; ++j)
        if (j < K - 1) old[j] = src[(long long)j * C + c];
    // concat(old, x_seq)[m]
    auto at = [&](int m) {
        bf16_t v = m < K - 1 ? bf16_t{} : x[(long long)(start + m - (K - 1)) * sx + c];
#pragma unroll
        for (int j = 0; j < MAXK - 1; ++j)
            if (j < K - 1 && j == m) v = old[j];
        return v;
    };
    const int r = save_at[b];  // prefix caching: also the state after r new tokens (r >= 64 > K - 1), to a snapshot row
    if (r > 0)
        for (int j = 0; j < K - 1; ++j)
            state[((long long)save_rows[b] * (K - 1) + j) * C + c] = x[(long long)(start + r - (K - 1) + j) * sx + c];
    if (set >= 0 && n > 1) {  // after token t: concat(old, x_seq)[t+1 .. t+K-1]
        for (int t = 0; t < n; ++t)
            for (int j = 0; j < K - 1; ++j)
                log[(((long long)set * K1 + t) * (K - 1) + j) * C + c] = at(t + 1 + j);
        return;
    }
    for (int j = 0; j < K - 1; ++j) state[((long long)slots[b] * (K - 1) + j) * C + c] = at(n + j);
}
