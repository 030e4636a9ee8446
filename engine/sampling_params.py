"""Per-request sampling parameters (vLLM names and semantics, serving-conventions §3).

`validate` is the one place their values are checked: the engine calls it at submit, the server
before it answers, and a `SamplingParamsError` names the parameter so the server's 400 can too.
"""
from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass, field, replace

GREEDY_EPS = 1e-5  # temperature below this is greedy, as in vLLM
# The sampler divides positive logits by the repetition penalty and multiplies negative ones, in
# float32: bounded so that neither can overflow (1e-45 would turn every positive logit into inf).
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


class SamplingParamsError(ValueError):
    """A sampling parameter out of its range; `param` is its name."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _show(v) -> str:
    try:
        return reprlib.repr(v)  # short, and safe for a value nested too deeply for repr
    except ValueError:  # an int with more digits than str() converts
        return f"an integer of {v.bit_length()} bits"


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
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raises SamplingParamsError for the first bad value. vocab_size adds the token-id range
        checks, max_logprobs the engine's logprobs limit."""
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise SamplingParamsError(name, f"{name} must be {why}, got {_show(getattr(self, name))}")

        def number(name: str, lo: float, hi: float, why: str, lo_open: bool = False) -> None:
            v = getattr(self, name)
            check(_is_finite(v) and (lo < v if lo_open else lo <= v) and v <= hi, name, why)

        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              "an integer >= 1")
        if self.temperature is not None:
            number("temperature", 0.0, math.inf, "a finite number >= 0")
        if self.top_p is not None:
            number("top_p", 0.0, 1.0, "in (0, 1]", lo_open=True)
        check(self.top_k is None or (_is_int(self.top_k) and self.top_k >= -1), "top_k",
              "an integer >= 1, or -1 / 0 to disable")
        number("min_p", 0.0, 1.0, "in [0, 1]")
        number("repetition_penalty", *REPETITION_PENALTY_RANGE, "in [%g, %g]" % REPETITION_PENALTY_RANGE)
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, -2.0, 2.0, "in [-2, 2]")
        # numpy's generators take any non-negative integer as a seed
        check(self.seed is None or (_is_int(self.seed) and self.seed >= 0), "seed", "a non-negative integer")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})")
        top = max_logprobs if max_logprobs is not None else math.inf
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= top), "logprobs",
              "an integer >= 0" + (f" and <= max_logprobs ({max_logprobs})" if max_logprobs is not None else ""))
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        limit = vocab_size if vocab_size is not None else math.inf
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            check(all(_is_int(t) and 0 <= t < limit for t in ids), name,
                  f"token ids in [0, {vocab_size if vocab_size is not None else 'vocab_size'})")
        check(all(_is_finite(v) and -100 <= v <= 100 for v in self.logit_bias.values()), "logit_bias",
              "values in [-100, 100]")

    def with_defaults(self, defaults: dict) -> "SamplingParams":
        """Fill unset temperature/top_p/top_k from generation_config.json (vLLM's behaviour)."""
        def pick(name, off):
            return getattr(self, name) if getattr(self, name) is not None else defaults.get(name, off)
        return replace(self, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1))
