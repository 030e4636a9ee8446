"""The engine: one loop thread owns the model, the cache and every request's state.

The outside talks to it only through `submit`/`add_request` (validated in the caller's thread,
so a server can answer 400/503 before sending headers), `abort`, and per-request event sinks.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .backend_numpy import CHUNK as GDN_CHUNK
from .config import ModelConfig
from .kv_blocks import DUMMY_BLOCK, KVBlockManager
from .model import Qwen35Model
from .request import Request, RequestOutput, Status, StopStringBuffer, TokenLogprob
from .runner import ModelRunner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import AdmissionError, OverloadedError, Scheduler
from .state_slots import DUMMY_SLOT, StateSlotPool
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .weights import load_weights

log = logging.getLogger("qwen35.engine")
__all__ = ["Engine", "EngineArgs", "RequestStream", "EngineDeadError", "AdmissionError", "OverloadedError"]


class EngineDeadError(RuntimeError):
    """The engine loop died; nothing more will be served (/health = 503)."""


@dataclass
class EngineArgs:
    max_model_len: int | None = None          # default min(model window, 8192)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int = 1024
    num_kv_blocks: int | None = None          # default: from the memory budget
    kv_cache_memory: int | None = None        # bytes for state slots + KV (cpu default 512 MiB)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16                      # see kv_blocks.py
    device: str = "auto"                      # "cpu" | "cuda" | "auto"
    max_logprobs: int = 20
    seed: int = 0                             # for requests without a seed
    enforce_eager: bool = False               # CUDA: no decode-step graphs
    batch_invariant: bool = False             # CUDA: a request's tokens independent of its batch (slower prefill)
    trace_steps: str | None = None            # JSONL path: one line per step (kind, sizes, timings)


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
    device_memory_used: int = 0               # bytes the backend holds in live arrays (0 on the CPU)


def make_backend(device: str, batch_invariant: bool = False):
    if device in ("cuda", "auto"):
        try:  # hook: the CUDA backend has the same op interface
            from .backend_cuda import CudaBackend
            return CudaBackend(batch_invariant=batch_invariant)
        except Exception:
            if device == "cuda":
                raise
    if device not in ("cpu", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    from .backend_numpy import NumpyBackend
    return NumpyBackend()


def _cache_bytes(model, block_size: int) -> tuple[int, int]:
    """Bytes of one state slot and of one KV block, measured on a 1-slot, 1-block cache so the
    backend's own dtypes count."""
    probe = model.alloc_cache(1, 1, block_size)
    return sum(x.nbytes for x in probe.conv + probe.rec), sum(x.nbytes for x in probe.k + probe.v)


