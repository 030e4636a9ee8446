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
