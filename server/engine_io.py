"""The server's only contact with the running engine: its limits and tokenizer, submit, abort, liveness
and stats, with engine exceptions mapped to HTTP errors (raised before any response header)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.engine import EngineDeadError, OverloadedError
from engine.sampling_params import SamplingParams

from .errors import APIError

RETRY_AFTER_S = "1"


@dataclass(frozen=True)
class EngineLimits:
    """What request validation needs to know about the engine."""
    vocab_size: int
    max_model_len: int
    max_num_seqs: int            # running requests; also the cap on n
    max_waiting_requests: int    # submitted, not yet running
    max_logprobs: int


def limits(engine) -> EngineLimits:
    a = engine.args
    return EngineLimits(engine.cfg.vocab_size, engine.max_model_len, a.max_num_seqs, a.max_waiting_requests,
                        a.max_logprobs)


def tokenizer(engine):
    return engine.tokenizer


def queue_room(engine) -> int:
    """Requests that can still be submitted before the waiting queue is full."""
    return engine.args.max_waiting_requests - engine.stats().waiting


def overloaded(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": RETRY_AFTER_S})


def add(engine, request_id: str, prompt_ids: list[int], params: SamplingParams):
    """Validates and queues one engine request; returns its async iterator of RequestOutput."""
    try:
        return engine.add_request(prompt_ids, params, request_id=request_id)
    except OverloadedError as e:
        raise overloaded(str(e)) from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    except ValueError as e:  # bad parameters, or a request that can never fit (AdmissionError)
        raise APIError(400, str(e), getattr(e, "param", None)) from None


def abort(engine, request_id: str) -> None:
    engine.abort(request_id)  # only enqueues: never blocks the event loop


def alive(engine) -> bool:
    return engine.is_alive()


def gauges(engine) -> dict[str, tuple[str, float]]:
    s = engine.stats()
    return {
        "vllm:num_requests_running": ("Requests in model execution batches.", s.running),
        "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", s.waiting),
        "vllm:kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).",
                                     s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
        "qwen35:kv_blocks_free": ("Free KV cache blocks.", s.kv_blocks_free),
        "qwen35:kv_blocks_total": ("KV cache blocks usable by requests.", s.kv_blocks_total),
        "qwen35:state_slots_free": ("Free GDN state slots.", s.state_slots_free),
        "qwen35:state_slots_total": ("GDN state slots usable by requests.", s.state_slots_total),
        "qwen35:device_memory_used_bytes": ("Memory held by the backend's live arrays.", s.device_memory_used),
        "qwen35:kv_blocks_cached": ("KV blocks holding a cached prefix, in use or free (prefix caching).",
                                    s.kv_blocks_cached),
        "qwen35:state_snapshots_used": ("GDN state snapshots held by running requests (prefix caching).",
                                        s.state_snapshots_used),
        "qwen35:state_snapshots_cached": ("GDN state snapshots holding a cached prefix (prefix caching).",
                                          s.state_snapshots_cached),
        "qwen35:state_snapshots_total": ("GDN state snapshots (prefix caching; 0 when off).", s.state_snapshots_total),
    }


def counters(engine) -> dict:
    s = engine.stats()
    return {"prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
            "preemptions": s.num_preemptions, "finished": dict(s.finished),
            "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
            "spec_decode_num_drafts": s.spec_decode_num_drafts,
            "spec_decode_num_draft_tokens": s.spec_decode_num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.spec_decode_num_accepted_tokens}
