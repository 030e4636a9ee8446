"""The small-M tensor-core GEMV path of CudaBackend.linear() (cuda/gemv.cu) against NumPy.

Weights are drawn on the GPU as bf16 bits (the 4B lm_head is 1.27 GB); the reference is the NumPy
f32 product of the same bf16 values, over a random subset of output features (plus the last ones, where
the kernel clamps a partial 16-row group). Every output is poisoned first (CudaBackend(poison=True)) and
must be finite everywhere. Also: strided and misaligned x views, the f32 logits output, M above the
threshold (cublasLt, the only case allowed to reach it), M-invariance bit for bit, CUDA-graph capture;
and the batch-invariant GEMM (gemm_inv, any M): right, and bit-identical to the GEMV row by row.
"""
import numpy as np
import pytest

from conftest import gpu_or_skip  # noqa: E402

cupy = gpu_or_skip()

import engine.gpu.backend as bc  # noqa: E402
from engine.gpu.backend import GEMV_MAX_M, LOGITS_ROWS, CudaBackend  # noqa: E402
from engine.arrays import bf16_to_f32  # noqa: E402

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2  # as tests/test_gpu_kernels.py: max|diff| / max|ref| for bf16 outputs
F32_TOL = 1e-3   # f32 logits: only the accumulation order differs from the reference
H, F, V = 2560, 9216, 248320
SHAPES = {  # name: (N, K) at the 4B config (fused projections as engine/model.py builds them)
    "in_proj": (12352, H), "gate_up": (2 * F, H), "down": (H, F), "qkv": (10240, H), "o_proj": (H, 4096),
    "lm_head": (V, H), "tiny": (96, 64), "ragged": (100, 200),  # ragged: N % 16 = 4, K % 32 = 8
    "ragged_k": (300, 1000),  # K % 32 = 8 over 7 K slices (gemv warps, gemm_inv folds)
}
MS = (1, 2, 3, 5, 8, 13, 16, GEMV_MAX_M + 1)
_W: dict = {}


@pytest.fixture(scope="module")
def be():
    return CudaBackend(poison=True)


def dev_bits(*shape, scale=1.0):
    """Random bf16 bits drawn on the GPU (round to nearest even)."""
    u = (cupy.random.standard_normal(shape, dtype=cupy.float32) * scale).view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)


def weight(name):
    """(device bits [N, K], checked rows, their f32 values on the host): one draw per shape."""
    if name not in _W:
        N, K = SHAPES[name]
        cupy.random.seed(N + K)
        w = dev_bits(N, K, scale=K ** -0.5)
        rows = np.arange(N) if N <= 2048 else np.unique(np.concatenate(
            [np.random.default_rng(N).choice(N, 1024, replace=False), np.arange(N - 24, N)]))
        _W[name] = (w, rows, bf16_to_f32(cupy.asnumpy(w[cupy.asarray(rows)])))
    return _W[name]


def rel(ours, want):
    assert ours.shape == want.shape, (ours.shape, want.shape)
    assert np.isfinite(ours).all(), "non-finite (unwritten?) output"
    return float(np.abs(ours - want).max() / max(np.abs(want).max(), 1e-30))


def check(be, x_dev, x_np, name):
    w, rows, w_np = weight(name)
    y = be.linear(x_dev, w)
    f32_out = w.shape[0] >= LOGITS_ROWS
    assert y.shape == (x_dev.shape[0], w.shape[0])
    assert y.dtype == (cupy.float32 if f32_out else cupy.uint16)
    full = be.to_host(y)
    assert np.isfinite(full).all(), "non-finite (unwritten?) output"
    assert rel(full[:, rows], x_np @ w_np.T) <= (F32_TOL if f32_out else BF16_TOL)
    return y


@pytest.fixture
def no_cublas(monkeypatch):
    """Fail if linear() falls back to cublasLt; yields the list of fallback calls when allowed."""
    calls = []

    def fake(*a, **k):
        calls.append(a[0].shape)
        if not calls_allowed[0]:
            raise AssertionError("linear() took the cublasLt path")
        return real(*a, **k)

    real, calls_allowed = bc.gemm, [False]
    monkeypatch.setattr(bc, "gemm", fake)
    return calls, calls_allowed


def rnd_x(seed, M, K):
    cupy.random.seed(seed)
    x = dev_bits(M, K)
    return x, bf16_to_f32(cupy.asnumpy(x))


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_linear_gemv(be, no_cublas, name, M):
    calls, allowed = no_cublas
    allowed[0] = M > GEMV_MAX_M
    x, x_np = rnd_x(1000 * M + SHAPES[name][0], M, SHAPES[name][1])
    check(be, x, x_np, name)
    assert len(calls) == (1 if M > GEMV_MAX_M else 0)


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("name", ["in_proj", "down", "tiny", "ragged"])
def test_linear_gemv_strided(be, no_cublas, name, M):
    """x as a column view of a wider buffer (as fused projection outputs are): a row stride that is a
    multiple of 8 elements and a 16-byte aligned start are read in place; an 8-byte misaligned start or a
    row stride of K + 4 are copied first. All stay on the GEMV path."""
    K = SHAPES[name][1]
    cupy.random.seed(7 * M + K)
    buf = dev_bits(M, K + 40)
    for view in (buf[:, 16:16 + K], buf[:, 4:4 + K], dev_bits(M, K + 4)[:, :K]):
        check(be, view, bf16_to_f32(cupy.asnumpy(view)), name)
    assert not no_cublas[0]


