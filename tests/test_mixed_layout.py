"""A small mixed step padded to its CUDA graph's shapes (engine/gpu/mixed_layout.py), run on the NumPy backend:
the step's own logits and every real slot's and page's state equal those of the unpadded step, and the padding
writes only the dummy slot and page. The GPU replay of that layout is tested in test_gpu_decode_graph.py."""
import numpy as np
import pytest

from engine.backend_numpy import NumpyBackend
from engine.config import ModelConfig
from engine.gpu.mixed_layout import MIXED_SEQS, MixedLayout
from engine.model import Qwen35Model
from engine.step import Step
from engine.weights import load_weights

BS, DUMMY = 16, 0


def _layout(model, cap=40, width=8, max_num_seqs=8):
    cfg = model.cfg
    return MixedLayout(cap, max_num_seqs, width * BS, width, DUMMY, DUMMY, cfg.num_heads // cfg.num_kv_heads)


@pytest.fixture(scope="module")
def model(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)
    return Qwen35Model(cfg, load_weights(tiny_dir, cfg), NumpyBackend())


def _world(model, rng):
    """Slots 1..6 and pages 1..30 hold garbage; sequences 0..2 (slots 1..3) have prefilled contexts; slots 4, 5
    are fresh prompts' (zeroed), slot 6 and the pages nobody owns are spare."""
    cache = model.alloc_cache(7, 31, BS)
    for a in cache.conv + cache.rec + cache.k + cache.v:
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)
    ctx = [5, 17, 33]
    blocks = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]] + [[11, 12, 13], [14, 15, 16, 17]]
    model.ops.reset_slots(cache, [1, 2, 3, 4, 5])
    model.forward(Step.build([(list(rng.integers(0, 200, n)), 0, 1 + i, blocks[i]) for i, n in enumerate(ctx)]), cache)
    return cache, ctx, blocks


def _copy(cache):
    return {name: [a.copy() for a in getattr(cache, name)] for name in ("conv", "rec", "k", "v")}


def test_padded_mixed_step_computes_the_step(model):
    rng = np.random.default_rng(0)
    cache, ctx, blocks = _world(model, rng)
    lay = _layout(model)
    # three decodes, a fresh 20-token prompt that ends (sampled), a 7-token chunk of a longer prompt (not sampled)
    chunks = [([int(rng.integers(0, 200))], ctx[i], 1 + i, blocks[i]) for i in range(3)]
    chunks += [(list(rng.integers(0, 200, 20)), 0, 4, blocks[3]), (list(rng.integers(0, 200, 7)), 0, 5, blocks[4])]
    step = Step.build(chunks, sample=[1, 1, 1, 1, 0])
    assert lay.fits(step) and lay.decodes(step) == 3
    pstep, tiles = lay.lay_out(step, 4)
    T, B = 4 + lay.cap, 4 + MIXED_SEQS + 1
    assert len(pstep.tokens) == T and pstep.num_seqs == B and len(pstep.logits_rows) == 4 + MIXED_SEQS
    assert tiles.shape == (lay.num_tiles, 8) and (tiles[:, 3] > 0).sum() >= 2
    assert set(pstep.slots[[3] + list(range(6, B))]) == {DUMMY}  # the padding decode row, empty chunks, filler

    before = _copy(cache)
    want = model.forward(step, cache)
    after_plain = _copy(cache)
    for name, arrays in before.items():  # back to the state before the step, then the padded step
        for a, b in zip(getattr(cache, name), arrays):
            a[...] = b
    got = model.forward(pstep, cache)[:len(step.logits_rows)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for name in ("conv", "rec"):
        for a, b, c in zip(getattr(cache, name), after_plain[name], before[name]):
            np.testing.assert_allclose(a[1:6], b[1:6], rtol=1e-4, atol=1e-4)
            assert np.array_equal(a[6], c[6]), f"{name}: the spare slot was written"
    owned = sorted(sum(blocks, []))
    spare = sorted(set(range(1, 31)) - set(owned))
    for name in ("k", "v"):
        for a, b, c in zip(getattr(cache, name), after_plain[name], before[name]):
            np.testing.assert_allclose(a[owned], b[owned], rtol=1e-4, atol=1e-4)
            assert np.array_equal(a[spare], c[spare]), f"{name}: a spare page was written"


def test_fits(model):
    lay = _layout(model)
    dec = [([1], 5, 1, [1]), ([2], 9, 2, [2])]
    assert lay.fits(Step.build(dec + [([1] * 30, 0, 3, [3, 4])], sample=[1, 1, 0]))
    assert lay.fits(Step.build([([1] * 30, 0, 3, [3, 4])]))  # no decodes: bucket 1
    assert not lay.fits(Step.build(dec + [([1] * 41, 0, 3, [3, 4, 5])]))  # over the cap
    assert not lay.fits(Step.build(dec + [([1] * 2, 0, 3 + i, [3 + i]) for i in range(MIXED_SEQS + 1)]))
    assert not lay.fits(Step.build(dec + [([1] * 30, 0, 3, [3, 4])], sample=[1, 0, 1]))  # a decode not sampled
    assert not lay.fits(Step.build(dec + [([1] * 30, 0, 3, [3, 4])], sample=[1, 1, 2]))  # a chunk's two rows
    assert not lay.fits(Step.build(dec + [([1] * 30, 0, 3, [3, 4])], spec={0: 0}))  # a log set
    assert not lay.fits(Step.build(dec + [([1] * 30, 200, 3, [3] * 16)]))  # past max_ctx (128)
    fed = Step.build(dec + [([1] * 30, 0, 3, [3, 4])], feed=(np.array([0, 2]), np.zeros(2)))
    assert not lay.fits(fed)  # a fed token outside the decodes
    with pytest.raises(ValueError):
        _layout(model, cap=MIXED_SEQS)
    with pytest.raises(ValueError):  # the filler would need more block table than the graphs have
        _layout(model, cap=8 * BS + 1)
