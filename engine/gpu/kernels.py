"""The CUDA kernels of cuda/*.cu: which template instances exist, how they are compiled and cached,
and the constants the launchers share with the sources.

- INSTANCES lists every template instance a launcher may ask for; `needed(cfg, batch_invariant)` the
  ones a model can launch. Each instance is its own NVRTC program (the .cu files' explicit
  instantiations are for the offline nvcc build and sit behind `#ifndef __CUDACC_RTC__`), so
  `prefetch()` compiles them in parallel threads (NVRTC releases the GIL) while the weights load.
  A file's `extern "C"` kernels come from one more program of that file.
- Constants the host needs (tile sizes, warps per block) are read from the sources' `#define`s
  (`define()`): written once, in the .cu file.
- Compiled cubins live in a cache directory, `QWEN35_KERNEL_CACHE` (default `~/.cache/qwen35/kernels`,
  or `$QWEN35_CACHE/kernels`), named by a hash of source, options, instance, GPU architecture and NVRTC
  version, with the instance's lowered (mangled) name beside it; a process loads them with
  `cupy.RawModule(path=...)`. `tools/build_kernels.py` fills such a directory without a GPU (a
  container image ships one); a read-only directory is used as it is, new cubins then go to a
  temporary one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..config import cache_root

log = logging.getLogger("qwen35.kernels")

# the sources: engine/gpu/cuda/ in an installed wheel (pyproject.toml ships cuda/ there as package
# data), else the source tree's cuda/ (a checkout, an editable install)
_WHEEL_CUDA_DIR = Path(__file__).resolve().parent / "cuda"
CUDA_DIR = _WHEEL_CUDA_DIR if _WHEEL_CUDA_DIR.is_dir() else Path(__file__).resolve().parents[2] / "cuda"
OPTIONS = ("-std=c++17",)

GDN_DK = (32, 64, 128)
GDN_WG_D = 128  # gdn_chunk_state_wg's dk = dv (its static_assert): every Qwen3.5 size
ATTN_HD = (64, 128, 256)
ATTN_G = (1, 2, 3, 4, 6, 8)
PREFILL_HD = (64, 128, 256)
# the compute capability built as sm_90a: attn_prefill is wgmma code (elsewhere prefill rows go to attn_fwd)
# and gdn_chunk_state shares its loads in thread-block clusters (elsewhere each block loads its own)
SM90A = "90"
# gdn_chunk_state's cluster sizes (compiled in): 2 pairs a head's state tiles on sm_90a. At 4, 30 clusters of
# its 227 KB blocks fit an H100 at once, not the 4B's 32 heads; 2 (66 fit) keeps a sequence in one wave.
GDN_CLUSTERS = (1, 2)
CONV_K = (2, 3, 4)
# gemv_bf16<MT, R, U, PF, OUT>: x tiles of 8 rows, 16-row W groups per warp, 32-k steps per load batch, L2
# 256-byte prefetch hint, output (0 bf16, 1 f32, 2 SwiGLU, 3 the residual add and RMSNorm after it); the last
# two variants serve only the batch-invariant decode buckets of 17..64 rows (OUT 0 and 1: the backend runs
# SwiGLU there as OUT = 0 + silu_mul, and the norms unfused)
GEMV_VARIANTS = ((1, 1, 4, 1), (2, 1, 4, 1), (1, 1, 2, 0), (1, 2, 2, 0), (2, 2, 2, 0), (4, 1, 2, 0), (8, 1, 1, 0))
GEMV_INVARIANT_ONLY = ((4, 1, 2, 0), (8, 1, 1, 0))


GEMV_OUT = {"bf16": 0, "f32": 1, "swiglu": 2, "residual": 3}


def gemv_name(mt: int, r: int, u: int, pf: int, out: int) -> str:
    return f"gemv_bf16<{mt}, {r}, {u}, {pf}, {out}>"


def _gemv_names(variants) -> list[str]:
    return [gemv_name(*v, o) for v in variants for o in (0, 1, 2, 3) if o < 2 or v not in GEMV_INVARIANT_ONLY]


INSTANCES = {
    "gdn.cu": ([f"{k}<{d}>" for k in ("gdn_recurrent", "gdn_chunk_prep") for d in GDN_DK]
               + [f"gdn_chunk_state<{d}, {c}>" for d in GDN_DK for c in GDN_CLUSTERS] + [f"gdn_chunk_state_wg<{GDN_WG_D}>"]),
    "attention.cu": [f"attn_fwd<{h}, {g}>" for h in ATTN_HD for g in ATTN_G],
    "attention_prefill.cu": [f"attn_prefill<{h}>" for h in PREFILL_HD],
    "gemv.cu": _gemv_names(GEMV_VARIANTS) + ["gemm_inv<0>", "gemm_inv<1>"],
    "conv1d.cu": [f"conv1d_fwd<{k}>" for k in CONV_K],
}


def source(file: str) -> str:
    """A .cu file with `#include "common.cuh"` inlined (the cache key then covers the header too)."""
    text = (CUDA_DIR / file).read_text()
    return re.sub(r'#include\s+"(\w+\.cuh)"', lambda m: (CUDA_DIR / m.group(1)).read_text(), text)


@functools.lru_cache(maxsize=None)
def define(file: str, name: str) -> int:
    """The integer value of `#define name value` in cuda/`file`."""
    m = re.search(rf"^#define\s+{name}\s+(\d+)\b", (CUDA_DIR / file).read_text(), re.M)
    if m is None:
        raise KeyError(f"cuda/{file} has no `#define {name} <integer>`")
    return int(m.group(1))


def has_extern_c(file: str) -> bool:
    return 'extern "C"' in (CUDA_DIR / file).read_text()


def needed(cfg, batch_invariant: bool) -> list[tuple[str, str | None]]:
    """(file, instance) of every program a model with these shapes can launch; None: the file's
    extern "C" kernels."""
    G = cfg.num_heads // cfg.num_kv_heads
    gemv = [v for v in GEMV_VARIANTS if batch_invariant or v not in GEMV_INVARIANT_ONLY]
    want = {
        "gdn.cu": ([f"{k}<{cfg.lin_k_dim}>" for k in ("gdn_recurrent", "gdn_chunk_prep")]
                   + [f"gdn_chunk_state<{cfg.lin_k_dim}, {c}>" for c in GDN_CLUSTERS]
                   + ([f"gdn_chunk_state_wg<{GDN_WG_D}>"] if cfg.lin_k_dim == cfg.lin_v_dim == GDN_WG_D else [])),
        "attention.cu": [f"attn_fwd<{cfg.head_dim}, {G}>"],
        "attention_prefill.cu": [f"attn_prefill<{cfg.head_dim}>"] if cfg.head_dim in PREFILL_HD else [],
        "gemv.cu": _gemv_names(gemv) + (["gemm_inv<0>", "gemm_inv<1>"]
                                                                       if batch_invariant else []),
        "conv1d.cu": [f"conv1d_fwd<{cfg.conv_kernel}>"],
    }
    out = [(f, None) for f in sorted(p.name for p in CUDA_DIR.glob("*.cu")) if has_extern_c(f)]
    for f, names in want.items():
        out += [(f, n) for n in names if n in INSTANCES[f]]  # shapes no kernel supports fail at launch, named
    return out


def every_program() -> list[tuple[str, str | None]]:
    out = [(f, None) for f in sorted(p.name for p in CUDA_DIR.glob("*.cu")) if has_extern_c(f)]
    return out + [(f, n) for f, names in INSTANCES.items() for n in names]


def cache_dir() -> Path:
    return Path(os.environ.get("QWEN35_KERNEL_CACHE") or cache_root() / "kernels")


# ---- compilation (NVRTC; no GPU needed) ------------------------------------------------------------
def target(arch: str) -> str:
    """NVRTC's -arch for compute capability `arch`: Hopper's feature set sm_90a (wgmma), which runs on
    exactly that compute capability, as each cubin here is built for the GPU it runs on."""
    return f"sm_{arch}a" if arch == "90" else f"sm_{arch}"


def _key(file: str, instance: str | None, arch: str, nvrtc_version) -> str:
    h = hashlib.sha256("\0".join([source(file), " ".join(OPTIONS), instance or "", target(arch),
                                  str(nvrtc_version)]).encode())
    return h.hexdigest()[:24]


def compile_program(file: str, instance: str | None, arch: str) -> tuple[bytes, str | None]:
    """(cubin, lowered name of the instance) for sm_`arch`."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source(file), file, [], [])
    try:
        if instance is not None:
            nvrtc.addNameExpression(prog, instance)
        try:
            nvrtc.compileProgram(prog, [*OPTIONS, f"-arch={target(arch)}"])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on cuda/{file} {instance or ''}: {e}\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog), nvrtc.getLoweredName(prog, instance) if instance is not None else None
    finally:
        nvrtc.destroyProgram(prog)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a concurrent reader sees all of it or nothing


