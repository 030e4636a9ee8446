"""Shared by the GPU op tests (import after conftest.gpu_or_skip()): bf16 tensors fed to both
backends, and the closeness measure with its bf16 tolerance."""
import cupy
import numpy as np

from engine.arrays import bf16_to_f32, f32_to_bf16

BF16_TOL = 2e-2  # max|diff| / max|ref| for bf16 outputs


def rel(ours, want):
    ours, want = np.asarray(ours, np.float32), np.asarray(want, np.float32)
    assert ours.shape == want.shape, (ours.shape, want.shape)
    assert np.isfinite(ours).all(), "non-finite (unwritten?) output"
    return float(np.abs(ours - want).max() / max(np.abs(want).max(), 1e-30))


class Pair:
    """A bf16 tensor as NumPy f32 values and as GPU bits."""

    def __init__(self, x):
        self.bits = f32_to_bf16(np.asarray(x, np.float32))
        self.np = bf16_to_f32(self.bits)
        self.dev = cupy.asarray(self.bits)


def rnd(rng, *shape, scale=1.0):
    return Pair(rng.standard_normal(shape).astype(np.float32) * scale)
