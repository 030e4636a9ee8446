"""Batched sampler vs a straightforward per-row NumPy implementation of vLLM's order."""
import numpy as np
import pytest

from engine.sampler import Sampler, SamplingRow, log_softmax
from engine.sampling_params import SamplingParams

V = 64


def reference(logits, row: SamplingRow):
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
    if 0 < row.top_k < V:
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
        SamplingRow(temperature=0.0),
        SamplingRow(temperature=0.7),
        SamplingRow(temperature=1.0, top_k=5),
        SamplingRow(temperature=0.9, top_p=0.6),
        SamplingRow(temperature=1.3, top_k=10, top_p=0.8),
        SamplingRow(temperature=1.0, min_p=0.2),
        SamplingRow(temperature=0.8, min_p=0.05, top_k=20, top_p=0.9),
        SamplingRow(temperature=1.0, repetition_penalty=1.5, prompt_ids=hist(10), output_ids=hist(5)),
        SamplingRow(temperature=0.0, repetition_penalty=0.7, prompt_ids=hist(10), output_ids=hist(5)),
        SamplingRow(temperature=1.0, frequency_penalty=0.8, presence_penalty=-0.5, output_ids=hist(30)),
        SamplingRow(temperature=0.5, banned_ids=[1, 2, 3], logit_bias={7: 3.0, 8: -50.0}),
        SamplingRow(temperature=1.0, top_k=V + 5),  # k beyond the vocabulary: off
    ]


@pytest.mark.parametrize("seed", range(5))
def test_process_matches_reference(seed):
    rng = np.random.default_rng(seed)
    rows = mixed_rows(rng)
    logits = rng.normal(0, 2, (len(rows), V)).astype(np.float32)
    got = Sampler().process(logits, rows)
    for i, row in enumerate(rows):
        want = reference(logits[i], row)
        assert np.array_equal(np.isfinite(got[i]), np.isfinite(want)), i
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[i][fin], want[fin], rtol=1e-5, atol=1e-5)


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
    assert (s.sample(logits, [SamplingRow(temperature=0.0)] * 4).token_ids == logits.argmax(1)).all()
    rows = [SamplingRow(temperature=2.0, top_k=3)] * 4
    top3 = np.argsort(-logits, 1)[:, :3]
    for _ in range(50):
        t = s.sample(logits, rows).token_ids
        assert all(t[i] in top3[i] for i in range(4))


def test_seed_is_independent_of_batch_neighbours():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (6, V)).astype(np.float32)
    alone = Sampler(0).sample(logits[2:3], [SamplingRow(temperature=1.0, generator=np.random.default_rng(7))])
    rows = [SamplingRow(temperature=1.0) for _ in range(6)]
    rows[2] = SamplingRow(temperature=1.0, generator=np.random.default_rng(7))
    batch = Sampler(123).sample(logits, rows)
    assert batch.token_ids[2] == alone.token_ids[0]


def test_seeded_distribution_follows_probabilities():
    logits = np.log(np.array([[0.5, 0.3, 0.2] + [1e-12] * (V - 3)], np.float32))
    g = np.random.default_rng(0)
    counts = np.bincount([Sampler().sample(logits, [SamplingRow(temperature=1.0, generator=g)]).token_ids[0]
                          for _ in range(3000)], minlength=V)
    np.testing.assert_allclose(counts[:3] / 3000, [0.5, 0.3, 0.2], atol=0.04)


def test_logprobs_come_from_raw_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (2, V)).astype(np.float32)
    rows = [SamplingRow(temperature=0.0, num_logprobs=3, logit_bias={5: 20.0}), SamplingRow(temperature=0.5)]
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