def build(file: str, instance: str | None, arch: str, dirs: list[Path]) -> tuple[Path, str | None, bool]:
    """The cubin of one program: found in one of `dirs`, else compiled and written to the first
    writable one. Returns (path, lowered name, compiled now)."""
    from cupy_backends.cuda.libs import nvrtc
    key = _key(file, instance, arch, nvrtc.getVersion())
    stem = f"{Path(file).stem}-{key}"
    for d in dirs:
        cubin, meta = d / f"{stem}.cubin", d / f"{stem}.json"
        if cubin.is_file() and meta.is_file():
            return cubin, json.loads(meta.read_text())["lowered"], False
    data, lowered = compile_program(file, instance, arch)
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            _write(d / f"{stem}.cubin", data)
            _write(d / f"{stem}.json", json.dumps({"file": file, "instance": instance, "lowered": lowered,
                                                   "arch": arch}).encode())
            return d / f"{stem}.cubin", lowered, True
        except OSError:
            continue
    raise RuntimeError(f"no writable kernel cache directory among {', '.join(map(str, dirs))}")


# ---- the process's kernels ----------------------------------------------------------------------
# CUfunction -> the dynamic shared bytes it is opted in to. Per process, not per Kernels: CuPy loads a
# cubin path once per device and shares that module between RawModules, so two backends in one process
# (tests) share their functions, and one must not lower the limit the other launches up to.
_opted_in: dict[int, int] = {}


