"""Verification of drafted tokens against the target's logits (spec-decode-spec.md §3).

A verify runs the target over `[x_L, d_1..d_k]` and returns the logits rows l_0..l_k, l_i scoring
the token after d_i (d_0 = x_L). Row i is processed as plain sampling would process the token after
d_1..d_i had been emitted (penalties and min_tokens count the drafts before it as output), so:

- greedy: t_i = argmax of row i; a = the number of leading drafts with d_{i+1} == t_i; the request
  emits d_1..d_a and the bonus t_a.
- sampled (one-hot drafts, as the n-gram drafter's): accept d_{i+1} iff u_i < p_i(d_{i+1}); at the
  first rejection emit a token drawn from p_i with d_{i+1} zeroed (renormalised); all accepted: a
  bonus drawn from p_k. The emitted tokens are distributed exactly as plain sampling's.

It all runs where the logits are, through the sampler's array code (NumPy or CuPy arrays). launch()
enqueues it and draws every uniform on the host, k for the acceptance tests and then one per row for
the replacement draws, whatever is accepted (a seeded request is reproducible); finish() brings the
small results to the host and decides. Logprobs (from the raw logits, as plain sampling's) are
computed in finish() for the emitted tokens alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import HostCopy, array_module, take_rows
from .request import Request
from .sampler import NEG, DrawInFlight, RowParams, Sampler, is_argmax
from .sampling_params import GREEDY_EPS


@dataclass
class VerifyInFlight:
    reqs: list[Request]
    drafts: list[list[int]]
    first: list[int]           # each request's first row in `logits`
    rows: list                 # per request: its RowParams per row, or the exception that ends it
    logits: object             # the raw rows [R, V], where they were computed
    top: HostCopy              # [R, 2] argmax_finite of `logits`
    proc: dict                 # request index -> its first row among the processed rows
    best: HostCopy | None      # [P] argmax of each processed row (greedy requests' tokens)
    p_draft: HostCopy | None   # p_i(d_{i+1}) of each sampled request's processed row (0 on a bonus row)
    draw: DrawInFlight | None  # a draw from each of those rows with its draft zeroed
    u: dict                    # request index -> its k acceptance uniforms (sampled requests)
    samp: dict                 # request index -> its first row in `p_draft` and `draw` (sampled requests)


def launch(sampler: Sampler, logits, top, reqs: list[Request], drafts: list[list[int]], first: list[int],
           rows: list) -> VerifyInFlight:
    """logits [R, V] f32 and top = argmax_finite(logits): the verify rows of reqs (request j's 1 + k_j
    rows start at first[j]). rows: per request its RowParams per row, or an exception (ends it alone)."""
    xp = array_module(logits)
    proc, idx, params, drow = {}, [], [], []
    for j, (req, d, r) in enumerate(zip(reqs, drafts, rows)):
        if isinstance(r, Exception) or all(map(is_argmax, r)):
            continue  # plain greedy rows: argmax_finite already has their tokens
        proc[j] = len(idx)
        idx += range(first[j], first[j] + len(d) + 1)
        params += r
        drow += d + [-1]  # the bonus row has no draft
    best = p_draft = draw = None
    u, samp = {}, {}
    if proc:
        x = take_rows(logits, idx)
        fin = take_rows(top, idx)[:, 1]
        # a non-finite row ends its request in finish(); until then it computes on zeros
        x = sampler.process(xp.where(fin[:, None] != 0, x, np.float32(0)), params)
        best = HostCopy(x.argmax(1))
        sampled = [j for j in proc if reqs[j].params.temperature >= GREEDY_EPS]
        srows = []  # the sampled requests' rows among the processed ones
        for j in sampled:  # acceptance uniforms first, then the replacement draws' (sampler.launch)
            samp[j] = len(srows)
            srows += range(proc[j], proc[j] + len(drafts[j]) + 1)
            g = reqs[j].generator or sampler.rng
            u[j] = np.array([g.random() for _ in drafts[j]])
        if srows:
            xs = x if len(srows) == len(idx) else take_rows(x, srows)
            d = np.array([drow[i] for i in srows], np.int64)
            on = np.flatnonzero(d >= 0)
            r_on, d_on = xp.asarray(on), xp.asarray(d[on])
            e = xp.exp(xs - xs.max(1, keepdims=True))
            p = xp.zeros(len(srows), xp.float64)
            p[r_on] = e[r_on, d_on].astype(xp.float64) / e[r_on].sum(1, dtype=xp.float64)
            p_draft = HostCopy(p)
            masked = xs.copy()
            masked[r_on, d_on] = NEG
            masked = xp.where((masked > NEG).any(1, keepdims=True), masked, xs)  # a draft holding all the mass
            # temperature 1: an inverse-CDF draw from the rows' softmax (top-k again keeps every candidate
            # left and lets the sampler draw among them alone; top-p must not cut twice)
            draw = sampler.launch(masked, [RowParams(temperature=1.0, top_k=params[i].top_k,
                                                     generator=params[i].generator) for i in srows])
    return VerifyInFlight(reqs, drafts, first, rows, logits, HostCopy(top), proc, best, p_draft, draw, u, samp)


def finish(v: VerifyInFlight) -> list[tuple[Request, list | Exception, int]]:
    """Waits for the verify's sampling; per request (request, the emitted tokens as (token id, logprob
    or None) or the exception that ends it, the number of drafts verified)."""
    top = v.top.result()
    best = v.best.result() if v.best is not None else None
    p = v.p_draft.result() if v.p_draft is not None else None
    drawn = v.draw.fetch().token_ids if v.draw is not None else None
    out, lp_rows, lp_tokens, lp_params, lp_at = [], [], [], [], []
    for j, (req, d) in enumerate(zip(v.reqs, v.drafts)):
        k, r0 = len(d), v.first[j]
        if isinstance(v.rows[j], Exception):
            out.append((req, v.rows[j], k))
            continue
        if j in v.u:  # sampled: accept while u_i < p_i(d_{i+1}); then the replacement draw (bonus if a = k)
            q = v.samp[j]
            a = next((i for i in range(k) if not v.u[j][i] < p[q + i]), k)
            tokens = d[:a] + [int(drawn[q + a])]
        else:          # greedy: accept while d_{i+1} == t_i; then t_a
            t = (top[r0:r0 + k + 1, 0] if j not in v.proc else best[v.proc[j]:v.proc[j] + k + 1]).tolist()
            a = next((i for i in range(k) if d[i] != t[i]), k)
            tokens = d[:a] + [t[a]]
        if not all(top[r0:r0 + a + 1, 1].tolist()):
            out.append((req, FloatingPointError(f"non-finite logits for request {req.request_id}"), k))
            continue
        if req.params.logprobs is not None:
            lp_at.append((len(out), len(lp_rows)))
            lp_rows += range(r0, r0 + a + 1)
            lp_tokens += tokens
            lp_params += v.rows[j][:a + 1]
        out.append((req, [(t, None) for t in tokens], k))
    if lp_rows:  # the emitted tokens' logprobs, from their raw rows
        xp = array_module(v.logits)
        lps = DrawInFlight.launch(xp, take_rows(v.logits, lp_rows), lp_params,
                                  xp.asarray(np.array(lp_tokens, np.int64))).fetch().logprobs
        for i, at in lp_at:
            req, toks, k = out[i]
            out[i] = (req, [(t, lps[at + n]) for n, (t, _) in enumerate(toks)], k)
    return out
