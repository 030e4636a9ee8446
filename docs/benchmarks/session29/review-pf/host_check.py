import sys
import numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from engine.gpu.prefill_tiles import prefill_tiles, split_parts, PF_MAX_PARTS, PF_MIN_PART_BLOCKS, PF_ROWS, PF_KEYS
from engine.gpu.mixed_layout import MixedLayout, MIXED_SEQS
from engine.step import Step

rng = np.random.default_rng(1)
# split_parts alone
for it in range(200000):
    k = int(rng.integers(1, 80)); wave = int(rng.integers(0, 300))
    nb = rng.integers(1, rng.choice([3, 20, 300, 3000]), k)
    p = split_parts(nb, wave)
    assert (p >= 1).all() and (p <= PF_MAX_PARTS).all()
    assert p[p > 1].sum() <= max(wave, 0), (nb, wave, p)
    assert (p <= nb).all()
    sz = nb // p
    assert ((p == 1) | (sz >= PF_MIN_PART_BLOCKS)).all()
print("split_parts ok")

def mk(lens, bases):
    return Step.build([([0] * n, b0, i, [0] * ((b0 + n) // 16 + 1)) for i, (n, b0) in enumerate(zip(lens, bases))])

worst_extra = 0
for it in range(20000):
    G = int(rng.choice([1, 2, 3, 4, 6, 8])); wave = int(rng.choice([0, 1, 2, 7, 16, 33, 66, 132, 264]))
    k = int(rng.integers(1, 8))
    lens = rng.integers(0, rng.choice([2, 10, 300, 2000]), k); bases = rng.integers(0, rng.choice([10, 5000, 40000]), k)
    nl = int(rng.integers(0, k + 1))
    step = mk(lens, bases)
    t, _ = prefill_tiles(step, G, nl, wave)
    if t is None: continue
    w, _ = prefill_tiles(step, G, nl, 0)
    assert (t[:, 5] > t[:, 4]).all()
    S = t[:, 7] & 0xFFFF; p = t[:, 7] >> 16
    assert (S <= PF_MAX_PARTS).all() and (p < S).all()
    sp = t[t[:, 6] >= 0]
    if len(sp):
        slots = sp[:, 6] + (sp[:, 7] >> 16)
        assert len(set(slots.tolist())) == len(slots) and slots.max() < wave
        # every part of a non-last part is fully visible to all rows; last part has visible keys for every row
        for e in sp:
            b, r0, t0, n, kb0, kb1, f, pw = e
            base = step.positions[t0]; nrows = min(PF_ROWS, n * G - r0)
            n_keys = base + (r0 + nrows - 1) // G + 1; min_lim = base + r0 // G
            assert kb0 * PF_KEYS <= min_lim  # every row sees this part's first key
    worst_extra = max(worst_extra, len(t) - len(w))
    assert len(t) - len(w) < max(wave, 1)
print("prefill_tiles ok; most extra entries", worst_extra)

# MixedLayout num_tiles bound: adversarial chunk splits of cap tokens
worst = -10**9
for it in range(20000):
    G = int(rng.choice([2, 4, 6, 8])); wave = int(rng.choice([0, 7, 16, 33, 66, 132]))
    cap = int(rng.choice([5, 16, 33, 64, 100, 128, 256, 300, 512]))
    W = 3000
    lay = MixedLayout(cap, 8, W * 16, W, 0, 0, G, wave)
    nch = int(rng.integers(1, MIXED_SEQS + 1))
    tot = int(rng.integers(nch, cap + 1))
    cuts = np.sort(rng.choice(np.arange(1, tot), nch - 1, replace=False)) if nch > 1 else np.array([], int)
    lens = np.diff(np.r_[0, cuts, tot]).astype(int)
    nd = int(rng.integers(0, 9))
    dec = [([5], int(rng.integers(1, 40000)), 1 + i, [1] * W) for i in range(nd)]
    chunks = [([0] * int(n), int(rng.integers(0, 40000)), 20 + i, [2] * W) for i, n in enumerate(lens)]
    step = Step.build(dec + chunks)
    if not lay.fits(step):
        continue
    P = max(1, nd)
    P = 1 << (P - 1).bit_length()
    pstep, tiles = lay.lay_out(step, P)
    t, _ = prefill_tiles(pstep, G, P, wave)
    worst = max(worst, len(t) - lay.num_tiles)
print("mixed layout ok; max(len - num_tiles) =", worst)
