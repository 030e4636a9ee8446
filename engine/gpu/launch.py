"""Kernel launches with programmatic dependent launch (PDL, sm_90+), eager and captured alike.

A decode step is ~350 small kernels in one CUDA graph, an eager prefill or mixed step ~280 of ours among
~130 cublasLt GEMMs; between two kernels the GPU drains one grid, then launches and ramps up the next.
With PDL a kernel's blocks are scheduled while its predecessor is still running: every kernel in cuda/
begins with `pdl_enter()` (common.cuh), which waits for the kernels before it (`griddepcontrol.wait`:
their writes are then visible) and then lets the next kernel launch (`griddepcontrol.launch_dependents`),
so the next grid is resident and starts the moment this one ends. Both instructions are no-ops for a kernel
launched without the attribute, and a kernel that is not ours (CuPy's, cublasLt's) is launched normally,
so it waits for everything before it as always. An array the memory pool hands out again is safe for the
same reason: no kernel of ours touches one before its wait (gemv_bf16 reads weights before it, which no
kernel writes).

CuPy's launch API takes no launch attributes, hence cuLaunchKernelEx through ctypes. The host cost is
what an eager step pays per launch, so the arguments are packed by one precompiled `struct` format per
signature into a buffer the driver copies at the call (no ctypes object per argument). QWEN35_PDL=0 turns
PDL off (CuPy's own launch; A/B timing, kernel_profile.py).
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading

import cupy
import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


# an argument's C type by its Python type: device pointers and the NumPy scalars the launchers pass (a
# Python int's C type would be a guess)
_CODE = {cupy.ndarray: "Q", np.int32: "i", np.int64: "q", np.uint64: "Q", np.float32: "f"}
_ALLOWED = os.environ.get("QWEN35_PDL", "1") != "0"


class _Launcher:
    """One thread's launch state: the config with its PDL attribute, and per signature a packing buffer
    and the kernelParams array pointing into it (each argument at its C alignment)."""

    def __init__(self):
        self.attr = _Attr(_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1
        self.cfg = _Config(attrs=ctypes.pointer(self.attr), num_attrs=1)
        self.cfg_ref = ctypes.byref(self.cfg)
        self.sigs: dict[str, tuple] = {}

    def signature(self, fmt: str) -> tuple:
        s = self.sigs.get(fmt)
        if s is None:
            packer = struct.Struct("@" + fmt)
            buf = ctypes.create_string_buffer(max(packer.size, 1))
            base, offsets = ctypes.addressof(buf), [struct.calcsize("@" + fmt[:i + 1]) - struct.calcsize("@" + c)
                                                    for i, c in enumerate(fmt)]
            params = (ctypes.c_void_p * max(len(fmt), 1))(*[base + o for o in offsets])
            s = self.sigs[fmt] = (packer.pack_into, buf, params)
        return s


_local = threading.local()
_lib = None


def _launcher() -> _Launcher:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _lib = lib
    la = _local.__dict__.get("launcher")
    if la is None:
        la = _local.launcher = _Launcher()
    return la


class Kernel:
    """A loaded kernel function, called as CuPy's: kernel(grid, block, args, shared_mem=0)."""
    __slots__ = ("fn", "ptr", "pdl", "fmt")

    def __init__(self, fn):
        self.fn = fn  # a cupy.RawKernel (RawModule.get_function)
        self.ptr = fn.kernel.ptr  # its CUfunction
        self.pdl = _ALLOWED and int(cupy.cuda.Device().compute_capability) >= 90
        self.fmt = ""  # its arguments' struct format, from its first launch (a C signature is fixed)

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if not self.pdl:
            return self.fn(grid, block, args, shared_mem=shared_mem)
        if len(args) != len(self.fmt):
            self.fmt = _format(args)
        la = _launcher()
        pack, buf, params = la.signature(self.fmt)
        pack(buf, 0, *[a.data.ptr if type(a) is cupy.ndarray else a for a in args])
        c = la.cfg
        c.gx, c.gy, c.gz = (tuple(grid) + (1, 1))[:3]
        c.bx, c.by, c.bz = (tuple(block) + (1, 1))[:3]
        c.smem, c.stream = shared_mem, cupy.cuda.get_current_stream().ptr
        err = _lib.cuLaunchKernelEx(la.cfg_ref, self.ptr, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {err}")


def _format(args) -> str:
    bad = [a for a in args if type(a) not in _CODE]
    if bad:
        raise TypeError(f"kernel argument of type {type(bad[0]).__name__}: pass a cupy array or a NumPy int32/int64/"
                        "uint64/float32 scalar")
    return "".join([_CODE[type(a)] for a in args])
