"""How far single-pass bf16 products in the chunked GDN state pass would move its output (CPU, NumPy).

The HF gate's sublayer rows (tests/test_gpu_hf_gate.py) let ours be ROW_RATIO = 2 times as far from HF f32 as
HF bf16 is (relative Frobenius norm per sublayer). HF bf16 runs the GDN core in f32 on bf16 inputs and rounds
its output to bf16; our gdn_chunk_state does its four products in bf16x3 (~f32). A single bf16 mma per k16
(FLA's and FlashInfer's choice) rounds W, P, S and v_new to bf16 at each product. At the 4B GDN shapes
(32 value heads, 16 q/k heads, 128 x 128 state), random inputs as the random checkpoint makes them, this
measures against an f64 core on unrounded inputs:
  hf_bf16: inputs rounded to bf16, f32 core (the same chunked form), output rounded to bf16;
  ours_x3: the same (bf16x3 ~ f32 products);
  ours_b1: inputs rounded, the state pass's products on bf16-rounded W, P, S, v_new, output rounded;
  ours_b1_state: the final state's distance (the next chunk's or a decode's start);
  fi_fp16_inv / fi_bf16_inv: FlashInfer's order (v_new = T' (v - e^gam k S), no W or U), its T' = (I + A)^-1
  diag(beta) rounded to fp16 (FlashInfer) or bf16 (FLA stores the inverse in bf16), ratios to hf_bf16.
Prints one row per prompt length, the ratio ours_b1 / hf_bf16 last; writes the table as JSON.

  python3 docs/benchmarks/session29/gdn_precision.py [--lens 128,1024,4096] [--heads 8] [--json PATH]
"""
import argparse
import json

import numpy as np

C = 64


def bf16(x):
    """Round to the nearest bf16 (ties to even), returned as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def fp16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def chunked(q, k, v, g, beta, S, dt, rnd=lambda x: x, inv=None):
    """The WY chunked form (engine/backend_numpy.delta_rule_chunked) in dtype dt, head-major [h, T, d];
    rnd rounds the state pass's product operands (W, P, S, v_new; q and k are bf16 already). inv (a rounding):
    FlashInfer's order instead, v_new = T' (v - e^gam k S) with T' = (I + A)^-1 diag(beta) rounded by inv and
    the bracket by rnd (no W or U)."""
    h, T, dk = q.shape
    eye = np.eye(C, dtype=dt)
    incl = np.tril(np.ones((C, C), bool))
    out = np.empty(v.shape, dt)
    S = S.astype(dt)
    for c0 in range(0, T, C):
        sl = slice(c0, c0 + C)
        qc, kc, vc, bc = q[:, sl].astype(dt), k[:, sl].astype(dt), v[:, sl].astype(dt), beta[:, sl, None].astype(dt)
        gam = np.cumsum(g[:, sl].astype(dt), axis=1)
        D = np.exp(np.where(incl, gam[:, :, None] - gam[:, None, :], -np.inf)).astype(dt)
        kb = kc * bc
        A = np.tril(kb @ kc.transpose(0, 2, 1) * D, -1)
        U = np.linalg.solve(eye + A, vc * bc)
        W = np.linalg.solve(eye + A, kb * np.exp(gam)[..., None])
        P = np.tril(qc @ kc.transpose(0, 2, 1) * D)
        Sr = rnd(S)
        if inv is None:
            v_new = U - rnd(W) @ Sr
        else:
            T_ = np.linalg.solve(eye + A, np.eye(C, dtype=dt)[None] * bc.transpose(0, 2, 1))
            v_new = inv(T_) @ rnd(vc - np.exp(gam)[..., None] * (kc @ Sr))
        vr = rnd(v_new)
        out[:, sl] = np.exp(gam)[..., None] * (qc @ Sr) + rnd(P) @ vr
        last = gam[:, -1:]
        S = np.exp(last)[..., None] * S + (kc * np.exp(last - gam)[..., None]).transpose(0, 2, 1) @ vr
    return out, S


def inputs(rng, T, h, dk=128, dv=128):
    """q, k L2-normed (q * dk^-0.5) as the kernels see them, v ~ N(0, 1); g and beta from the random checkpoint's
    distributions (engine/checkpoint.py: A_log ~ log U[1, 16], softplus(dt_bias) log-uniform in [1e-3, 1e-1])."""
    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = l2(rng.standard_normal((h, T, dk))) * dk ** -0.5
    k = l2(rng.standard_normal((h, T, dk)))
    v = rng.standard_normal((h, T, dv))
    A = np.exp(np.log(rng.uniform(1, 16, h)))
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), h))
    a = rng.standard_normal((h, T))
    sp = np.log1p(np.exp(a + np.log(np.expm1(dt))[:, None]))
    g = -A[:, None] * sp
    beta = 1 / (1 + np.exp(-rng.standard_normal((h, T))))
    return q, k, v, g, beta


def rel(x, ref):
    return float(np.sqrt(np.square(x.astype(np.float64) - ref).sum() / np.square(ref).sum()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="128,1024,4096")
    ap.add_argument("--heads", type=int, default=8, help="value heads simulated (the 4B has 32; each is independent)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for T in (int(x) for x in a.lens.split(",")):
        rng = np.random.default_rng(T)
        q, k, v, g, beta = inputs(rng, T, a.heads)
        S0 = np.zeros((a.heads, 128, 128))
        ref, Sref = chunked(q, k, v, g, beta, S0, np.float64)
        qb, kb, vb = bf16(q), bf16(k), bf16(v)  # the conv output is bf16 (q, k normed in f32 from it)
        hf, Shf = chunked(qb, kb, vb, g, beta, S0, np.float32)
        b1, Sb1 = chunked(qb, kb, vb, g, beta, S0, np.float32, rnd=bf16)
        r = {"T": T, "hf_bf16": rel(bf16(hf), ref), "ours_b1": rel(bf16(b1), ref),
             "hf_state": rel(Shf, Sref), "ours_b1_state": rel(Sb1, Sref)}
        r["ratio"] = r["ours_b1"] / r["hf_bf16"]
        r["state_ratio"] = r["ours_b1_state"] / r["hf_state"]
        for name, inv in (("fi_fp16_inv", fp16), ("fi_bf16_inv", bf16)):  # FlashInfer's order, its inverse rounded
            o, So = chunked(qb, kb, vb, g, beta, S0, np.float32, rnd=bf16, inv=inv)
            r[name + "_ratio"] = rel(bf16(o), ref) / r["hf_bf16"]
            r[name + "_state_ratio"] = rel(So, Sref) / r["hf_state"]
        rows.append(r)
        print(" ".join(f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    if a.json:
        json.dump({"rows": rows, "args": vars(a)}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
