"""The op interface every backend implements, and the per-sequence state it operates on.

`Qwen35Model` is written once against `Backend`; `NumpyBackend` (backend_numpy.py, float32, the
reference and test oracle) and `CudaBackend` (gpu/backend.py, bf16 kernels) implement it with the
same arguments. Shapes use T tokens of the step, B sequences, H hidden size; a "column view" is a
slice of a fused projection's output (row stride > width). Activations are the backend's compute
arrays (f32 on NumPy, bf16 bits on the GPU); ops infer head counts from shapes, so they need no
config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .step import Step


@dataclass
class Cache:
    """Per-sequence state of every layer: GDN conv and recurrent state by slot, paged KV by block."""
    conv: list[Any]  # per GDN layer [rows, K-1, conv_dim] (bf16 on the GPU); rows: slots, then snapshots
    rec: list[Any]   # per GDN layer [rows, nv, dk, dv], f32
    k: list[Any]     # per attention layer [blocks, block_size, nkv, hd]
    v: list[Any]
    block_size: int
    rows: Any = None  # the backend's own table of the state arrays' rows for copy_slots (CUDA: on the device)
    # speculative decoding's log sets (step.py), per GDN layer, in the backend's own layout: conv_log
    # [sets, 1 + k, K-1, conv_dim] (the conv state after each of a verify's tokens), rec_log [sets, 1 + k, ...]
    # (what each token's recurrent update added); empty without speculative decoding
    conv_log: list[Any] = field(default_factory=list)
    rec_log: list[Any] = field(default_factory=list)


class Backend(Protocol):
    name: str                 # for logs ("numpy", "cuda")
    decode_graphs: bool       # pure-decode steps can be captured and replayed (gpu/decode_graph.py)
    batch_invariant: bool     # a row's results do not depend on the rest of its step
    needs_warm_up: bool       # first uses are slow (lazy plans, pools): run a step before serving

    # ---- weights, state, kernels -------------------------------------------------------
    def weight(self, arr) -> Any:
        """Checkpoint array (bf16 bits as uint16, or f32), or a list of them to concatenate along rows (a
        fused projection) -> the backend's weight array."""

    def alloc_cache(self, cfg, num_slots: int, num_blocks: int, block_size: int, spec_logs: int = 0,
                    spec_tokens: int = 0) -> Cache:
        """num_slots state rows, num_blocks KV blocks; spec_logs log sets of 1 + spec_tokens entries."""

    def reset_slots(self, cache: Cache, slots: list[int]) -> None:
        """Zero the conv and recurrent state of these slots (a sequence's first chunk)."""

    def copy_slots(self, cache: Cache, src: list[int], dst: list[int]) -> None:
        """conv[l][dst[i]] = conv[l][src[i]] and rec[l][dst[i]] = rec[l][src[i]] for every GDN layer l, in
        stream order (prefix caching: a snapshot restored into a slot, a slot saved into a snapshot;
        snapshots are rows after the slots, state_snapshots.py). src and dst are disjoint."""

    def cache_budget(self, cfg, max_num_batched_tokens: int, max_num_seqs: int, utilization: float) -> int:
        """Bytes the state slots and KV blocks may take, after the weights (already loaded) and a
        reserve for one step's activations (engine/memory.py plans with it)."""

    def load_kernels(self, cfg) -> None:
        """Starts compiling (or loading from the kernel cache) every kernel this model's shapes can
        launch, in the background; the first launch of each waits for it."""

    def memory_used(self) -> int:
        """Bytes held in live arrays."""

    # ---- steps ---------------------------------------------------------------------------
    def prepare(self, step: Step, cache: Cache) -> Any:
        """The step's metadata where the ops need it (an object with `.step`); fills in Step.feed."""

    def to_host(self, x) -> np.ndarray:
        """A float32 host copy (bf16 bits are converted)."""

    def argmax_finite(self, x) -> Any:
        """[B, 2] int32 per f32 logits row [B, V]: the argmax over the finite entries (first of equal
        maxima; 0 when none) and 1 if every entry is finite. Stays where the logits are."""

    def mark(self) -> Any:
        """A point in the enqueued work (device event or host clock)."""

    def elapsed_ms(self, a, b) -> float:
        """Time between two marks (waits for the later one)."""

    # ---- ops -----------------------------------------------------------------------------
    def embed(self, table, meta) -> Any:
        """[T, H]: the rows of `table` [V, H] for the step's tokens."""

    def gather_rows(self, x, rows) -> Any:
        """x[rows]: x [T, H], rows [n] int32 (host or device) -> [n, H]."""

    def add_rms_norm(self, x, residual, w, eps: float) -> tuple[Any, Any]:
        """residual += x (residual None: the first layer, residual = x); returns
        (RMSNorm(residual) * (1 + w), residual). x, residual [T, H]; w [H]."""

    def linear(self, x, w) -> Any:
        """x [M, K] (a column view allowed) @ w [N, K]^T -> [M, N] (f32 for the lm_head)."""

    def linear_add_rms_norm(self, x, w_proj, residual, w, eps: float) -> tuple[Any, Any]:
        """add_rms_norm(linear(x, w_proj), residual, w, eps), residual not None, with the same results: a
        sublayer's output projection and the norm after it, one op so a backend can fuse them."""

    def weight_gate_up(self, gate, up) -> Any:
        """An MLP's gate and up matrices ([F, H] checkpoint arrays) -> the backend's fused weight for
        swiglu (its row order is the backend's own)."""

    def swiglu(self, x, gate_up) -> Any:
        """silu(x gate^T) * (x up^T) [T, F] for x [T, H] and a weight from weight_gate_up: the two GEMMs'
        outputs rounded as the activations' dtype, then the product rounded."""

    def conv1d(self, x, w, state, meta, log=None) -> Any:
        """Causal depthwise conv + SiLU per sequence, continuing from and updating the slots' state.
        x [T, C] (column view), w [C, K], state [slots, K-1, C] (in place) -> [T, C]. log: the layer's
        Cache.conv_log (a verify's per-token states; a replay's old state, step.py)."""

    def delta_rule(self, qkv, a, b, A_log, dt_bias, state, meta, log=None) -> Any:
        """Gating, GQA head mapping, q/k L2 norm and the gated delta rule. qkv [T, 2*nk*dk + nv*dv]
        (the conv output), a, b [T, nv] (column views), A_log, dt_bias [nv] f32, state
        [slots, nv, dk, dv] f32 updated in place -> o [T, nv*dv]. log: the layer's Cache.rec_log (a
        verify's updates, which a replay applies first, step.py)."""

    def gated_rms_norm(self, o, z, w, eps: float) -> Any:
        """Per value head: w * RMSNorm(o) * silu(z). o [T, nv*dv], z [T, nv*dv] (column view), w [dv]."""

    def attn_prep(self, q_gate, k, v, q_norm, k_norm, k_cache, v_cache, meta, rotary_dim: int, theta: float,
                  eps: float, gated: bool = True) -> tuple[Any, Any]:
        """q/gate split, q/k RMSNorm(1 + w), partial NeoX RoPE, K/V written into the paged cache at
        the step's slot mapping. q_gate [T, nh*2*hd], k, v [T, nkv*hd] (column views), k_cache,
        v_cache [blocks, block_size, nkv, hd] -> (q [T, nh, hd], gate [T, nh, hd] or [T, nh*hd]).
        gated False (the DFlash drafter, dflash.py): q_gate is q alone [T, nh*hd] and gate comes back
        None; q_gate None as well: only K/V are written, (None, None) comes back."""

    def attention(self, q, gate, k_cache, v_cache, meta, causal: bool = True, window: int = 0) -> Any:
        """Causal GQA attention of each sequence's new tokens over its paged KV, times sigmoid(gate)
        (gate None: no output gate). q [T, nh, hd] -> [T, nh*hd]. causal False: every new token sees all
        of its sequence's keys (0..seq_len-1). window > 0: a token at position p sees keys
        p-window+1..p only (DFlash's sliding layers; with causal False, counted back from seq_len-1)."""


def make_backend(device: str, batch_invariant: bool = False) -> Backend:
    """"cuda": the GPU backend (CuPy must import and see a device); "cpu": NumPy; "auto": the GPU
    when it can start, else NumPy."""
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device in ("cuda", "auto"):
        try:
            from .gpu.backend import CudaBackend
            return CudaBackend(batch_invariant=batch_invariant)
        except ImportError as e:
            if device == "cuda":
                raise RuntimeError(f"--device cuda needs CuPy ({e}): pip install -e '.[cuda13]' (or '.[cuda12]' "
                                   "for a CUDA 12 driver)") from None
        except Exception:
            if device == "cuda":
                raise
    from .backend_numpy import NumpyBackend
    return NumpyBackend()
