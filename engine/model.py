"""The Qwen3.5 dense decoder, written once against the backend op interface (spec §3-§7).

Weights that are always used together are fused at load (one GEMM each): GDN
in_proj_qkv|z|b|a, attention q|k|v, MLP gate|up. The same code runs on the NumPy and CUDA backends.
"""
from __future__ import annotations

import numpy as np

from .config import LINEAR, ModelConfig
from .step import Step


class Qwen35Model:
    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], backend):
        self.cfg, self.ops = cfg, backend
        up = backend.weight  # a list of arrays: their concatenation (rows), fused where they are uploaded
        self.embed = up(weights["embed_tokens.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else up(weights["lm_head.weight"])
        self.norm = up(weights["norm.weight"])
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            w = lambda name: weights[f"layers.{i}.{name}"]  # noqa: E731
            layer = {"kind": kind, "ln1": up(w("input_layernorm.weight")), "ln2": up(w("post_attention_layernorm.weight")),
                     "gate_up": up([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
                     "down": up(w("mlp.down_proj.weight"))}
            if kind == LINEAR:
                p = "linear_attn."
                layer |= {"in_proj": up([w(p + "in_proj_qkv.weight"), w(p + "in_proj_z.weight"),
                                         w(p + "in_proj_b.weight"), w(p + "in_proj_a.weight")]),
                          "conv": up(w(p + "conv1d.weight")[:, 0, :]), "dt_bias": up(w(p + "dt_bias")),
                          "A_log": up(w(p + "A_log")), "norm": up(w(p + "norm.weight")),
                          "out_proj": up(w(p + "out_proj.weight"))}
            else:
                p = "self_attn."
                layer |= {"qkv": up([w(p + "q_proj.weight"), w(p + "k_proj.weight"), w(p + "v_proj.weight")]),
                          "q_norm": up(w(p + "q_norm.weight")), "k_norm": up(w(p + "k_norm.weight")),
                          "o_proj": up(w(p + "o_proj.weight"))}
            self.layers.append(layer)

    def weight_bytes(self) -> int:
        arrays = {id(a): a for a in [self.embed, self.lm_head, self.norm]
                  + [v for L in self.layers for v in L.values() if hasattr(v, "nbytes")]}
        return sum(a.nbytes for a in arrays.values())

    def alloc_cache(self, num_slots: int, num_blocks: int, block_size: int):
        return self.ops.alloc_cache(self.cfg, num_slots, num_blocks, block_size)

    def forward(self, step: Step, cache):
        """Runs the step's tokens through every layer, updating the cache; returns the logits
        of step.logits_rows only (the final norm and lm_head run on those rows alone)."""
        return self.forward_meta(self.ops.prepare(step, cache), cache)

    def forward_meta(self, meta, cache):
        ops, eps = self.ops, self.cfg.rms_norm_eps
        x, residual = ops.embed(self.embed, meta), None
        lin = full = 0
        for L in self.layers:
            h, residual = ops.add_rms_norm(x, residual, L["ln1"], eps)
            if L["kind"] == LINEAR:
                x = self._gdn(L, h, meta, cache.conv[lin], cache.rec[lin])
                lin += 1
            else:
                x = self._attention(L, h, meta, cache.k[full], cache.v[full])
                full += 1
            h, residual = ops.add_rms_norm(x, residual, L["ln2"], eps)
            x = ops.linear(ops.silu_mul(ops.linear(h, L["gate_up"])), L["down"])
        rows = meta.step.logits_rows
        h, _ = ops.add_rms_norm(ops.gather_rows(x, rows), ops.gather_rows(residual, rows), self.norm, eps)
        return ops.linear(h, self.lm_head)

    def _gdn(self, L, h, meta, conv_state, rec_state):
        cfg, ops = self.cfg, self.ops
        c, vd, nv = cfg.conv_dim, cfg.value_dim, cfg.lin_num_v_heads
        proj = ops.linear(h, L["in_proj"])  # [T, qkv | z | b | a]
        qkv = ops.conv1d(proj[:, :c], L["conv"], conv_state, meta)
        o = ops.delta_rule(qkv, proj[:, c + vd + nv:], proj[:, c + vd:c + vd + nv], L["A_log"], L["dt_bias"],
                           rec_state, meta)
        o = ops.gated_rms_norm(o, proj[:, c:c + vd], L["norm"], cfg.rms_norm_eps)
        return ops.linear(o, L["out_proj"])

    def _attention(self, L, h, meta, k_cache, v_cache):
        cfg, ops = self.cfg, self.ops
        nq, nkv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        proj = ops.linear(h, L["qkv"])  # [T, q_gate | k | v]
        q, gate = ops.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv], proj[:, nq + nkv:], L["q_norm"], L["k_norm"],
                                k_cache, v_cache, meta, cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps)
        return ops.linear(ops.attention(q, gate, k_cache, v_cache, meta), L["o_proj"])
