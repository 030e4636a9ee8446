"""NumpyBackend.memory_used(): the bytes of the live weight and cache arrays it allocated, so the
device-memory checks (qwen35:device_memory_used_bytes, the lifecycle gate) mean something on the CPU."""
import gc

import numpy as np

from engine.backend_numpy import NumpyBackend
from engine.config import ModelConfig
from engine.model import Qwen35Model
from engine.step import Step
from engine.weights import load_weights


def test_numpy_memory_used_is_weights_plus_cache(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)
    be = NumpyBackend()
    assert be.memory_used() == 0
    weights = load_weights(tiny_dir, cfg)
    model = Qwen35Model(cfg, weights, be)
    # the F32 checkpoint vectors (A_log, GDN norm) are used in place from the mapped file: not allocated here
    mapped = sum(w.nbytes for w in weights.values() if w.dtype == np.float32)
    assert mapped > 0 and be.memory_used() == model.weight_bytes() - mapped
    held = be.memory_used()
    cache = model.alloc_cache(3, 9, 16)
    cache_bytes = sum(a.nbytes for a in cache.conv + cache.rec + cache.k + cache.v)
    assert be.memory_used() == held + cache_bytes
    model.forward(Step.build([(list(range(40)), 0, 1, [1, 2, 3])]), cache)
    assert be.memory_used() == held + cache_bytes  # step activations are not held
    del cache
    gc.collect()
    assert be.memory_used() == held
    del model
    gc.collect()
    assert be.memory_used() == 0
