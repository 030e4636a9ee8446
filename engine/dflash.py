"""The DFlash drafter (z-lab block diffusion, spec-decode-spec §2): config, loader and model, written once
against the backend op interface (ops.py) like the target.

- Context: for every position the target commits, the residual stream after each tap layer of the
  target (`target_layer_ids`) is fused (fc, hidden_norm) into one feature; each drafter layer keeps
  its K/V (k_proj, k_norm, RoPE; v_proj) in the drafter's own paged KV, indexed by the request's
  block table. It always covers exactly the target's committed positions 0..L-1 (`context`).
- Draft: one forward of the block [x_L, mask x (B-1)] at positions L..L+B-1 over that context; its
  own K/V are written at L..L+B-1, past the committed context, where the next append overwrites them
  (positions past the request's KV reservation go to per-batch-row scratch pages after the pool's
  blocks). Sliding layers are causal with a window, the full layer is not. The drafter's final norm,
  the target's lm_head, argmax: d_j for position L+j, j = 1..B-1.
- Norms are plain RMSNorm w * x^ (not the target's 1 + w): the (1 + w) norm ops run on w - 1.
- RoPE is full-width NeoX with the drafter's own theta; no embedding or lm_head of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .arrays import as_f32, to_numpy
from .config import ConfigError, ModelConfig
from .drafter import Drafter, StepRecord
from .model import Capture
from .request import Request
from .step import Step
from .weights import WeightError, read_safetensors

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    sliding_window: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    # what Backend.alloc_cache reads: every drafter layer is an attention layer, there is no GDN state
    @property
    def linear_layers(self) -> list[int]:
        return []

    @property
    def full_layers(self) -> list[int]:
        return list(range(self.num_layers))

    @classmethod
    def from_dict(cls, raw: dict) -> "DFlashConfig":
        if "DFlashDraftModel" not in raw.get("architectures", []):
            raise ConfigError(f"architectures {raw.get('architectures')}: not a DFlash drafter (DFlashDraftModel)")

        def need(key: str, src: dict = raw):
            if key not in src:
                raise ConfigError(f"DFlash config.json: missing required field {key!r}")
            return src[key]

        n = int(need("num_hidden_layers"))
        types = tuple(raw.get("layer_types") or [FULL] * n)  # the earlier releases: every layer full
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ConfigError(f"DFlash layer_types {list(types)}: need {n} of {SLIDING!r} / {FULL!r}")
        if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias"):
            raise ConfigError("DFlash config: only hidden_act silu without attention biases is supported")
        nh, nkv = int(need("num_attention_heads")), int(need("num_key_value_heads"))
        if nh % nkv:
            raise ConfigError(f"DFlash num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
        dcfg = raw.get("dflash_config", {})
        block = int(dcfg.get("block_size", raw.get("block_size", 16)))  # older checkpoints: top level
        if block < 2:
            raise ConfigError(f"DFlash block_size {block}: need at least 2 (the anchor and one mask)")
        rope = raw.get("rope_parameters") or {}
        taps = dcfg.get("target_layer_ids")
        if taps is None:
            taps = default_taps(int(need("num_target_layers")), n)
        return cls(hidden_size=int(need("hidden_size")), intermediate_size=int(need("intermediate_size")),
                   layer_types=types, num_heads=nh, num_kv_heads=nkv, head_dim=int(need("head_dim")),
                   rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                   sliding_window=int(raw.get("sliding_window") or 0), block_size=block,
                   mask_token_id=int(need("mask_token_id", dcfg)), target_layer_ids=tuple(int(t) for t in taps))

    def check_target(self, target: ModelConfig) -> None:
        """The drafter must fit the target it reads taps from and shares embed_tokens and lm_head with."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"DFlash hidden_size {self.hidden_size} != the target's {target.hidden_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"DFlash mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                              f"(0..{target.vocab_size - 1})")
        bad = [t for t in self.target_layer_ids if not 0 <= t < target.num_layers]
        if bad or not self.target_layer_ids:
            raise ConfigError(f"DFlash target_layer_ids {list(self.target_layer_ids)}: each must name one of the "
                              f"target's {target.num_layers} layers")


def dflash_shapes(cfg: DFlashConfig, n_taps: int) -> dict[str, tuple[int, ...]]:
    """z-lab's tensors (spec-decode-spec §2.2), [out, in]: 11 per layer + fc, hidden_norm, norm."""
    H, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"fc.weight": (H, n_taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (cfg.num_heads * hd, H),
                   p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, H),
                   p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, H),
                   p + "self_attn.o_proj.weight": (H, cfg.num_heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                   p + "mlp.down_proj.weight": (H, F)}
    return shapes


