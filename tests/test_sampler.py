"""Batched sampler vs a straightforward per-row NumPy implementation of vLLM's order."""
import numpy as np
import pytest

from engine import sampler as S
from engine.sampler import RowParams, Sampler, log_softmax
from engine.sampling_params import SamplingParams

V = 64


def reference(logits, row: RowParams):
    """One row, vLLM's order, written plainly (full sorts, Python loops)."""
    x = logits.astype(np.float64).copy()
    for t in row.banned_ids:
        x[t] = -np.inf
    for t, b in row.logit_bias.items():
        x[t] += b
    if row.repetition_penalty != 1.0:
        for t in set(row.prompt_ids) | set(row.output_ids):
            x[t] = x[t] / row.repetition_penalty if x[t] > 0 else x[t] * row.repetition_penalty
    for t in set(row.output_ids):
        c = row.output_ids.count(t)
        x[t] -= row.frequency_penalty * c
        x[t] -= row.presence_penalty * (c > 0)
    if row.temperature < 1e-5:
        return x
    x /= row.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if row.min_p > 0:
        x[p < row.min_p * p.max()] = -np.inf
    if 0 < row.top_k < len(x):
        kth = np.sort(x)[::-1][row.top_k - 1]
        x[x < kth] = -np.inf
    if row.top_p < 1.0:
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(p)  # ascending, as vLLM
        cum = np.cumsum(p[order])
        drop = cum <= 1 - row.top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    return x


def ref_token(x, u):
    p = np.exp(x - x.max())
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, u * cdf[-1]))


def mixed_rows(rng):
    hist = lambda n: rng.integers(0, V, n).tolist()  # noqa: E731
    return [
        RowParams(temperature=0.0),
        RowParams(temperature=0.7),
        RowParams(temperature=1.0, top_k=5),
        RowParams(temperature=0.9, top_p=0.6),
        RowParams(temperature=1.3, top_k=10, top_p=0.8),
        RowParams(temperature=1.0, min_p=0.2),
        RowParams(temperature=0.8, min_p=0.05, top_k=20, top_p=0.9),
        RowParams(temperature=1.0, repetition_penalty=1.5, prompt_ids=hist(10), output_ids=hist(5)),
        RowParams(temperature=0.0, repetition_penalty=0.7, prompt_ids=hist(10), output_ids=hist(5)),
        RowParams(temperature=1.0, frequency_penalty=0.8, presence_penalty=-0.5, output_ids=hist(30)),
        RowParams(temperature=0.5, banned_ids=[1, 2, 3], logit_bias={7: 3.0, 8: -50.0}),
        RowParams(temperature=1.0, top_k=V + 5),  # k beyond the vocabulary: off
    ]


def assert_process_matches(logits, rows):
    """Sampler.process masks exactly what the reference masks, and the kept logits agree."""
    got = Sampler().process(logits, rows)
    for i, row in enumerate(rows):
        want = reference(logits[i], row)
        assert np.array_equal(np.isfinite(got[i]), np.isfinite(want)), i
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[i][fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_process_matches_reference(seed):
    rng = np.random.default_rng(seed)
    rows = mixed_rows(rng)
    logits = rng.normal(0, 2, (len(rows), V)).astype(np.float32)
    assert_process_matches(logits, rows)


def test_sample_matches_reference_with_same_uniforms():
    rng = np.random.default_rng(1)
    rows = mixed_rows(rng)
    for r in rows:
        r.generator = np.random.default_rng(42)
    logits = rng.normal(0, 2, (len(rows), V)).astype(np.float32)
    toks = Sampler().sample(logits, rows).token_ids
    for i, row in enumerate(rows):
        x = reference(logits[i], row)
        want = int(np.argmax(x)) if row.temperature < 1e-5 else ref_token(x, 1.0 - np.random.default_rng(42).random())
        assert toks[i] == want, i


def test_greedy_is_argmax_and_masked_tokens_never_sampled():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1, (4, V)).astype(np.float32)
    s = Sampler(0)
    assert (s.sample(logits, [RowParams(temperature=0.0)] * 4).token_ids == logits.argmax(1)).all()
    rows = [RowParams(temperature=2.0, top_k=3)] * 4
    top3 = np.argsort(-logits, 1)[:, :3]
    for _ in range(50):
        t = s.sample(logits, rows).token_ids
        assert all(t[i] in top3[i] for i in range(4))


