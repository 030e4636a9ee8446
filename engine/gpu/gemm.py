"""bf16 GEMM through cublasLt, called with ctypes: y[T, out] = x[T, in] @ w[out, in]^T.

f32 accumulation (CUBLAS_COMPUTE_32F), bf16 inputs and output. Row-major operands are passed to the
column-major library as their transposes: Y^T[out, T] = W[out, in] (op T on the [in, out] col-major
view) x X^T. One algorithm is chosen per (M, N, K, strides) and cached with its descriptors: cublasLt's
heuristic's first, except for decode-sized M (TUNE_M: the decode graphs' buckets above the GEMV), where
its TUNE_CANDIDATES best guesses are timed on the call's own operands at first use (an eager warm-up
forward, never inside a graph capture) and the fastest kept. The workspace is preallocated once, and
every call runs on CuPy's current stream, so the GEMM can be captured into a CUDA graph.
"""
from __future__ import annotations

import ctypes
import glob
import os
import site
import sys

import cupy

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20
TUNE_M = (17, 256)  # M range whose algorithm is chosen by timing
TUNE_CANDIDATES = 8


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _candidate_dirs() -> list[str]:
    dirs = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            dirs += [os.path.join(os.environ[var], "lib64"), os.path.join(os.environ[var], "lib")]
    dirs += ["/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/lib/x86_64-linux-gnu"]
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:
        pass
    for r in roots:
        if r:
            dirs += [os.path.join(r, "nvidia", "cublas", "lib"), os.path.join(r, "nvidia", "cu13", "lib"),
                     os.path.join(r, "cupy", ".data", "lib")]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def load_cublaslt() -> ctypes.CDLL:
    """Find libcublasLt: already-loaded/ld.so names first, then the toolkit and the nvidia-cublas wheel."""
    tried = []
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            tried.append(name)
    dirs = _candidate_dirs()
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "libcublasLt.so*")), reverse=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                tried.append(path)
    raise RuntimeError("libcublasLt not found: tried the names " + ", ".join(tried[:3]) +
                       " and the directories " + ", ".join(dirs) +
                       " (install the CUDA toolkit or the nvidia-cublas wheel, or set CUDA_PATH)")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cublasLt {what} failed with status {status}")


class _Plan:
    """Descriptors and the chosen algorithm for one GEMM shape."""

    def __init__(self, g: "Gemm", M: int, N: int, K: int, ldx: int, ldw: int, f32_out: bool = False,
                 n_algos: int = 1):
        lib, vp = g.lib, ctypes.c_void_p
        self.desc, self.a, self.b, self.c = vp(), vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.addressof(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate")
        ta, tb = ctypes.c_int32(CUBLAS_OP_T), ctypes.c_int32(CUBLAS_OP_N)
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, ctypes.addressof(ta), 4), "set TRANSA")
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSB, ctypes.addressof(tb), 4), "set TRANSB")
        # A = W as col-major [K, N] (ld ldw), op T; B = X as col-major [K, M] (ld ldx); C = D = Y^T [N, M].
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.addressof(self.a), CUDA_R_16BF, u64(K), u64(N), i64(ldw)), "layout A")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.addressof(self.b), CUDA_R_16BF, u64(K), u64(M), i64(ldx)), "layout B")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.addressof(self.c), CUDA_R_32F if f32_out else CUDA_R_16BF, u64(N), u64(M),
                                              i64(N)), "layout C")
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.addressof(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.addressof(ws), 8),
               "set max workspace")
        res, n = (_HeuristicResult * n_algos)(), ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(g.handle, self.desc, self.a, self.b, self.c, self.c, pref, n_algos,
                                                  ctypes.addressof(res), ctypes.addressof(n)), "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        self.candidates = [r for r in res[:n.value] if r.state == 0]
        if not self.candidates:
            raise RuntimeError(f"cublasLt found no algorithm for bf16 GEMM M={M} N={N} K={K}")
        self.choose(0)

    def choose(self, i: int) -> None:
        self.algo = self.candidates[i].algo
        self.algo_ptr = ctypes.addressof(self.algo)
        self.ws_size = self.candidates[i].workspaceSize


