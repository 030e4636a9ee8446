"""The HTTP API in process (httpx ASGI transport, tiny model, NumPy backend): every endpoint,
the SSE byte format, the error envelope, auth and request-id echo."""
from __future__ import annotations

import re

import httpx
import pytest

from engine.engine import Engine
from server.app import ServerContext, build_app
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


async def test_chat(client):
    r = (await client.post("/v1/chat/completions", json=_chat_body())).json()
    m = r["choices"][0]["message"]
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    # Qwen3.5's prompt opens <think>; random output never closes it: everything is reasoning
    assert m["role"] == "assistant" and m["content"] == "" and len(m["reasoning_content"]) > 0
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


# --- fuzz: no body, however wrong, is anything but a clean APIError in the parser ---

from hypothesis import given, settings, strategies as st  # noqa: E402

from server.errors import APIError  # noqa: E402
from server.protocol import chat_request, completion_request  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=False)
                     | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
         "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "logit_bias",
         "stop_token_ids", "min_tokens", "presence_penalty", "repetition_penalty", "chat_template_kwargs",
         "response_format", "tool_choice", "truncate_prompt_tokens", "best_of"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _json, max_size=6))
def test_parser_fuzz(body):
    for parse in (completion_request, chat_request):
        try:
            parse(body, vocab_size=1000, max_model_len=MAX_LEN, max_n=4)
        except APIError as e:
            assert e.status == 400 and e.message