def test_seed_is_independent_of_batch_neighbours():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (6, V)).astype(np.float32)
    alone = Sampler(0).sample(logits[2:3], [RowParams(temperature=1.0, generator=np.random.default_rng(7))])
    rows = [RowParams(temperature=1.0) for _ in range(6)]
    rows[2] = RowParams(temperature=1.0, generator=np.random.default_rng(7))
    batch = Sampler(123).sample(logits, rows)
    assert batch.token_ids[2] == alone.token_ids[0]


def test_seeded_distribution_follows_probabilities():
    logits = np.log(np.array([[0.5, 0.3, 0.2] + [1e-12] * (V - 3)], np.float32))
    g = np.random.default_rng(0)
    counts = np.bincount([Sampler().sample(logits, [RowParams(temperature=1.0, generator=g)]).token_ids[0]
                          for _ in range(3000)], minlength=V)
    np.testing.assert_allclose(counts[:3] / 3000, [0.5, 0.3, 0.2], atol=0.04)


def test_logprobs_come_from_raw_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (2, V)).astype(np.float32)
    rows = [RowParams(temperature=0.0, num_logprobs=3, logit_bias={5: 20.0}), RowParams(temperature=0.5)]
    out = Sampler().sample(logits, rows)
    assert out.token_ids[0] == 5 and out.logprobs[1] is None
    lp = log_softmax(logits[0].astype(np.float64))
    chosen, ids, lps = out.logprobs[0]
    assert chosen == pytest.approx(lp[5], abs=1e-5)
    assert ids == np.argsort(-lp)[:3].tolist()
    np.testing.assert_allclose(lps, np.sort(lp)[::-1][:3], atol=1e-5)


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={3: 200.0}), "logit_bias"),
])
def test_params_validation_names_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_params_defaults_from_generation_config():
    p = SamplingParams().with_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    p = SamplingParams(temperature=0.0, top_k=-1).with_defaults({"temperature": 0.6, "top_k": 20})
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, -1)
    assert SamplingParams(stop="x").stop == ["x"]


# ---- large vocabularies: the candidate prefilter, the top-p widening, ties, the two-level CDF ----

def check_against_reference(logits, rows, seed=42):
    assert_process_matches(logits, rows)
    for r in rows:
        r.generator = np.random.default_rng(seed)
    toks = Sampler().sample(logits, rows).token_ids
    for i, row in enumerate(rows):
        x = reference(logits[i], row)
        want = int(np.argmax(x)) if row.temperature < 1e-5 else ref_token(x, 1.0 - np.random.default_rng(seed).random())
        assert toks[i] == want, i


@pytest.mark.parametrize("Vbig", [5000, 70000])
def test_large_vocab_paths_match_reference(Vbig):
    """Top-k via chunk maxima, top-p found among TOP_P_CANDIDATES (peaked rows) or after widening
    (flat rows: 16x, then the whole row), min_p leaving fewer finite tokens than k."""
    rng = np.random.default_rng(Vbig)
    logits = rng.normal(0, 2, (9, Vbig)).astype(np.float32)
    logits[1:4, rng.integers(0, Vbig, 30)] += 12.0  # peaked rows: a small nucleus
    rows = [
        RowParams(temperature=1.0, top_k=5),
        RowParams(temperature=0.9, top_p=0.9),
        RowParams(temperature=0.7, top_k=50, top_p=0.8),
        RowParams(temperature=1.0, top_p=0.5, min_p=0.01),
        RowParams(temperature=1.5, top_p=0.95),         # flat: the nucleus is most of the vocabulary
        RowParams(temperature=1.0, top_p=0.3),          # flat, smaller nucleus
        RowParams(temperature=1.0, min_p=0.5, top_k=40),  # fewer finite tokens than k
        RowParams(temperature=0.0, repetition_penalty=1.3, prompt_ids=rng.integers(0, Vbig, 40).tolist()),
        RowParams(temperature=1.0, banned_ids=[7, 9], logit_bias={3: 8.0}, frequency_penalty=0.5,
                    output_ids=rng.integers(0, Vbig, 20).tolist()),
    ]
    check_against_reference(logits, rows, seed=Vbig)


