"""The tensor-core prefill attention (cuda/attention_prefill.cu) against the NumPy backend's attention.

Fresh random bf16 q, gate and paged K/V (the whole cache random: the cached prefix and the new tokens'
rows alike), random non-contiguous pages; ragged batches of prefills and chunked prefills (cached
prefixes of 0, 17, 300 tokens), mixed with decode rows (leading decodes go to attn_fwd, a single-token
sequence after a prefill goes through the prefill kernel). Outputs are poisoned with NaN
(CudaBackend(poison=True)), so an unwritten row fails. Tolerance as tests/test_gpu_kernels.py:
max|diff| / max|ref| <= 2e-2.
"""
import numpy as np
import pytest

from conftest import gpu_or_skip  # noqa: E402

cupy = gpu_or_skip()

from engine.gpu.backend import CudaBackend  # noqa: E402
from engine.backend_numpy import NumpyBackend  # noqa: E402
from engine.ops import Cache  # noqa: E402
from engine.step import Step  # noqa: E402
from gpu_pairs import BF16_TOL, rel, rnd  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def be():
    return CudaBackend(poison=True)


def make_step(rng, lens, bases, bs):
    """Sequences with new-token counts `lens` resuming at `bases`; random non-contiguous pages (page 0
    unused). Returns (step, number of pages)."""
    need = [(b0 + n + bs - 1) // bs for n, b0 in zip(lens, bases)]
    nb = sum(need) + 1 + 3
    pages = rng.permutation(np.arange(1, nb))
    chunks, o = [], 0
    for i, (n, b0) in enumerate(zip(lens, bases)):
        chunks.append((list(rng.integers(0, 1000, n)), b0, i, list(pages[o:o + need[i]])))
        o += need[i]
    return Step.build(chunks), nb


class _C:
    def __init__(self, bs):
        self.block_size = bs


# (new tokens, cached prefix) per sequence
CASES = {
    "ragged": ([15, 64, 65, 130, 1], [0, 17, 300, 0, 0]),
    "decodes+chunks": ([1, 1, 1, 65, 15, 1, 130, 2], [700, 5, 300, 17, 300, 40, 0, 17]),
    "long": ([1, 1000, 1], [1200, 300, 1500]),
    "single-prefill": ([64], [0]),
}
DIMS = [(16, 4, 256), (24, 4, 256), (8, 2, 256), (12, 2, 256), (8, 2, 128), (4, 2, 64), (6, 2, 64)]
DIM_IDS = ["G4-nkv4-4b", "G6-nkv4-27b", "G4-nkv2", "G6-nkv2", "G4-hd128", "G2-hd64-tiny", "G3-hd64-tiny3"]


def _check(be, lens, bases, nh, nkv, hd, bs=16, seed=0, split=None):
    """split: whether attn_prefill must have split some tile's keys into parts (None: either)."""
    rng = np.random.default_rng(seed + sum(lens) + 7 * nh + hd + bs)
    step, nb = make_step(rng, lens, bases, bs)
    T = sum(lens)
    q = rnd(rng, T, nh, hd, scale=2.0)  # sharper softmax than unit scores
    qg = rnd(rng, T, nh * 2 * hd + 24)  # the gate as attn_prep gives it: a strided view of q_gate
    gate_np = qg.np[:, :nh * 2 * hd].reshape(T, nh, 2, hd)[:, :, 1].reshape(T, nh * hd)
    kc, vc = rnd(rng, nb, bs, nkv, hd), rnd(rng, nb, bs, nkv, hd)
    want = NumpyBackend().attention(q.np, gate_np, kc.np, vc.np, NumpyBackend().prepare(step, _C(bs)))
    m = be.prepare(step, Cache([], [], [], [], bs))
    sqg = qg.dev.shape[1]
    gate = cupy.ndarray((T, nh, hd), cupy.uint16, qg.dev.data + hd * 2, strides=(sqg * 2, 2 * hd * 2, 2))
    got = be.to_host(be.attention(q.dev, gate, kc.dev, vc.dev, m))
    assert m.prefill_tiles is not None and m.prefill_tiles[1] is not None, "prefill kernel not dispatched"
    if split is not None:
        assert bool((cupy.asnumpy(m.prefill_tiles[1])[:, 6] >= 0).any()) == split
    err = rel(got, want)
    rows = [float(np.abs(got[r] - want[r]).max()) for r in range(T)]
    assert err <= BF16_TOL, f"rel err {err:.3e}; worst row {int(np.argmax(rows))} of {T}"


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("nh,nkv,hd", DIMS, ids=DIM_IDS)
def test_prefill_attention(be, case, nh, nkv, hd):
    lens, bases = CASES[case]
    _check(be, lens, bases, nh, nkv, hd)


def test_prefill_attention_many_tiles(be):
    """A 2048-token chunk after 2048 cached tokens on the 4B heads: 256 CTAs of 32..64 key blocks ending in
    either K/V stage (the timing under which the epilogue's staging once raced the other warpgroup's last
    P V). The 4B heads only: the NumPy reference takes ~10-30 s here."""
    _check(be, [2048], [2048], 16, 4, 256)


# short chunks over long contexts: too few tiles to fill the GPU, so their keys split into parts (up to
# PF_MAX_PARTS for the lone 5-token tile); a leading decode on attn_fwd beside them
SPLIT_CASES = {"chunks-after-4000": ([1, 256, 40], [700, 4000, 1500]), "one-tile-12000": ([5], [12000])}


@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=list(SPLIT_CASES))
@pytest.mark.parametrize("nh,nkv,hd", [DIMS[0], DIMS[1], DIMS[5]], ids=[DIM_IDS[0], DIM_IDS[1], DIM_IDS[5]])
def test_prefill_attention_split_keys(be, case, nh, nkv, hd):
    lens, bases = SPLIT_CASES[case]
    _check(be, lens, bases, nh, nkv, hd, split=True)
    _check(CudaBackend(poison=True, batch_invariant=True), lens, bases, nh, nkv, hd, split=False)


@pytest.mark.parametrize("bs", [8, 32, 64, 128])
def test_prefill_attention_block_sizes(be, bs):
    _check(be, [15, 65, 130, 1], [17, 300, 0, 40], 16, 4, 256, bs=bs)
