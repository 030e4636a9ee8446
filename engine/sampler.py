"""Batched sampling in vLLM's order (serving-conventions §3), NumPy implementation.

One call handles a batch with mixed parameters: every step is a masked array op over the rows
that need it, and per-token data (penalised tokens, banned ids, biases) is passed as flat
(row, token) index arrays, so a CuPy twin is the same code on device arrays. Randomness is one
uniform per row per step from the request's own generator (seeded) or a shared one, drawn on the
host: a seeded request samples the same tokens whatever its batch neighbours are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GREEDY_EPS = 1e-5


@dataclass
class SamplingRow:
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


@dataclass
class SampleResult:
    token_ids: np.ndarray                 # [B] int64
    logprobs: list[tuple[float, list[int], list[float]] | None]  # (chosen lp, top ids, top lps) per row


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _flat(rows, pick):
    """(row index, token id, value) arrays over rows for per-row {token: value} maps."""
    r, t, v = [], [], []
    for i, row in enumerate(rows):
        d = pick(row)
        r += [i] * len(d)
        t += list(d)
        v += list(d.values())
    return np.array(r, np.int64), np.array(t, np.int64), np.array(v, np.float32)


class Sampler:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)  # unseeded requests

    def process(self, logits: np.ndarray, rows: list[SamplingRow]) -> np.ndarray:
        """Steps 2-10 of vLLM's order: the logits the token is drawn from (masked = -inf).
        Greedy rows stop after the penalties (their argmax is the token)."""
        x = np.array(logits, np.float32)
        col = lambda name: np.array([getattr(r, name) for r in rows], np.float32)  # noqa: E731
        # min_tokens masking and logit_bias
        r, t, _ = _flat(rows, lambda row: dict.fromkeys(row.banned_ids, 0.0))
        x[r, t] = -np.inf
        r, t, v = _flat(rows, lambda row: row.logit_bias)
        np.add.at(x, (r, t), v)
        # penalties: repetition over prompt+output, then frequency and presence over output
        rp = col("repetition_penalty")
        r, t, _ = _flat(rows, lambda row: dict.fromkeys(row.prompt_ids + row.output_ids, 0.0)
                        if row.repetition_penalty != 1.0 else {})
        vals = x[r, t]
        x[r, t] = np.where(vals > 0, vals / rp[r], vals * rp[r])
        fp, pp = col("frequency_penalty"), col("presence_penalty")
        r, t, c = _flat(rows, lambda row: _counts(row.output_ids)
                        if row.frequency_penalty or row.presence_penalty else {})
        x[r, t] -= fp[r] * c + pp[r] * (c > 0)
        # temperature, then min_p, then top-k / top-p on the sampled rows
        temp = col("temperature")
        s = np.flatnonzero(temp >= GREEDY_EPS)
        x[s] /= temp[s, None]
        minp = col("min_p")
        m = s[minp[s] > 0]
        if len(m):
            xm = x[m]
            x[m] = np.where(xm < xm.max(1, keepdims=True) + np.log(minp[m])[:, None], -np.inf, xm)
        V = x.shape[1]
        k = np.array([r.top_k if 0 < r.top_k < V else V for r in rows], np.int64)
        p = col("top_p")
        m = s[(k[s] < V) | (p[s] < 1.0)]
        if len(m):
            x[m] = _top_k_top_p(x[m], k[m], p[m])
        return x

    def sample(self, logits: np.ndarray, rows: list[SamplingRow]) -> SampleResult:
        x = self.process(logits, rows)
        tokens = x.argmax(1)
        s = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_EPS]
        if s:
            # inverse CDF with u in (0, 1]: never lands on a zero-probability token
            u = np.array([1.0 - (rows[i].generator or self.rng).random() for i in s])
            xs = x[s]
            cdf = np.cumsum(np.exp(xs - xs.max(1, keepdims=True)), axis=1)
            tokens[s] = np.minimum((cdf < u[:, None] * cdf[:, -1:]).sum(1), x.shape[1] - 1)
        return SampleResult(tokens.astype(np.int64), _logprobs(logits, rows, tokens))


def _counts(ids: list[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for t in ids:
        out[t] = out.get(t, 0.0) + 1.0
    return out


def _top_k_top_p(x: np.ndarray, k: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Top-k, then top-p on the renormalised top-k distribution. Works on the K best candidates
    only (K = the largest k), so the common top-k case never sorts the whole vocabulary."""
    R, V = x.shape
    K = V if (p[k >= V] < 1.0).any() else int(k.max())
    if K < V:
        idx = np.argpartition(-x, K - 1, axis=1)[:, :K]
        idx = np.take_along_axis(idx, np.argsort(-np.take_along_axis(x, idx, 1), axis=1, kind="stable"), 1)
    else:
        idx = np.argsort(-x, axis=1, kind="stable")
    sv = np.take_along_axis(x, idx, 1)
    pos = np.arange(K)[None]
    sv = np.where(pos < k[:, None], sv, -np.inf)
    e = np.exp(sv - sv[:, :1])
    prob = e / e.sum(1, keepdims=True)
    before = np.cumsum(prob, 1) - prob  # mass of the strictly better candidates
    sv = np.where((before < p[:, None]) | (pos == 0), sv, -np.inf)
    out = np.full((R, V), -np.inf, np.float32)
    np.put_along_axis(out, idx, sv, 1)
    return out


def _logprobs(logits, rows, tokens):
    """Chosen-token and top-N logprobs from the raw logits (vLLM's default raw_logprobs)."""
    out = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    if not want:
        return out
    lp = log_softmax(np.asarray(logits, np.float32)[want])
    for j, i in enumerate(want):
        n = rows[i].num_logprobs
        top = np.argpartition(-lp[j], n)[:n] if n else np.zeros(0, np.int64)
        top = top[np.argsort(-lp[j][top], kind="stable")]
        out[i] = (float(lp[j, tokens[i]]), top.tolist(), lp[j, top].tolist())
    return out
