"""One choice's output stream: engine step outputs in, the deltas a response carries out.

The engine already detokenizes and applies stop strings; here the chat reasoning is split
from the content and logprobs are put in (token id, logprob, [(id, logprob), ...]) form.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningSplitter


@dataclass
class Delta:
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChoiceState:
    def __init__(self, index: int, tokenizer, thinking: bool | None):
        self.index, self.tokenizer = index, tokenizer
        self.num_tokens = 0
        self.cached_tokens = None  # prompt tokens the engine's prefix cache served (None: caching off)
        self.spec_decode = None    # speculative decoding's per-request figures, from the final event (None: off)
        self.finished = False
        self.splitter = None if thinking is None else ReasoningSplitter(thinking)

    def update(self, out) -> Delta:
        """out: an engine RequestOutput (one step's delta, or the final event)."""
        self.num_tokens = max(self.num_tokens, out.completion_tokens)
        self.cached_tokens = out.cached_tokens
        if out.spec_decode is not None:
            self.spec_decode = out.spec_decode
        self.finished = out.finished
        d = Delta(token_ids=list(out.new_token_ids), finish_reason=out.finish_reason if out.finished else None,
                  stop_reason=out.stop_reason,
                  logprobs=[(lp.token_id, lp.logprob, list(lp.top_logprobs.items())) for lp in out.logprobs or []])
        if self.splitter is not None:
            d.reasoning, d.text = self.splitter.add(out.new_text, final=out.finished)
        else:
            d.text = out.new_text
        return d

    def token_str(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id], skip_special_tokens=False)
