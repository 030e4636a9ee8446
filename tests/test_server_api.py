"""The HTTP API in process (httpx ASGI transport, tiny model, NumPy backend): every endpoint,
the SSE byte format, the error envelope, auth and request-id echo."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time

import httpx
import pytest

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from server import prompts, serving
from server.app import ServerContext, build_app
from server.launch import model_names
from server.protocol import GenRequest
from server.reasoning import ReasoningSplitter, prompt_opens_thinking
from server_util import metric, sse_events

MAX_LEN = 256
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = Engine(tiny_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=128, max_model_len=MAX_LEN)
    yield eng
    eng.shutdown()


def _client(engine, **kw):
    app = build_app(ServerContext(engine, "tiny", "/models/tiny", **kw))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


@pytest.fixture
async def client(engine):
    async with _client(engine) as c:
        yield c


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _complete(client, **body):
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --- simple endpoints ---


async def test_models_version_health(client):
    r = await client.get("/v1/models")
    card = r.json()["data"][0]
    assert r.json()["object"] == "list"
    assert card["id"] == "tiny" and card["root"] == "/models/tiny" and card["max_model_len"] == MAX_LEN
    assert (await client.get("/version")).json()["version"]
    r = await client.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert (await client.get("/ping")).status_code == 200


async def test_tokenize_detokenize(client, engine):
    r = (await client.post("/tokenize", json={"prompt": "Hello", "return_token_strs": True})).json()
    assert r["tokens"] == engine.tokenizer.encode("Hello") and r["count"] == 5 and r["max_model_len"] == MAX_LEN
    assert "".join(r["token_strs"]) == "Hello"
    r2 = (await client.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert r2 == {"prompt": "Hello"}
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == engine.tokenizer.encode(text)
    assert (await client.post("/detokenize", json={"tokens": [-1]})).status_code == 400


async def test_metrics_text(client):
    await _complete(client)
    text = (await client.get("/metrics")).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "qwen35:kv_blocks_free", "qwen35:state_slots_free", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert f"# TYPE {name} " in text
        metric(text, name)
    assert metric(text, "vllm:request_success_total", finished_reason="length") >= 1
    for h in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        buckets = [float(v) for v in re.findall(rf'^{h}_bucket{{.*}} (\S+)$', text, re.M)]
        assert buckets == sorted(buckets) and buckets[-1] == metric(text, h + "_count") >= 1
        assert f'{h}_bucket{{model_name="tiny",engine="0",le="+Inf"}}' in text
    assert 'le="2560.0"' in text  # vLLM's TTFT buckets


# --- completions ---


async def test_completion_shape_and_prompt_forms(client, engine):
    out = await _complete(client)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "tiny"
    (c,) = out["choices"]
    assert c["finish_reason"] == "length" and c["stop_reason"] is None and c["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    ids = engine.tokenizer.encode("Hello")
    for prompt in (ids, ["Hello", "Hello"], [ids, ids]):
        got = await _complete(client, prompt=prompt)
        assert [ch["text"] for ch in got["choices"]] == [c["text"]] * len(got["choices"])
        assert [ch["index"] for ch in got["choices"]] == list(range(len(got["choices"])))
    two = await _complete(client, prompt=["Hello", "Hi"], n=2, temperature=1.0, seed=7)
    assert [ch["index"] for ch in two["choices"]] == [0, 1, 2, 3]
    assert two["usage"]["prompt_tokens"] == 5 + 2 and two["usage"]["completion_tokens"] == 24


async def test_completion_sampling_options(client, engine):
    base = (await _complete(client))["choices"][0]["text"]
    assert (await _complete(client, echo=True))["choices"][0]["text"] == "Hello" + base
    # stop string: cut before it, or kept with include_stop_str_in_output
    stop = base[2]
    c = (await _complete(client, stop=[stop]))["choices"][0]
    assert c["text"] == base[:base.index(stop)] and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    c = (await _complete(client, stop=stop, include_stop_str_in_output=True))["choices"][0]
    assert c["text"] == base[:base.index(stop) + 1]
    tid = engine.tokenizer.encode(base)[1]
    c = (await _complete(client, stop_token_ids=[tid], ignore_eos=False))["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == tid
    c = (await _complete(client, logit_bias={"40": 100}))["choices"][0]
    assert c["text"] == "H" * 6
    lp = (await _complete(client, logprobs=3))["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["text_offset"] == list(range(6)) and all(len(t) <= 3 for t in lp["top_logprobs"])
    ids = (await _complete(client, logprobs=0, return_tokens_as_token_ids=True))["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in ids["tokens"])
    a, b = [(await _complete(client, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=3))["choices"][0]["text"]
            for _ in range(2)]
    assert a == b
    for extra in ({"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2}, {"min_tokens": 3},
                  {"truncate_prompt_tokens": 2}, {"user": "x", "unknown_field": 1}):
        await _complete(client, **extra)


async def test_completion_stream_bytes(client):
    base = await _complete(client)
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, **GREEDY, "stream": True,
                                                    "stream_options": {"include_usage": True}, "logprobs": 1})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) == 6  # one event per engine step
    assert len({(e["id"], e["created"]) for e in events[:-1]}) == 1
    assert "".join(e["choices"][0]["text"] for e in chunks) == base["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * 5 + ["length"]
    assert all(e["usage"] is None for e in chunks)
    assert usage["choices"] == [] and usage["usage"] == base["usage"]
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, **GREEDY, "stream": True})
    events = sse_events(r.content)
    assert len(events) == 4 and all("usage" not in e for e in events[:-1])


# --- chat ---


def _chat_body(**kw):
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 5,
            **GREEDY, **kw}


async def test_chat(engine):
    async with _client(engine, reasoning_parser="qwen3") as client:
        r = (await client.post("/v1/chat/completions", json=_chat_body())).json()
        m = r["choices"][0]["message"]
        assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
        # Qwen3.5's prompt opens <think>; random output never closes it: everything is reasoning
        assert m["role"] == "assistant" and m["content"] == "" and len(m["reasoning_content"]) > 0
        assert m["reasoning"] == m["reasoning_content"]  # vLLM's new name and its compatibility alias
        off = (await client.post("/v1/chat/completions", json=_chat_body(
            chat_template_kwargs={"enable_thinking": False}, max_completion_tokens=None, max_tokens=4))).json()
        m = off["choices"][0]["message"]
        assert m["reasoning_content"] is None and len(m["content"]) > 0 and off["usage"]["completion_tokens"] == 4
        lp = (await client.post("/v1/chat/completions", json=_chat_body(logprobs=True, top_logprobs=2))).json()
        content = lp["choices"][0]["logprobs"]["content"]
        assert len(content) == 5 and {"token", "logprob", "bytes", "top_logprobs"} <= content[0].keys()
        assert len(content[0]["top_logprobs"]) == 2


async def test_chat_stream_bytes(client):
    full = (await client.post("/v1/chat/completions", json=_chat_body(
        chat_template_kwargs={"enable_thinking": False}))).json()
    r = await client.post("/v1/chat/completions", json=_chat_body(
        stream=True, stream_options={"include_usage": True}, chat_template_kwargs={"enable_thinking": False}))
    events = sse_events(r.content)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = events[1:-2]
    assert len(content) == 5 and events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in content) == \
        full["choices"][0]["message"]["content"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_reasoning_split():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    s = ReasoningSplitter(thinking=True)
    parts = [s.add(x) for x in ("step", " one</th", "ink>\n\nAnswer")] + [s.add("", final=True)]
    assert "".join(p[0] for p in parts) == "step one" and "".join(p[1] for p in parts) == "\n\nAnswer"
    s = ReasoningSplitter(thinking=False)
    assert s.add("<think>r</think>c", final=True) == ("r", "c")


# --- errors ---


BAD = [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 99}, "n"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "logprobs"),
]


@pytest.mark.parametrize("body,param", BAD)
async def test_invalid_completion_params(client, body, param):
    for stream in (False, True) if "stream_options" not in body else (False,):
        # validation happens before the stream starts: a 400, never an in-band error
        r = await client.post("/v1/completions", json={**body, "stream": body.get("stream", stream)})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": "hi"}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
])
async def test_invalid_chat_params(client, body):
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


async def test_error_envelopes(client):
    r = await client.post("/v1/completions", content=b'{"prompt": ')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert (await client.post("/v1/completions", json=[1, 2])).status_code == 400
    r = await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `gpt-4` does not exist."
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert (await client.get("/v1/completions")).status_code == 405
    r = await client.post("/v1/completions", json={"prompt": "x" * 250, "max_tokens": 10})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and str(MAX_LEN) in msg and "260" in msg
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 300}]})
    assert r.status_code == 400 and str(MAX_LEN) in r.json()["error"]["message"]


async def test_auth_and_request_id(engine):
    async with _client(engine, api_key="sekret") as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                         headers={"Authorization": "Bearer sekret", "X-Request-Id": "bench-1-7"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "bench-1-7"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        r = await c.get("/v1/models", headers={"x-request-id": "r2"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "r2"


async def test_dead_engine_is_503(client, engine, monkeypatch):
    monkeypatch.setattr(engine, "dead", RuntimeError("boom"))
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and "boom" in r.json()["error"]["message"]


# --- hardening (#17): malformed input is a named 4xx, never a 500 ---


MALFORMED = [
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", None, "nested too deeply"),
    (b'{"prompt": "\\ud800"}', None, "surrogate"),
    (b'{"prompt": "x", "model": "a\\udfff"}', None, "surrogate"),
    (b'{"prompt": "x", "temperature": NaN}', None, "NaN"),
    (b'{"prompt": "x", "temperature": Infinity}', None, "Infinity"),
    (b'{"prompt": "x", "temperature": 1e400}', "temperature", "finite"),
    (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature", "finite"),
    (b'{"prompt": "x", "top_p": -1e400}', "top_p", "(0, 1]"),
    (b'{"prompt": "x", "repetition_penalty": 1e-45}', "repetition_penalty", "1e-06"),
    (b'{"prompt": "x", "logit_bias": {"' + b"1" * 5000 + b'": 1}}', "logit_bias", "not a token id"),
    (b'{"prompt": "x", "logit_bias": {"1": 1e400}}', "logit_bias", "[-100, 100]"),
    (b'{"prompt": "x", "seed": -1}', "seed", "non-negative"),
]


@pytest.mark.parametrize("raw,param,needle", MALFORMED)
async def test_malformed_completion_is_a_named_400(client, raw, param, needle):
    r = await client.post("/v1/completions", content=raw)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and needle in err["message"], r.text


@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udbff"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/tokenize", b'{"\\ud800": 1, "prompt": "x"}'),
])
async def test_lone_surrogates_are_400(client, path, raw):
    r = await client.post(path, content=raw)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    ok = await client.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}')  # a valid pair is one character
    assert ok.status_code == 200


async def test_internal_error_keeps_its_details_in_the_log(client, monkeypatch, caplog):
    def boom(ctx, raw):
        raise RuntimeError("secret detail")
    monkeypatch.setattr(prompts, "completion", boom)
    r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "req-9"})
    err = r.json()["error"]
    assert r.status_code == 500 and "secret" not in r.text and "req-9" in err["message"] and err["code"] == 500
    assert "secret detail" in caplog.text and "req-9" in caplog.text


# --- hardening (#17): no request can stall the others; limits ---


async def test_request_chat_template_needs_the_flag_and_is_limited(client, engine, monkeypatch):
    for extra in ({"chat_template": "{{ messages[0].content }}"}, {"chat_template_kwargs": {"chat_template": "x"}}):
        r = await client.post("/v1/chat/completions", json=_chat_body(**extra))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "chat_template"
        assert "--trust-request-chat-template" in err["message"]
    monkeypatch.setattr(prompts, "RENDER_TIMEOUT_S", 0.3)
    async with _client(engine, trust_request_chat_template=True) as c:
        r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                            "chat_template": "{{ messages[0].content }}!"})
        assert r.json()["tokens"] == engine.tokenizer.encode("hi!")
        # vLLM's `reasoning` on an assistant message reaches the template as `reasoning_content` too
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
        r = await c.post("/tokenize", json={"messages": msgs, "chat_template": "{{ messages[1].reasoning_content }}",
                                            "add_generation_prompt": False})
        assert r.json()["tokens"] == engine.tokenizer.encode("r")
        t0 = time.monotonic()
        slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        r = await c.post("/v1/chat/completions", json=_chat_body(chat_template=slow))
        assert r.status_code == 400 and "longer than 0.3 s" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10
        r = await c.post("/v1/chat/completions", json=_chat_body(chat_template="{{ 'ab ' * 3000000 }}"))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "chat_template"
        assert "rendered 9000000 characters" in err["message"]


async def test_body_size_limit_is_413(engine):
    async with _client(engine, max_request_body_bytes=1000) as c:
        r = await c.post("/v1/completions", json={"prompt": "x" * 2000})
        err = r.json()["error"]
        assert r.status_code == 413 and str(len(r.request.content)) in err["message"] and "1000" in err["message"]

        async def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            yield b"x" * 2000
            yield b'"}'
        r = await c.post("/v1/completions", content=chunks())
        assert r.status_code == 413 and "more than 1000" in r.json()["error"]["message"]
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200


async def test_prompt_too_long_is_refused_before_it_is_tokenized(client, engine, monkeypatch):
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    text = "x" * (MAX_LEN * prompts.chars_per_token(engine.tokenizer))  # at least MAX_LEN tokens
    r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code == 400 and f"{len(text)} characters" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert calls == []


async def test_limits_come_from_the_engine(tiny_dir):
    """prompts x n beyond the waiting queue: refused whole, 400 when it can never wait, 503 when the
    queue lacks room now, and nothing is enqueued; the logprobs limit is the engine's max_logprobs."""
    eng = Engine(tiny_dir, start=False, device="cpu", max_num_seqs=4, max_waiting_requests=6, max_logprobs=5,
                 max_model_len=MAX_LEN)
    try:
        async with _client(eng) as c:
            r = await c.post("/v1/completions", json={"prompt": ["a"] * 4, "n": 2})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "n" and "8 engine requests" in err["message"]
            for _ in range(3):
                eng.submit([1, 2], SamplingParams(max_tokens=1), lambda out: None)
            r = await c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2})
            assert r.status_code == 503 and r.headers["retry-after"] and "room for 3" in r.json()["error"]["message"]
            assert eng.stats().waiting == 3
            r = await c.post("/v1/completions", json={"prompt": "a", "logprobs": 6})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "logprobs" and "max_logprobs (5)" in err["message"]
            r = await c.post("/v1/chat/completions", json=_chat_body(logprobs=True, top_logprobs=6))
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    finally:
        eng.shutdown()


