"""Model runner: turns the scheduler's (request, num_new_tokens) list into one Step, runs the
forward, and samples one token for every sequence that reached the end of its known tokens.
Where the scheduled requests become arrays (the drafters build their own steps; verify.py reads a
verify's logits rows).

Three calls, each enqueuing device work without waiting for it, so the engine can overlap its host
work with the device (engine.py): forward() launches a step, sample() launches the sampling of its
logits, collect() waits for the tokens and brings them to the host. A sampled token feeds the next
forward on the device (Step.feed) before collect() has seen it.

Speculative decoding: a request scheduled with drafts (scheduler.py) is a verify, `[pending token,
d_1..d_k]` with logits on all 1 + k rows. Its GDN layers log its tokens in its log set and leave the slot
as it was (step.py); verify.py turns the rows into the emitted tokens (`Verified`), the engine sets
`req.replay` to the a + 1 tokens it committed (a accepted drafts) and rewinds the request by the k - a
rejected positions, and the request's next step replays those tokens first: a rollback copies nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import verify
from .arrays import HostCopy, array_module, as_f32, take_rows
from .drafter import StepRecord
from .kv_blocks import DUMMY_BLOCK
from .prefix_cache import Plan
from .request import Request, Status
from .sampler import DrawInFlight, RowParams, Sampler, is_argmax
from .state_slots import DUMMY_SLOT
from .step import Step


@dataclass
class SampledToken:
    token_id: int
    logprob: tuple[float, list[int], list[float]] | None


@dataclass
class Verified:
    """A verify's outcome: the emitted tokens (accepted drafts, then the bonus or replacement token)."""
    tokens: list[SampledToken]
    drafted: int             # drafts verified; len(tokens) - 1 of them were accepted


@dataclass
class ForwardInFlight:
    """A forward in flight."""
    batch: list[tuple[Request, int]]
    sampled: list[Request]   # the requests of the logits rows, in order
    logits: object           # [len(sampled), vocab] on the backend's device
    marks: tuple = ()        # (start, end) device marks when timing
    plan: Plan | None = None  # prefix caching: its state copies, published once it is complete
    drafts: dict = field(default_factory=dict)  # verifying request -> its drafts (1 + k logits rows)
    record: StepRecord | None = None  # with a capture: what the drafter observes once the step is collected


@dataclass
class SamplingInFlight:
    """A step's sampling in flight: one token per request, on the device until collect() (a verify's
    tokens: in `verify`)."""
    requests: list[Request]  # those with one row, then the verifying ones
    row: dict                # request with one row -> its row
    tokens: object           # [R] sampled token ids (device): the next forward's feed
    top: HostCopy            # [R, 2] int32 argmax / all-finite per row, on its way to the host
    draw: DrawInFlight | None  # the sampler's rows (`drawn`), None when every row is plain greedy
    drawn: list[int]
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> what ended that request alone
    marks: tuple = ()
    verify: verify.VerifyInFlight | None = None


