"""Batched sampling in vLLM's order (serving-conventions §3), one code for NumPy and CuPy arrays.

One call handles a batch with mixed parameters: every step is an array op over the whole batch (or
the rows that need it), and per-token data (penalised tokens, banned ids, biases) is built on the host
as flat indices into the [B, V] logits with their values, uploaded once. The same functions run on
NumPy arrays (CPU backend, test hooks) and on CuPy arrays (GPU backend: the logits never leave the
device; CuPy is imported only when it is handed a CuPy array). Only small results come back: the [B]
tokens and, for rows that ask, the chosen and top-N logprobs, in one transfer.

Randomness is one uniform per sampled row per step from the request's own generator (seeded) or the
shared one, drawn on the host in row order: a seeded request samples the same tokens whatever its
batch neighbours are, and the CPU and the GPU draw the same uniforms.

Exactness across the two array modules: a candidate's rank is its unique key (value descending, then
token id ascending), so top-k / top-p / top-N select the same tokens whatever sort or selection
algorithm runs; elementwise float32 math (+ - * /) is IEEE on both; probability mass is int64 fixed
point (_mass), so top-p cuts and the inverse CDF add exactly, in any order. Only exp and log may
differ in the last bit between NumPy and CUDA: logprobs agree to ~1e-6, and a token could differ only
if a draw fell within ~1e-13 of a boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .arrays import HostCopy, array_module, as_f32, to_numpy
from .sampling_params import GREEDY_EPS

TOP_P_CANDIDATES = 1024   # top-p without top-k: the nucleus is first looked for among this many best
NEG = np.float32(-np.inf)
_PAD_KEY = np.int64(np.iinfo(np.int64).max)
_LOW32 = np.int64(0xFFFFFFFF)


@dataclass
class RowParams:
    """One sequence's sampling inputs for this step (plain Python, built by the runner)."""
    temperature: float
    top_k: int = -1              # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    banned_ids: list[int] = field(default_factory=list)     # min_tokens: stop/EOS ids suppressed
    logit_bias: dict[int, float] = field(default_factory=dict)
    num_logprobs: int | None = None
    generator: np.random.Generator | None = None


def is_argmax(row: RowParams) -> bool:
    """The sampler would return this row's raw argmax and nothing else (greedy, nothing that changes
    the logits, no logprobs): the runner takes the backend's argmax instead of sampling."""
    return (row.temperature < GREEDY_EPS and row.repetition_penalty == 1.0 and not row.presence_penalty
            and not row.frequency_penalty and not row.banned_ids and not row.logit_bias
            and row.num_logprobs is None)


@dataclass
class DrawResult:
    token_ids: np.ndarray                 # [B] int64 (host)
    logprobs: list[tuple[float, list[int], list[float]] | None]  # (chosen lp, top ids, top lps) per row


# ---- host-side inputs, uploaded once ----------------------------------------------------------
def _upload(xp, arrays: dict[str, np.ndarray]) -> dict:
    """Host arrays on xp's device, one copy per dtype (identity for NumPy)."""
    if xp is np:
        return arrays
    out = {}
    for dt in sorted({a.dtype.str for a in arrays.values()}):
        names = [k for k, a in arrays.items() if a.dtype.str == dt]
        dev = xp.asarray(np.concatenate([arrays[k].ravel() for k in names]))
        off = 0
        for k in names:
            a = arrays[k]
            out[k] = dev[off:off + a.size].reshape(a.shape)
            off += a.size
    return out


def log_softmax(x):
    xp = array_module(x)
    m = x.max(-1, keepdims=True)
    return x - m - xp.log(xp.exp(x - m).sum(-1, keepdims=True))


def _flat(rows, pick, V):
    """(flat index row * V + token, row, value) arrays over rows for per-row {token: value} maps."""
    r, t, v = [], [], []
    for i, row in enumerate(rows):
        d = pick(row)
        r += [i] * len(d)
        t += list(d)
        v += list(d.values())
    r, t = np.array(r, np.int64), np.array(t, np.int64)
    if len(t) and (t.min() < 0 or t.max() >= V):
        bad = t[(t < 0) | (t >= V)]
        raise IndexError(f"token ids {sorted(set(bad.tolist()))[:8]} out of range for vocabulary {V}")
    return r * V + t, r, np.array(v, np.float32)