async def test_a_big_request_lets_the_loop_run_while_it_is_submitted(tiny_dir):
    eng = Engine(tiny_dir, start=False, device="cpu", max_num_seqs=4, max_model_len=1024)
    try:
        job = serving.Job("cmpl-big", GenRequest(params=SamplingParams(max_tokens=1)), [[5] * 1000] * 300, [])
        turns = 0

        async def other_request():
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)
        other = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        await serving.submit(ServerContext(eng, "tiny", "tiny"), job, None)
        other.cancel()
        assert eng.stats().waiting == 300 and turns >= 300_000 // serving.YIELD_EVERY_TOKENS
    finally:
        eng.shutdown()


async def test_disconnect_non_streaming_aborts_quietly(engine, caplog):
    """A client that goes away before its JSON response: the request is aborted, a 499 goes
    nowhere, and nothing is logged (it was a TypeError: a Response wrapped in JSONResponse)."""
    app = build_app(ServerContext(engine, "tiny", "/models/tiny"))
    body = json.dumps({"prompt": "Hello", "max_tokens": 240, **GREEDY}).encode()
    sent, received = [], []

    async def receive():
        if not received:
            received.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("test", 1), "server": ("test", 80)}
    aborts = engine.stats().finished.get("abort", 0)
    with caplog.at_level(logging.WARNING):
        await app(scope, receive, send)
    assert sent[0]["status"] == 499 and not caplog.records
    deadline = time.monotonic() + 5
    while engine.stats().finished.get("abort", 0) == aborts:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_api_key_compared_in_constant_time(engine, monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((len(a), len(b))) or real(a, b))
    async with _client(engine, api_key="sekret") as c:
        for key, status in (("s", 401), ("sekret-and-more", 401), ("sekret", 200)):
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status
    assert compared == [(32, 32)] * 3  # digests: the key's length does not show either