def lex_order(x):
    """Reference ranking: finite entries by value descending, then id ascending."""
    ids = np.lexsort((np.arange(len(x)), -x.astype(np.float64)))
    return ids[np.isfinite(x[ids])]


@pytest.mark.parametrize("K", [1, 3, 17, 200, 1300, 5000])
def test_ranked_order_is_unique_with_ties(K):
    rng = np.random.default_rng(K)
    x = (np.round(rng.normal(0, 2, (5, 5000)) * 2) / 2).astype(np.float32)  # many ties
    x[1, rng.integers(0, 5000, 4990)] = -np.inf                                  # fewer finite than K
    x[2] = 0.0
    x[2, ::2] = -0.0                                                              # -0.0 ties +0.0
    x[3, :] = -np.inf
    x[3, [10, 4000]] = 1.0
    ids, n = S._ranked(np, x, K)
    for i in range(5):
        want = lex_order(x[i])[:K]
        assert n[i] == len(want)
        assert ids[i, :n[i]].tolist() == want.tolist(), i


def test_top_k_ties_keep_the_lowest_ids():
    logits = np.zeros((1, 4000), np.float32)
    logits[0, [100, 200]] = 1.0
    x = Sampler().process(logits, [RowParams(temperature=1.0, top_k=5)])
    assert np.flatnonzero(np.isfinite(x[0])).tolist() == [0, 1, 2, 100, 200]


def test_inverse_cdf_matches_searchsorted_and_skips_masked():
    rng = np.random.default_rng(5)
    V2 = 3001  # not a multiple of the chunk length
    x = rng.normal(0, 3, (6, V2)).astype(np.float32)
    x[:, rng.integers(0, V2, 2000)] = -np.inf
    x[5, :-1] = -np.inf  # only the last token
    x[5, -1] = 0.5
    for u in [1e-12, 0.3, 0.999999, 1.0, *rng.random(20)]:
        uu = np.full(6, u)
        got = S._inverse_cdf(np, x, uu, x.argmax(1))
        for i in range(6):
            assert got[i] == ref_token(x[i].astype(np.float64), u), (i, u)
            assert np.isfinite(x[i, got[i]])


def test_kept_candidates_draw_equals_whole_row_draw():
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 2, (4, 6000)).astype(np.float32)
    rows = [RowParams(temperature=1.0, top_k=k, top_p=p) for k, p in [(7, 1.0), (60, 0.7), (500, 0.95), (3, 0.1)]]
    x, cand = Sampler()._process(logits, rows)
    r, ids, keep = cand
    for u in rng.random(30):
        uu = np.full(4, u)
        a = S._inverse_cdf_kept(np, x, r, ids, keep, uu, x.argmax(1))
        b = S._inverse_cdf(np, x, uu, x.argmax(1))
        assert a.tolist() == b.tolist()


def test_logprobs_sizes_and_ties():
    logits = np.zeros((3, V), np.float32)
    logits[0, 5] = 1.0
    rows = [RowParams(temperature=0.0, num_logprobs=4), RowParams(temperature=1.0, num_logprobs=0),
            RowParams(temperature=0.0, num_logprobs=V + 10)]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[0][1] == [5, 0, 1, 2]          # ties: the lowest ids first
    assert out.logprobs[1][1] == [] and out.logprobs[1][2] == []
    assert out.logprobs[2][1] == list(range(V)) and len(out.logprobs[2][2]) == V
    assert out.logprobs[1][0] == pytest.approx(-np.log(V), abs=1e-5)


def test_out_of_range_token_ids_raise():
    logits = np.zeros((1, V), np.float32)
    for row in (RowParams(temperature=0.0, banned_ids=[V]), RowParams(temperature=0.0, logit_bias={-1: 1.0})):
        with pytest.raises(IndexError, match="out of range"):
            Sampler().sample(logits, [row])


def test_bf16_bits():
    from engine.arrays import as_f32, f32_to_bf16
    a = np.array([[1.5, -2.0], [np.nan, 0.25]], np.float32)
    np.testing.assert_array_equal(as_f32(f32_to_bf16(a))[0], a[0])
