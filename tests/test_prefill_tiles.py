"""attn_prefill's host work list (engine/gpu/prefill_tiles.py): tiles of query rows, and the parts a tile's keys
split into when the tiles are too few to fill the GPU. NumPy only (CPU)."""
import numpy as np
import pytest

from engine.gpu.prefill_tiles import PF_KEYS, PF_MAX_PARTS, PF_MIN_PART_BLOCKS, PF_ROWS, prefill_tiles
from engine.step import Step


def _step(lens, bases):
    return Step.build([([0] * n, b0, i, [0] * ((b0 + n) // 16 + 1)) for i, (n, b0) in enumerate(zip(lens, bases))])


def _blocks(t, bases, G):
    """Key blocks of each listed tile (keys 0 .. its last row's position)."""
    return np.array([-(-(bases[b] + (min(r0 + PF_ROWS, n * G) - 1) // G + 1) // PF_KEYS) for b, r0, _, n in t[:, :4]])


def test_tiles_cover_rows():
    """Every (sequence, row) in exactly one tile, no tile straddles sequences, most key blocks first, leading
    decodes left to attn_fwd; without a wave no tile is split."""
    lens, bases = [1, 1, 1000, 1, 65, 0, 3], [9, 40, 300, 7, 17, 5, 0]
    step = _step(lens, bases)
    for G in (1, 2, 3, 4, 6, 8):
        t, n_dec = prefill_tiles(step, G)
        assert n_dec == 2 and t.shape[1] == 8
        cover = {}
        for b, r0, t0, n in t[:, :4]:
            assert t0 == step.cu_seqlens[b] and n == lens[b] and 0 <= r0 < n * G and r0 % PF_ROWS == 0
            cover.setdefault(int(b), []).append(int(r0))
        for b in range(2, len(lens)):
            assert sorted(cover.get(b, [])) == list(range(0, lens[b] * G, PF_ROWS)), (G, b)
        nb = _blocks(t, bases, G)
        assert list(nb) == sorted(nb, reverse=True)
        assert (t[:, 4] == 0).all() and (t[:, 5] == nb).all() and (t[:, 6] == -1).all() and (t[:, 7] == 1).all()
    assert prefill_tiles(Step.build([([0], 5, 0, [0]), ([0], 0, 1, [1])]), 4) == (None, 2)


# (new tokens, cached prefix) per sequence, wave, whether some tile splits, entries listed (None: any)
SPLITS = {
    "mixed-chunk-after-4000": ([1, 256, 40], [700, 4000, 1500], 33, True, None),  # 4B heads on 132 SMs
    "one-tile-12000": ([5], [12000], 33, True, PF_MAX_PARTS),
    "8-tiles-after-16128": ([256], [16128], 33, True, 32),  # ~254 blocks each: 4 parts each, one wave
    "prefill-1024": ([1024], [0], 33, False, 32),            # 32 tiles of 1..16 blocks
    "prefill-8192": ([8192], [0], 33, False, 256),           # more tiles than a wave
    "small-wave": ([3, 100, 7], [2000, 900, 5000], 7, True, None),
}


@pytest.mark.parametrize("case", list(SPLITS), ids=list(SPLITS))
def test_split_parts(case):
    """A split tile's parts cover its key blocks [0, nb) once, in order, each at least PF_MIN_PART_BLOCKS, at
    most PF_MAX_PARTS of them; the parts' workspace slots are one range per tile, all disjoint, within the wave;
    entries are at most the tiles plus a wave, listed by key blocks, most first."""
    lens, bases, wave, split, entries = SPLITS[case]
    G = 4
    step = _step(lens, bases)
    whole, _ = prefill_tiles(step, G)
    t, _ = prefill_tiles(step, G, wave=wave)
    assert len(t) <= len(whole) + wave and (entries is None or len(t) == entries)
    assert bool((t[:, 6] >= 0).any()) == split
    slots = []
    for tile, nb in zip(whole[:, :4], _blocks(whole, bases, G)):
        parts = t[(t[:, :4] == tile).all(1)]
        S = int(parts[0, 7] & 0xFFFF)
        assert len(parts) == S <= PF_MAX_PARTS and ((parts[:, 7] & 0xFFFF) == S).all()
        parts = parts[np.argsort(parts[:, 7] >> 16)]
        assert list(parts[:, 7] >> 16) == list(range(S))
        assert parts[0, 4] == 0 and parts[-1, 5] == nb and (parts[1:, 4] == parts[:-1, 5]).all()
        if S == 1:
            assert parts[0, 6] == -1
        else:
            assert (parts[:, 5] - parts[:, 4] >= PF_MIN_PART_BLOCKS).all() and (parts[:, 6] == parts[0, 6]).all()
            slots += range(parts[0, 6], parts[0, 6] + S)
    assert len(slots) == len(set(slots)) and all(0 <= s < wave for s in slots)
    size = t[:, 5] - t[:, 4]
    assert list(size) == sorted(size, reverse=True)


@pytest.mark.parametrize("chunks", [[(256, 16128)], [(100, 9000), (3, 15000), (150, 40)], [(1, 700)]])
def test_mixed_layout_holds_the_parts(chunks):
    """A small mixed step's graph lists its tiles in MixedLayout.num_tiles entries, split parts included (up to a
    wave more than the unsplit tiles), padded with empty tiles."""
    from engine.gpu.mixed_layout import MixedLayout
    W, wave, P = 1100, 33, 4
    lay = MixedLayout(256, 8, W * 16, W, 0, 0, 4, wave)
    decodes = [([5], 300 + i, 1 + i, [1] * W) for i in range(3)]
    step = Step.build(decodes + [([0] * n, b0, 10 + i, [2] * W) for i, (n, b0) in enumerate(chunks)])
    assert lay.fits(step)
    pstep, tiles = lay.lay_out(step, P)
    want, _ = prefill_tiles(pstep, 4, P, wave)
    assert tiles.shape == (lay.num_tiles, 8) and len(want) <= lay.num_tiles
    assert np.array_equal(tiles[:len(want)], want) and (tiles[len(want):] == 0).all()
    assert bool((want[:, 6] >= 0).any()) == (chunks[0][1] > 1000)
