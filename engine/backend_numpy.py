"""NumPy float32 backend: the reference every CUDA kernel is tested against, and the CPU engine.

Each op is the plain math of the spec (§3-§7), written for clarity. The GPU backend
(`gpu/backend.py`) implements the same methods with the same arguments (the interface: ops.py).
Ops infer head counts from array shapes, so they need no model config. The module-level helpers are the
places the classic bugs of spec §13 live; the parity tests patch them to prove the gate bites.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace

import numpy as np

from .arrays import bf16_to_f32
from .config import GDN_CHUNK
from .ops import Cache
from .step import Step

CPU_CACHE_BUDGET = 512 << 20  # bytes for state slots + KV: host memory is plentiful, tests want it small


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def l2norm(x, eps=1e-6):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def gdn_qk_heads(x, r):
    """[T, nk, d] -> [T, nk*r, d]: GDN value head h reads q/k head h // r (spec §4.4)."""
    return np.repeat(x, r, axis=1)


def split_q_gate(qg, nh, hd):
    """q_proj output is per-head [q_h | gate_h] (spec §5.1)."""
    qg = qg.reshape(-1, nh, 2 * hd)
    return qg[..., :hd], qg[..., hd:].reshape(-1, nh * hd)


def gated_norm_weight(w):
    """The GDN output norm uses the plain weight, not 1 + w (spec §4.8)."""
    return w


def rope(x, pos, rd, theta):
    """NeoX half rotation of the first rd dims (spec §5.3). x [T, heads, hd], pos [T]."""
    inv = 1.0 / theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    ang = pos.astype(np.float64)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None].astype(np.float32)
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None].astype(np.float32)
    xr = x[..., :rd]
    rot = np.concatenate([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return np.concatenate([xr * cos + rot * sin, x[..., rd:]], -1)


def _spec(step: Step, b: int) -> tuple[int, int]:
    """Sequence b's log set (-1: none) and how many of its logged tokens it replays first (step.py)."""
    st = int(step.spec_logs[b]) if step.spec_logs is not None else -1
    return st, int(step.replay[b]) if st >= 0 and step.replay is not None else 0


def delta_rule_recurrent(q, k, v, g, beta, S):
    """Token recurrence (spec §4.6). q, k [T, h, dk]; v [T, h, dv]; g, beta [T, h]; S [h, dk, dv]."""
    o = np.empty(v.shape, np.float32)
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + np.einsum("hk,hv->hkv", k[t], delta)
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def delta_rule_chunked(q, k, v, g, beta, S, chunk=GDN_CHUNK):
    """WY/UT chunked form (spec §4.7), equal to the recurrence up to f32 rounding."""
    T = q.shape[0]
    pad = (-T) % chunk
    if pad:  # zero padding (g = 0, beta = 0) leaves outputs and final state unchanged
        q, k, v = (np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) for x in (q, k, v))
        g, beta = (np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) for x in (g, beta))
    # head-major [h, T, d]
    q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))
    g, beta = g.T, beta.T
    eye = np.eye(chunk, dtype=np.float32)
    incl = np.tril(np.ones((chunk, chunk), bool))
    out = np.empty(v.shape, np.float32)
    for c0 in range(0, q.shape[1], chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl, None]
        gam = np.cumsum(g[:, sl], axis=1)                                   # [h, C]
        D = np.exp(np.where(incl, gam[:, :, None] - gam[:, None, :], -np.inf))
        kb = kc * bc
        A = np.tril(kb @ kc.transpose(0, 2, 1) * D, -1)
        U = np.linalg.solve(eye + A, vc * bc)
        W = np.linalg.solve(eye + A, kb * np.exp(gam)[..., None])
        v_new = U - W @ S
        out[:, sl] = (qc * np.exp(gam)[..., None]) @ S + (qc @ kc.transpose(0, 2, 1) * D) @ v_new
        last = gam[:, -1:]
        S = np.exp(last)[..., None] * S + (kc * np.exp(last - gam)[..., None]).transpose(0, 2, 1) @ v_new
    return out.transpose(1, 0, 2)[:T], S


