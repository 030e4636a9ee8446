"""Offline API: `LLM(model_dir, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from pathlib import Path

from .engine import Engine, OverloadedError
from .request import RequestOutput, TokenLogprob
from .sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLM:
    def __init__(self, model_dir: str | Path, **engine_args):
        self.engine = Engine(model_dir, **engine_args)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """prompts: a str, a list of token ids, or a list of either. Outputs come in prompt order.
        Beyond the waiting bound we wait for finishes; a request the engine refuses (bad
        parameters, can never fit) aborts the ones already submitted and raises."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        events: queue.Queue[RequestOutput] = queue.Queue()
        outs: dict[str, CompletionOutput] = {}
        order, todo, done = [], list(zip(ids, params)), 0
        while done < len(prompts):
            while todo:
                p, sp = todo[0]
                try:
                    rid = self.engine.submit(p, sp, events.put)
                except OverloadedError:
                    break
                except Exception:
                    for r in order:
                        self.engine.abort(r)
                    raise
                todo.pop(0)
                order.append(rid)
                outs[rid] = CompletionOutput(rid, p, logprobs=[] if sp and sp.logprobs is not None else None)
            ev = events.get()
            o = outs[ev.request_id]
            o.text += ev.new_text
            o.token_ids += ev.new_token_ids
            if o.logprobs is not None and ev.logprobs:
                o.logprobs += ev.logprobs
            if ev.finished:
                o.finish_reason, o.stop_reason, o.error = ev.finish_reason, ev.stop_reason, ev.error
                done += 1
        return [outs[r] for r in order]

    def shutdown(self) -> None:
        self.engine.shutdown()