def _counts(ids: list[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for t in ids:
        out[t] = out.get(t, 0.0) + 1.0
    return out


@dataclass
class _Inputs:
    """Everything process() needs from the rows, as small host arrays (`arrays` travel to the device)."""
    arrays: dict
    scale: bool          # some sampled row has temperature != 1
    min_p: bool
    top_rows: np.ndarray  # sampled rows with top-k or top-p
    top_k: np.ndarray     # [len(top_rows)] (V = off)
    top_p: np.ndarray


def _inputs(rows: list[RowParams], V: int) -> _Inputs:
    col = lambda name: np.array([getattr(r, name) for r in rows], np.float32)  # noqa: E731
    a = {}
    a["ban"], _, _ = _flat(rows, lambda row: dict.fromkeys(row.banned_ids, 0.0), V)
    a["bias_i"], _, a["bias_v"] = _flat(rows, lambda row: row.logit_bias, V)
    # penalties: repetition over prompt+output, then frequency and presence over output
    a["rep_i"], r, _ = _flat(rows, lambda row: dict.fromkeys(row.prompt_ids + row.output_ids, 0.0)
                             if row.repetition_penalty != 1.0 else {}, V)
    a["rep_v"] = col("repetition_penalty")[r]
    fp, pp = col("frequency_penalty"), col("presence_penalty")
    a["pen_i"], r, c = _flat(rows, lambda row: _counts(row.output_ids)
                             if row.frequency_penalty or row.presence_penalty else {}, V)
    a["pen_v"] = fp[r] * c + pp[r] * (c > 0)
    temp = col("temperature")
    sampled = temp >= GREEDY_EPS
    a["tdiv"] = np.where(sampled, temp, np.float32(1.0)).astype(np.float32)
    minp = col("min_p")
    on = sampled & (minp > 0)
    a["lminp"] = np.where(on, np.log(np.where(on, minp, np.float32(1.0))), NEG).astype(np.float32)
    k = np.array([r.top_k if 0 < r.top_k < V else V for r in rows], np.int64)
    p = col("top_p")
    m = np.flatnonzero(sampled & ((k < V) | (p < 1.0)))
    a["top_rows"], a["top_k"], a["top_p"] = m, k[m], p[m]
    return _Inputs(a, bool((a["tdiv"] != 1.0).any()), bool(on.any()), m, k[m], p[m])


# ---- the sampler -------------------------------------------------------------------------------
class Sampler:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)  # unseeded requests

    def process(self, logits, rows: list[RowParams]):
        """Steps 2-10 of vLLM's order: the logits the token is drawn from (masked = -inf), a new
        float32 array on the logits' device. Greedy rows stop after the penalties (their argmax is
        the token)."""
        return self._process(logits, rows)[0]

    def _process(self, logits, rows):
        """(process()'s logits, the kept candidates of the top-k / top-p rows or None)."""
        xp = array_module(logits)
        x = xp.array(logits, dtype=xp.float32, order="C")
        R, V = x.shape
        h = _inputs(rows, V)
        d = _upload(xp, h.arrays)
        f = x.reshape(-1)  # a view: flat indices row * V + token
        # min_tokens masking and logit_bias (each map's tokens are distinct: plain fancy indexing)
        if d["ban"].size:
            f[d["ban"]] = NEG
        if d["bias_i"].size:
            f[d["bias_i"]] += d["bias_v"]
        if d["rep_i"].size:
            vals = f[d["rep_i"]]
            f[d["rep_i"]] = xp.where(vals > 0, vals / d["rep_v"], vals * d["rep_v"])
        if d["pen_i"].size:
            f[d["pen_i"]] -= d["pen_v"]
        # temperature (greedy rows divide by 1: unchanged), then min_p, then top-k / top-p
        if h.scale:
            x /= d["tdiv"][:, None]
        if h.min_p:  # rows without min_p have threshold -inf
            x = xp.where(x < (x.max(1) + d["lminp"])[:, None], NEG, x)
        cand = None
        if len(h.top_rows):
            whole = len(h.top_rows) == R
            xm = x if whole else x[d["top_rows"]]
            out, ids, keep, fit = _top_k_top_p(xp, xm, d["top_k"], d["top_p"], h.top_k, h.top_p)
            if whole:
                x = out
            else:
                x[d["top_rows"]] = out
            if not fit.all():
                fi = _upload(xp, {"f": np.flatnonzero(fit)})["f"]
                ids, keep = ids[fi], keep[fi]
            cand = (h.top_rows[fit], ids, keep)
        return x, cand

    def sample(self, logits, rows: list[RowParams]) -> DrawResult:
        return self.launch(logits, rows).fetch()

    def launch(self, logits, rows: list[RowParams]) -> "DrawInFlight":
        """sample() without waiting for the device: the tokens stay where the logits are (they can feed
        the next forward before the host has seen them); fetch() brings everything to the host."""
        xp = array_module(logits)
        x, cand = self._process(logits, rows)
        R, V = x.shape
        tokens = x.argmax(1)
        s = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_EPS]
        if s:
            # inverse CDF in vocabulary order with u in (0, 1]: never lands on a zero-probability
            # token. Rows cut by top-k / top-p draw from their kept candidates alone (the same draw:
            # the rest of the row is -inf), the others over the whole row.
            u = np.array([1.0 - (rows[i].generator or self.rng).random() for i in s], np.float64)
            pos = {int(r): j for j, r in enumerate(cand[0])} if cand is not None else {}
            c = [j for j, i in enumerate(s) if i in pos]      # positions in s
            f = [j for j, i in enumerate(s) if i not in pos]
            sa = np.array(s, np.int64)
            d = _upload(xp, {"c": np.array([pos[s[j]] for j in c], np.int64), "gc": sa[c],
                             "uc": u[c], "gf": sa[f], "uf": u[f]})
            if c:
                _, ids, keep = cand
                if len(c) < len(cand[0]):
                    ids, keep = ids[d["c"]], keep[d["c"]]
                tokens[d["gc"]] = _inverse_cdf_kept(xp, x, d["gc"], ids, keep, d["uc"], tokens[d["gc"]])
            if f:
                if len(f) == R:
                    tokens = _inverse_cdf(xp, x, d["uf"], tokens)
                else:
                    tokens[d["gf"]] = _inverse_cdf(xp, x[d["gf"]], d["uf"], tokens[d["gf"]])
        return DrawInFlight.launch(xp, logits, rows, tokens)


