"""Compile the CUDA kernels to cubins ahead of time, without a GPU (NVRTC through CuPy).

Fills a kernel cache directory (engine/gpu/kernels.py: what `qwen35 serve` loads before compiling
anything): every program of every instance by default, or only those a checkpoint's shapes can launch.
A container image runs this at build time so its first start compiles nothing.

    python3 tools/build_kernels.py [--arch 90] [--dir DIR] [--model CHECKPOINT_DIR] [--batch-invariant]
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.config import ModelConfig
from engine.gpu import kernels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help="compute capability, e.g. 90 for sm_90 (H100, H200)")
    ap.add_argument("--dir", default=None, help=f"output directory (default: {kernels.cache_dir()})")
    ap.add_argument("--model", default=None, help="only what this checkpoint's shapes can launch")
    ap.add_argument("--batch-invariant", action="store_true", help="with --model: the batch-invariant kernels too")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args(argv)
    out = Path(a.dir) if a.dir else kernels.cache_dir()
    progs = (kernels.needed(ModelConfig.from_dir(a.model), a.batch_invariant) if a.model
             else kernels.every_program())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.jobs) as pool:
        done = list(pool.map(lambda p: kernels.build(*p, a.arch, [out]), progs))
    compiled = sum(c for _, _, c in done)
    print(f"{len(progs)} programs for sm_{a.arch} in {out}: {compiled} compiled, {len(progs) - compiled} already "
          f"there ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
