"""The Qwen3.5 dense decoder, written once against the backend op interface (spec §3-§7).

Weights that are always used together are fused at load (one GEMM each): GDN
in_proj_qkv|z|b|a, attention q|k|v, MLP gate|up. The same code runs on the NumPy and CUDA backends.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .arrays import array_module
from .config import FULL, LINEAR, ModelConfig
from .step import Step


@dataclass(frozen=True)
class Capture:
    """What a forward keeps for a drafter (drafter.py), every row of the step, besides the logits."""
    post_norm: bool = False     # the final-norm output [T, H] (the lm_head's input; MTP's hidden)
    taps: tuple[int, ...] = ()  # the residual stream after each of these decoder layers (0-based; HF's
                                # hidden_states[l + 1], except that HF's last entry is post-norm), in this
                                # order: [T, len(taps) * H]


def layer_weights(ops, w, kind: str) -> dict:
    """One decoder layer's weights, uploaded by the backend `ops`, w(name) reading its tensors: the
    target's layers and the MTP head's (mtp.py) both load through this."""
    up = ops.weight  # a list of arrays: their concatenation (rows), fused where they are uploaded
    layer = {"kind": kind, "ln1": up(w("input_layernorm.weight")), "ln2": up(w("post_attention_layernorm.weight")),
             "gate_up": ops.weight_gate_up(w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")),
             "down": up(w("mlp.down_proj.weight"))}
    if kind == LINEAR:
        p = "linear_attn."
        return layer | {"in_proj": up([w(p + "in_proj_qkv.weight"), w(p + "in_proj_z.weight"),
                                       w(p + "in_proj_b.weight"), w(p + "in_proj_a.weight")]),
                        "conv": up(w(p + "conv1d.weight")[:, 0, :]), "dt_bias": up(w(p + "dt_bias")),
                        "A_log": up(w(p + "A_log")), "norm": up(w(p + "norm.weight")),
                        "out_proj": up(w(p + "out_proj.weight"))}
    p = "self_attn."
    return layer | {"qkv": up([w(p + "q_proj.weight"), w(p + "k_proj.weight"), w(p + "v_proj.weight")]),
                    "q_norm": up(w(p + "q_norm.weight")), "k_norm": up(w(p + "k_norm.weight")),
                    "o_proj": up(w(p + "o_proj.weight"))}


class Qwen35Model:
    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], backend, draft_kv_layers: int = 0):
        """draft_kv_layers: full-attention layers of paged KV that a drafter keeps in this model's cache,
        after the model's own (MTP: 1; mtp.py), so that they share its blocks and memory plan."""
        self.cfg, self.ops, self.draft_kv_layers = cfg, backend, draft_kv_layers
        up = backend.weight  # a list of arrays: their concatenation (rows), fused where they are uploaded
        self.embed = up(weights["embed_tokens.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else up(weights["lm_head.weight"])
        self.norm = up(weights["norm.weight"])
        self.layers = [layer_weights(backend, lambda name, i=i: weights[f"layers.{i}.{name}"], kind)
                       for i, kind in enumerate(cfg.layer_types)]

    def weight_bytes(self) -> int:
        arrays = {id(a): a for a in [self.embed, self.lm_head, self.norm]
                  + [v for L in self.layers for v in L.values() if hasattr(v, "nbytes")]}
        return sum(a.nbytes for a in arrays.values())

    def alloc_cache(self, num_slots: int, num_blocks: int, block_size: int, spec_logs: int = 0, spec_tokens: int = 0):
        # the backend sizes KV by the config's attention layers: the drafter's come after the model's own
        cfg = self.cfg
        if self.draft_kv_layers:
            cfg = replace(cfg, layer_types=cfg.layer_types + (FULL,) * self.draft_kv_layers,
                          num_layers=cfg.num_layers + self.draft_kv_layers)
        return self.ops.alloc_cache(cfg, num_slots, num_blocks, block_size, spec_logs, spec_tokens)

    def forward(self, step: Step, cache, capture: Capture | None = None):
        """Runs the step's tokens through every layer, updating the cache; returns the logits of
        step.logits_rows only (the final norm and lm_head run on those rows alone), and with a capture
        (logits, {"post_norm": ..., "taps": ...}) with the keys it asks for (the final norm then runs
        over every row)."""
        return self.forward_meta(self.ops.prepare(step, cache), cache, capture)

    def forward_meta(self, meta, cache, capture: Capture | None = None):
        ops, eps = self.ops, self.cfg.rms_norm_eps
        taps = Taps(capture.taps if capture else (), len(meta.step.tokens), self.cfg.hidden_size)
        layers = self.layers
        h, residual = ops.add_rms_norm(ops.embed(self.embed, meta), None, layers[0]["ln1"], eps)
        lin = full = 0
        for i, L in enumerate(layers):
            taps.keep(i - 1, residual)  # the stream after the layer before
            if L["kind"] == LINEAR:
                logs = (cache.conv_log[lin], cache.rec_log[lin]) if cache.conv_log else (None, None)
                o, w_o = self._gdn(L, h, meta, cache.conv[lin], cache.rec[lin], *logs), L["out_proj"]
                lin += 1
            else:
                o, w_o = self.attention(L, h, meta, cache.k[full], cache.v[full]), L["o_proj"]
                full += 1
            # each sublayer's output projection with the norm after it (ops may fuse the two)
            h, residual = ops.linear_add_rms_norm(o, w_o, residual, L["ln2"], eps)
            a = ops.swiglu(h, L["gate_up"])
            if i + 1 < len(layers):
                h, residual = ops.linear_add_rms_norm(a, L["down"], residual, layers[i + 1]["ln1"], eps)
        rows, last = meta.step.logits_rows, len(layers) - 1
        if len(rows) == len(meta.step.tokens):  # every row samples (decode, verify): the final norm as the others
            h, residual = ops.linear_add_rms_norm(a, layers[last]["down"], residual, self.norm, eps)
            logits = ops.linear(h, self.lm_head)
        elif capture is None or not (capture.post_norm or last in capture.taps):  # the final norm on those rows
            x = ops.linear(a, layers[last]["down"])
            h, _ = ops.add_rms_norm(ops.gather_rows(x, rows), ops.gather_rows(residual, rows), self.norm, eps)
            logits = ops.linear(h, self.lm_head)
        else:  # the final norm over every row
            h, residual = ops.add_rms_norm(ops.linear(a, layers[last]["down"]), residual, self.norm, eps)
            logits = ops.linear(ops.gather_rows(h, rows), self.lm_head)
        taps.keep(last, residual)  # (the stream after the last layer, where it was computed)
        if capture is None:
            return logits
        return logits, ({"post_norm": h} if capture.post_norm else {}) | ({"taps": taps.out} if capture.taps else {})

    def _gdn(self, L, h, meta, conv_state, rec_state, conv_log=None, rec_log=None):
        """The GDN token mixer up to its output projection (L["out_proj"])."""
        cfg, ops = self.cfg, self.ops
        c, vd, nv = cfg.conv_dim, cfg.value_dim, cfg.lin_num_v_heads
        proj = ops.linear(h, L["in_proj"])  # [T, qkv | z | b | a]
        qkv = ops.conv1d(proj[:, :c], L["conv"], conv_state, meta, conv_log)
        o = ops.delta_rule(qkv, proj[:, c + vd + nv:], proj[:, c + vd:c + vd + nv], L["A_log"], L["dt_bias"],
                           rec_state, meta, rec_log)
        return ops.gated_rms_norm(o, proj[:, c:c + vd], L["norm"], cfg.rms_norm_eps)

    def attention(self, L, h, meta, k_cache, v_cache):
        """Gated attention up to its output projection (L["o_proj"]); the MTP layer (mtp.py) runs it too."""
        cfg, ops = self.cfg, self.ops
        nq, nkv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        proj = ops.linear(h, L["qkv"])  # [T, q_gate | k | v]
        q, gate = ops.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv], proj[:, nq + nkv:], L["q_norm"], L["k_norm"],
                                k_cache, v_cache, meta, cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps)
        return ops.attention(q, gate, k_cache, v_cache, meta)


class Taps:
    """Copies of the residual stream after the layers a Capture names, into one [T, len(taps) * H] array
    (a copy when it passes: the backends add into the residual in place)."""

    def __init__(self, layers: tuple[int, ...], T: int, H: int):
        assert len(set(layers)) == len(layers), f"a layer tapped twice: {layers}"
        self.at, self.T, self.H, self.out = {layer: j for j, layer in enumerate(layers)}, T, H, None

    def keep(self, layer: int, residual) -> None:
        j = self.at.get(layer)
        if j is None:
            return
        if self.out is None:
            self.out = array_module(residual).empty((self.T, len(self.at) * self.H), residual.dtype)
        self.out[:, j * self.H:(j + 1) * self.H] = residual