def test_models_id_is_the_directory_name_unless_served_name():
    assert model_names("/srv/models/Qwen3.5-4B/", None) == ("Qwen3.5-4B", "Qwen3.5-4B")
    assert model_names("/srv/models/Qwen3.5-4B", "qwen") == ("qwen", "/srv/models/Qwen3.5-4B")


# --- vLLM compatibility of the chat response (#17 item 5) ---


async def test_chat_response_fields_as_vllm(client, engine):
    r = (await client.post("/v1/chat/completions", json=_chat_body())).json()
    m = r["choices"][0]["message"]
    # no --reasoning-parser (vLLM's default): the whole output is content
    assert len(m["content"]) > 0 and m["reasoning"] is None and m["reasoning_content"] is None
    for key in ("system_fingerprint", "service_tier", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params"):
        assert key in r and r[key] is None
    async with _client(engine, reasoning_parser="qwen3") as c:
        reasoning = (await c.post("/v1/chat/completions", json=_chat_body(max_completion_tokens=8))).json()[
            "choices"][0]["message"]["reasoning"]
        stop = reasoning[3]
        raw = await c.post("/v1/chat/completions", json=_chat_body(max_completion_tokens=8, stream=True, stop=[stop]))
        chunks = [e["choices"][0] for e in sse_events(raw.content)[1:-1]]
    assert "".join(ch["delta"].get("reasoning", "") for ch in chunks) == reasoning[:reasoning.index(stop)]
    deltas = [ch["delta"] for ch in chunks]
    assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning" in d)
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == stop
    assert all("stop_reason" not in ch for ch in chunks[:-1])  # vLLM sets it on a choice's last chunk only


# --- fuzz: no body, however wrong, is anything but a clean 4xx ---

from hypothesis import given, settings, strategies as st  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from server.engine_io import EngineLimits  # noqa: E402
from server.errors import APIError  # noqa: E402
from server.protocol import chat_request, completion_request  # noqa: E402

LIMITS = EngineLimits(vocab_size=1000, max_model_len=MAX_LEN, max_num_seqs=4, max_waiting_requests=16,
                      max_logprobs=20)
_text = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=5)  # lone surrogates too
_huge = st.integers(0, 4299).map(lambda n: 10 ** n) | st.integers(0, 4299).map(lambda n: -10 ** n)
_json = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | _huge | st.floats() | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=6)
_KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
         "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "logit_bias",
         "stop_token_ids", "min_tokens", "presence_penalty", "repetition_penalty", "chat_template_kwargs",
         "response_format", "tool_choice", "truncate_prompt_tokens", "best_of", "chat_template"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _json | st.lists(_json, max_size=2), max_size=6))
