"""Shared by the HF gates (test_hf_parity.py on the CPU, test_gpu_hf_gate.py on the GPU).

- hf_or_skip: torch and transformers, or a skip; a failure instead when QWEN35_REQUIRE_HF is set.
- The sublayer rows: each GDN / attention mixer's and each MLP's output over the prompt tokens,
  ours against HF's. On random weights bf16 noise at the final logits is as large as a subtle bug's
  effect (RoPE theta / 10 or q/k norms without their weights move the 4b shape's logprobs less than
  HF bf16 itself is from f32), but at the first attention layer's output the bug is 3-5x the noise.
- The two subtle bugs, planted into any backend's attn_prep, to show the gates catch them.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.config import LINEAR

ROWS_PER_PROMPT = 256  # sublayer rows keep at most this many positions of a prompt (evenly spaced): host memory


def hf_or_skip(cuda: bool = False):
    """(torch, transformers); skips the module when they (or, with cuda, torch's CUDA) are missing, or
    fails it when QWEN35_REQUIRE_HF is set (CI and the GPU machine: a skipped gate is a failed gate)."""
    required = bool(os.environ.get("QWEN35_REQUIRE_HF"))
    try:
        import torch
        import transformers
    except ImportError as e:
        missing = f"the HF gate needs torch and transformers ({e})"
    else:
        if not cuda or torch.cuda.is_available():
            return torch, transformers
        missing = f"torch {torch.__version__} sees no CUDA device"
    if required:
        pytest.fail(f"QWEN35_REQUIRE_HF is set but {missing}", pytrace=False)
    pytest.skip(missing, allow_module_level=True)


# --- the two subtle bugs ---------------------------------------------------------------------

SUBTLE_BUGS = ("rope_theta_div10", "qk_norm_weights_dropped")


def plant_bug(monkeypatch, backend_cls, bug: str) -> None:
    """backend_cls.attn_prep computes `bug`: RoPE with theta / 10, or the q/k RMSNorms with w = 0 (1 + w = 1)."""
    if bug not in SUBTLE_BUGS:
        raise ValueError(bug)
    orig = backend_cls.attn_prep

    def attn_prep(self, q_gate, k, v, q_norm, k_norm, k_cache, v_cache, meta, rotary_dim, theta, eps):
        if bug == "rope_theta_div10":
            theta = theta / 10
        else:
            q_norm, k_norm = q_norm * 0, k_norm * 0
        return orig(self, q_gate, k, v, q_norm, k_norm, k_cache, v_cache, meta, rotary_dim, theta, eps)

    monkeypatch.setattr(backend_cls, "attn_prep", attn_prep)


# --- sublayer rows ---------------------------------------------------------------------------


def sublayer_names(cfg) -> list[str]:
    """The rows, in forward order: each layer's mixer then its MLP, but the last MLP (whose output
    only the sampled rows reach; the logits gate covers it)."""
    names = []
    for i, kind in enumerate(cfg.layer_types):
        names += [f"{i}.{'linear_attn' if kind == LINEAR else 'self_attn'}", f"{i}.mlp"]
    return names[:-1]


def kept_positions(n: int) -> np.ndarray:
    return np.arange(n) if n <= ROWS_PER_PROMPT else np.linspace(0, n - 1, ROWS_PER_PROMPT).round().astype(int)


def record_sublayers(model, step, cache):
    """model.forward(step, cache), and per sequence of the step its sublayer outputs at the kept
    positions, [rows, kept, H] f32. A sublayer's output is the x that the next add_rms_norm adds to
    the residual: call 2i+1 of a forward carries layer i's mixer, call 2i+2 its MLP (the last call,
    the final norm, sees the sampled rows only)."""
    ops, calls = model.ops, 2 * model.cfg.num_layers
    counts = [len(kept_positions(int(n))) for n in np.diff(step.cu_seqlens)]
    keep = np.concatenate([s + kept_positions(int(n)) for s, n in zip(step.cu_seqlens[:-1], np.diff(step.cu_seqlens))])
    outs = []
    orig = ops.add_rms_norm

    def add_rms_norm(x, residual, w, eps):
        if len(outs) < calls:
            outs.append(ops.to_host(x)[keep])  # copied now: the CUDA backend adds into residuals in place
        return orig(x, residual, w, eps)

    ops.add_rms_norm = add_rms_norm
    try:
        logits = model.forward(step, cache)
    finally:
        del ops.add_rms_norm
    return logits, np.split(np.stack(outs[1:]), np.cumsum(counts)[:-1], axis=1)


class HFSublayers:
    """Forward hooks on an HF Qwen3_5ForCausalLM: record(call) runs call() and returns its result and
    the sublayer outputs of the one forward it makes (batch 1), [rows, kept, H] f32, in our row order."""

    def __init__(self, hf):
        self._out: list | None = None
        self._handles = []
        for layer in hf.model.layers:
            mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
            for module in (mixer, layer.mlp):
                self._handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        if self._out is not None:
            y = (output[0] if isinstance(output, tuple) else output)[0]
            self._out.append(y[kept_positions(len(y)).tolist()].float().cpu().numpy())

    def record(self, call):
        self._out = []
        try:
            result = call()
        finally:
            outs, self._out = self._out, None
        return result, np.stack(outs[:-1])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def sublayer_errors(ours: list[np.ndarray], truth: list[np.ndarray]) -> np.ndarray:
    """Per row: ||ours - truth|| / ||truth|| over every kept position of every prompt."""
    num = sum(np.square(o.astype(np.float64) - t).sum(axis=(1, 2)) for o, t in zip(ours, truth))
    den = sum(np.square(t.astype(np.float64)).sum(axis=(1, 2)) for t in truth)
    return np.sqrt(num / den)