def _declare(lib) -> None:
    vp, sz, i32, i64, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
    sigs = {
        "cublasLtCreate": [vp],
        "cublasLtMatmulDescCreate": [vp, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, vp],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int


class Gemm:
    def __init__(self):
        self.lib = load_cublaslt()
        _declare(self.lib)
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.addressof(self.handle)), "Create")
        self.workspace = cupy.empty(WORKSPACE_BYTES, cupy.uint8)
        self.plans: dict[tuple, _Plan] = {}
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)
        # the addresses every call passes, taken once: an eager prefill makes ~130 of these calls, ~19 us of
        # host each (~8 of them inside cublasLtMatmul)
        self.alpha_ptr, self.beta_ptr = ctypes.addressof(self.alpha), ctypes.addressof(self.beta)
        self.ws_ptr = self.workspace.data.ptr

    def __call__(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None,
                 f32_out: bool = False) -> cupy.ndarray:
        """x [M, K] bf16 (uint16 bits), row stride may exceed K; w [N, K] bf16 contiguous -> [M, N] bf16
        (or f32 with f32_out, e.g. for logits)."""
        M, K = x.shape
        N, Kw = w.shape
        assert Kw == K and x.dtype == cupy.uint16 and w.dtype == cupy.uint16, (x.shape, w.shape, x.dtype)
        sx = x.strides
        if sx[1] != 2 or (sx[0] // 2) % 8:
            x = cupy.ascontiguousarray(x)
            sx = x.strides
        if not w.flags.c_contiguous:
            raise ValueError("gemm: weight must be contiguous")
        ldx = sx[0] // 2 if M > 1 else K
        if out is None:
            out = cupy.empty((M, N), cupy.float32 if f32_out else cupy.uint16)
        else:
            assert out.dtype == (cupy.float32 if f32_out else cupy.uint16) and out.flags.c_contiguous
        if M == 0:
            return out
        stream = cupy.cuda.get_current_stream()
        key = (M, N, K, ldx, f32_out)
        plan = self.plans.get(key)
        if plan is None:
            tune = TUNE_M[0] <= M <= TUNE_M[1] and not stream.is_capturing()
            plan = _Plan(self, M, N, K, ldx, K, f32_out, TUNE_CANDIDATES if tune else 1)
            if tune and len(plan.candidates) > 1:
                self._tune(plan, x, w, out, stream)
            self.plans[key] = plan
        self._run(plan, x, w, out, stream.ptr)
        return out

    def _run(self, plan: _Plan, x, w, out, stream: int) -> None:
        y = out.data.ptr
        _check(self.lib.cublasLtMatmul(self.handle, plan.desc, self.alpha_ptr, w.data.ptr, plan.a, x.data.ptr, plan.b,
                                       self.beta_ptr, y, plan.c, y, plan.c, plan.algo_ptr, self.ws_ptr, plan.ws_size,
                                       stream), "Matmul")

    def _tune(self, plan: _Plan, x, w, out, stream, reps: int = 5) -> None:
        """Keep the plan's fastest candidate: each timed over `reps` back-to-back calls (after one warm call)
        between two events; the candidates take turns twice, the better time counts."""
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        best = [float("inf")] * len(plan.candidates)
        for _ in range(2):
            for i in range(len(plan.candidates)):
                plan.choose(i)
                self._run(plan, x, w, out, stream.ptr)
                start.record(stream)
                for _ in range(reps):
                    self._run(plan, x, w, out, stream.ptr)
                end.record(stream)
                end.synchronize()
                best[i] = min(best[i], cupy.cuda.get_elapsed_time(start, end))
        plan.choose(min(range(len(best)), key=best.__getitem__))


_GEMM: Gemm | None = None


def get_gemm() -> Gemm:
    """The process's cublasLt handle and workspace (created on first use)."""
    global _GEMM
    if _GEMM is None:
        _GEMM = Gemm()
    return _GEMM


def gemm(x, w, out=None, f32_out=False):
    return get_gemm()(x, w, out, f32_out)
