"""Per-request sampling parameters (vLLM names and semantics, serving-conventions §3)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

GREEDY_EPS = 1e-5  # temperature below this is greedy, as in vLLM


@dataclass
class SamplingParams:
    max_tokens: int | None = 16           # None: up to max_model_len
    temperature: float | None = None      # None: generation_config.json, else 1.0
    top_p: float | None = None            # None: generation_config.json, else 1.0
    top_k: int | None = None              # None: generation_config.json, else off; -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None           # top-N alternatives besides the chosen token
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name, why):
            raise ValueError(f"{name} must be {why}, got {getattr(self, name)!r}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "an integer >= 1")
        if self.temperature is not None and not 0.0 <= self.temperature:
            bad("temperature", ">= 0")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < -1):
            bad("top_k", "an integer >= 1, or -1 / 0 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an integer or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "an integer >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "non-empty strings")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            if any(not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
                bad(name, f"token ids in [0, {vocab_size if vocab_size is not None else 'vocab_size'})")
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias", "values in [-100, 100]")

    def with_defaults(self, defaults: dict) -> "SamplingParams":
        """Fill unset temperature/top_p/top_k from generation_config.json (vLLM's behaviour)."""
        def pick(name, off):
            return getattr(self, name) if getattr(self, name) is not None else defaults.get(name, off)
        return replace(self, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1))
