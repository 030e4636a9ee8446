"""Time per step of work enqueued back to back, and the host's share of it, on any backend."""
from __future__ import annotations

import statistics
import time


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


def host_per_call(fn, ops, calls: int, warm: int = 1) -> float:
    """Median seconds fn takes to return on the host (on the GPU: to enqueue its work), each call made with
    the device idle (the work before it waited for): what a step costs the host, which time_per_call
    reports only when it exceeds the device's."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(calls):
        ops.elapsed_ms(ops.mark(), ops.mark())  # waits for everything enqueued so far
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    ops.elapsed_ms(ops.mark(), ops.mark())
    return statistics.median(times)
