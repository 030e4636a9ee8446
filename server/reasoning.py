"""Qwen3 reasoning split: text before `</think>` is reasoning, the rest is the answer.

Qwen3.5's generation prompt already opens the block (`<think>\\n`) when thinking is on, so the
output starts inside the reasoning and contains only the closing tag; a `<think>` the model
writes itself opens a block too. A partial tag at the end of a delta is held back.

As in vLLM, the split runs only when the server is started with `--reasoning-parser qwen3`;
without it, the whole output is `content`.
"""
from __future__ import annotations

PARSERS = ("qwen3",)  # --reasoning-parser choices (vLLM's name for the Qwen3 family's parser)
START, END = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def _partial_suffix(s: str, tag: str) -> int:
    """Length of the longest end of s that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if tag.startswith(s[-k:]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.pending = ""

    def add(self, text: str, final: bool = False) -> tuple[str, str]:
        """Feed a text delta; returns (reasoning delta, content delta)."""
        s, reasoning, content = self.pending + text, [], []
        self.pending = ""
        while s:
            tag = END if self.thinking else START
            i = s.find(tag)
            if i < 0:
                keep = 0 if final else _partial_suffix(s, tag)
                part, self.pending = s[:len(s) - keep], s[len(s) - keep:]
                (reasoning if self.thinking else content).append(part)
                break
            (reasoning if self.thinking else content).append(s[:i])
            s = s[i + len(tag):]
            self.thinking = not self.thinking
        return "".join(reasoning), "".join(content)
