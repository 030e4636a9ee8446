"""Which cuda/gemv.cu kernel a decode-sized GEMM runs, with how many blocks and warps (tuned on an H200
at the 4B shapes, graph-timed; docs/benchmarks/NOTES.md has the sweeps)."""
from __future__ import annotations

import functools

from .kernels import gemv_name

GEMV_MAX_M = 16  # linear() runs the tensor-core GEMV for 1 <= M <= this, cublasLt above
# batch_invariant: the GEMV (32- and 64-row variants) up to this many rows, gemm_inv above (same bits)
GEMV_MAX_M_INVARIANT = 64


def gemv_nw(N: int, K: int) -> int:
    """Warps per block of gemv_bf16, i.e. the K slices whose partial sums make up every output: a function
    of (N, K) only (see gemv_plan). gemm_inv takes the same number to reproduce gemv_bf16's results."""
    groups = -(-N // 16)
    return max(1, min(16, (K // 32) // 4, max(4, -(-2560 // groups))))


@functools.lru_cache(maxsize=None)
def gemv_plan(M: int, N: int, K: int, out: int) -> tuple[str, int, int, int]:
    """(kernel, blocks, warps per block, shared bytes). The warps per block NW (the K split, hence the
    summation order) depend on (N, K) only, never on M, so a row's result is the same in any batch of
    <= GEMV_MAX_M rows; the variant changes no result.
    NW: >= ~2560 warps in all (N = 2560 has only 160 row groups: 16 warps), >= 4 steps of 32 k each.
    Few row groups (NW >= 8) need every block resident at once (one wave): U = 2 at M <= 4 (2 blocks of
    16 warps per SM), else R = 2 (half the blocks). Many row groups: R = 1, U = 4 with the 256-byte L2
    prefetch (at M = 16 too: gate_up 37.4 -> 33.5 us, in_proj 24.1 -> 23.3 on an H100, against U = 2;
    tools/gemv_sweep.py, docs/benchmarks/session13-h100.md). out: kernels.GEMV_OUT."""
    nw = gemv_nw(N, K)
    if M > GEMV_MAX_M:  # batch-invariant decode buckets: x tiles of 32 or 64 rows (one W pass)
        v = (4, 1, 2, 0) if M <= 32 else (8, 1, 1, 0)
    elif nw >= 8:
        v = (1, 1, 2, 0) if M <= 4 else (1, 2, 2, 0) if M <= 8 else (2, 2, 2, 0)
    else:
        v = (1, 1, 4, 1) if M <= 8 else (2, 1, 4, 1)
    return gemv_launch(v, out, N, nw)


def gemv_launch(v: tuple[int, int, int, int], out: int, N: int, nw: int) -> tuple[str, int, int, int]:
    """(kernel, blocks, warps per block, shared bytes) of variant v = (MT, R, U, PF) with nw warps a block
    (the residual form keeps the block's new residual values beside the warps' partial sums)."""
    mt, r, u, pf = v
    tile = 16 * r * 8 * mt * 4
    return gemv_name(mt, r, u, pf, out), -(-N // (16 * r)), nw, nw * tile + (tile if out == 3 else 0)
