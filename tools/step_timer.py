"""Time per step of work enqueued back to back, on any backend."""
from __future__ import annotations


def time_per_call(fn, ops, calls: int, warm: int = 3) -> float:
    """Seconds per call of fn over `calls` calls back to back, after `warm` untimed ones: the backend's
    marks around the loop (device events on the GPU, the host clock on NumPy), so the time is the longer
    of the host's launches and the device's work, what a serving loop sees."""
    for _ in range(warm):
        fn()
    start = ops.mark()
    for _ in range(calls):
        fn()
    return ops.elapsed_ms(start, ops.mark()) / 1e3 / calls
