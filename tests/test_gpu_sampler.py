"""The sampler on device (CuPy arrays) against the same sampler on the host (NumPy arrays).

engine/sampler.py is one code for both array modules: the same random logits, uploaded, must give
the same tokens (greedy, seeded and unseeded rows: the uniforms are drawn on the host from the same
generators), the same masked logits and the same logprobs (within 1e-5: exp/log/sum may differ in
the last bits), for mixed-parameter batches of B = 1, 7 and 64 rows at the real vocabulary size.
Run: python3 -m pytest -q -m gpu tests/test_gpu_sampler.py
"""
import time

import numpy as np
import pytest

from conftest import gpu_or_skip  # noqa: E402

cupy = gpu_or_skip()

from engine.arrays import as_f32, take_rows  # noqa: E402
from engine.sampler import RowParams, Sampler  # noqa: E402

pytestmark = pytest.mark.gpu
V = 248320


def mixed_rows(B, rng):
    """B rows cycling over every parameter combination; odd rows seeded (seed = row index)."""
    hist = lambda n: rng.integers(0, V, n).tolist()  # noqa: E731
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.0, num_logprobs=5),
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.6, top_k=20, top_p=0.95, num_logprobs=20),
        dict(temperature=0.9, top_p=0.9),                      # top-p alone: candidates, maybe widened
        dict(temperature=1.5, top_p=0.98),                     # flat nucleus: the whole-row pass
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.8, min_p=0.1, top_k=50, top_p=0.9),
        dict(temperature=1.0, repetition_penalty=1.3, prompt_ids=hist(200), output_ids=hist(30)),
        dict(temperature=0.0, repetition_penalty=0.8, prompt_ids=hist(50), output_ids=hist(10)),
        dict(temperature=1.1, frequency_penalty=0.7, presence_penalty=-0.4, output_ids=hist(60), num_logprobs=0),
        dict(temperature=0.5, banned_ids=[248044, 248046, 3], logit_bias={7: 5.0, 11: -30.0, 248000: 2.5}),
        dict(temperature=1.0, top_k=V + 5, num_logprobs=2),    # k beyond the vocabulary: off
        dict(temperature=1.0, top_k=1),
    ]
    rows = []
    for i in range(B):
        kw = dict(kinds[(4 * i + 4) % len(kinds)] if B < len(kinds) else kinds[i % len(kinds)])
        rows.append(RowParams(**kw, generator=np.random.default_rng(i) if i % 2 else None))
    return rows


def fresh(rows):
    """The same rows with fresh generators (same seeds), so both runs draw the same uniforms."""
    out = []
    for i, r in enumerate(rows):
        d = dict(r.__dict__)
        d["generator"] = np.random.default_rng(i) if r.generator is not None else None
        out.append(RowParams(**d))
    return out


def make_logits(B, rng):
    x = rng.normal(0, 2.5, (B, V)).astype(np.float32)
    for i in range(0, B, 3):  # peaked rows, like a confident model: a small nucleus
        x[i, rng.integers(0, V, 25)] += rng.uniform(6, 14)
    return x


@pytest.mark.parametrize("B", [1, 7, 64])
def test_device_matches_host(B):
    rng = np.random.default_rng(B)
    host = make_logits(B, rng)
    rows = mixed_rows(B, rng)
    dev = cupy.asarray(host)
    for step in range(3):  # a few steps: the generators advance identically
        if step == 0:
            hr, dr = fresh(rows), fresh(rows)
        a = Sampler(7).sample(host, hr)
        b = Sampler(7).sample(dev, dr)
        assert isinstance(b.token_ids, np.ndarray) and b.token_ids.dtype == np.int64
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        for i, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            if la is None:
                assert lb is None, i
                continue
            assert lb[0] == pytest.approx(la[0], abs=1e-5), i
            assert lb[1] == la[1], i
            np.testing.assert_allclose(lb[2], la[2], atol=1e-5)
    # the masked logits themselves: same mask, same values (f32 + - * / are exact on both)
    pa = Sampler().process(host, rows)
    pb = Sampler().process(dev, rows).get()
    np.testing.assert_array_equal(np.isfinite(pa), np.isfinite(pb))
    fin = np.isfinite(pa)
    np.testing.assert_allclose(pb[fin], pa[fin], rtol=1e-6, atol=0)


def test_ties_and_degenerate_rows():
    x = np.zeros((4, V), np.float32)
    x[1, [10, 20, 30]] = 3.0
    x[2, :] = -1.0
    x[2, V - 1] = -1.0
    rows = [RowParams(temperature=0.0, num_logprobs=3), RowParams(temperature=0.0, num_logprobs=4),
            RowParams(temperature=1.0, top_k=3, generator=np.random.default_rng(1)),
            RowParams(temperature=1.0, top_p=0.5, generator=np.random.default_rng(2))]
    a = Sampler().sample(x, fresh(rows))
    b = Sampler().sample(cupy.asarray(x), fresh(rows))
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert a.token_ids[0] == 0 and a.token_ids[1] == 10 and a.token_ids[2] in (0, 1, 2)
    assert [r[1] for r in a.logprobs[:2]] == [r[1] for r in b.logprobs[:2]] == [[0, 1, 2], [10, 20, 30, 0]]


def test_helpers_on_device():
    x = np.random.default_rng(0).normal(size=(5, 300)).astype(np.float32)
    x[3, 7] = np.nan
    d = cupy.asarray(x)
    np.testing.assert_array_equal(take_rows(d, [4, 1]).get(), x[[4, 1]])
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(as_f32(cupy.asarray(bits)).get(), (bits.astype(np.uint32) << 16).view(np.float32))


def test_timing_report():
    """Not a gate: prints the device sampling time of a B=64 step for a few parameter mixes."""
    rng = np.random.default_rng(0)
    dev = cupy.asarray(make_logits(64, rng))
    mixes = {"greedy": [RowParams(temperature=0.0)] * 64,
             "temperature": [RowParams(temperature=0.8)] * 64,
             "top_k20_top_p0.95": [RowParams(temperature=0.6, top_k=20, top_p=0.95)] * 64,
             "top_p0.9 alone": [RowParams(temperature=0.9, top_p=0.9)] * 64,
             "mixed": mixed_rows(64, rng)}
    s = Sampler()
    for name, rows in mixes.items():
        s.sample(dev, rows)
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(10):
            s.sample(dev, rows)
        print(f"sample B=64 {name}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms")
