"""NumPy emulation of cuda/attention_prefill.cu (branch s29-pf-split) driven by the real prefill_tiles."""
import sys
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from engine.gpu.prefill_tiles import PF_ROWS, PF_KEYS, PF_MAX_PARTS, prefill_tiles  # noqa: E402
from engine.gpu.mixed_layout import MixedLayout  # noqa: E402
from engine.step import Step  # noqa: E402

f32 = np.float32
NEG_INF = f32(-np.inf)


def fmaf(a, b, c):
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(f32)


def sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(f32)


class Work:
    def __init__(self, wave, nkv, HD):
        slots = wave * nkv
        self.part_o = np.full(slots * PF_ROWS * HD, np.nan, f32)   # flat, as the kernel indexes it
        self.part_ml = np.full(slots * PF_ROWS * 2, np.nan, f32)
        self.counters = np.zeros(slots, np.int32)
        self.max_slot = -1


def cta(blk_y, kvh, tiles, q, gate, kc, vc, bt, positions, nkv, G, bs_shift, scale_log2, out, W, HD, stats):
    """One CTA, as the kernel. Returns nothing; writes out / workspace."""
    e = tiles[blk_y]
    b, r0, t0, n = (int(x) for x in e[:4])
    kb0, nblocks = int(e[4]), int(e[5] - e[4])
    if n == 0:
        return
    nh = nkv * G
    base = int(positions[t0])
    rows_end = n * G
    nrows = min(PF_ROWS, rows_end - r0)
    n_keys = base + (r0 + nrows - 1) // G + 1
    min_lim = base + r0 // G
    table = bt[b]
    assert nblocks >= 1, ("empty part", e)
    # Q tile
    Q = np.zeros((PF_ROWS, HD), f32)
    for row in range(PF_ROWS):
        fr = r0 + row
        if fr < rows_end:
            tok, g = fr // G, fr % G
            Q[row] = q[t0 + tok, kvh * G + g]
    bs_mask = (1 << bs_shift) - 1

    def block(cache, kb):
        j = kb * PF_KEYS + np.arange(PF_KEYS)
        ok = j < n_keys
        page = np.where(ok, table[np.minimum(j, n_keys - 1) >> bs_shift], 0)
        blk = cache[page, j & bs_mask, kvh].astype(f32)
        blk[~ok] = 0
        return blk

    rows = np.arange(PF_ROWS)
    lim = np.minimum(base + (r0 + rows) // G, n_keys - 1)
    o = np.zeros((PF_ROWS, HD), f32)
    m_r = np.full(PF_ROWS, NEG_INF, f32)
    l_r = np.zeros(PF_ROWS, f32)
    for kb in range(nblocks):
        K = block(kc, kb0 + kb)
        V = block(vc, kb0 + kb)
        s = (Q @ K.T).astype(f32)
        k0 = (kb0 + kb) * PF_KEYS
        if k0 + PF_KEYS - 1 > min_lim:
            keys = k0 + np.arange(PF_KEYS)
            s[keys[None, :] > lim[:, None]] = NEG_INF
        mx = np.maximum(m_r, s.max(1))
        ms = np.where(mx == NEG_INF, f32(0), mx * scale_log2).astype(f32)
        with np.errstate(invalid="ignore"):
            corr = np.exp2((m_r * scale_log2 - ms).astype(f32)).astype(f32)
        m_r = mx
        p = np.exp2(fmaf(s, scale_log2, -ms[:, None])).astype(f32)
        l_r = (l_r * corr + p.sum(1, dtype=f32)).astype(f32)
        o = (o * corr[:, None] + p @ V).astype(f32)
    OS = HD + 8
    so = np.full(PF_ROWS * OS + PF_MAX_PARTS * PF_ROWS, np.nan, f32)  # staging + the merge weights (smem)
    first = int(e[6])
    if first < 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            for row in range(PF_ROWS):
                so[row * OS:row * OS + HD] = o[row] * (f32(1) / l_r[row])
    else:
        parts, p_ = int(e[7]) & 0xFFFF, int(e[7]) >> 16
        assert parts <= PF_MAX_PARTS
        slot, slot0 = (first + p_) * nkv + kvh, first * nkv + kvh
        W.max_slot = max(W.max_slot, slot)
        for row in range(PF_ROWS):
            if row >= nrows:
                continue
            W.part_o[(slot * PF_ROWS + row) * HD + np.arange(HD)] = o[row]
            W.part_ml[(slot * PF_ROWS + row) * 2 + np.arange(2)] = (m_r[row], l_r[row])
        old = W.counters[slot0]
        W.counters[slot0] += 1
        last = old == parts - 1
        if last:
            W.counters[slot0] = 0
        if not last:
            return
        stats["merges"] += 1
        pstride = nkv * PF_ROWS
        wgt_off = PF_ROWS * OS
        for tid in range(nrows):
            mlb = (slot0 * PF_ROWS + tid) * 2
            m = NEG_INF
            for qq in range(parts):
                m = max(m, W.part_ml[mlb + qq * pstride * 2])
            assert np.isfinite(m), ("M not finite", e, tid)
            ms = f32(m * scale_log2)
            l = f32(0)
            for qq in range(parts):
                vx, vy = W.part_ml[mlb + qq * pstride * 2], W.part_ml[mlb + qq * pstride * 2 + 1]
                w = np.exp2(fmaf(vx, scale_log2, -ms))
                so[wgt_off + qq * PF_ROWS + tid] = w
                l = fmaf(vy, w, l)
            assert l > 0, ("l = 0", e, tid)
            inv = f32(1) / l
            for qq in range(parts):
                so[wgt_off + qq * PF_ROWS + tid] *= inv
        for row in range(nrows):
            acc = np.zeros(HD, f32)
            src = (slot0 * PF_ROWS + row) * HD
            for qq in range(parts):
                w = so[wgt_off + qq * PF_ROWS + row]
                v = W.part_o[src + qq * pstride * HD + np.arange(HD)]
                acc = fmaf(w, v, acc)
            so[row * OS:row * OS + HD] = acc
    for row in range(PF_ROWS):
        fr = r0 + row
        if fr >= rows_end:
            continue
        tok, g = fr // G, fr % G
        t, h = t0 + tok, kvh * G + g
        x = so[row * OS:row * OS + HD]
        assert np.isfinite(x).all(), ("nonfinite staging", e, row)
        out[t, h] = x * sigmoid(gate[t, h])
        stats["written"][t, h] += 1


def launch(tiles, q, gate, kc, vc, bt, positions, nkv, G, bs, HD, W, rng):
    T, nh, _ = q.shape
    out = np.full((T, nh, HD), np.nan, f32)
    stats = {"merges": 0, "written": np.zeros((T, nh), int)}
    order = [(y, x) for y in range(len(tiles)) for x in range(nkv)]
    rng.shuffle(order)  # any arrival order
    scale_log2 = f32(HD ** -0.5 * np.log2(np.e))
    for y, x in order:
        cta(y, x, tiles, q, gate, kc, vc, bt, positions, nkv, G, bs.bit_length() - 1, scale_log2, out, W, HD, stats)
    assert (W.counters == 0).all(), "counter left nonzero"
    return out, stats


def reference(step, n_lead, q, gate, kc, vc, bs):
    T, nh, HD = q.shape
    nkv = kc.shape[2]
    G = nh // nkv
    cu = step.cu_seqlens
    ref = np.full((T, nh, HD), np.nan)
    for s in range(n_lead, step.num_seqs):
        a, z = int(cu[s]), int(cu[s + 1])
        if z == a:
            continue
        pos = step.positions[a:z].astype(np.int64)
        L = int(pos.max()) + 1
        j = np.arange(L)
        pages = step.block_tables[s][j // bs]
        K = kc[pages, j % bs].astype(np.float64)  # [L, nkv, HD]
        V = vc[pages, j % bs].astype(np.float64)
        for kvh in range(nkv):
            Q = q[a:z, kvh * G:(kvh + 1) * G].astype(np.float64)  # [n, G, HD]
            S = np.einsum("ngd,ld->ngl", Q, K[:, kvh]) * HD ** -0.5
            S = np.where(j[None, None, :] > pos[:, None, None], -np.inf, S)
            S -= S.max(-1, keepdims=True)
            P = np.exp(S)
            O = np.einsum("ngl,ld->ngd", P, V[:, kvh]) / P.sum(-1)[..., None]
            gt = gate[a:z, kvh * G:(kvh + 1) * G].astype(np.float64)
            ref[a:z, kvh * G:(kvh + 1) * G] = O / (1 + np.exp(-gt))
    return ref


def make(rng, dec, chunks, bs, nh, nkv, HD):
    """dec: decode contexts; chunks: (new tokens, cached) per sequence."""
    seqs = [([0], c, 0, None) for c in dec] + [([0] * n, c0, 0, None) for n, c0 in chunks]
    need = [-(-(c + len(tk)) // bs) for tk, c, _, _ in seqs]
    perm = rng.permutation(sum(need) + 5) + 1
    pos = 0
    built = []
    for i, ((tk, c, _, _), k) in enumerate(zip(seqs, need)):
        built.append((tk, c, i + 1, list(perm[pos:pos + k])))
        pos += k
    step = Step.build(built)
    nblk = int(perm.max()) + 1
    T = len(step.tokens)
    q = rng.standard_normal((T, nh, HD)).astype(f32)
    gate = rng.standard_normal((T, nh, HD)).astype(f32)
    kc = rng.standard_normal((nblk, bs, nkv, HD)).astype(f32)
    vc = rng.standard_normal((nblk, bs, nkv, HD)).astype(f32)
    return step, q, gate, kc, vc


def run_case(name, dec, chunks, nh, nkv, HD, wave, bs=16, seed=0, mixed_cap=0, launches=2):
    rng = np.random.default_rng(seed)
    G = nh // nkv
    step, q, gate, kc, vc = make(rng, dec, chunks, bs, nh, nkv, HD)
    n_lead = len(dec)
    if mixed_cap:
        W_ = 4000
        lay = MixedLayout(mixed_cap, 8, W_ * bs, W_, 0, 0, G, wave)
        assert lay.fits(step), "not a mixed step"
        P = 8
        pstep, tiles = lay.lay_out(step, P)
        # the padded layout's tables point at page 0 for padding (a real page here: fine for emulation)
        step_e, n_lead_e = pstep, P
        T = len(pstep.tokens)
        # move rows to the padded positions
        qq = np.zeros((T,) + q.shape[1:], f32); gg = np.zeros_like(qq)
        nd = len(dec)
        qq[:nd], gg[:nd] = q[:nd], gate[:nd]
        npf = len(step.tokens) - nd
        qq[P:P + npf], gg[P:P + npf] = q[nd:], gate[nd:]
        qq[P + npf:] = rng.standard_normal((T - P - npf,) + q.shape[1:])
        q, gate = qq, gg
        assert len(tiles) == lay.num_tiles
        entries = int((tiles[:, 3] > 0).sum())
    else:
        tiles, _ = prefill_tiles(step, G, n_lead, wave)
        step_e, n_lead_e = step, n_lead
        entries = len(tiles)
    whole, _ = prefill_tiles(step_e, G, n_lead_e, 0)
    W = Work(wave, nkv, HD)
    want = reference(step_e, n_lead_e, q, gate, kc, vc, bs)
    sel = ~np.isnan(want[..., 0])
    errs = []
    for _ in range(launches):  # repeated launches on the same workspace (layers / graph replays)
        got, stats = launch(tiles, q, gate, kc, vc, step_e.block_tables, step_e.positions, nkv, G, bs, HD, W, rng)
        assert (stats["written"][sel] == 1).all(), "a row written != once"
        assert (stats["written"][~sel] == 0).all()
        d = np.abs(got[sel] - want[sel]).max() / np.abs(want[sel]).max()
        errs.append(d)
    nsplit = int((tiles[:, 6] >= 0).sum())
    maxparts = int((tiles[:, 7] & 0xFFFF).max())
    print(f"{name:42s} tiles {len(whole):3d} entries {entries:3d} split-parts {nsplit:3d} maxparts {maxparts:2d} "
          f"slots used {W.max_slot + 1:4d}/{wave * nkv:4d} merges/launch {stats['merges']:3d} rel err "
          + " ".join(f"{x:.2e}" for x in errs), flush=True)
    return max(errs)
