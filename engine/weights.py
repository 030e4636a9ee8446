"""Checkpoint weights: memory-mapped safetensors in the published Hugging Face layout.

Tensors come back as NumPy arrays named as in the text model (`layers.3.self_attn.q_proj.weight`,
`embed_tokens.weight`, ...). bf16 stays raw 16-bit bits (dtype uint16) until a backend converts it;
F32 tensors (`A_log`, `linear_attn.norm.weight`) stay float32.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .arrays import bf16_to_f32
from .config import FULL, LINEAR, ModelConfig

# safetensors dtype -> NumPy dtype of the raw buffer (BF16 kept as bits)
_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_PREFIXES = ("model.language_model.", "model.")
_VISION = "model.visual."
_MTP = "mtp."
F32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")


class WeightError(ValueError):
    """A missing, unexpected or mis-shaped tensor; the message names it."""


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map one .safetensors file; returns views into the mapping."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise WeightError(f"{path.name}: tensor {name} has dtype {info['dtype']} (supported: BF16, F16, F32)")
        lo, hi = info["data_offsets"]
        out[name] = data[lo:hi].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text tensor the model needs, with its [out, in] shape (spec §2)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(cfg.layer_types):
        shapes |= _layer_shapes(cfg, f"layers.{i}.", kind)
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction head every published checkpoint carries, top-level `mtp.*`
    (spec-decode-spec §1.2): fc fusing [embedding; hidden] (2H -> H), three (1+w) norms and one
    full-attention decoder layer; it shares the target's embed_tokens and lm_head. Loaded for the "mtp"
    drafter only (mtp.py)."""
    H = cfg.hidden_size
    return {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
            "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)} | _layer_shapes(cfg, "mtp.layers.0.", FULL)


def _layer_shapes(cfg: ModelConfig, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors under prefix p: its norms, MLP and token mixer (GDN or attention)."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    shapes = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
              p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F)}
    if kind == LINEAR:
        nv = cfg.lin_num_v_heads
        return shapes | {p + "linear_attn.in_proj_qkv.weight": (cfg.conv_dim, H),
                         p + "linear_attn.in_proj_z.weight": (cfg.value_dim, H),
                         p + "linear_attn.in_proj_b.weight": (nv, H), p + "linear_attn.in_proj_a.weight": (nv, H),
                         p + "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
                         p + "linear_attn.dt_bias": (nv,), p + "linear_attn.A_log": (nv,),
                         p + "linear_attn.norm.weight": (cfg.lin_v_dim,),
                         p + "linear_attn.out_proj.weight": (H, cfg.value_dim)}
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return shapes | {p + "self_attn.q_proj.weight": (2 * nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                     p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                     p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise WeightError(f"{index.name} names shard(s) that do not exist: {', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{model_dir}: no *.safetensors files and no model.safetensors.index.json")
    return files


def _text_name(name: str, mtp: bool) -> str | None:
    """Checkpoint name -> text-model name; None for tensors we ignore (vision tower, MTP head unless mtp)."""
    if name.startswith(_VISION) or (name.startswith(_MTP) and not mtp):
        return None
    if name == "lm_head.weight" or name.startswith(_MTP):
        return name
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # unknown: reported as unexpected below


def load_weights(model_dir: str | Path, cfg: ModelConfig, mtp: bool = False) -> dict[str, np.ndarray]:
    """mtp: the MTP head's mtp.* tensors too (speculative method "mtp"), under their checkpoint names."""
    model_dir = Path(model_dir)
    want = expected_shapes(cfg) | (mtp_shapes(cfg) if mtp else {})
    found: dict[str, np.ndarray] = {}
    for path in _files(model_dir):
        for name, arr in read_safetensors(path).items():
            key = _text_name(name, mtp)
            if key is None or (key == "lm_head.weight" and cfg.tie_word_embeddings):
                continue  # a stored copy of a tied lm_head is the embedding again
            if key not in want:
                raise WeightError(f"unexpected tensor {name} (shape {list(arr.shape)}) in {path.name}")
            if tuple(arr.shape) != want[key]:
                raise WeightError(f"tensor {name}: expected shape {list(want[key])}, found {list(arr.shape)}")
            if arr.dtype == np.float16:
                arr = arr.astype(np.float32)
            if key.endswith(F32_SUFFIXES) and arr.dtype == np.uint16:
                arr = bf16_to_f32(arr)  # Qwen3.6-style bf16 copies of the f32 tensors
            found[key] = arr
    missing = [k for k in want if k not in found]
    if mtp and not any(k.startswith(_MTP) for k in found):
        raise WeightError(f"{model_dir}: the checkpoint has no mtp.* tensors (the multi-token-prediction head), so "
                          "it cannot serve speculative method 'mtp'")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"missing tensor {missing[0]} (expected shape {list(want[missing[0]])}){more}")
    if cfg.tie_word_embeddings:
        found["lm_head.weight"] = found["embed_tokens.weight"]
    return found

