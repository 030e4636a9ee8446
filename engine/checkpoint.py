"""Random-weight checkpoints in the exact published Hugging Face layout (spec §1-§2), MTP head included.

Presets: `tiny` and `tiny3` (every ratio of the real models at toy size; tiny3 has 3 GDN value
heads per key head as 27B does, and ties lm_head as 4B does), and the real `4b`, `9b`, `27b` shapes.
Big checkpoints are written shard by shard, so memory stays at one shard.

`make_dflash` writes a DFlash drafter for a preset's target instead (z-lab's layout, spec-decode-spec
§2.1-§2.2; loaded by dflash.py): the 4B release's shape for every real preset, a 3-layer toy for tiny/tiny3.
"""
from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .dflash import DFlashConfig, default_taps, dflash_shapes
from .weights import expected_shapes, mtp_shapes

_COMMON = dict(vocab_size=248320, conv_kernel=4, max_position_embeddings=262144)
PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64,
                 lin_num_k_heads=2, lin_num_v_heads=4, lin_k_dim=32, lin_v_dim=64, tie=False),
    "tiny3": dict(hidden_size=128, intermediate_size=256, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=64,
                  lin_num_k_heads=2, lin_num_v_heads=6, lin_k_dim=32, lin_v_dim=32, tie=True),
    "4b": dict(hidden_size=2560, intermediate_size=9216, num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256,
               lin_num_k_heads=16, lin_num_v_heads=32, lin_k_dim=128, lin_v_dim=128, tie=True),
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256,
               lin_num_k_heads=16, lin_num_v_heads=32, lin_k_dim=128, lin_v_dim=128, tie=False),
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256,
                lin_num_k_heads=16, lin_num_v_heads=48, lin_k_dim=128, lin_v_dim=128, tie=False),
}
EOS_IDS = [248046, 248044]  # <|im_end|>, <|endoftext|>


def config_json(preset: str) -> dict:
    p = PRESETS[preset] | _COMMON
    L = p["num_layers"]
    rotary = int(p["head_dim"] * 0.25)
    text = {
        "model_type": "qwen3_5_text", "vocab_size": p["vocab_size"], "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"], "num_hidden_layers": L,
        "num_attention_heads": p["num_heads"], "num_key_value_heads": p["num_kv_heads"], "head_dim": p["head_dim"],
        "linear_num_key_heads": p["lin_num_k_heads"], "linear_num_value_heads": p["lin_num_v_heads"],
        "linear_key_head_dim": p["lin_k_dim"], "linear_value_head_dim": p["lin_v_dim"],
        "linear_conv_kernel_dim": p["conv_kernel"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": p["max_position_embeddings"], "tie_word_embeddings": p["tie"],
        "attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4,
        "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L)],
        "partial_rotary_factor": 0.25, "mamba_ssm_dtype": "float32", "dtype": "bfloat16",
        "eos_token_id": 248044, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": _mrope_section(rotary // 2), "mrope_interleaved": True},
    }
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": p["tie"], "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054, "transformers_version": "5.17.0"}


# The drafter's shape per target preset: z-lab's Qwen3.5-4B-DFlash (spec-decode-spec §2.1) with the
# target's hidden size; the toy keeps its ratios (a sliding window short enough for tests to cross).
_DFLASH = {"real": dict(num_layers=6, num_taps=8, num_heads=32, num_kv_heads=8, head_dim=128, sliding_window=4096),
           "toy": dict(num_layers=3, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=64, sliding_window=40)}
DFLASH_MASK_ID = 248077  # the current 4B release's mask token


def dflash_config_json(preset: str) -> dict:
    target = PRESETS[preset]
    d = _DFLASH["toy" if preset.startswith("tiny") else "real"]
    n, H, T = d["num_layers"], target["hidden_size"], target["num_layers"]
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "hidden_size": H,
            "intermediate_size": target["intermediate_size"], "hidden_act": "silu", "num_hidden_layers": n,
            "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"],
            "sliding_window": d["sliding_window"], "use_sliding_window": True, "max_window_layers": n,
            "num_attention_heads": d["num_heads"], "num_key_value_heads": d["num_kv_heads"],
            "head_dim": d["head_dim"], "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
            "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0, "vocab_size": 248320,
            "max_position_embeddings": 262144, "num_target_layers": T, "tie_word_embeddings": True,
            "dtype": "bfloat16", "eos_token_id": 248044,
            "dflash_config": {"block_size": 16, "mask_token_id": DFLASH_MASK_ID,
                              "target_layer_ids": default_taps(T, d["num_taps"])}}


