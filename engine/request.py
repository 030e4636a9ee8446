"""A request's state inside the engine, and the events it emits.

KV blocks, the state slot and `num_computed` (the position the sequence has reached) are one
unit: the scheduler allocates them together at admission and frees them together at the end. A
prefix-cache hit starts the unit at `num_computed = cached_tokens`: shared blocks, and a slot the
runner fills from a snapshot (prefix_cache.py).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float                 # of the chosen token, from the raw logits
    top_logprobs: dict[int, float]  # the N most likely tokens (raw logits)


@dataclass
class RequestOutput:
    """One event of a request's stream: the delta of one engine step, or the final event."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    queue_time: float | None = None    # seconds from arrival to admission; on the first token's event
    cached_tokens: int | None = None   # prompt tokens restored from the prefix cache (None: caching off)
    # speculative decoding, on the final event: {"speculative": whether it had a log set (else it ran
    # without speculation), "draft_tokens": verified, "accepted_tokens": of which accepted}; None: off
    spec_decode: dict | None = None


class StopStringBuffer:
    """Holds back max(len(stop)) - 1 characters so a partial stop string is never emitted
    (with include_stop_str_in_output nothing is held; the emitted tail is searched instead)."""

    def __init__(self, stops: list[str], include: bool):
        self.stops, self.include = stops, include
        self.look = max(map(len, stops), default=1) - 1  # chars a new match can reach back
        self.hold = 0 if include else self.look
        self.pending = ""  # generated, not emitted
        self.tail = ""     # last `look` emitted chars

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Returns (text safe to emit, matched stop string or None). Matches wholly inside the
        tail were looked for on earlier calls, so every match found ends in new text."""
        self.pending += delta
        if check and self.stops:
            window = self.tail + self.pending
            hits = [(i, s) for s in self.stops if (i := window.find(s)) >= 0]
            if hits:
                i, s = min(hits)
                out = window[len(self.tail):i + len(s) if self.include else i]
                self.pending = ""
                return out, s
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return "", None
        out, self.pending = self.pending[:cut], self.pending[cut:]
        seen = self.tail + out
        self.tail = seen[max(0, len(seen) - self.look):]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams          # defaults already applied
    max_tokens: int                 # resolved (params.max_tokens or what max_model_len leaves)
    stop_ids: frozenset[int]        # stop_token_ids, plus the EOS ids unless ignore_eos
    sink: Callable[[RequestOutput], None]
    generator: object = None        # per-request RNG when seeded (sampler's business)
    detokenizer: object = None
    stop_buffer: StopStringBuffer | None = None
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # when admission gave it KV blocks and a slot
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0           # tokens whose KV and recurrent state are in the cache
    cached_tokens: int = 0          # prompt tokens restored from the prefix cache at admission
    pending: int = 0                # 1 while its latest token is sampled on the device, not yet seen here
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # speculative decoding: proposed for this step's verify
    spec_log: int | None = None     # its log set (state_slots.SpecLogPool); None: no speculation
    replay: int = 0                 # tokens of its last verify its next step replays from the log (step.py)
    num_draft_tokens: int = 0       # drafts verified, and of them accepted (the final event reports both)
    num_accepted_tokens: int = 0
    spec_misses: int = 0            # proposals in a row that brought no accepted token (engine.py: pauses)
    spec_resume: int = 0            # when it proposes again (engine._clock: a step number, or its own tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def at_limit(self) -> bool:
        """max_tokens is reached, counting a pending token: nothing more to compute."""
        return len(self.output_ids) + self.pending >= self.max_tokens

    @property
    def lifetime_tokens(self) -> int:
        """Positions the request may ever occupy: what admission reserves."""
        return len(self.prompt_ids) + self.max_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Known token ids in [start, stop) (a pending token is not known yet)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.output_ids[max(start - n, 0):max(stop - n, 0)]

    def stop_check(self, token_id: int) -> tuple[str, int | None] | None:
        """After appending token_id: (finish_reason, stop_reason) if the request is done."""
        n = len(self.output_ids)
        if n >= self.params.min_tokens and token_id in self.stop_ids:
            return "stop", (token_id if token_id in self.params.stop_token_ids else None)
        if n >= self.max_tokens:
            return "length", None
        return None

    def commit(self, token_ids: list[int]) -> tuple[int, tuple | None]:
        """Appends one step's sampled tokens (a verify's may be several) up to the first that ends the request
        by a stop token or max_tokens; returns how many it appended and (finish_reason, stop_reason) or
        None. Stop strings are render()'s."""
        for i, t in enumerate(token_ids):
            self.output_ids.append(t)
            done = self.stop_check(t)
            if done:
                return i + 1, done
        return len(token_ids), None

    def render(self, tokens: list, done: tuple | None) -> tuple[RequestOutput, tuple | None]:
        """The event of the last len(tokens) committed tokens ((token id, logprob) pairs, a logprob (chosen,
        top ids, top logprobs) or None; done: what commit() returned): each detokenized and checked for stop
        strings as if alone. A stop string ends the request at the token that completes it (the committed
        tokens after it are taken back). Returns the event and (finish_reason, stop_reason) if done."""
        n0 = len(self.output_ids) - len(tokens)
        ids, text, lps, end = [], [], [], None
        for i, (token_id, logprob) in enumerate(tokens):
            ids.append(token_id)
            end = done if i == len(tokens) - 1 else None
            delta = "" if end and end[0] == "stop" else self.detokenizer.add(token_id)  # stop tokens add no text
            if end:
                delta += self.detokenizer.flush()
            piece, matched = self.stop_buffer.feed(delta, check=n0 + i + 1 >= self.params.min_tokens)
            text.append(piece)
            if logprob is not None:
                chosen, top_ids, top_lps = logprob
                lps.append(TokenLogprob(token_id, chosen, dict(zip(top_ids, top_lps))))
            if matched is not None:
                end = ("stop", matched)
                del self.output_ids[n0 + i + 1:]
            elif end:
                text.append(self.stop_buffer.flush())
            if end:
                break
        out = RequestOutput(self.request_id, ids, "".join(text), prompt_tokens=len(self.prompt_ids),
                            completion_tokens=len(self.output_ids), logprobs=lps or None)
        if n0 == 0:
            out.queue_time = self.scheduled_at - self.arrival
        return out, end