def load_dflash(model_dir: str | Path, target: ModelConfig) -> tuple[DFlashConfig, dict[str, np.ndarray]]:
    """The drafter's config (checked against the target's) and its tensors, checked by name and shape."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: the DFlash drafter directory has no config.json")
    cfg = DFlashConfig.from_dict(json.loads(path.read_text()))
    cfg.check_target(target)
    want = dflash_shapes(cfg, len(cfg.target_layer_ids))
    found: dict[str, np.ndarray] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{model_dir}: no *.safetensors files")
    for f in files:
        for name, arr in read_safetensors(f).items():
            key = name.removeprefix("model.")
            if key not in want:
                raise WeightError(f"unexpected tensor {name} (shape {list(arr.shape)}) in the DFlash drafter {f.name}")
            if tuple(arr.shape) != want[key]:
                raise WeightError(f"DFlash tensor {name}: expected shape {list(want[key])}, found {list(arr.shape)}")
            found[key] = arr
    missing = [k for k in want if k not in found]
    if missing:
        raise WeightError(f"the DFlash drafter lacks tensor {missing[0]} (expected shape {list(want[missing[0]])})"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return cfg, found


def _plain(arr: np.ndarray) -> np.ndarray:
    """A plain RMSNorm weight w as the (1 + w) norm ops take it: w - 1, in f32 (exact for bf16 w)."""
    return as_f32(arr) - np.float32(1.0)


class DFlashDrafter(Drafter):
    """Proposes up to B-1 tokens per request from one block forward; its context grows by what the
    target commits (observe). `context[req]` is the context length L of each request it knows."""

    def __init__(self, cfg: DFlashConfig, weights: dict[str, np.ndarray], target, num_speculative_tokens: int,
                 max_num_seqs: int):
        """target: the Qwen35Model whose taps, embed_tokens and lm_head it uses."""
        if num_speculative_tokens > cfg.block_size - 1:
            raise ValueError(f"speculative_config: num_speculative_tokens {num_speculative_tokens} is more than the "
                             f"DFlash drafter's block of {cfg.block_size} proposes ({cfg.block_size - 1})")
        self.cfg, self.ops, self.target, self.max_num_seqs = cfg, target.ops, target, max_num_seqs
        self.capture = Capture(taps=cfg.target_layer_ids)
        up = self.ops.weight
        self.fc, self.hidden_norm, self.norm = (up(weights["fc.weight"]), up(_plain(weights["hidden_norm.weight"])),
                                                up(_plain(weights["norm.weight"])))
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            w = lambda name: weights[f"layers.{i}.{name}"]  # noqa: E731
            self.layers.append({
                "sliding": kind == SLIDING, "ln1": up(_plain(w("input_layernorm.weight"))),
                "ln2": up(_plain(w("post_attention_layernorm.weight"))),
                "qkv": up([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]),
                "q_norm": up(_plain(w("self_attn.q_norm.weight"))), "k_norm": up(_plain(w("self_attn.k_norm.weight"))),
                "o_proj": up(w("self_attn.o_proj.weight")),
                "gate_up": self.ops.weight_gate_up(w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")),
                "down": up(w("mlp.down_proj.weight"))})
        self.cache, self.num_blocks, self.scratch_pages = None, 0, 0  # alloc()
        self.context: dict[Request, int] = {}

    def weight_bytes(self) -> int:
        arrays = [self.fc, self.hidden_norm, self.norm] + [v for L in self.layers for v in L.values()
                                                           if hasattr(v, "nbytes")]
        return sum(a.nbytes for a in arrays)

    def kv_bytes(self, block_size: int) -> tuple[int, int]:
        """Its KV per pool block in the backend's dtype, and its scratch pages'."""
        probe = self.ops.alloc_cache(self.cfg, 0, 1, block_size)
        per_block = sum(a.nbytes for a in probe.k + probe.v)
        return per_block, per_block * self.max_num_seqs * scratch_pages(self.cfg, block_size)

    def bind(self, cache) -> None:
        self.alloc(cache.k[0].shape[0], cache.block_size)

    def alloc(self, num_blocks: int, block_size: int) -> None:
        """Its KV: a page for each of the target pool's blocks (same ids), then the scratch pages."""
        self.num_blocks, self.scratch_pages = num_blocks, scratch_pages(self.cfg, block_size)
        self.cache = self.ops.alloc_cache(self.cfg, 0, num_blocks + self.max_num_seqs * self.scratch_pages,
                                          block_size)

    def observe(self, record: StepRecord) -> None:
        self.append(record.captured["taps"], record.committed())

    # ---- context ------------------------------------------------------------------------
    def append(self, taps, spans: list[tuple[Request, int, int, int]]) -> None:
        """Context K/V for committed positions: spans (request, first position, first row of taps, rows)
        with taps [rows, n_taps * H], the target's tap layers' residual streams concatenated. Each span
        continues its request's context (a new request starts at 0)."""
        spans = [s for s in spans if s[3] > 0]
        for req, pos, _, _ in spans:
            if self.context.get(req, 0) != pos:
                raise RuntimeError(f"DFlash context of {req.request_id} covers {self.context.get(req, 0)} positions, "
                                   f"an append starts at {pos}")
        if not spans:
            return
        cfg, ops = self.cfg, self.ops
        step = Step.build([([0] * n, pos, 0, req.block_ids) for req, pos, _, n in spans], sample=[0] * len(spans))
        meta = ops.prepare(step, self.cache)
        rows = np.concatenate([np.arange(r, r + n) for _, _, r, n in spans]).astype(np.int32)
        c, _ = ops.add_rms_norm(ops.linear(ops.gather_rows(taps, rows), self.fc), None, self.hidden_norm,
                                cfg.rms_norm_eps)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for L, k_cache, v_cache in zip(self.layers, self.cache.k, self.cache.v):
            kv = ops.linear(c, L["qkv"][nq:])  # k | v rows of the fused projection
            ops.attn_prep(None, kv[:, :nkv], kv[:, nkv:], None, L["k_norm"], k_cache, v_cache, meta, cfg.head_dim,
                          cfg.rope_theta, cfg.rms_norm_eps, gated=False)
        for req, pos, _, n in spans:
            self.context[req] = pos + n

    def forget(self, req: Request) -> None:
        self.context.pop(req, None)

    # ---- draft --------------------------------------------------------------------------
    def block_logits(self, reqs: list[Request], rooms: list[int] | None = None):
        """f32 logits of the first rooms[i] mask slots of each request (default all B-1), request after
        request: slot j scores position L+j, L the request's committed length (its context), x_L its
        pending token. The block is whole whatever the rooms (the full layer's queries see all of it)."""
        cfg, ops = self.cfg, self.ops
        B, bs = cfg.block_size, self.cache.block_size
        chunks = []
        for i, req in enumerate(reqs):
            L = req.num_computed
            if self.context.get(req, 0) != L:
                raise RuntimeError(f"DFlash context of {req.request_id} covers {self.context.get(req, 0)} positions, "
                                   f"the target committed {L}")
            pages = req.block_ids[:-(-(L + B) // bs)]
            first = self.num_blocks + i * self.scratch_pages  # past the reservation: this row's scratch pages
            pages = pages + list(range(first, first + -(-(L + B) // bs) - len(pages)))
            chunks.append(([req.token_ids(L, L + 1)[0]] + [cfg.mask_token_id] * (B - 1), L, 0, pages))
        meta = ops.prepare(Step.build(chunks, sample=[0] * len(chunks)), self.cache)
        eps, nq, nkv = cfg.rms_norm_eps, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        x, residual = ops.embed(self.target.embed, meta), None
        for L, k_cache, v_cache in zip(self.layers, self.cache.k, self.cache.v):
            h, residual = ops.add_rms_norm(x, residual, L["ln1"], eps)
            proj = ops.linear(h, L["qkv"])
            q, _ = ops.attn_prep(proj[:, :nq], proj[:, nq:nq + nkv], proj[:, nq + nkv:], L["q_norm"], L["k_norm"],
                                 k_cache, v_cache, meta, cfg.head_dim, cfg.rope_theta, eps, gated=False)
            # sliding layers: causal, the last sliding_window keys; the full-attention layer sees the whole block
            o = ops.attention(q, None, k_cache, v_cache, meta, causal=L["sliding"],
                              window=cfg.sliding_window if L["sliding"] else 0)
            h, residual = ops.linear_add_rms_norm(o, L["o_proj"], residual, L["ln2"], eps)
            x = ops.linear(ops.swiglu(h, L["gate_up"]), L["down"])
        rooms = rooms if rooms is not None else [B - 1] * len(reqs)
        rows = np.array([i * B + j for i, k in enumerate(rooms) for j in range(1, k + 1)], np.int32)
        z, _ = ops.add_rms_norm(ops.gather_rows(x, rows), ops.gather_rows(residual, rows), self.norm, eps)
        return ops.linear(z, self.target.lm_head)

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        """Greedy drafts (argmax, whatever the request's sampling: spec-decode-spec §2.3), the first
        rooms[i] of the B-1 for request i; the lm_head runs on those rows only."""
        rooms = [min(k, self.cfg.block_size - 1) for k in rooms]
        busy = [i for i, k in enumerate(rooms) if k > 0]
        out = [[] for _ in reqs]
        if busy:
            logits = self.block_logits([reqs[i] for i in busy], [rooms[i] for i in busy])
            top = to_numpy(self.ops.argmax_finite(logits))[:, 0].tolist()
            for i in busy:
                out[i], top = top[:rooms[i]], top[rooms[i]:]
        return out


def default_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's build_target_layer_ids: target layers spread from 1 to T-3 (spec-decode-spec §2.1)."""
    T, n = num_target_layers, num_draft_layers
    if n == 1:
        return [T // 2]
    return [round(1 + i * (T - 4) / (n - 1)) for i in range(n)]


def scratch_pages(cfg: DFlashConfig, block_size: int) -> int:
    """Pages per draft row for block positions past the request's reservation: the pending position L is
    inside it, so at most B-1 positions, from a page boundary on."""
    return -(-(cfg.block_size - 1) // block_size)