def make_dflash(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A random DFlash drafter for the preset's target: config.json and one model.safetensors. Norms are
    plain w (used as w, not 1 + w: spec-decode-spec §2.2), so they are drawn around 1."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = dflash_config_json(preset)
    cfg = DFlashConfig.from_dict(raw)
    shapes = dflash_shapes(cfg, len(cfg.target_layer_ids))
    rng = np.random.default_rng(seed)
    sizes = ModelConfig.from_dict(config_json(preset))  # _std scales the output projections by depth

    def make(name):
        x = _init(rng, name, shapes[name], sizes)
        return _to_bf16_bits(x + 1.0 if x.ndim == 1 else x)

    _stream_safetensors(out / "model.safetensors", {k: (s, np.uint16) for k, s in shapes.items()}, make)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def _mrope_section(half: int) -> list[int]:
    """Split rotary_dim/2 frequencies over (T, H, W) like the real [11, 11, 10] for 32."""
    a = -(-half // 3)
    return [a, a, half - 2 * a]


def _std(name: str, shape, cfg: ModelConfig) -> float:
    if name.endswith("linear_attn.norm.weight"):
        return 0.1
    if len(shape) == 1:  # zero-centred RMSNorm weights (used as 1 + w), MTP's pre_fc_norm_* too
        return 0.1
    if name.endswith("conv1d.weight"):
        return 0.5
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 2.0 / np.sqrt(cfg.hidden_size)
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
        return 1.0 / np.sqrt(shape[1] * 2 * cfg.num_layers)
    return 1.0 / np.sqrt(shape[1])


def _init(rng, name: str, shape, cfg: ModelConfig) -> np.ndarray:
    """Weights that keep bf16 activations finite through 64 layers and logits O(1), with
    randomised norms, A_log, dt_bias and conv so every convention in the spec matters.
    Matrices are uniform with the target std (8x faster to draw than normals: 4B in seconds)."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 1e-1], as in Mamba
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    x = rng.random(shape, dtype=np.float32)
    x -= 0.5
    x *= np.float32(_std(name, shape, cfg) * np.sqrt(12.0))
    if name.endswith("linear_attn.norm.weight"):
        x += 1.0
    return x


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Truncation, not rounding: these are random values anyway, and it is 5x cheaper."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    _stream_safetensors(path, {k: (v.shape, v.dtype) for k, v in tensors.items()}, tensors.__getitem__)


def _stream_safetensors(path: Path, specs: dict[str, tuple], make) -> None:
    """Write the header from shapes alone, then each tensor as `make(name)` returns it, so at
    most one tensor is in memory."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in specs.items():
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": "BF16" if dtype == np.uint16 else "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, (shape, dtype) in specs.items():
            arr = np.ascontiguousarray(make(name))
            assert arr.shape == tuple(shape) and arr.dtype == dtype, name
            f.write(memoryview(arr).cast("B"))


def make_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, shard_bytes: int = 4 << 30) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    from .vocab import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = config_json(preset)
    cfg = ModelConfig.from_dict(raw)
    shapes = expected_shapes(cfg) | mtp_shapes(cfg)  # the published layout carries the MTP head
    f32 = lambda k: k.endswith(("A_log", "linear_attn.norm.weight"))  # noqa: E731
    nbytes = {k: int(np.prod(s)) * (4 if f32(k) else 2) for k, s in shapes.items()}
    shards, cur, size = [], [], 0
    for k in shapes:
        if cur and size + nbytes[k] > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += nbytes[k]
    shards.append(cur)
    rng = np.random.default_rng(seed)
    full = lambda k: k if k == "lm_head.weight" or k.startswith("mtp.") else "model.language_model." + k  # noqa: E731
    weight_map = {}
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        specs = {full(k): (shapes[k], np.float32 if f32(k) else np.uint16) for k in names}
        short = {full(k): k for k in names}

        def make(name, short=short):
            x = _init(rng, short[name], shapes[short[name]], cfg)
            return x if f32(short[name]) else _to_bf16_bits(x)

        _stream_safetensors(out / fname, specs, make)
        weight_map.update(dict.fromkeys(specs, fname))
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 248044, "eos_token_id": EOS_IDS, "pad_token_id": 248044, "do_sample": True,
         "temperature": 0.6, "top_p": 0.95, "top_k": 20, "transformers_version": "5.17.0"}, indent=2))
    write_tokenizer(out)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="qwen35 make-model", description="write a random-weight Qwen3.5 checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--dflash", action="store_true",
                    help="write a DFlash drafter for the preset's target instead (for --speculative-config)")
    a = ap.parse_args(argv)
    if a.dflash:
        print(make_dflash(a.out_dir, a.preset, a.seed))
    else:
        print(make_model(a.out_dir, a.preset, a.seed, int(a.shard_gb * (1 << 30))))
