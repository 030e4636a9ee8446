"""Kernel launches, optionally with programmatic dependent launch (PDL, sm_90+).

A decode step is ~350 small kernels in one CUDA graph; at batch 1 each lasts 2-30 us, and between two of
them the GPU drains one grid, then launches and ramps up the next. With PDL a kernel's blocks are
scheduled while its predecessor is still running: every kernel in cuda/ begins with `pdl_enter()`
(common.cuh), which waits for the kernels before it (`griddepcontrol.wait`: their writes are then
visible) and then lets the next kernel launch (`griddepcontrol.launch_dependents`), so the next grid is
resident and starts the moment this one ends. Both instructions are no-ops for a kernel launched without
the attribute, and a kernel that is not ours (CuPy's, cublasLt's) is launched normally, so it waits for
everything before it as always.

PDL launches are used inside `with pdl():`: DecodeGraphs wraps its captures in it (the launches
are recorded once and replayed; the ctypes call here is slower on the host than CuPy's own launch, which
eager steps keep). CuPy's launch API takes no launch attributes, hence cuLaunchKernelEx through ctypes.
QWEN35_PDL=0 turns it off everywhere (A/B timing).
"""
from __future__ import annotations

import contextlib
import ctypes
import os

import cupy
import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float}
_state = {"on": False, "lib": None}
_ALLOWED = os.environ.get("QWEN35_PDL", "1") != "0"


@contextlib.contextmanager
def pdl():
    """Kernel launches inside use PDL (when the device supports it and QWEN35_PDL is not 0)."""
    old = _state["on"]
    _state["on"] = _ALLOWED and int(cupy.cuda.Device().compute_capability) >= 90
    try:
        yield
    finally:
        _state["on"] = old


def _lib():
    if _state["lib"] is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _state["lib"] = lib
    return _state["lib"]


def _arg(a):
    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    t = _SCALARS.get(getattr(a, "dtype", None))
    if t is None:  # a Python int's C type would be a guess: the launchers pass NumPy scalars
        raise TypeError(f"kernel argument of type {type(a).__name__}: pass a cupy array or a NumPy int32/int64/"
                        "uint64/float32 scalar")
    return t(a.item())


class Kernel:
    """A loaded kernel function, called as CuPy's: kernel(grid, block, args, shared_mem=0)."""
    __slots__ = ("fn", "ptr")

    def __init__(self, fn):
        self.fn = fn  # a cupy.RawKernel (RawModule.get_function)
        self.ptr = fn.kernel.ptr  # its CUfunction

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if not _state["on"]:
            return self.fn(grid, block, args, shared_mem=shared_mem)
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        attr = _Attr(_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        cfg = _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                      cupy.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
        vals = [_arg(a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        err = _lib().cuLaunchKernelEx(ctypes.byref(cfg), self.ptr, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {err}")