def test_parser_fuzz(body):
    for parse in (completion_request, chat_request):
        try:
            parse(body, LIMITS)
        except APIError as e:
            assert e.status == 400 and e.message


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# The classes a JSON parser meets: nesting, \u escapes (lone surrogates, and a valid pair), numbers
# beyond any range (huge ints, non-finite floats, the non-standard literals), and plain values
# (json.dumps escapes the lone surrogates _text makes), messages among them.
_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | _text,
                                            "content": _text | _json}), min_size=1, max_size=2)
_RAW = (st.integers(1, 5000).map(_nested) | st.sampled_from(['"\\ud800"', '"a\\udfffb"', '"\\ud83d\\ude00"'])
        | st.integers(0, 4400).map(lambda n: "9" * (n + 1)) | st.integers(0, 4400).map(lambda n: "-1" + "0" * n)
        | st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-45", "4.9e-324"])
        | (_json | _messages).map(lambda v: json.dumps(v, allow_nan=True)))
# the keys whose strings reach the tokenizer or an error message, often; any key, and a surrogate
_RAW_KEYS = (st.sampled_from(["prompt", "messages", "model", "tokens", "stop"])
             | st.sampled_from(_KEYS + ["model", "tokens"]) | _text).map(json.dumps)


def _raw_body(items) -> bytes:
    # small max tokens first, so that a body that turns out valid generates little (later keys win)
    pairs = ['"max_tokens":2', '"max_completion_tokens":2', *(f"{k}:{v}" for k, v in items)]
    return ("{" + ",".join(pairs) + "}").encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def sync_client(engine):
    app = build_app(ServerContext(engine, "tiny", "/models/tiny", trust_request_chat_template=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_RAW_KEYS, _RAW), max_size=4), st.integers(0, 4).map(_nested))
def test_http_fuzz_no_5xx(sync_client, items, junk):
    for raw in (_raw_body(items), junk.encode()):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            r = sync_client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, raw[:200], r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["code"] == r.status_code and err["message"]
