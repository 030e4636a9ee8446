"""The engine: one loop thread owns the model, the cache and every request's state.

The outside talks to it only through `submit`/`add_request` (validated in the caller's thread,
so a server can answer 400/503 before sending headers), `abort`, and per-request event sinks.
Each step is schedule (scheduler.py) -> run (runner.py: launch the forward) -> postprocess (the
previous step's tokens: detokenize, stop, finish), with the device one step ahead of the host.

Speculative decoding (`speculative_config`, off by default): a drafter proposes tokens for each
request about to decode and the step verifies them (runner.py, verify.py); see step().
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .config import GDN_CHUNK, EngineArgs, ModelConfig, SpeculativeConfig
from .drafter import make_drafter
from .kv_blocks import DUMMY_BLOCK, KVBlockManager
from .memory import plan_cache
from .model import Qwen35Model
from .ops import make_backend
from .prefix_cache import Plan, PrefixCache
from .request import Request, RequestOutput, Status, StopStringBuffer
from .runner import ForwardInFlight, ModelRunner, Verified
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import AdmissionError, OverloadedError, Scheduler
from .state_slots import DUMMY_SLOT, SpecLogPool, StateSlotPool
from .state_snapshots import SnapshotPool
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .trace import StepTrace
from .weights import load_weights

log = logging.getLogger("qwen35.engine")
PAUSE_AFTER = 4  # speculative decoding: proposals in a row without an accepted token before a request pauses
MAX_PAUSE = 32   # the longest pause, in decode steps
__all__ = ["Engine", "RequestStream", "EngineDeadError", "AdmissionError", "OverloadedError"]


class EngineDeadError(RuntimeError):
    """The engine loop died; nothing more will be served (/health = 503)."""


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    state_slots_free: int = 0
    state_slots_total: int = 0
    num_preemptions: int = 0                  # always 0: admission reserves whole lifetimes
    num_rejected: int = 0                     # can never fit
    num_overloaded: int = 0                   # waiting queue full
    prompt_tokens: int = 0                    # prefill tokens computed
    generation_tokens: int = 0
    finished: dict = field(default_factory=dict)  # finish_reason -> count
    device_memory_used: int = 0               # bytes the backend holds in live arrays
    # prefix caching (all 0 when it is off)
    prefix_cache_queries: int = 0             # prompt tokens of admitted requests (vLLM's count)
    prefix_cache_hits: int = 0                # of which restored from the cache
    kv_blocks_cached: int = 0                 # published KV blocks, held or free
    state_snapshots_used: int = 0             # reserved or pinned by running requests
    state_snapshots_cached: int = 0           # published
    state_snapshots_total: int = 0
    # speculative decoding (all 0 when it is off); vLLM's spec_decode counters
    spec_decode_num_drafts: int = 0           # verifies (a request's drafts checked in one step)
    spec_decode_num_draft_tokens: int = 0     # drafted tokens verified
    spec_decode_num_accepted_tokens: int = 0  # of which accepted (bonus tokens not counted)


class RequestStream:
    """Async iterator over one request's events (per-step deltas, the last has finished=True).
    aclose(), or cancelling the task awaiting it, aborts the request."""

    def __init__(self, engine: "Engine", request_id: str, q: asyncio.Queue):
        self.engine, self.request_id, self._q, self.finished = engine, request_id, q, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._q.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        self.finished = out.finished
        return out

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class Engine:
    def __init__(self, model_dir: str | Path, start: bool = True, **engine_args):
        unknown = set(engine_args) - {f.name for f in fields(EngineArgs)}
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        t_start = time.perf_counter()
        a = self.args = EngineArgs(**engine_args)
        self.cfg = cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        max_len = a.max_model_len or min(cfg.max_position_embeddings, 8192)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if a.max_num_batched_tokens < a.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({a.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({a.max_num_seqs}) so every running sequence can decode each step")
        spec = SpeculativeConfig.parse(a.speculative_config)
        if spec is not None and a.enable_prefix_caching and spec.method != "ngram":
            raise ValueError(f"prefix caching works with the ngram drafter only: the {spec.method} drafter's own KV "
                             "at a cached prefix's positions was written for another request's continuation")
        backend = make_backend(a.device, a.batch_invariant)
        backend.load_kernels(cfg)  # compiles in the background while the weights load
        mtp = spec is not None and spec.method == "mtp"  # the MTP head: its weights, and its KV in the cache
        weights = load_weights(model_dir, cfg, mtp=mtp)
        model = Qwen35Model(cfg, weights, backend, draft_kv_layers=int(mtp))
        # before the memory plan, which measures the free memory the weights leave (tests swap in oracle drafters)
        self.drafter = make_drafter(spec, model, weights, a.max_num_seqs) if spec else None
        del weights  # the model and the drafter hold their own uploads
        t_weights = time.perf_counter()
        plan = plan_cache(model, a, max_len, spec.num_speculative_tokens if spec else 0, self.drafter)
        self.kv = KVBlockManager(plan.num_blocks, a.block_size)
        self.slots = StateSlotPool(plan.num_slots)
        self.prefix = None
        if a.enable_prefix_caching:
            # min_tail 2 when batch-invariant: no hit and no cut never leaves a one-token last chunk
            self.prefix = PrefixCache(self.kv, SnapshotPool(plan.num_slots, plan.num_snapshots), chunk=GDN_CHUNK,
                                      min_tail=2 if a.batch_invariant else 1)
        self.scheduler = Scheduler(self.kv, self.slots, max_model_len=max_len, max_num_seqs=a.max_num_seqs,
                                   max_num_batched_tokens=a.max_num_batched_tokens,
                                   prefill_budget_with_decodes=a.prefill_budget_with_decodes,
                                   max_waiting_requests=a.max_waiting_requests,
                                   # the GDN chunk: prompt chunks then keep the chunked form's boundaries
                                   chunk_align=GDN_CHUNK if a.batch_invariant else 1, prefix=self.prefix,
                                   spec_logs=SpecLogPool(plan.num_spec_logs) if spec else None)
        # one more log set than the pool hands out: CUDA graphs' padded verify rows write there
        cache = model.alloc_cache(plan.num_rows, self.kv.num_blocks, a.block_size,
                                  plan.num_spec_logs + 1 if spec else 0, plan.spec_tokens)
        log.info(plan.describe(backend.name, model.weight_bytes() + (self.drafter.weight_bytes() if spec else 0),
                               a))
        if self.prefix is not None and not plan.num_snapshots:
            log.warning("prefix caching is on but the memory plan left no GDN state snapshots: every request is "
                        "served cold (give --num-state-snapshots)")
        self.spec = spec
        if self.drafter is not None:
            self.drafter.bind(cache)
        self.runner = ModelRunner(model, cache, Sampler(a.seed))
        if backend.needs_warm_up:
            self.runner.warm_up(min(a.max_num_batched_tokens, max_len))
        if backend.decode_graphs and not a.enforce_eager:
            from .gpu.decode_graph import DecodeGraphs
            from .gpu.mixed_layout import MIXED_MAX_CAP, MIXED_SEQS
            # small mixed steps replay graphs too (a capped step's host enqueue was its time); not with speculation
            # (a drafter's capture, verifies) or in batch-invariant mode (its eager kernels stand)
            cap = a.prefill_budget_with_decodes
            mixed_cap = (cap if MIXED_SEQS < cap <= min(MIXED_MAX_CAP, max_len) and spec is None
                         and not a.batch_invariant else 0)
            self.runner.graphs = DecodeGraphs(model, cache, a.max_num_seqs, dummy_slot=DUMMY_SLOT,
                                              dummy_block=DUMMY_BLOCK, max_blocks_per_seq=-(-max_len // a.block_size),
                                              capture_now=True,
                                              # verifies' padded rows fit the dummy page: K < block_size
                                              verify_k=plan.spec_tokens if plan.spec_tokens < a.block_size else 0,
                                              dummy_spec_log=plan.num_spec_logs,
                                              capture=self.drafter.capture if self.drafter is not None else None,
                                              mixed_cap=mixed_cap)
        log.info("engine ready in %.1f s (config and weights %.1f s; cache, kernels, warm-up and graphs %.1f s)",
                 time.perf_counter() - t_start, t_weights - t_start, time.perf_counter() - t_weights)
        self.max_model_len = max_len
        self.eos_ids = frozenset(cfg.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self._stats = EngineStats()                # counters; gauges are filled in by stats()
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, Request] = {}   # loop thread only
        self._pending = 0                          # submitted, not yet admitted (under _lock)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self._stop = False
        self._trace = StepTrace(a.trace_steps, backend) if a.trace_steps else None
        self.runner.timing = self._trace is not None
        self._inflight = None                      # the sampling on the device, collected next step()
        # prefix caching: the Plans of launched forwards, published (commit) once known complete
        self._launched_plans: list[Plan] = []      # not covered by a sampling yet
        self._inflight_plans: list[Plan] = []      # complete when self._inflight is collected
        self._step_trace = None                    # (line, forward marks) of the last launched step
        self._record = None                        # speculative decoding: the last launched step's StepRecord
        self._deferred = None                      # events, and tokens to render, held back until the step is launched
        self._step_no = 0                          # step() calls (speculation pauses end at step numbers)
        self._last_step_end = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="qwen35-engine", daemon=True)
        if start:
            self._thread.start()

    # ---- outside interface (any thread) ----------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None, sink: Callable[[RequestOutput], None],
               request_id: str | None = None) -> str:
        """Validates and queues a request; `sink` gets its events from the loop thread. Raises
        ValueError (bad parameters, AdmissionError: can never fit), OverloadedError, EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        params = (params or SamplingParams()).with_defaults(self.cfg.sampling_defaults)
        params.validate(self.cfg.vocab_size, self.args.max_logprobs)  # what depends on the model and engine
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if any(not 0 <= t < self.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        try:
            self.scheduler.check_fits(len(ids), max(max_tokens, 1))
        except AdmissionError:
            with self._lock:
                self._stats.num_rejected += 1
            raise
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        req = Request(request_id or f"req-{next(self._ids)}", ids, params, max_tokens, stop_ids, sink,
                      generator=np.random.default_rng(params.seed) if params.seed is not None else None,
                      stop_buffer=StopStringBuffer(params.stop, params.include_stop_str_in_output))
        with self._lock:
            try:
                self.scheduler.check_queue(self._pending)
            except OverloadedError:
                self._stats.num_overloaded += 1
                raise
            self._pending += 1
        self._inbox.put(("add", req))
        return req.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> "RequestStream":
        """Async interface: validates now (raises like submit), returns the event stream.
        Must be called from the event loop that will iterate the stream."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = self.submit(prompt, params, lambda out: loop.call_soon_threadsafe(q.put_nowait, out), request_id)
        return RequestStream(self, rid, q)

    def abort(self, request_id: str) -> None:
        """Ends the request with finish_reason "abort" at the next step boundary (no-op if done)."""
        self._inbox.put(("abort", request_id))

    def is_alive(self) -> bool:
        return self.dead is None and (self._thread.is_alive() or not self._thread.ident)

    def stats(self) -> EngineStats:
        """A snapshot: gauges read now, counters since start (safe from any thread)."""
        s = replace(self._stats, running=len(self.scheduler.running), waiting=self._pending,
                    kv_blocks_free=self.kv.num_free, kv_blocks_used=self.kv.num_used,
                    kv_blocks_total=self.kv.capacity, state_slots_free=self.slots.num_free,
                    state_slots_total=self.slots.capacity, finished=dict(self._stats.finished),
                    device_memory_used=self.runner.model.ops.memory_used())
        if self.prefix is not None:
            p = self.prefix
            s = replace(s, prefix_cache_queries=p.queries, prefix_cache_hits=p.hits,
                        kv_blocks_cached=self.kv.num_cached, state_snapshots_used=p.snaps.num_used,
                        state_snapshots_cached=p.snaps.num_cached,
                        state_snapshots_total=p.snaps.capacity)
        return s

    def shutdown(self) -> None:
        self._stop = True
        self._inbox.put(("wake", None))
        if self._thread.ident:
            self._thread.join(timeout=10)

    # ---- loop thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self.step(block=True)
            self._flush()  # a step in flight still delivers its tokens
            self._fail_all("engine shut down")
        except BaseException as e:  # noqa: BLE001 - record it for /health, tell every request
            self.dead = e
            self._fail_all(f"engine loop died: {e!r}")

    def _fail_all(self, why: str) -> None:
        """Ends every known and still-queued request with an error event."""
        while True:
            try:
                kind, x = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._emit(x, RequestOutput(x.request_id, [], "", True, "error", error=why))
        for req in list(self._requests.values()):
            try:
                self._finish(req, "error", error=why)
            except Exception:  # noqa: BLE001 - state may be broken; the event matters more
                self._emit(req, RequestOutput(req.request_id, [], "", True, "error", error=why))

    def step(self, block: bool = False) -> None:
        """One step boundary: schedule and launch step n+1, then postprocess step n (wait for its
        tokens, deliver them), then launch step n+1's sampling.

        The device runs ahead of the host by one step: the forward is enqueued before the host waits
        for the previous step's tokens (a decode's input token reaches the forward on the device,
        runner.py), so scheduling, metadata, detokenization and event delivery overlap the device's
        work. A request that finishes on the token collected here was scheduled once more; that row
        is computed and dropped (its KV reservation covers it). Results arrive one step() later: a
        step's tokens are delivered by the next call.

        With speculative decoding a step that may verify collects first, then shows the drafter what a
        collected verify committed (drafter.py: observe, for a drafter with a capture), then asks it, then
        schedules: a request's drafts continue its latest tokens, and where its next step starts depends
        on how many drafts its last verify accepted, both known only once its tokens are on the host. So
        the device waits while the host proposes, schedules and launches; the collected tokens' events
        are sent after the launch. A step in which no request can draft (every speculating request
        paused, see _propose) runs as above, one step ahead; a drafter with a capture observes a step
        without verifies as soon as its sampling is launched (_schedule_and_launch)."""
        self._drain(block and not self._requests and self._inflight is None)
        t0 = time.perf_counter()
        self._step_no += 1
        sync = self.drafter is not None and self._must_wait()
        if sync:
            self._deferred = []  # the collected tokens' events go out once the next step is launched
            self._flush(t0)                                                 # 0. step n's tokens first
            if self._record is not None:  # what verify n committed, for a drafter that reads the target
                self.drafter.observe(self._record)
                self._record = None
        if self.drafter is not None:
            self._propose()
        try:
            self._schedule_and_launch(t0)
        finally:
            if sync:
                self._send_deferred()
        self._last_step_end = time.perf_counter()

    def _schedule_and_launch(self, t0: float) -> None:
        batch = self.scheduler.schedule()                                   # 1. schedule (host only)
        t1 = time.perf_counter()
        info = None
        if batch and self._trace is not None:
            info = StepTrace.begin(batch, t0, t1, (t0 - self._last_step_end) * 1e3 if self._inflight is None else 0.0)
            if self.prefix is not None:  # the state copies around its forward (their time is in gpu_ms)
                info.update(restores=len(self.scheduler.plan.restore), saves=len(self.scheduler.plan.save))
            if self.drafter is not None:
                info.update(draft_tokens=sum(len(req.drafts) for req, _ in batch))
        launched, error = self._launch(batch) if batch else (None, None)   # 2. run: step n+1 enqueued
        t2 = time.perf_counter()
        self._flush(t0 if batch else None)                                  # 3. postprocess step n
        t3 = time.perf_counter()
        if launched is not None and launched.sampled:
            error = self._launch_sampling(launched)                         #    and step n+1's sampling
        if launched is not None and launched.record is not None and not launched.drafts and error is None:
            self.drafter.observe(launched.record)  # every row commits: no need to wait for its tokens
        if info is not None:
            info.update(launch_ms=(t2 - t1) * 1e3, sample_ms=(time.perf_counter() - t3) * 1e3)
            if error is not None:  # its line now: nothing of it is in flight
                info["error"] = f"{type(error).__name__}: {error}"
                self._trace.write(info, (), 0.0, 0.0, (), next_start=time.perf_counter())
            else:
                self._step_trace = (info, launched.marks)

    def _room(self, req: Request) -> int:
        """How many drafts req may verify next step (0: it decodes plainly): at most what max_tokens leaves
        after the bonus token (a verify never emits past max_tokens, nor computes a position past its KV
        reservation); none while it prefills, has no log set or pauses."""
        if req.spec_log is None or req.spec_resume > self._clock(req) or req.num_tokens - req.num_computed != 1:
            return 0
        return max(min(self.spec.num_speculative_tokens, req.max_tokens - len(req.output_ids) - req.pending - 1), 0)

    def _must_wait(self) -> bool:
        """Whether the next step must wait for the one in flight: a request in it may draft (its drafts
        continue tokens not collected yet), or a verify in flight decides where its request goes on (and,
        for a drafter with a capture, what it committed)."""
        s = self._inflight
        return (s is not None and s.verify is not None) or any(self._room(req) for req in self.scheduler.running)

    def _propose(self) -> None:
        """Drafts for each running request about to decode (_room). A request whose proposals brought no
        accepted token PAUSE_AFTER times in a row (no drafts, or all rejected) pauses (_missed), so a
        drafter that keeps failing costs little (steps run one ahead while every request pauses) and one
        that works is not held back (an accepted token resets the count)."""
        reqs, rooms = [], []
        for req in self.scheduler.running:
            req.drafts = []
            room = self._room(req)
            if room:
                reqs.append(req)
                rooms.append(room)
        if reqs:
            for req, room, drafts in zip(reqs, rooms, self.drafter.propose(reqs, rooms)):
                req.drafts = list(drafts)[:room]
                if not req.drafts:
                    self._missed(req)

    def _missed(self, req: Request) -> None:
        """The n-th miss in a row from PAUSE_AFTER on pauses req for p = 2 ** (n - PAUSE_AFTER) steps (at most
        MAX_PAUSE) and a bit: it proposes again at the step after next whose number is a multiple of p, so
        that paused requests try again in the same steps (a step in which one request may draft waits for
        the step before it: spread out, a batch's probes would make most steps wait)."""
        req.spec_misses += 1
        if req.spec_misses >= PAUSE_AFTER:
            p = min(MAX_PAUSE, 2 ** (req.spec_misses - PAUSE_AFTER))
            req.spec_resume = (self._clock(req) // p + 2) * p

    def _clock(self, req: Request) -> int:
        """What a pause counts: engine steps; a seeded request's own tokens (its pending one included), so
        that where it verifies, and so its random draws, do not depend on the requests beside it."""
        return len(req.output_ids) + req.pending if req.generator is not None else self._step_no

    def _send_deferred(self) -> None:
        """A synchronous step's events, once the next step is launched: its collected tokens' text
        (_on_tokens) and the events held back."""
        deferred, self._deferred = self._deferred, None
        for req, x in deferred:
            if isinstance(x, RequestOutput):
                self._emit(req, x)
            else:
                self._render(req, x, None)

    def _launch(self, batch) -> tuple[ForwardInFlight | None, Exception | None]:
        with self._lock:  # a request's first chunk starts at its cached tokens (0 without a prefix hit)
            self._pending -= sum(1 for req, _ in batch if req.num_computed == req.cached_tokens)
        plan = self.scheduler.plan if self.prefix is not None else None
        self.runner.capture = self.drafter.capture if self.drafter is not None else None
        try:
            launched = self.runner.forward(batch, self._inflight, plan)
        except Exception as e:  # noqa: BLE001 - the whole step failed: end its requests, keep serving
            self._abandon([plan])
            self._fail_step([req for req, _ in batch], e)
            return None, e.with_traceback(None)  # its frames would hold the step's device arrays until a GC pass
        if plan is not None:
            self._launched_plans.append(plan)
        self._record = launched.record if launched.drafts else None  # a verify's: observed once collected
        for req, n in batch:
            self.scheduler.advance(req, n)
            self._stats.prompt_tokens += max(0, min(req.num_computed, len(req.prompt_ids)) -
                                             max(req.num_computed - n, 0))
        return launched, None

    def _launch_sampling(self, launched: ForwardInFlight) -> Exception | None:
        try:
            self._inflight = self.runner.sample(launched)
        except Exception as e:  # noqa: BLE001 - e.g. the test hook; the whole step failed
            self._abandon([launched.plan])
            self._fail_step([req for req, _ in launched.batch], e)
            return e.with_traceback(None)  # as in _launch
        # this sampling completes after every forward launched so far (one stream)
        self._inflight_plans, self._launched_plans = self._launched_plans, []
        for req in self._inflight.requests:
            req.pending = 1
        return None

    def _flush(self, next_start: float | None = None) -> None:
        """Collects the sampling in flight (delivering its tokens) and writes the previous step's trace
        line. next_start: when the step after it began (None: now)."""
        prev, self._step_trace = self._step_trace, None
        waited = self._collect(self._inflight) if self._inflight is not None else (0.0, 0.0, ())
        if prev is not None:
            self._trace.write(*prev, *waited, next_start=next_start if next_start is not None else time.perf_counter())

    def _collect(self, sampling) -> tuple[float, float, tuple]:
        """Waits for the sampling in flight and delivers its tokens. Returns (ms waiting for the device,
        ms delivering, the sampling's device marks) for the step trace."""
        self._inflight = None
        plans, self._inflight_plans = self._inflight_plans, []
        t0 = time.perf_counter()
        try:
            results = self.runner.collect(sampling)
        except Exception as e:  # noqa: BLE001 - the device failed the step
            for req in sampling.requests:
                req.pending = 0
            self._abandon(plans)
            self._fail_step(sampling.requests, e)
            return (time.perf_counter() - t0) * 1e3, 0.0, ()
        for plan in plans:  # publish what those forwards computed before their tokens can end requests
            self.prefix.commit(plan)
        t1 = time.perf_counter()
        for req, res in results:
            req.pending = 0
            if req.status is not Status.RUNNING:  # ended (abort, error) while its token was in flight
                continue
            if isinstance(res, Exception):
                self._finish(req, "error", error=f"{type(res).__name__}: {res}")
            elif isinstance(res, Verified):
                self._on_verified(req, res)
            else:
                self._on_tokens(req, [res])
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, sampling.marks

    def _abandon(self, plans) -> None:
        """Steps that failed, or may have: their requests publish nothing more (prefix_cache.py)."""
        for plan in plans:
            if plan is not None:
                self.prefix.abandon(plan)

    def _fail_step(self, reqs, e: Exception) -> None:
        """A whole step failed: ends each of its requests still running with an error naming it."""
        for req in reqs:
            if req.status is not Status.FINISHED:
                self._finish(req, "error", error=f"engine step failed (request {req.request_id}): "
                                                 f"{type(e).__name__}: {e}")

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(block=block)
            while True:
                kind, x = msg
                if kind == "add":
                    self._add(x)
                elif kind == "abort" and x in self._requests:
                    self._finish(self._requests[x], "abort")
                msg = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, req: Request) -> None:
        try:
            if req.request_id in self._requests:
                raise ValueError(f"request id {req.request_id!r} is already running")
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.skip_special_tokens)
            self.scheduler.add(req)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                self._pending -= 1
            req.status = Status.FINISHED
            self._emit(req, RequestOutput(req.request_id, [], "", True, "error", prompt_tokens=len(req.prompt_ids),
                                          error=f"{type(e).__name__}: {e}"))
            return
        self._requests[req.request_id] = req

    def _on_tokens(self, req: Request, tokens: list) -> None:
        """One step's tokens (SampledToken): one event (serving-conventions §2.4), or the final one. In a
        synchronous step (speculation, step()) only what the next schedule needs happens now (the tokens
        appended, stop tokens and max_tokens); their text, stop strings and event come after the launch."""
        n, done = req.commit([t.token_id for t in tokens])
        pairs = [(t.token_id, t.logprob) for t in tokens[:n]]
        if self._deferred is not None and done is None:
            self._deferred.append((req, pairs))
        else:
            self._render(req, pairs, done)

    def _render(self, req: Request, pairs: list, done: tuple | None) -> None:
        try:
            out, done = req.render(pairs, done)
        except Exception as e:  # noqa: BLE001 - a detokenizer failure ends this request only
            if req.status is Status.RUNNING:
                self._finish(req, "error", error=f"detokenization failed: {type(e).__name__}: {e}")
            return
        self._stats.generation_tokens += len(out.new_token_ids)
        if done and req.status is Status.RUNNING:
            self._finish(req, done[0], done[1], out)
        else:  # (a step rendered after its launch may have ended the request meanwhile: its event still goes)
            self._emit(req, out)

    def _on_verified(self, req: Request, res: Verified) -> None:
        """A verify's tokens, in one event, each applied as plain decoding would (stop tokens, stop strings
        and max_tokens end the request at the first that finishes it). Its next step replays the tokens the
        verify committed (the pending one and the accepted drafts: step.py), which is its rollback; if a
        draft was rejected, the request is rewound to recompute those positions."""
        s, accepted = self._stats, len(res.tokens) - 1
        s.spec_decode_num_drafts += 1
        s.spec_decode_num_draft_tokens += res.drafted
        s.spec_decode_num_accepted_tokens += accepted
        req.num_draft_tokens += res.drafted
        req.num_accepted_tokens += accepted
        self._on_tokens(req, res.tokens)
        if req.status is not Status.RUNNING:
            return
        if accepted:
            req.spec_misses = 0
        else:
            self._missed(req)
        req.replay = 1 + accepted
        if accepted < res.drafted:
            self.scheduler.rewind(req, res.drafted - accepted)

    def _finish(self, req: Request, reason: str, stop_reason=None, out: RequestOutput | None = None,
                error: str | None = None) -> None:
        if req.status is Status.WAITING:
            with self._lock:
                self._pending -= 1
        spec = None if self.spec is None else {  # before finish() frees its log set
            "speculative": req.spec_log is not None, "draft_tokens": req.num_draft_tokens,
            "accepted_tokens": req.num_accepted_tokens}
        self.scheduler.finish(req)
        if self.drafter is not None:
            self.drafter.forget(req)
        self._requests.pop(req.request_id, None)
        self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1
        out = out or RequestOutput(req.request_id, [], "", prompt_tokens=len(req.prompt_ids),
                                   completion_tokens=len(req.output_ids))
        out.finished, out.finish_reason, out.stop_reason, out.error = True, reason, stop_reason, error
        out.spec_decode = spec
        self._emit(req, out)

    def _emit(self, req: Request, out: RequestOutput) -> None:
        if self._deferred is not None:
            self._deferred.append((req, out))
            return
        if self.prefix is not None:
            out.cached_tokens = req.cached_tokens
        try:
            req.sink(out)
        except Exception as e:  # noqa: BLE001 - a broken consumer must not take the loop down
            if not out.finished and req.status is not Status.FINISHED:  # (a deferred event: it may have ended)
                self._finish(req, "error", error=f"event sink failed: {e!r}")
