"""Configuration: the model's (the text decoder of a Qwen3.5 dense checkpoint) and the engine's.

Reads both published `config.json` layouts (the multimodal wrapper with values under
`text_config`, and the text-only one) and `generation_config.json`. Anything we do not
implement fails here, at load, with a message that names it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

LINEAR, FULL = "linear_attention", "full_attention"
GDN_CHUNK = 64  # tokens per chunk of the GDN's chunked (WY) prefill form (spec §4.7)


def cache_root() -> Path:
    """Where qwen35 keeps what it builds (the demo checkpoint, compiled kernels): $QWEN35_CACHE."""
    return Path(os.environ.get("QWEN35_CACHE", Path.home() / ".cache" / "qwen35"))


class ConfigError(ValueError):
    """A checkpoint config we cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated delta net
    lin_num_k_heads: int
    lin_num_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # sampling defaults from generation_config.json (temperature, top_p, top_k, ...)
    sampling_defaults: dict = field(default_factory=dict)

    # derived sizes, named as in the spec (§1.3)
    @property
    def key_dim(self) -> int:
        return self.lin_num_k_heads * self.lin_k_dim

    @property
    def value_dim(self) -> int:
        return self.lin_num_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in the model directory")
        raw = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, gen: dict | None = None) -> "ModelConfig":
        gen = gen or {}
        model_type = raw.get("model_type")
        if model_type and "moe" in model_type:
            raise ConfigError(f"model_type {model_type!r}: MoE Qwen3.5 models are not supported (dense only)")
        if model_type not in ("qwen3_5", "qwen3_5_text"):
            raise ConfigError(f"model_type {model_type!r}: expected 'qwen3_5' or 'qwen3_5_text'")
        text = raw.get("text_config", raw) if model_type == "qwen3_5" else raw
        if model_type == "qwen3_5" and "text_config" not in raw:
            raise ConfigError("config.json: model_type 'qwen3_5' needs a 'text_config' section")
        for src in (raw, text):
            if src.get("quantization_config"):
                method = src["quantization_config"].get("quant_method", "?")
                raise ConfigError(f"quantization_config (quant_method {method!r}): quantized checkpoints are not supported")
        if "moe" in str(text.get("model_type", "")) or text.get("num_experts"):
            raise ConfigError("text_config: MoE (num_experts) is not supported (dense only)")

        def need(key: str):
            if key not in text:
                raise ConfigError(f"config.json: missing required field {key!r}")
            return text[key]

        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(need("full_attention_interval"))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
        for i, t in enumerate(layer_types):
            if t not in (LINEAR, FULL):
                raise ConfigError(f"layer_types[{i}] = {t!r}: unknown layer type (expected {LINEAR!r} or {FULL!r})")

        nh, nkv = int(need("num_attention_heads")), int(need("num_key_value_heads"))
        nk, nv = int(need("linear_num_key_heads")), int(need("linear_num_value_heads"))
        if nh % nkv:
            raise ConfigError(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
        if nv % nk:
            raise ConfigError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r}: only 'silu' is supported")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias true: not supported (Qwen3.5 has no attention biases)")

        head_dim = int(need("head_dim"))
        rope = text.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type {rope_type!r}: only 'default' is supported")
        # HF falls back to theta 10000 when rope_parameters is absent (spec §1.2); so do we.
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2:
            raise ConfigError(f"rotary dim {rotary_dim} (head_dim {head_dim} x partial_rotary_factor {factor}) is odd")
        sections = rope.get("mrope_section")
        if sections is not None and sum(sections) != rotary_dim // 2:
            raise ConfigError(f"rope_parameters.mrope_section {sections} does not sum to rotary_dim/2 = {rotary_dim // 2}")

        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        eos = gen.get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
        eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                        "presence_penalty", "frequency_penalty") if k in gen}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        return cls(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")), num_layers=n_layers,
            layer_types=tuple(layer_types), num_heads=nh, num_kv_heads=nkv, head_dim=head_dim,
            rotary_dim=rotary_dim, rope_theta=theta, lin_num_k_heads=nk, lin_num_v_heads=nv,
            lin_k_dim=int(need("linear_key_head_dim")), lin_v_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(need("linear_conv_kernel_dim")), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie), max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            eos_token_ids=eos_ids, pad_token_id=gen.get("pad_token_id", text.get("pad_token_id", raw.get("pad_token_id"))),
            sampling_defaults=defaults,
        )


@dataclass
class EngineArgs:
    """The engine's settings (vLLM's names); the CLI flags map onto these."""
    max_model_len: int | None = None          # default min(model window, 8192)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192         # vLLM's default: a wave of arrivals is admitted together
    prefill_budget_with_decodes: int = 0      # prompt tokens in a step that also decodes (0: no cap beyond the above)
    max_waiting_requests: int = 1024          # submitted, not yet admitted: beyond this, 503
    num_kv_blocks: int | None = None          # default: from the memory budget
    kv_cache_memory: int | None = None        # bytes for state slots + KV (cpu default 512 MiB)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16                      # see kv_blocks.py
    device: str = "auto"                      # "cpu" | "cuda" | "auto"
    max_logprobs: int = 20                    # the most top logprobs a request may ask for
    seed: int = 0                             # for requests without a seed
    enforce_eager: bool = False               # CUDA: no decode-step graphs
    batch_invariant: bool = False             # CUDA: a request's tokens independent of its batch (slower prefill)
    trace_steps: str | None = None            # JSONL path: one line per step (kind, sizes, timings)
    enable_prefix_caching: bool = False       # shared KV blocks + GDN state snapshots (prefix_cache.py)
    num_state_snapshots: int | None = None    # snapshot pool size with prefix caching (default: memory.py)
    speculative_config: dict | str | None = None  # vLLM's JSON (SpeculativeConfig.parse); None: off


SPEC_METHODS = ("ngram", "mtp", "dflash")  # the drafters built so far (engine/drafter.py, mtp.py, dflash.py)
MAX_SPEC_TOKENS = 15       # a verify is at most 16 tokens per sequence (DFlash's block)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, vLLM's keys: the drafter and how many tokens it proposes per step."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5    # ngram: the longest suffix matched ...
    prompt_lookup_min: int = 5    # ... down to this one
    model: str | None = None      # dflash: the drafter's directory

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """A JSON object (or its text) -> the config, None when off; a ValueError names what is wrong."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = set(value) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported (one of {list(SPEC_METHODS)})")
        k = value.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPEC_TOKENS}], got {k!r}")
        # vLLM: both default to 5, and one given alone sets the other
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if type(lo) is not int or type(hi) is not int or not 1 <= lo <= hi:
            raise ValueError(f"speculative_config: need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {lo!r} and {hi!r}")
        model = value.get("model")
        if (method == "dflash") != (model is not None) or not isinstance(model, (str, type(None))):
            raise ValueError(f"speculative_config: 'model' (a path) names the drafter of method 'dflash', and only "
                             f"it; got {model!r} for {method!r}")
        return cls(method, k, hi, lo, model)