@pytest.mark.parametrize("name", ["in_proj", "gate_up", "down", "o_proj", "lm_head", "ragged"])
def test_gemv_m_invariant(be, no_cublas, name):
    """A row's result does not depend on the batch it is in (every M <= GEMV_MAX_M), bit for bit."""
    K = SHAPES[name][1]
    w = weight(name)[0]
    x, _ = rnd_x(K + 3, GEMV_MAX_M, K)
    alone = [be.linear(x[i:i + 1], w) for i in range(GEMV_MAX_M)]
    bits = (lambda a: cupy.asnumpy(a.view(cupy.uint32))) if alone[0].dtype == cupy.float32 else cupy.asnumpy
    for M in (2, 3, 8, 9, 13, 16):
        y = bits(be.linear(x[:M], w))
        for i in range(M):
            assert np.array_equal(y[i], bits(alone[i])[0]), (M, i)
    y8 = bits(be.linear(x[:8], w))
    assert np.array_equal(bits(alone[0])[0], y8[0])


def test_gemv_graph_capture(be, no_cublas):
    """linear() captured into a CUDA graph (output allocated from the pool during capture) replays the
    eager result bit for bit."""
    w = weight("in_proj")[0]
    x, _ = rnd_x(11, 4, H)
    want = cupy.asnumpy(be.linear(x, w))
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        y = be.linear(x, w)  # warm: the pool caches the output block on this stream
        del y
        s.synchronize()
        s.begin_capture()
        y = be.linear(x, w)
        g = s.end_capture()
        y.fill(0)
        g.launch(s)
        s.synchronize()
    assert np.array_equal(cupy.asnumpy(y), want)


@pytest.fixture(scope="module")
def be_inv():
    return CudaBackend(poison=True, batch_invariant=True)


@pytest.mark.parametrize("M", [GEMV_MAX_M + 1, 33, 64, 100, 257])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemm_inv_matches_reference(be_inv, no_cublas, name, M):
    """batch_invariant: M > GEMV_MAX_M runs the 32/64-row GEMV variants up to 64 rows, gemm_inv above (never
    cublasLt); right against NumPy, every output written (poisoned first), partial tiles in M, N and K."""
    x, x_np = rnd_x(77 * M + SHAPES[name][0], M, SHAPES[name][1])
    check(be_inv, x, x_np, name)
    assert not no_cublas[0]


@pytest.mark.parametrize("name", list(SHAPES))
def test_gemm_inv_rows_equal_gemv_rows(be_inv, no_cublas, name):
    """The batch-invariant contract: a row's bits are the same in any batch, gemv_bf16 (M <= 64 in this mode)
    and gemm_inv (any larger M) alike; x as a column view of a wider buffer (as fused projections are) too."""
    K = SHAPES[name][1]
    w = weight(name)[0]
    cupy.random.seed(K + 5)
    buf = dev_bits(300, K + 24)
    x = buf[:, 16:16 + K]
    bits = (lambda a: cupy.asnumpy(a.view(cupy.uint32))) if w.shape[0] >= LOGITS_ROWS else cupy.asnumpy
    big = bits(be_inv.linear(x, w))
    for lo, hi in ((0, 1), (5, 21), (37, 38), (290, 300)):
        part = bits(be_inv.linear(x[lo:hi], w))
        assert np.array_equal(part, big[lo:hi]), (lo, hi)
    for M in (17, 32, 33, 64, 65, 129):
        assert np.array_equal(bits(be_inv.linear(x[200:200 + M], w)), big[200:200 + M]), M
    assert not no_cublas[0]


@pytest.mark.parametrize("M", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("producer", ["down", "o_proj", "tiny"])
def test_fused_norm(be, no_cublas, producer, M):
    """linear_add_rms_norm: up to GEMV_FUSED_NORM_MAX_M rows one GEMV adds its output into the residual and
    its last block normalizes the rows (gemv.cu OUT = 3); above, the GEMV then add_rms_norm. Either way the
    same bits as the two ops, residual and normalized rows; and the block counter is left at zero."""
    if producer == "tiny":  # the tiny preset's widths: hidden 128
        cupy.random.seed(M)
        Hp, wp = 128, dev_bits(128, 256, scale=256 ** -0.5)
    else:
        Hp, wp = H, weight(producer)[0]
    cupy.random.seed(1000 + M)
    x, res = dev_bits(M, wp.shape[1]), dev_bits(M, Hp, scale=3.0)
    w = cupy.random.standard_normal(Hp, dtype=cupy.float32) * 0.1
    for _ in range(2):  # twice: the second call finds the counter the first left
        h1, r1 = be.add_rms_norm(be.linear(x, wp), res.copy(), w, 1e-6)
        h2, r2 = be.linear_add_rms_norm(x, wp, res.copy(), w, 1e-6)
        assert np.array_equal(cupy.asnumpy(r1), cupy.asnumpy(r2))
        assert np.array_equal(cupy.asnumpy(h1), cupy.asnumpy(h2))
        assert int(be._gemv_count[0]) == 0
    assert not no_cublas[0]
