"""Op-level checks of the NumPy reference that the model-level gate cannot localise."""
import numpy as np
import pytest

from engine.backend_numpy import NumpyBackend, delta_rule_chunked, delta_rule_recurrent, l2norm
from engine.step import Step


def _inputs(rng, T, h=3, dk=16, dv=24):
    q = l2norm(rng.standard_normal((T, h, dk)).astype(np.float32)) * dk ** -0.5
    k = l2norm(rng.standard_normal((T, h, dk)).astype(np.float32))
    v = rng.standard_normal((T, h, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.3, (T, h)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, h)).astype(np.float32)
    S0 = rng.standard_normal((h, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T", [1, 5, 64, 65, 200])
def test_chunked_delta_rule_equals_recurrence(T):
    q, k, v, g, beta, S0 = _inputs(np.random.default_rng(T), T)
    o1, S1 = delta_rule_recurrent(q, k, v, g, beta, S0)
    o2, S2 = delta_rule_chunked(q, k, v, g, beta, S0)
    assert np.abs(o1 - o2).max() <= 1e-4 * max(1.0, np.abs(o1).max())
    assert np.abs(S1 - S2).max() <= 1e-4 * np.abs(S1).max()


def test_delta_rule_state_carries_across_windows():
    q, k, v, g, beta, S0 = _inputs(np.random.default_rng(7), 130)
    o, S = delta_rule_chunked(q, k, v, g, beta, S0)
    oa, Sa = delta_rule_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], S0)
    ob, Sb = delta_rule_chunked(q[37:], k[37:], v[37:], g[37:], beta[37:], Sa)
    assert np.abs(np.concatenate([oa, ob]) - o).max() <= 1e-4 * np.abs(o).max()
    assert np.abs(Sb - S).max() <= 1e-4 * np.abs(S).max()


def test_conv1d_prefill_handoff():
    """Splitting a prompt anywhere (also inside the first K-1 tokens) gives the same conv output
    and final state: the state is the last K-1 pre-conv inputs of the whole sequence so far."""
    rng = np.random.default_rng(0)
    C, K, T = 10, 4, 23
    be = NumpyBackend()
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    meta = lambda n: be.prepare(Step.build([([0] * n, 0, 0, [0, 1])]), _cache(be))  # noqa: E731
    state = np.zeros((1, K - 1, C), np.float32)
    full = be.conv1d(x, w, state, meta(T))
    final = state.copy()
    for split in (1, 2, 3, 11):
        state[:] = 0
        a = be.conv1d(x[:split], w, state, meta(split))
        b = be.conv1d(x[split:], w, state, meta(T - split))
        assert np.allclose(np.concatenate([a, b]), full, atol=1e-5)
        assert np.allclose(state, final)
    assert np.allclose(final[0], x[-(K - 1):])


def _cache(be):
    class C:
        block_size = 16
    return C()


def _gdn_inputs(rng, T, nk=2, nv=4, dk=16, dv=24):
    qkv = rng.standard_normal((T, 2 * nk * dk + nv * dv)).astype(np.float32)
    a, b = (rng.standard_normal((T, nv)).astype(np.float32) for _ in range(2))
    A_log = np.log(rng.uniform(1, 16, nv)).astype(np.float32)
    dt_bias = rng.uniform(-3, 0, nv).astype(np.float32)
    return qkv, a, b, A_log, dt_bias


def test_state_saved_inside_a_chunk_is_the_state_of_its_prefix():
    """Step.save_at (prefix caching): the conv and recurrent state written after r new tokens equal the
    state of a step that fed only those r tokens, and the step's outputs and final state are unchanged."""
    rng = np.random.default_rng(5)
    be = NumpyBackend()
    lens, saves = [1, 200, 130], {1: (128, 6), 2: (64, 7)}
    chunks = [([0] * n, 10 * (n == 1), slot, [0] * 20) for n, slot in zip(lens, [3, 0, 1])]
    T, C = sum(lens), 40
    x, w = rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((C, 4)).astype(np.float32)
    qkv, a, b, A_log, dt_bias = _gdn_inputs(rng, T)
    conv0 = rng.standard_normal((8, 3, C)).astype(np.float32)
    rec0 = rng.standard_normal((8, 4, 16, 24)).astype(np.float32)

    def run(step, conv, rec):
        m = be.prepare(step, _cache(be))
        return be.conv1d(x, w, conv, m), be.delta_rule(qkv, a, b, A_log, dt_bias, rec, m)
    plain = [conv0.copy(), rec0.copy()]
    want = run(Step.build(chunks), *plain)
    got_state = [conv0.copy(), rec0.copy()]
    got = run(Step.build(chunks, saves=saves), *got_state)
    for g_, w_ in zip(got, want):
        assert np.array_equal(g_, w_)
    assert np.array_equal(got_state[0][:6], plain[0][:6]) and np.array_equal(got_state[1][:6], plain[1][:6])
    cu = np.cumsum([0] + lens)
    for i, (r, row) in saves.items():
        alone, slot, h = [conv0.copy(), rec0.copy()], chunks[i][2], slice(cu[i], cu[i] + r)
        m = be.prepare(Step.build([([0] * r, 0, slot, [0] * 20)]), _cache(be))
        be.conv1d(x[h], w, alone[0], m)
        be.delta_rule(qkv[h], a[h], b[h], A_log, dt_bias, alone[1], m)
        assert np.array_equal(got_state[0][row], alone[0][slot]), i
        assert np.array_equal(got_state[1][row], alone[1][slot]), i