@dataclass
class DrawInFlight:
    """A sampling enqueued on the logits' device: `tokens` [R] (int64, on the device), and the tokens with
    the chosen and top-N logprobs (from the raw logits, vLLM's default raw_logprobs) of the rows that
    ask, packed in one array on its way to the host (one transfer); fetch() waits for it."""
    tokens: object
    packed: HostCopy
    rows: list[RowParams]
    want: list[int]
    N: int

    @classmethod
    def launch(cls, xp, logits, rows, tokens) -> "DrawInFlight":
        R = len(rows)
        want = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
        parts = [tokens.astype(xp.float64)]
        N = max([rows[i].num_logprobs for i in want], default=0)
        if want:
            wi = _upload(xp, {"w": np.array(want, np.int64)})["w"]
            raw = as_f32(logits if len(want) == R else logits[wi])
            # log_softmax's own formula, (x - m) - log(sum(exp(x - m))), evaluated at the gathered tokens
            m = raw.max(1, keepdims=True)
            ls = xp.log(xp.exp(raw - m).sum(1, keepdims=True))
            parts.append(((xp.take_along_axis(raw, tokens[wi][:, None], 1) - m) - ls).ravel().astype(xp.float64))
            if N:
                ids, n = _ranked(xp, raw, N)
                top = (xp.take_along_axis(raw, ids, 1) - m) - ls
                parts += [ids.ravel().astype(xp.float64), top.ravel().astype(xp.float64), n.astype(xp.float64)]
        return cls(tokens, HostCopy(xp.concatenate(parts)), rows, want, min(N, logits.shape[1]))

    def fetch(self) -> DrawResult:
        rows, want, N, R = self.rows, self.want, self.N, len(self.rows)
        host = self.packed.result()
        out: list = [None] * R
        if want:
            W = len(want)
            chosen = host[R:R + W]
            if N:
                ids = host[R + W:R + W + W * N].astype(np.int64).reshape(W, N)
                top = host[R + W + W * N:R + W + 2 * W * N].reshape(W, N)
                n = host[R + W + 2 * W * N:].astype(np.int64)
            for j, i in enumerate(want):
                c = min(rows[i].num_logprobs, int(n[j])) if N else 0
                out[i] = (float(chosen[j]), ids[j, :c].tolist() if c else [], top[j, :c].tolist() if c else [])
        return DrawResult(host[:R].astype(np.int64), out)