def _default_budget(backend, cfg: ModelConfig, a: EngineArgs) -> int:
    """Bytes for slots + KV: 512 MiB on the CPU; on the GPU what gpu_memory_utilization leaves
    after the weights (already loaded) and a rough reserve for one step's activations."""
    if backend.name == "numpy":
        return 512 << 20
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    per_token = 4 * (4 * cfg.intermediate_size + 2 * cfg.conv_dim + 8 * cfg.hidden_size)
    # + the chunked GDN prefill's f32 workspace (W, Qs, Ks, U, P, aux per token and value head)
    per_token += 4 * cfg.lin_num_v_heads * (3 * cfg.lin_k_dim + cfg.lin_v_dim + 64 + 4)
    activations = a.max_num_batched_tokens * per_token
    logits = 8 * a.max_num_seqs * cfg.vocab_size
    return int(free - (1 - a.gpu_memory_utilization) * total - activations - logits)


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
        a = self.args = EngineArgs(**engine_args)
        self.cfg = cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        backend = make_backend(a.device, a.batch_invariant)
        max_len = a.max_model_len or min(cfg.max_position_embeddings, 8192)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if a.max_num_batched_tokens < a.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({a.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({a.max_num_seqs}) so every running sequence can decode each step")
        model = Qwen35Model(cfg, load_weights(model_dir, cfg), backend)
        # state slots (one per sequence + the dummy) are reserved first; KV gets what is left
        num_slots = a.max_num_seqs + 1
        slot_bytes, block_bytes = _cache_bytes(model, a.block_size)
        num_blocks = a.num_kv_blocks
        if num_blocks is None:
            budget = a.kv_cache_memory if a.kv_cache_memory is not None else _default_budget(backend, cfg, a)
            useful = a.max_num_seqs * -(-max_len // a.block_size) + 1  # more could never be used at once
            num_blocks = min((budget - num_slots * slot_bytes) // block_bytes, useful)
        self.kv = KVBlockManager(int(num_blocks), a.block_size)
        self.slots = StateSlotPool(num_slots)
        self.scheduler = Scheduler(self.kv, self.slots, max_model_len=max_len, max_num_seqs=a.max_num_seqs,
                                   max_num_batched_tokens=a.max_num_batched_tokens,
                                   max_waiting_requests=a.max_waiting_requests,
                                   # the GDN chunk: prompt chunks then keep the chunked form's boundaries
                                   chunk_align=GDN_CHUNK if a.batch_invariant else 1)
        cache = model.alloc_cache(num_slots, self.kv.num_blocks, a.block_size)
        gib = 1 / (1 << 30)
        log.info("memory plan (%s): weights %.2f GiB; step activations for %d tokens; %d state slots x %.1f MiB "
                 "= %.2f GiB; %d KV blocks x %d tokens = %.2f GiB", backend.name, model.weight_bytes() * gib,
                 a.max_num_batched_tokens, num_slots, slot_bytes / (1 << 20), num_slots * slot_bytes * gib,
                 self.kv.num_blocks, a.block_size, self.kv.num_blocks * block_bytes * gib)
        graphs = None
        if backend.name == "cuda" and not a.enforce_eager:
            from .decode_graph import DecodeGraphs
            graphs = DecodeGraphs(model, cache, a.max_num_seqs, dummy_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                                  max_blocks_per_seq=-(-max_len // a.block_size), capture_now=True)
        self.runner = ModelRunner(model, cache, Sampler(a.seed), graphs)
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
        self._trace = open(a.trace_steps, "a", buffering=1) if a.trace_steps else None
        self.runner.timing = self._trace is not None
        self._inflight = None                      # the sampling on the device, collected next step()
        self._step_trace = None                    # the last launched step's trace line, written next step()
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
        params.validate(self.cfg.vocab_size)
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({self.args.max_logprobs}), got {params.logprobs}")
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
            if self._pending >= self.args.max_waiting_requests:
                self._stats.num_overloaded += 1
                raise OverloadedError(f"The request queue is full ({self.args.max_waiting_requests} waiting requests).")
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
        return replace(self._stats, running=len(self.scheduler.running), waiting=self._pending,
                       kv_blocks_free=self.kv.num_free, kv_blocks_used=self.kv.num_used,
                       kv_blocks_total=self.kv.capacity, state_slots_free=self.slots.num_free,
                       state_slots_total=self.slots.capacity, finished=dict(self._stats.finished),
                       device_memory_used=self.runner.model.ops.memory_used())

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
        """One step boundary: take messages, schedule and launch the next forward, then deliver the
        previous step's tokens and launch the new step's sampling.

        The device runs ahead of the host by one step: the forward is enqueued before the host waits
        for the previous step's tokens (a decode's input token reaches the forward on the device,
        runner.py), so scheduling, metadata, detokenization and event delivery overlap the device's
        work. A request that finishes on the token collected here was scheduled once more; that row
        is computed and dropped (its KV reservation covers it). Results arrive one step() later: a
        step's tokens are delivered by the next call."""
        self._drain(block and not self._requests and self._inflight is None)
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched, info, failure = None, None, None
        if batch:
            with self._lock:
                self._pending -= sum(1 for req, _ in batch if req.num_computed == 0)
            if self._trace is not None:  # sizes before advance() moves num_computed
                decode_rows = sum(1 for req, _ in batch if req.num_computed >= len(req.prompt_ids))
                prefill_tokens = sum(n for req, n in batch if req.num_computed < len(req.prompt_ids))
                kind = "decode" if not prefill_tokens else ("prefill" if not decode_rows else "mixed")
                info = {"t": t0, "kind": kind, "batch": len(batch), "decode_rows": decode_rows,
                        "prefill_tokens": prefill_tokens, "schedule_ms": (t1 - t0) * 1e3,
                        "idle_ms": (t0 - self._last_step_end) * 1e3 if self._inflight is None else 0.0}
            try:
                launched = self.runner.forward(batch, self._inflight)
            except Exception as e:  # noqa: BLE001 - the whole step failed: end its requests, keep serving
                self._fail_step([req for req, _ in batch], e)
                failure = e
            else:
                for req, n in batch:
                    self.scheduler.advance(req, n)
                    self._stats.prompt_tokens += max(0, min(req.num_computed, len(req.prompt_ids)) -
                                                     max(req.num_computed - n, 0))
        t2 = time.perf_counter()
        self._flush(t0 if batch else None)
        t3 = time.perf_counter()
        if launched is not None and launched.sampled:
            try:
                self._inflight = self.runner.sample(launched)
            except Exception as e:  # noqa: BLE001 - e.g. the test hook; the whole step failed
                self._fail_step([req for req, _ in launched.batch], e)
                failure = e
            else:
                for req in self._inflight.requests:
                    req.pending = 1
        if info is not None:
            info.update(launch_ms=(t2 - t1) * 1e3, sample_ms=(time.perf_counter() - t3) * 1e3)
            if failure is not None:  # its line now: nothing of it is in flight
                info["error"] = f"{type(failure).__name__}: {failure}"
                self._write_trace((info, ()), 0.0, 0.0, (), next_start=time.perf_counter())
            else:
                self._step_trace = (info, launched.marks)
        self._last_step_end = time.perf_counter()

    def _flush(self, next_start: float | None = None) -> None:
        """Collects the sampling in flight (delivering its tokens) and writes the previous step's trace
        line. next_start: when the step after it began (None: now)."""
        prev, self._step_trace = self._step_trace, None
        waited = self._collect(self._inflight) if self._inflight is not None else (0.0, 0.0, ())
        if prev is not None:
            self._write_trace(prev, *waited, next_start=next_start if next_start is not None else time.perf_counter())

    def _collect(self, sampling) -> tuple[float, float, tuple]:
        """Waits for the sampling in flight and delivers its tokens. Returns (ms waiting for the device,
        ms delivering, the sampling's device marks) for the step trace."""
        self._inflight = None
        t0 = time.perf_counter()
        try:
            results = self.runner.collect(sampling)
        except Exception as e:  # noqa: BLE001 - the device failed the step
            for req in sampling.requests:
                req.pending = 0
            self._fail_step(sampling.requests, e)
            return (time.perf_counter() - t0) * 1e3, 0.0, ()
        t1 = time.perf_counter()
        for req, res in results:
            req.pending = 0
            if req.status is not Status.RUNNING:  # ended (abort, error) while its token was in flight
                continue
            if isinstance(res, Exception):
                self._finish(req, "error", error=f"{type(res).__name__}: {res}")
            else:
                self._on_token(req, res)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, sampling.marks

    def _write_trace(self, step_trace, wait_ms: float, deliver_ms: float, sample_marks: tuple, next_start: float):
        """One JSON line for a step: sizes and host phases from its launch, device time (gpu_ms) from its
        marks, and step_ms, the period from its launch to the next one's. The device runs one step
        ahead, so a long step's wall time shows in the period of the step after it; gpu_ms is its own."""
        info, fwd = step_trace
        ops = self.runner.ops
        gpu = (ops.elapsed_ms(*fwd) if fwd else 0.0) + (ops.elapsed_ms(*sample_marks) if sample_marks else 0.0)
        info.update(wait_ms=wait_ms, deliver_ms=deliver_ms, gpu_ms=gpu, step_ms=(next_start - info["t"]) * 1e3)
        self._trace.write(json.dumps(info) + "\n")

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

    def _on_token(self, req: Request, res) -> None:
        tok = res.token_id
        req.output_ids.append(tok)
        self._stats.generation_tokens += 1
        done = req.stop_check(tok)
        try:
            delta = "" if done and done[0] == "stop" else req.detokenizer.add(tok)  # stop tokens add no text
            if done:
                delta += req.detokenizer.flush()
            text, matched = req.stop_buffer.feed(delta, check=len(req.output_ids) >= req.params.min_tokens)
            if matched is not None:
                done = ("stop", matched)
            elif done:
                text += req.stop_buffer.flush()
        except Exception as e:  # noqa: BLE001 - a detokenizer failure ends this request only
            self._finish(req, "error", error=f"detokenization failed: {type(e).__name__}: {e}")
            return
        lp = None
        if res.logprob is not None:
            chosen, top_ids, top_lps = res.logprob
            lp = [TokenLogprob(tok, chosen, dict(zip(top_ids, top_lps)))]
        out = RequestOutput(req.request_id, [tok], text, prompt_tokens=len(req.prompt_ids),
                            completion_tokens=len(req.output_ids), logprobs=lp)
        if len(req.output_ids) == 1:
            out.queue_time = req.scheduled_at - req.arrival
        if done:
            self._finish(req, done[0], done[1], out)
        else:
            self._emit(req, out)

    def _finish(self, req: Request, reason: str, stop_reason=None, out: RequestOutput | None = None,
                error: str | None = None) -> None:
        if req.status is Status.WAITING:
            with self._lock:
                self._pending -= 1
        self.scheduler.finish(req)
        self._requests.pop(req.request_id, None)
        self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1
        out = out or RequestOutput(req.request_id, [], "", prompt_tokens=len(req.prompt_ids),
                                   completion_tokens=len(req.output_ids))
        out.finished, out.finish_reason, out.stop_reason, out.error = True, reason, stop_reason, error
        self._emit(req, out)

    def _emit(self, req: Request, out: RequestOutput) -> None:
        try:
            req.sink(out)
        except Exception as e:  # noqa: BLE001 - a broken consumer must not take the loop down
            if not out.finished:
                self._finish(req, "error", error=f"event sink failed: {e!r}")
