"""Prefix caching through the HTTP server: a 5-turn chat on /v1/chat/completions of a real `qwen35 serve`
with --enable-prefix-caching gives, turn by turn, the replies of a server with caching off; its usage
carries prompt_tokens_details.cached_tokens (the cold server's has none), /metrics counts vLLM's
prefix_cache_queries / hits in tokens, and every held block and snapshot is free again at the end.
CPU: the tiny model; marked gpu: the 4B checkpoint, both servers --batch-invariant (the replies are
then bit-exact whatever the cache does; by default bf16 noise may flip a greedy token on the random
checkpoint, which tests/test_prefix_engine.py bounds with the logits). The servers run one after the
other."""
from __future__ import annotations

import httpx
import numpy as np

from server_util import ServerProcess, metric

ARGS = ("--max-model-len", "4096", "--max-num-seqs", "4", "--max-num-batched-tokens", "256")


def _words(rng, n):
    return " ".join(f"w{x}" for x in rng.integers(0, 5000, n))


def _chat(url, messages):
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def test_five_turn_chat_equals_cold(target):
    model_dir, device = target
    args = ARGS + (("--batch-invariant",) if device == "cuda" else ())
    rng = np.random.default_rng(16)
    users = [_words(rng, 12) for _ in range(5)]
    system = {"role": "system", "content": _words(rng, 30)}
    turns, replies, usages = [], [], []
    with ServerProcess(model_dir, "--enable-prefix-caching", *args, device=device) as warm:
        messages = [system]
        for text in users:
            messages = messages + [{"role": "user", "content": text}]
            reply, usage = _chat(warm.url, messages)
            turns.append(messages)
            replies.append(reply)
            usages.append(usage)
            messages = messages + [{"role": "assistant", "content": reply}]
        m = httpx.get(warm.url + "/metrics", timeout=10).text
        assert metric(m, "qwen35:state_snapshots_used") == 0 and metric(m, "qwen35:state_snapshots_total") > 0
        assert metric(m, "qwen35:kv_blocks_free") == metric(m, "qwen35:kv_blocks_total")
        assert metric(m, "vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
        assert metric(m, "vllm:prefix_cache_hits_total") == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                 for u in usages)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    print("prompt tokens", [u["prompt_tokens"] for u in usages], "cached", cached)
    # Turn 2 resumes at turn 1's last 64-aligned prompt boundary unless that falls inside the generation
    # prompt the template does not re-render in the history ("<|im_start|>assistant\n" is, the empty think
    # block after it is not): then it misses, and leaves a branch point where it left turn 1. From turn 3
    # on every turn hits, deeper each time.
    assert cached[0] == 0 and all(0 < c < u["prompt_tokens"] for c, u in zip(cached[2:], usages[2:]))
    assert cached == sorted(cached)
    with ServerProcess(model_dir, *args, device=device) as cold:
        for messages, reply, usage in zip(turns, replies, usages):
            got, cold_usage = _chat(cold.url, messages)
            assert "prompt_tokens_details" not in cold_usage       # caching off: no such field
            assert cold_usage["prompt_tokens"] == usage["prompt_tokens"] and got == reply
