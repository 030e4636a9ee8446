"""Model runner: turns the scheduler's (request, num_new_tokens) list into one Step, runs the
forward, and samples one token for every sequence that reached the end of its known tokens.
The only place where requests meet arrays."""
from __future__ import annotations

from dataclasses import dataclass

from .request import Request
from .sampler import Sampler, SamplingRow, float_logits, is_argmax, take_rows
from .step import Step


@dataclass
class Sampled:
    token_id: int
    logprob: tuple[float, list[int], list[float]] | None


class ModelRunner:
    def __init__(self, model, cache, sampler: Sampler, graphs=None):
        """graphs: a DecodeGraphs (CUDA) that replays pure-decode steps; None runs every step eagerly."""
        self.model, self.cache, self.sampler, self.graphs = model, cache, sampler, graphs
        self.ops = model.ops
        # test hook: (requests sampled, host logits) -> logits; raising fails the whole step
        self.logits_hook = None

    def run(self, batch: list[tuple[Request, int]]) -> list[tuple[Request, Sampled | Exception]]:
        """Per sequence that sampled: its token, or the exception that ended only that request."""
        fresh = [req.slot for req, _ in batch if req.num_computed == 0]
        if fresh:  # a sequence's first chunk: its (possibly reused) slot starts from zero state
            self.ops.reset_slots(self.cache, fresh)
        chunks, want = [], []
        for req, n in batch:
            start = req.num_computed
            chunks.append((req.token_ids(start, start + n), start, req.slot, req.block_ids))
            want.append(start + n == req.num_tokens)
        step = Step.build(chunks, want)
        if self.graphs is not None and len(step.tokens) == len(batch) == len(step.logits_rows):
            logits = self.graphs.run(step)  # every sequence decodes one token
        else:
            logits = self.model.forward(step, self.cache)
        sampled = [req for (req, _), w in zip(batch, want) if w]
        if not sampled:
            return []
        # sampling runs where the logits are (on the GPU for the CUDA backend); the test hook gets
        # host logits, and then the sampling runs on the host
        if self.logits_hook is not None:
            logits = self.logits_hook(sampled, self.ops.to_host(logits))
        logits = float_logits(logits)
        # one pass over every row where the logits are: non-finite rows fail alone, plain greedy rows
        # take the argmax, and only the rest go through the sampler
        top, finite = self.ops.argmax_finite(logits)
        results, ok, rows = [], [], []
        for i, req in enumerate(sampled):
            try:
                if not finite[i]:
                    raise FloatingPointError(f"non-finite logits for request {req.request_id}")
                row = self._row(req, logits.shape[1])
                if is_argmax(row):
                    results.append((req, Sampled(int(top[i]), None)))
                else:
                    rows.append(row)
                    ok.append(i)
            except Exception as e:  # noqa: BLE001 - ends this request only
                results.append((req, e))
        if ok:
            out = self.sampler.sample(logits if len(ok) == len(sampled) else take_rows(logits, ok), rows)
            results += [(sampled[i], Sampled(int(out.token_ids[j]), out.logprobs[j])) for j, i in enumerate(ok)]
        return results

    @staticmethod
    def _row(req: Request, vocab: int) -> SamplingRow:
        p = req.params
        if any(not 0 <= t < vocab for t in p.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {sorted(p.logit_bias)}")
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
            banned_ids=sorted(req.stop_ids) if len(req.output_ids) < p.min_tokens else [],
            logit_bias=p.logit_bias, num_logprobs=p.logprobs, generator=req.generator)
