"""Array helpers that work on NumPy and CuPy arrays alike (CuPy is imported only when handed one),
and the one bf16 convention: bf16 lives as raw bits in uint16 arrays (neither NumPy nor CuPy has a
bf16 dtype)."""
from __future__ import annotations

import numpy as np


def array_module(a):
    """numpy, or cupy for a CuPy array (imported only then: the NumPy path never needs CuPy)."""
    if type(a).__module__.partition(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def to_numpy(a) -> np.ndarray:
    return a.get() if array_module(a) is not np else np.asarray(a)


def bf16_to_f32(bits):
    """bf16 bits (uint16) -> float32, exact, where the array lives."""
    xp = array_module(bits)
    return (xp.asarray(bits, dtype=xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(x) -> np.ndarray:
    """Round to nearest even, as torch does; returns the raw bits (host)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def as_f32(a):
    """float32 where the array lives; uint16 arrays are bf16 bits."""
    if a.dtype == np.uint16:
        return bf16_to_f32(a)
    return a.astype(array_module(a).float32, copy=False)


def take_rows(a, rows):
    """a[rows] for a host list of row indices, on a's device."""
    xp = array_module(a)
    return a[xp.asarray(np.asarray(rows, np.int64))]


class HostCopy:
    """An array's copy to the host, started now; result() waits for it. For a CuPy array the copy is
    asynchronous (into pinned memory, then an event), so waiting for it does not also wait for device
    work enqueued after it, as a plain .get() would."""

    def __init__(self, a):
        self._done = None
        if array_module(a) is np:
            self._host = np.asarray(a)
            return
        import cupy
        import cupyx
        a = cupy.ascontiguousarray(a)
        self._host = cupyx.empty_pinned(a.shape, a.dtype)
        cupy.asnumpy(a, out=self._host, blocking=False)
        self._done = cupy.cuda.Event(disable_timing=True)
        self._done.record()

    def result(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        return self._host