class ModelRunner:
    def __init__(self, model, cache, sampler: Sampler, graphs=None):
        """graphs: a DecodeGraphs (CUDA) that replays pure-decode steps; None runs every step eagerly."""
        self.model, self.cache, self.sampler, self.graphs = model, cache, sampler, graphs
        self.ops = model.ops
        self.timing = False  # mark device time around each forward and sampling (the step trace)
        self.capture = None  # a model.Capture: every forward keeps it for the drafter (ForwardInFlight.record)
        # test hook: (requests sampled, host logits) -> logits; raising fails the whole step
        self.logits_hook = None

    def warm_up(self, num_tokens: int) -> None:
        """A prefill of num_tokens tokens and a decode step after it, both in the dummy slot and page,
        before the first request: it then finds its kernels loaded, the GEMM plans made, the backend's
        lazily built helpers ready and the memory pool grown to a prefill's size."""
        self.ops.reset_slots(self.cache, [DUMMY_SLOT])
        blocks = [DUMMY_BLOCK] * -(-(num_tokens + 1) // self.cache.block_size)
        logits = self.model.forward(Step.build([([0] * num_tokens, 0, DUMMY_SLOT, blocks)]), self.cache)
        tokens = self.ops.argmax_finite(as_f32(logits))[:, 0]
        step = Step.build([([0], num_tokens, DUMMY_SLOT, blocks)], feed=(np.zeros(1, np.int64), tokens))
        self.ops.to_host(self.ops.argmax_finite(as_f32(self.model.forward(step, self.cache))))

    def forward(self, batch: list[tuple[Request, int]], prev: SamplingInFlight | None,
                plan: Plan | None = None) -> ForwardInFlight:
        """Launches the step. prev: the sampling in flight, whose tokens feed the decodes of requests
        with a pending token. plan: prefix caching's state copies, in stream order around the forward:
        snapshots restored into the slots of hits before it; saves inside a chunk written by the step's
        GDN layers (at most one per sequence), saves at a chunk's end copied from the slot after it."""
        fresh = [req.slot for req, _ in batch if req.num_computed == 0]
        assert not any(req.replay for req, _ in batch if req.num_computed == 0)
        if fresh:  # a sequence's first chunk: its (possibly reused) slot starts from zero state
            self.ops.reset_slots(self.cache, fresh)
        inside, at_end = {}, []  # saves inside a chunk, by slot (the kernels write them); at a chunk's end
        if plan is not None:
            span = {req.slot: (req.num_computed, end) for req, end in plan.ends}
            for slot, sid, pos in plan.save:
                if pos < span[slot][1]:
                    assert slot not in inside, "two in-chunk saves for one sequence"
                    inside[slot] = (pos - span[slot][0], sid)
                else:
                    at_end.append((slot, sid))
        chunks, want, dst, src, saves, drafts, spec, replay, t = [], [], [], [], {}, {}, {}, {}, 0
        for i, (req, n) in enumerate(batch):
            if req.slot in inside:
                saves[i] = inside[req.slot]
            start = req.num_computed
            k = max(start + n - req.num_tokens, 0)  # a verify: its last k tokens are the drafts
            ids = req.token_ids(start, start + n - k)
            if req.pending:  # its last known token is the one prev sampled: filled in on the device
                dst.append(t + n - k - 1)
                src.append(prev.row[req])
                ids.append(0)
            if k:
                drafts[req] = req.drafts[:k]
                ids += drafts[req]
                spec[i] = req.spec_log
            if req.replay:  # its last verify's committed tokens, from its log set (step.py)
                spec[i], replay[i] = req.spec_log, req.replay
                req.replay = 0
            assert len(ids) == n, (req.request_id, start, n, len(ids))
            chunks.append((ids, start, req.slot, req.block_ids))
            want.append(1 + k if start + n >= req.num_tokens else 0)
            t += n
        feed = None
        if dst:
            src_rows = np.array(src, np.int64)
            same = len(src) == len(prev.requests) and (src_rows == np.arange(len(src))).all()
            xp = array_module(prev.tokens)
            feed = (np.array(dst, np.int64), prev.tokens if same else prev.tokens[xp.asarray(src_rows)])
        step = Step.build(chunks, want, feed, saves, spec, replay)
        start = self.ops.mark() if self.timing else None  # the step's device time includes the copies
        if plan is not None and plan.restore:  # a hit's first chunk resumes from the snapshot's state
            self.ops.copy_slots(self.cache, *plan.restore_ids)
        record = None
        kind = self.graphs.kind(step) if self.graphs is not None else None
        graphs = self.graphs if kind is not None else None
        if graphs is not None and self.capture not in (None, graphs.keep):
            graphs = None  # the graphs keep other activations than the drafter needs: eager
        if self.capture is not None:
            logits, captured = (graphs.run(step, with_capture=True, kind=kind) if graphs is not None
                                else self.model.forward(step, self.cache, self.capture))
            record = StepRecord(captured, [(req, req.num_computed, int(step.cu_seqlens[i]), n)
                                           for i, (req, n) in enumerate(batch)])
        elif graphs is not None:
            logits = graphs.run(step, kind=kind)  # every sequence decodes one token, or verifies K drafts
        else:
            logits = self.model.forward(step, self.cache)
        if at_end:  # (a verify's slot holds the state before it until its next step: verifies save nothing)
            assert not drafts or not {s for s, _ in at_end} & {req.slot for req in drafts}
            self.ops.copy_slots(self.cache, [a for a, _ in at_end], [b for _, b in at_end])
        marks = (start, self.ops.mark()) if self.timing else ()
        return ForwardInFlight(batch, [req for (req, _), w in zip(batch, want) if w], logits, marks, plan, drafts,
                               record)

    def sample(self, launched: ForwardInFlight) -> SamplingInFlight:
        """Launches the sampling of the step's requests that are still running (one finished while the
        step was in flight has nothing to sample). Their parameters read output_ids, so the previous
        sampling must have been collected."""
        start = self.ops.mark() if self.timing else None
        drafts = launched.drafts
        nrows = [1 + len(drafts.get(req, ())) for req in launched.sampled]
        live = [i for i, req in enumerate(launched.sampled) if req.status is Status.RUNNING]
        reqs = [launched.sampled[i] for i in live]
        logits = launched.logits
        if len(live) < len(launched.sampled):
            first = np.cumsum([0] + nrows)
            logits = take_rows(logits, [r for i in live for r in range(first[i], first[i] + nrows[i])])
        # sampling runs where the logits are (on the GPU for the CUDA backend); the test hook gets
        # host logits (one request per row: a verify's repeats), and then the sampling runs on the host
        if self.logits_hook is not None and reqs:
            logits = self.logits_hook([req for i in live for req in [launched.sampled[i]] * nrows[i]],
                                      self.ops.to_host(logits))
        logits = as_f32(logits)
        # one pass over every row where the logits are: non-finite rows fail alone (collect()), plain
        # greedy rows take the argmax, and only the rest go through the sampler
        top = self.ops.argmax_finite(logits)
        verifying = None
        if drafts:  # the verifies' rows go to verify.py, the others' on below as in any step
            one, vreqs, vfirst, r = [], [], [], 0
            for req in reqs:
                if req in drafts:
                    vreqs.append(req)
                    vfirst.append(r)
                else:
                    one.append(r)
                r += 1 + len(drafts.get(req, ()))
            V = logits.shape[1]
            verifying = verify.launch(self.sampler, logits, top, vreqs, [drafts[q] for q in vreqs], vfirst,
                                      [self._verify_rows(q, drafts[q], V) for q in vreqs])
            reqs = [req for req in reqs if req not in drafts]
            logits, top = take_rows(logits, one), take_rows(top, one)
        rows, drawn, errors = [], [], {}
        for j, req in enumerate(reqs):
            try:
                row = self._row(req, logits.shape[1])
                if not is_argmax(row):
                    rows.append(row)
                    drawn.append(j)
            except Exception as e:  # noqa: BLE001 - ends this request only
                errors[j] = e
        tokens, draw = top[:, 0], None
        if drawn:
            xp = array_module(top)
            every = len(drawn) == len(reqs)
            di = None if every else xp.asarray(np.array(drawn, np.int64))
            x, fin = (logits, top[:, 1]) if every else (take_rows(logits, drawn), top[di, 1])
            # a non-finite row fails in collect(); until then it draws from zeros, so that every token
            # that may feed the next forward is a valid id
            x = xp.where(fin[:, None] != 0, x, np.float32(0))
            draw = self.sampler.launch(x, rows)
            if every:
                tokens = draw.tokens
            else:
                tokens = tokens.astype(xp.int64)
                tokens[di] = draw.tokens
        marks = (start, self.ops.mark()) if self.timing else ()
        row = {req: j for j, req in enumerate(reqs)}
        if launched.record is not None:
            launched.record.sampled = (row, tokens)
        return SamplingInFlight(reqs + (verifying.reqs if verifying else []), row, tokens, HostCopy(top), draw, drawn,
                                errors, marks, verifying)

    def collect(self, s: SamplingInFlight) -> list[tuple[Request, SampledToken | Verified | Exception]]:
        """Waits for the sampling and returns, per request, its token (a verify's: its tokens) or the
        exception that ended only that request."""
        top = s.top.result()
        res = s.draw.fetch() if s.draw is not None else None
        at = {j: k for k, j in enumerate(s.drawn)}
        out = []
        for req, j in s.row.items():
            if not top[j, 1]:
                out.append((req, FloatingPointError(f"non-finite logits for request {req.request_id}")))
            elif j in s.errors:
                out.append((req, s.errors[j]))
            elif j in at:
                out.append((req, SampledToken(int(res.token_ids[at[j]]), res.logprobs[at[j]])))
            else:
                out.append((req, SampledToken(int(top[j, 0]), None)))
        if s.verify is not None:
            out += [(req, res if isinstance(res, Exception) else Verified([SampledToken(*t) for t in res], k))
                    for req, res, k in verify.finish(s.verify)]
        return out

    def _verify_rows(self, req: Request, drafts: list[int], vocab: int) -> list[RowParams] | Exception:
        """A verify's row parameters: row i samples the token after drafts[:i], as if they were output."""
        try:
            return [self._row(req, vocab, drafts[:i]) for i in range(len(drafts) + 1)]
        except Exception as e:  # noqa: BLE001 - ends this request only
            return e

    @staticmethod
    def _row(req: Request, vocab: int, drafted: list[int] = ()) -> RowParams:
        """drafted: tokens taken as output after req's (a verify's rows)."""
        p = req.params
        output = req.output_ids + list(drafted) if drafted else req.output_ids
        if any(not 0 <= t < vocab for t in p.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {sorted(p.logit_bias)}")
        return RowParams(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, prompt_ids=req.prompt_ids, output_ids=output,
            banned_ids=sorted(req.stop_ids) if len(output) < p.min_tokens else [],
            logit_bias=p.logit_bias, num_logprobs=p.logprobs, generator=req.generator)