def argmax_finite(x) -> np.ndarray:
    """[B, 2] int32 per logits row: the argmax (first of equal maxima, over the finite entries; 0 for a
    row with none) and 1 if every entry is finite. The runner's one look at every sampled row."""
    x = np.asarray(x)
    fin = np.isfinite(x)
    top = np.where(fin, x, -np.inf).argmax(1) if x.shape[1] else np.zeros(len(x), np.int64)
    return np.stack([top, fin.all(1)], 1).astype(np.int32)


@dataclass
class Meta:
    step: Step
    slot_mapping: np.ndarray  # [T] flat KV row (block * block_size + offset) of each new token


class NumpyBackend:
    name = "numpy"
    decode_graphs = False
    needs_warm_up = False
    batch_invariant = False  # NumPy's matmul may sum in an order that depends on M

    def __init__(self) -> None:
        self._held: list[weakref.ref] = []  # the weight and cache arrays allocated here (memory_used)

    def _hold(self, a: np.ndarray) -> np.ndarray:
        self._held.append(weakref.ref(a))  # dead references are skipped by memory_used()
        return a

    # ---- weights and state -------------------------------------------------------------
    def weight(self, arr) -> np.ndarray:
        """Checkpoint array (bf16 bits as uint16, or f32), or a list of them to concatenate (rows)
        -> compute array (f32 here)."""
        if isinstance(arr, list):
            arr = np.concatenate(arr)
        if arr.dtype == np.uint16:
            return self._hold(bf16_to_f32(arr))
        out = np.ascontiguousarray(arr, np.float32)
        # a contiguous f32 checkpoint array comes back as a view of the memory-mapped file: not ours
        return out if np.may_share_memory(out, arr) else self._hold(out)

    def alloc_cache(self, cfg, num_slots: int, num_blocks: int, block_size: int, spec_logs: int = 0,
                    spec_tokens: int = 0) -> Cache:
        """rec_log entries are a token's recurrence inputs per value head, [k (L2-normed) | v | g | beta]: a
        replay runs delta_rule_recurrent on them again (the same bits as the plain decode)."""
        nlin, nfull = len(cfg.linear_layers), len(cfg.full_layers)
        z = lambda *s: self._hold(np.zeros(s, np.float32))  # noqa: E731
        n = 1 + spec_tokens
        logs = nlin if spec_logs else 0
        return Cache(
            conv=[z(num_slots, cfg.conv_kernel - 1, cfg.conv_dim) for _ in range(nlin)],
            rec=[z(num_slots, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim) for _ in range(nlin)],
            k=[z(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim) for _ in range(nfull)],
            v=[z(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim) for _ in range(nfull)],
            block_size=block_size,
            conv_log=[z(spec_logs, n, cfg.conv_kernel - 1, cfg.conv_dim) for _ in range(logs)],
            rec_log=[z(spec_logs, n, cfg.lin_num_v_heads, cfg.lin_k_dim + cfg.lin_v_dim + 2) for _ in range(logs)])

    def reset_slots(self, cache: Cache, slots) -> None:
        for a in cache.conv + cache.rec:
            a[list(slots)] = 0.0

    def copy_slots(self, cache: Cache, src, dst) -> None:
        for a in cache.conv + cache.rec:
            a[list(dst)] = a[list(src)]

    def cache_budget(self, cfg, max_num_batched_tokens: int, max_num_seqs: int, utilization: float) -> int:
        return CPU_CACHE_BUDGET

    def load_kernels(self, cfg) -> None:
        pass  # nothing to compile

    def prepare(self, step: Step, cache: Cache) -> Meta:
        bs = cache.block_size
        if step.feed is not None:
            rows, ids = step.feed
            tokens = step.tokens.copy()
            tokens[rows] = ids
            step = replace(step, tokens=tokens, feed=None)
        seq = np.repeat(np.arange(step.num_seqs), np.diff(step.cu_seqlens))
        blocks = step.block_tables[seq, step.positions // bs]
        return Meta(step, (blocks * bs + step.positions % bs).astype(np.int64))

    def memory_used(self) -> int:
        """Bytes held in live weight and cache arrays allocated by this backend (not step activations)."""
        return sum(a.nbytes for a in (r() for r in self._held) if a is not None)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x, np.float32)

    argmax_finite = staticmethod(argmax_finite)

    @staticmethod
    def mark():
        """A point in the backend's work (here the host clock: every op is synchronous)."""
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(a, b) -> float:
        return (b - a) * 1e3

    # ---- ops ---------------------------------------------------------------------------
    def embed(self, table, meta: Meta):
        return table[meta.step.tokens]

    def add_rms_norm(self, x, residual, w, eps):
        """residual += x; return (RMSNorm1p(residual), residual). residual None: the first layer."""
        residual = x if residual is None else residual + x
        return rms(residual, eps) * (1.0 + w), residual

    def linear(self, x, w):
        return x @ w.T

    def linear_add_rms_norm(self, x, w_proj, residual, w, eps):
        return self.add_rms_norm(self.linear(x, w_proj), residual, w, eps)

    def gather_rows(self, x, rows):
        return x[rows]

    def weight_gate_up(self, gate, up):
        return self.weight([gate, up])

    def swiglu(self, x, gate_up):
        h = self.linear(x, gate_up)
        f = h.shape[1] // 2
        return silu(h[:, :f]) * h[:, f:]

    def conv1d(self, x, w, state, meta: Meta, log=None):
        """Causal depthwise conv (kernel K) + SiLU per sequence, continuing from and updating the
        slot's state: the last K-1 pre-conv inputs (spec §4.2). x [T, C] (a column view), w [C, K].
        A verify writes the state after each of its tokens to its log set instead of the slot; a replay
        starts from the logged state after its last verify's committed tokens (step.py)."""
        K = w.shape[1]
        out = np.empty(x.shape, np.float32)
        step = meta.step
        cu = step.cu_seqlens
        for b, slot in enumerate(step.slots):
            n = cu[b + 1] - cu[b]
            st, r = _spec(step, b)
            xp = np.concatenate([log[st, r - 1] if r else state[slot], x[cu[b]:cu[b + 1]]])
            out[cu[b]:cu[b + 1]] = sum(xp[j:j + n] * w[:, j] for j in range(K))
            if step.save_at is not None and step.save_at[b]:  # the K-1 inputs before the saved position
                state[step.save_rows[b]] = xp[step.save_at[b]:step.save_at[b] + K - 1]
            if st >= 0 and n > 1:  # a verify
                for t in range(n):
                    log[st, t] = xp[t + 1:t + K]
            else:
                state[slot] = xp[-(K - 1):]
        return silu(out)

    def delta_rule(self, qkv, a, b, A_log, dt_bias, state, meta: Meta, log=None):
        """Gating, head mapping, q/k L2 norm and the gated delta rule (spec §4.3-§4.7).
        qkv [T, 2*nk*dk + nv*dv] conv output; a, b [T, nv]; state [slots, nv, dk, dv] updated in place.
        Returns o [T, nv*dv]. Single-token sequences and verifies use the recurrence (a verify logs its
        tokens' inputs and leaves the slot as it was; a replay applies the logged ones first, step.py),
        longer ones the chunked form."""
        nv, dk, dv = state.shape[1:]
        nk = (qkv.shape[1] - nv * dv) // (2 * dk)
        T = qkv.shape[0]
        q = qkv[:, :nk * dk].reshape(T, nk, dk)
        k = qkv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
        v = qkv[:, 2 * nk * dk:].reshape(T, nv, dv)
        q = l2norm(gdn_qk_heads(q, nv // nk)) * dk ** -0.5
        k = l2norm(gdn_qk_heads(k, nv // nk))
        beta = sigmoid(b)
        g = -np.exp(A_log) * softplus(a + dt_bias)
        o = np.empty((T, nv, dv), np.float32)
        step = meta.step
        cu = step.cu_seqlens
        for i, slot in enumerate(step.slots):
            s = slice(cu[i], cu[i + 1])
            rule = delta_rule_recurrent if cu[i + 1] - cu[i] == 1 else delta_rule_chunked
            r = int(step.save_at[i]) if step.save_at is not None else 0
            st, rp = _spec(step, i)
            S = state[slot]
            for j in range(rp):  # the last verify's committed tokens, as it computed them
                e = log[st, j]
                _, S = delta_rule_recurrent(np.zeros((1, nv, dk), np.float32), e[None, :, :dk],
                                            e[None, :, dk:dk + dv], e[None, :, -2], e[None, :, -1], S)
            if st >= 0 and cu[i + 1] - cu[i] > 1:  # a verify: its tokens logged, the slot keeps the state before them
                state[slot] = S
                for t in range(cu[i], cu[i + 1]):
                    h = slice(t, t + 1)
                    log[st, t - cu[i]] = np.concatenate([k[t], v[t], g[t][:, None], beta[t][:, None]], 1)
                    o[h], S = delta_rule_recurrent(q[h], k[h], v[h], g[h], beta[h], S)
            elif rp:
                o[s], state[slot] = delta_rule_recurrent(q[s], k[s], v[s], g[s], beta[s], S)
            elif r:  # the chunked form cut at a chunk boundary computes exactly what it does whole
                h = slice(cu[i], cu[i] + r)
                o[h], state[step.save_rows[i]] = rule(q[h], k[h], v[h], g[h], beta[h], state[slot])
                s = slice(cu[i] + r, cu[i + 1])
                o[s], state[slot] = rule(q[s], k[s], v[s], g[s], beta[s], state[step.save_rows[i]])
            else:
                o[s], state[slot] = rule(q[s], k[s], v[s], g[s], beta[s], state[slot])
        return o.reshape(T, nv * dv)

    def gated_rms_norm(self, o, z, w, eps):
        """Per value head over dv: w * rms(o) * silu(z) (plain w, spec §4.8)."""
        dv = w.shape[0]
        T = o.shape[0]
        y = rms(o.reshape(T, -1, dv), eps) * gated_norm_weight(w) * silu(z.reshape(T, -1, dv))
        return y.reshape(T, -1)

    def attn_prep(self, q_gate, k, v, q_norm, k_norm, k_cache, v_cache, meta: Meta, rotary_dim, theta, eps,
                  gated=True):
        """q/gate split, QK RMSNorm1p, partial NeoX RoPE, K/V written into the paged cache.
        Returns (q [T, nh, hd], gate [T, nh*hd]); gated False: q_gate is q alone (gate None), or None."""
        hd = k_norm.shape[0]
        T = k.shape[0]
        pos = meta.step.positions
        q = gate = None
        if q_gate is not None:
            if gated:
                q, gate = split_q_gate(q_gate, q_gate.shape[1] // (2 * hd), hd)
            else:
                q = q_gate.reshape(T, -1, hd)
            q = rope(rms(q, eps) * (1.0 + q_norm), pos, rotary_dim, theta)
        k = rope(rms(k.reshape(T, -1, hd), eps) * (1.0 + k_norm), pos, rotary_dim, theta)
        nkv = k.shape[1]
        k_cache.reshape(-1, nkv, hd)[meta.slot_mapping] = k
        v_cache.reshape(-1, nkv, hd)[meta.slot_mapping] = v.reshape(T, nkv, hd)
        return q, gate

    def attention(self, q, gate, k_cache, v_cache, meta: Meta, causal=True, window=0):
        """GQA attention over each sequence's paged KV (causal; or all its keys; a window of the last
        `window` keys), then the sigmoid output gate (None: none). q [T, nh, hd]; returns [T, nh*hd]."""
        T, nh, hd = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        st = meta.step
        o = np.empty((T, nh, hd), np.float32)
        for b in range(st.num_seqs):
            if st.cu_seqlens[b + 1] == st.cu_seqlens[b]:
                continue  # no new tokens (a CUDA graph's empty padding sequence: gpu/mixed_layout.py)
            n_ctx = int(st.seq_lens[b])
            blocks = st.block_tables[b, :(n_ctx + bs - 1) // bs]
            K = k_cache[blocks].reshape(-1, nkv, hd)[:n_ctx]
            V = v_cache[blocks].reshape(-1, nkv, hd)[:n_ctx]
            rows = slice(st.cu_seqlens[b], st.cu_seqlens[b + 1])
            qb = q[rows]
            last = st.positions[rows] if causal else np.full(len(qb), n_ctx - 1)  # each token's last key
            Kx, Vx = np.repeat(K, nh // nkv, axis=1), np.repeat(V, nh // nkv, axis=1)  # kv head = h // group
            sc = np.einsum("thd,shd->hts", qb, Kx) * hd ** -0.5
            key = np.arange(n_ctx)[None, None]
            hidden = (key > last[None, :, None]) | ((key <= last[None, :, None] - window) if window else False)
            sc = np.where(hidden, -np.inf, sc)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            o[rows] = np.einsum("hts,shd->thd", sc, Vx)
        o = o.reshape(T, nh * hd)
        return o if gate is None else o * sigmoid(gate)