class Kernels:
    """Loaded kernel functions, by (file, kernel name). `prefetch()` compiles or loads programs in the
    background; `fn()` waits for the program it needs (or builds it then: a launch the plan did not
    foresee still works, only slower to start)."""

    def __init__(self, arch: str, workers: int | None = None):
        self.arch = arch
        primary = cache_dir()
        self.dirs = [primary, Path(tempfile.gettempdir()) / f"qwen35-kernels-{os.getuid()}"]
        self._pool = ThreadPoolExecutor(workers or min(32, os.cpu_count() or 4), thread_name_prefix="nvrtc")
        self._jobs: dict[tuple[str, str | None], Future] = {}
        self._fns: dict[tuple[str, str], object] = {}  # -> its launch.Kernel
        self._resident: dict[tuple[str, str, int], int] = {}  # resident() answers
        self._modules: dict[tuple[str, str | None], tuple] = {}
        self._lock = threading.Lock()

    def prefetch(self, programs, report: bool = False) -> None:
        """Starts building (or finding) these programs in the background. report: log once they are
        all ready, with how long it took and how many came from the cache."""
        t0 = time.perf_counter()
        with self._lock:
            jobs = [self._jobs.get(p) or self._jobs.setdefault(p, self._pool.submit(build, *p, self.arch, self.dirs))
                    for p in programs]
        if report:
            threading.Thread(target=self._report, args=(jobs, t0), daemon=True, name="kernels-report").start()

    def _report(self, jobs, t0: float) -> None:
        try:
            done = [j.result() for j in jobs]
        except Exception as e:  # noqa: BLE001 - the launch that needs it raises it
            log.error("kernel build failed: %s", e)
            return
        compiled = sum(c for _, _, c in done)
        log.info("kernels: %d programs ready in %.1f s (%d compiled now, %d from the cache in %s)",
                 len(done), time.perf_counter() - t0, compiled, len(done) - compiled, self.dirs[0])

    def _module(self, file: str, instance: str | None):
        m = self._modules.get((file, instance))
        if m is None:
            import cupy
            self.prefetch([(file, instance)])
            path, lowered, _ = self._jobs[(file, instance)].result()
            m = self._modules[(file, instance)] = (cupy.RawModule(path=str(path)), lowered)
        return m

    def fn(self, file: str, name: str, smem: int = 0):
        """Kernel `name` (an instance like `attn_fwd<256, 4>` or an extern "C" name) of cuda/`file`;
        `smem`: the dynamic shared memory it will be launched with, opted in to (above the 48 KiB
        default) the first time a launch needs that much."""
        k = self._fns.get((file, name))
        if k is None:
            mod, lowered = self._module(file, name if "<" in name else None)
            from .launch import Kernel  # CuPy: imported once a GPU is in use (tools/build_kernels.py needs none)
            k = self._fns[(file, name)] = Kernel(mod.get_function(lowered or name))
        if smem > _opted_in.get(k.ptr, 0):
            k.fn.max_dynamic_shared_size_bytes = smem
            _opted_in[k.ptr] = smem
        return k

    def resident(self, file: str, name: str, threads: int, smem: int = 0) -> int:
        """How many blocks of `threads` threads and `smem` bytes of dynamic shared memory of kernel `name` one
        SM holds."""
        n = self._resident.get((file, name, threads, smem))
        if n is None:
            import cupy
            n = self._resident[(file, name, threads, smem)] = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                self.fn(file, name, smem).ptr, threads, smem)
        return n

