"""Running a validated request on the engine and shaping the OpenAI responses.

A request fans out into one engine request per (prompt, sample); their per-step outputs are
merged into one stream of (choice, Delta). Whatever ends the handler (completion, client
disconnect, error) the finally clause aborts every engine request still running.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from .choice import ChoiceState, Delta
from .errors import APIError
from .protocol import GenRequest
from . import engine_io, sse

log = logging.getLogger("qwen35.server")
YIELD_EVERY_TOKENS = 1 << 16  # prompt tokens submitted between two turns of the event loop (~10 ms)
# vLLM response fields this server has nothing for: null, as vLLM sends them
_NULL_FIELDS = {"service_tier": None, "system_fingerprint": None, "kv_transfer_params": None}


@dataclass(eq=False)  # hashed by identity (ServerContext.jobs)
class Job:
    """The engine requests of one HTTP request, with their choices."""
    rid: str
    g: GenRequest
    prompts: list[list[int]]      # token ids per prompt
    prompt_texts: list[str]       # for echo
    choices: list[ChoiceState] = field(default_factory=list)
    streams: list = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> dict:
        p, c = self.prompt_tokens, self.completion_tokens
        out = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
        # With prefix caching on: vLLM's field (OpenAI's shape, 0 on a miss), counted once per prompt like
        # prompt_tokens (its first sample's); absent when caching is off.
        cached = [c.cached_tokens for c in self.choices[::self.g.n]]
        if any(x is not None for x in cached):
            out["prompt_tokens_details"] = {"cached_tokens": sum(x or 0 for x in cached)}
        # With speculative decoding on (not vLLM's: it has per-request figures only in its metrics): the choices'
        # drafted and accepted tokens, and how many ran without speculation (no log set left for them).
        spec = [c.spec_decode for c in self.choices if c.spec_decode is not None]
        if spec:
            out["spec_decode"] = {"draft_tokens": sum(s["draft_tokens"] for s in spec),
                                  "accepted_tokens": sum(s["accepted_tokens"] for s in spec),
                                  "choices_without_speculation": sum(not s["speculative"] for s in spec)}
        return out


async def submit(ctx, job: Job, thinking: bool | None) -> None:
    """Admit every engine request now (before any header), or none of them. thinking: None
    without a reasoning parser, else whether the prompt opened a <think> block."""
    g, checked = job.g, 0
    need, room = len(job.prompts) * g.n, engine_io.queue_room(ctx.engine)
    if need > room:  # checked whole, so that a big request never enqueues part of itself first
        raise engine_io.overloaded(f"The request queue is full: room for {room} more requests, this one needs "
                                   f"{need}.")
    ctx.jobs.add(job)
    try:
        for j, ids in enumerate(job.prompts):
            for i in range(g.n):
                idx = j * g.n + i
                params = g.params
                if params.seed is not None and g.n > 1:
                    # as vLLM's parallel sampling: distinct but reproducible samples
                    params = replace(params, seed=params.seed + i)
                job.choices.append(ChoiceState(idx, ctx.tokenizer, thinking))
                job.streams.append(engine_io.add(ctx.engine, f"{job.rid}-{idx}", ids, params))
                checked += len(ids)
                if checked >= YIELD_EVERY_TOKENS:  # the engine checks every prompt id on this thread
                    checked = 0
                    await asyncio.sleep(0)  # let the loop serve the others between the parts of a big request
    except BaseException:
        abort_all(ctx, job)
        raise


def abort_all(ctx, job: Job) -> None:
    ctx.jobs.discard(job)
    for c in job.choices:
        if not c.finished:
            c.finished = True
            engine_io.abort(ctx.engine, f"{job.rid}-{c.index}")


def abort_running(ctx) -> None:
    """Shutdown: end every running request; each stream still sends its "abort" finish."""
    for job in list(ctx.jobs):
        for c in job.choices:
            if not c.finished:
                engine_io.abort(ctx.engine, f"{job.rid}-{c.index}")


async def steps(ctx, job: Job):
    """Yields (choice, Delta) per engine step per choice, in arrival order; one per step that
    produced a token (empty-text deltas included)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((k, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((k, e))
        await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(job.streams)]
    last = [None] * len(job.choices)
    try:
        live = len(tasks)
        while live:
            k, out = await queue.get()
            if out is None:
                live -= 1
                continue
            if isinstance(out, Exception):
                raise out
            c = job.choices[k]
            if c.finished:
                continue
            if out.finish_reason == "error":
                c.finished = True
                log.error("request %s-%d failed in the engine: %s", job.rid, c.index, out.error)
                raise APIError(500, f"internal error in the engine (request {job.rid})")
            if not out.new_token_ids and not out.new_text and not out.finished:
                continue  # chunked prefill step: nothing to send
            d = c.update(out)
            _observe(ctx, job, k, last, len(out.new_token_ids), d, out.queue_time)
            yield c, d
    finally:
        for t in tasks:
            t.cancel()
        abort_all(ctx, job)


def _observe(ctx, job: Job, k: int, last: list, n_new: int, d: Delta, queue_time: float | None) -> None:
    now, m = time.monotonic(), ctx.metrics
    if queue_time is not None:
        m.queue.observe(queue_time)
    if n_new:
        (m.ttft if last[k] is None else m.itl).observe(now - (job.arrival if last[k] is None else last[k]))
        last[k] = now
    if d.finish_reason is not None:
        m.e2e.observe(now - job.arrival)


# --- completions -------------------------------------------------------------------------------


def _completion_logprobs(c: ChoiceState, d: Delta, as_ids: bool, offset: int) -> dict:
    toks, lps, tops, offs = [], [], [], []
    for tid, lp, top in d.logprobs:
        s = c.token_str(tid, as_ids)
        toks.append(s)
        lps.append(lp)
        tops.append({c.token_str(t, as_ids): v for t, v in top})
        offs.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _echo_prefix(job: Job, c: ChoiceState) -> str:
    return job.prompt_texts[c.index // job.g.n] if job.g.echo else ""


async def completion_json(ctx, job: Job) -> dict:
    texts = {c.index: _echo_prefix(job, c) for c in job.choices}
    lps: dict[int, dict] = {}
    ends: dict[int, tuple] = {}
    async for c, d in steps(ctx, job):
        if job.g.logprobs is not None:
            part = _completion_logprobs(c, d, job.g.tokens_as_ids, len(texts[c.index]))
            acc = lps.setdefault(c.index, {k: [] for k in part})
            for k, v in part.items():
                acc[k] += v
        texts[c.index] += d.text
        if d.finish_reason is not None:
            ends[c.index] = (d.finish_reason, d.stop_reason)
    choices = [{"index": i, "text": texts[i], "logprobs": lps.get(i) if job.g.logprobs is not None else None,
                "finish_reason": ends.get(i, ("abort", None))[0], "stop_reason": ends.get(i, (None, None))[1],
                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None} for i in sorted(texts)]
    return {"id": job.rid, "object": "text_completion", "created": job.created, "model": ctx.model_name,
            "choices": choices, "usage": job.usage(), **_NULL_FIELDS}


def completion_stream(ctx, job: Job):
    head = {"id": job.rid, "object": "text_completion", "created": job.created, "model": ctx.model_name}
    sent = {c.index: 0 for c in job.choices}   # characters sent, for text_offset
    first = set()

    async def chunks():
        async for c, d in steps(ctx, job):
            text = d.text
            if c.index not in first:
                first.add(c.index)
                text = _echo_prefix(job, c) + text
            lp = (_completion_logprobs(c, d, job.g.tokens_as_ids, sent[c.index])
                  if job.g.logprobs is not None else None)
            sent[c.index] += len(text)
            yield dict(head, choices=[{"index": c.index, "text": text, "logprobs": lp,
                                       "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])

    return _sse(chunks(), head, job)


def _with_usage(chunk: dict, job: Job) -> dict:
    if job.g.include_usage:
        chunk["usage"] = job.usage() if job.g.continuous_usage else None
    return chunk


# --- chat --------------------------------------------------------------------------------------


def _chat_logprobs(c: ChoiceState, d: Delta, as_ids: bool) -> list[dict]:
    def entry(tid, lp):
        s = c.token_str(tid, as_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return [dict(entry(tid, lp), top_logprobs=[entry(t, v) for t, v in top]) for tid, lp, top in d.logprobs]


async def chat_json(ctx, job: Job) -> dict:
    acc = {c.index: {"content": "", "reasoning": "", "logprobs": [], "end": ("abort", None)} for c in job.choices}
    async for c, d in steps(ctx, job):
        a = acc[c.index]
        a["content"] += d.text
        a["reasoning"] += d.reasoning
        if job.g.logprobs is not None:
            a["logprobs"] += _chat_logprobs(c, d, job.g.tokens_as_ids)
        if d.finish_reason is not None:
            a["end"] = (d.finish_reason, d.stop_reason)
    choices = [{"index": i, "message": _message(a["content"], a["reasoning"] or None),
                "logprobs": {"content": a["logprobs"]} if job.g.logprobs is not None else None,
                "finish_reason": a["end"][0], "stop_reason": a["end"][1], "token_ids": None}
               for i, a in sorted(acc.items())]
    return {"id": job.rid, "object": "chat.completion", "created": job.created, "model": ctx.model_name,
            "choices": choices, "usage": job.usage(), **_NULL_FIELDS, "prompt_logprobs": None,
            "prompt_token_ids": None}


def _reasoning(text: str | None) -> dict:
    # vLLM's `reasoning` (since PR 27752) and `reasoning_content`, the name it keeps for older clients
    return {"reasoning": text, "reasoning_content": text}


def _message(content: str, reasoning: str | None) -> dict:
    return {"role": "assistant", "content": content, **_reasoning(reasoning), "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "tool_calls": []}


def chat_stream(ctx, job: Job):
    head = {"id": job.rid, "object": "chat.completion.chunk", "created": job.created, "model": ctx.model_name}
    started = set()

    async def chunks():
        async for c, d in steps(ctx, job):
            if c.index not in started:
                # The role chunk goes out with the first token, never at receipt (client TTFT).
                started.add(c.index)
                role = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                yield dict(head, choices=[role])
            delta = _reasoning(d.reasoning) if d.reasoning else {}
            if d.text or not d.reasoning:
                delta["content"] = d.text
            choice = {"index": c.index, "delta": delta,
                      "logprobs": {"content": _chat_logprobs(c, d, job.g.tokens_as_ids)}
                      if job.g.logprobs is not None else None, "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            yield dict(head, choices=[choice])

    return _sse(chunks(), head, job)


async def _sse(chunks, head: dict, job: Job):
    """The framing both streams share: each chunk (with "usage": null when usage is on), the final
    usage chunk, an in-band error once headers are out, and [DONE]."""
    try:
        async for chunk in chunks:
            yield sse.event(_with_usage(chunk, job))
        if job.g.include_usage:
            yield sse.event(dict(head, choices=[], usage=job.usage()))
    except APIError as e:
        yield sse.event({"error": e.body()["error"]})
    except Exception:  # noqa: BLE001 - headers are sent: report in band, the details only in the log
        log.exception("request %s failed while streaming", job.rid)
        yield sse.event(APIError(500, f"internal error (request {job.rid})").body())
    yield sse.DONE