# ---- ranking, top-k / top-p, inverse CDF -------------------------------------------------------
def _desc_keys(xp, vals, ids):
    """int64 keys ordering (value descending, id ascending), unique per row: the sort order never
    depends on the algorithm. ids < 2**32; -0.0 counts as +0.0; values are not NaN."""
    b = (vals + np.float32(0.0)).view(xp.int32)
    s = b ^ ((b >> 31) & np.int32(0x7FFFFFFF))      # int32 increasing with the float value
    return (~s).astype(xp.int64) * np.int64(1 << 32) + ids.astype(xp.int64)


def _ranked(xp, x, K: int):
    """Each row's K best finite entries in (value descending, id ascending) order: (ids [R, K'],
    n [R]) with K' = min(K, V) and n = how many of a row's K' are real (fewer finite: the rest are
    padding with id 0). Small K: chunk maxima bound the K-th best from below (K chunks have a max at
    least that large), so only the entries at or above that bound are compacted and sorted."""
    R, V = x.shape
    K = min(K, V)
    col = xp.arange(K)
    if 4 * K >= V:
        keys = _desc_keys(xp, x, xp.arange(V)[None, :])
        keys.sort(axis=1)
        keys = keys[:, :K]
        n = xp.minimum((x > NEG).sum(1), K)
    else:
        L = -(-V // max(64, 4 * K))     # chunk length: at least 2K chunks
        nc = -(-V // L)
        pad = xp.full((R, nc * L), NEG, xp.float32)
        pad[:, :V] = x
        cm = xp.sort(pad.reshape(R, nc, L).max(2), axis=1)
        bound = cm[:, nc - K]            # the K-th largest chunk maximum <= the K-th largest entry
        mask = (x >= bound[:, None]) & (x > NEG)
        cnt = mask.sum(1)
        rr, cc = xp.nonzero(mask)        # row-major: ascending ids within a row
        start = xp.cumsum(cnt) - cnt
        pos = xp.arange(rr.size) - start[rr]
        C = max(int(cnt.max()), K)
        keys = xp.full((R, C), _PAD_KEY, xp.int64)
        keys[rr, pos] = _desc_keys(xp, x[rr, cc], cc)
        keys.sort(axis=1)
        keys = keys[:, :K]
        n = xp.minimum(cnt, K)
    ids = xp.where(col[None, :] < n[:, None], keys & _LOW32, 0)
    return ids, n


def _mass(xp, d, V: int):
    """Probability mass exp(d) (d = logit - row max <= 0, float64) in int64 fixed point, 2**(62 -
    bits(V)) per unit of the max: integer sums are exact, so every prefix sum and total is the same
    whatever the summation order or device (a mass below ~V * 2**-62 of the max counts as zero)."""
    return (xp.exp(d) * float(2 ** (62 - V.bit_length()))).astype(xp.int64)


def _top_k_top_p(xp, x, k, p, k_host, p_host):
    """Top-k, then top-p on the renormalised top-k distribution (rows without top-k: the whole
    distribution). Works on the K best candidates (K = the largest k; TOP_P_CANDIDATES for top-p
    alone), so the common cases never sort the vocabulary; a top-p row whose nucleus is not inside
    its candidates is redone with 16x as many, then over the whole row.
    Returns (masked logits [R, V], first-pass candidate ids and keep mask [R, K], host fit [R]:
    whether a row's kept tokens are all among those candidates)."""
    R, V = x.shape
    nucleus = (k_host >= V) & (p_host < 1.0)
    K = int(np.where(nucleus, min(V, TOP_P_CANDIDATES), k_host).max())
    zfull = None
    if nucleus.any():  # top-p alone normalises over the whole row
        zfull = _mass(xp, x.astype(xp.float64) - x.max(1, keepdims=True).astype(xp.float64), V).sum(1)
    out, ids, keep, fits = _cut(xp, x, k, p, zfull, K)
    fit = np.ones(R, bool)
    if nucleus.any() and K < V:
        fit = to_numpy(fits)
        todo = np.flatnonzero(~fit)
        while len(todo):
            K = V if 64 * K >= V else 16 * K
            ri = _upload(xp, {"r": todo})["r"]
            o, _, _, f = _cut(xp, x[ri], k[ri], p[ri], zfull[ri], K)
            out[ri] = o
            todo = todo[~to_numpy(f)] if K < V else todo[:0]
    return out, ids, keep, fit


def _cut(xp, x, k, p, zfull, K):
    """(masked logits [R, V], candidate ids [R, K], keep [R, K], fits [R]) from each row's K best
    candidates; fits: the top-k / top-p cut fell inside them (always, for rows with top-k)."""
    R, V = x.shape
    ids, n = _ranked(xp, x, K)
    K = ids.shape[1]
    pos = xp.arange(K)[None, :]
    vals = xp.take_along_axis(x, ids, 1)
    live = pos < xp.minimum(n, k)[:, None]                  # top-k (and real)
    sv = xp.where(live, vals, NEG).astype(xp.float64)
    e = _mass(xp, sv - sv[:, :1], V)
    z = e.sum(1)
    if zfull is not None:
        z = xp.where(k < V, z, zfull)
    pz = p.astype(xp.float64) * z.astype(xp.float64)      # p of the (top-k or whole) mass
    cum = xp.cumsum(e, 1)
    # top-p: keep while the mass of the strictly better candidates is below p (rows with p < 1)
    keep = live & (((cum - e).astype(xp.float64) < pz[:, None]) | (pos == 0) | (p >= 1.0)[:, None])
    fits = (k < V) | (n < K) | (cum[:, -1].astype(xp.float64) >= pz)
    full = xp.full((R, V + 1), NEG, xp.float32)             # column V takes the dropped candidates
    full[xp.arange(R)[:, None], xp.where(keep, ids, V)] = vals
    return full[:, :V], ids, keep, fits


def _inverse_cdf_kept(xp, x, rows, ids, keep, u, fallback):
    """_inverse_cdf's draw for x[rows], from each row's kept candidates alone (every other token of
    those rows is -inf): the kept ids in vocabulary order, their float64 prefix sums."""
    V = x.shape[1]
    srt = xp.sort(xp.where(keep, ids, V), axis=1)          # kept ids ascending, then V (none)
    ok = srt < V
    v = xp.where(ok, x[rows[:, None], xp.minimum(srt, V - 1)], NEG).astype(xp.float64)
    e = _mass(xp, v - v.max(1, keepdims=True), V)
    c = xp.cumsum(e, 1)
    target = u * c[:, -1].astype(xp.float64)
    t = xp.minimum((c.astype(xp.float64) < target[:, None]).sum(1), ok.sum(1) - 1)[:, None]
    tok = xp.take_along_axis(srt, t, 1)[:, 0]
    return xp.where(xp.take_along_axis(e, t, 1)[:, 0] > 0, tok, fallback)


def _inverse_cdf(xp, x, u, argmax):
    """Per row the first token whose cumulative mass (vocabulary order, _mass fixed point) reaches
    u * total, two-level: chunk sums pick the chunk, one chunk's prefix sums pick the token.
    argmax: each row's argmax (its value is the row max; the token if a zero-mass token were ever
    pointed at)."""
    S, V = x.shape
    L = 1 << (((V - 1).bit_length() + 1) // 2)               # ~sqrt(V), a power of two
    nc = -(-V // L)
    e = xp.zeros((S, nc * L), xp.int64)
    e[:, :V] = _mass(xp, x.astype(xp.float64) - xp.take_along_axis(x, argmax[:, None], 1).astype(xp.float64), V)
    e3 = e.reshape(S, nc, L)
    cc = xp.cumsum(e3.sum(2), 1)
    target = u * cc[:, -1].astype(xp.float64)
    j = xp.minimum((cc.astype(xp.float64) < target[:, None]).sum(1), nc - 1)
    base = xp.where(j > 0, xp.take_along_axis(cc, xp.maximum(j - 1, 0)[:, None], 1)[:, 0], 0)
    ar = xp.arange(S)
    t = ((base[:, None] + xp.cumsum(e3[ar, j], 1)).astype(xp.float64) < target[:, None]).sum(1)
    tok = j * L + xp.minimum(t, L - 1)
    return xp.where(e[ar, tok] > 0, tok, argmax)
