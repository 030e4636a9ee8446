// Causal depthwise conv1d (kernel K) + SiLU over varlen sequences, continuing from and updating each
// slot's conv state: the last K-1 pre-conv inputs (spec §4.2). Decode is the T=1 case of the same code.
// Two launches: conv1d_fwd reads the old state, then conv1d_state_update writes the new one.
#include "common.cuh"

#define MAXK 8

// x: [T, C] with row stride sx (a column view); w: bf16 [C, K]; state: bf16 [slots, K-1, C];
// out: [T, C] contiguous. tok_seq[t]: sequence of token t; cu: [B+1]; slots: [B].
extern "C" __global__ void conv1d_fwd(const bf16_t* __restrict__ x, long long sx, const bf16_t* __restrict__ w,
                                      const bf16_t* __restrict__ state, bf16_t* __restrict__ out,
                                      const int* __restrict__ tok_seq, const int* __restrict__ cu,
                                      const int* __restrict__ slots, int C, int K)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int t = blockIdx.y;
    const int b = tok_seq[t];
    const int start = cu[b];
    const int i = t - start;  // index within the sequence's new tokens
    const long long slot = slots[b];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXK; ++j) {
        if (j < K) {
            const int m = i + j;  // index into concat(state[K-1], x_seq)
            const float xv = m < K - 1 ? bf2f(state[(slot * (K - 1) + m) * C + c])
                                       : bf2f(x[(long long)(start + m - (K - 1)) * sx + c]);
            acc += bf2f(w[(long long)c * K + j]) * xv;
        }
    }
    out[(long long)t * C + c] = f2bf(silu_f(acc));
}

// New state = the last K-1 rows of concat(old state, x_seq). Each thread owns one (sequence, channel)
// and reads everything before writing, so the update is in place without races.
extern "C" __global__ void conv1d_state_update(const bf16_t* __restrict__ x, long long sx, bf16_t* state,
                                               const int* __restrict__ cu, const int* __restrict__ slots, int C, int K)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int b = blockIdx.y;
    const int start = cu[b], n = cu[b + 1] - cu[b];
    const long long slot = slots[b];
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
