"""HTTP lifecycle gate against a real `qwen35 serve` subprocess: baseline, rejections,
cancellation and disconnects at every stage, overload, then a clean follow-up whose output hash
equals the baseline, idle gauges and device memory back at its idle value (on the CPU the NumPy
backend's weight and cache arrays), and a clean SIGINT shutdown. One server per target, the tiny
model on the CPU and (marked gpu) the random 4B checkpoint on the GPU, shared by the tests; its
baseline is taken before any test's request, so the tests pass in any order (the SIGINT test
stops a server of its own)."""
from __future__ import annotations

import asyncio
import hashlib
import signal
import threading
import time

import httpx
import pytest

from server_util import ServerProcess, metric, sse_events

openai = pytest.importorskip("openai")

MAX_LEN, SEQS, WAITING = 4096, 2, 2
BASE = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = 3000          # prompt tokens: dozens of 32-token prefill chunks
IDLE_WITHIN_S = 2.0  # an aborted request must be gone long before it could have finished


def _serve(target) -> ServerProcess:
    model_dir, device = target
    return ServerProcess(model_dir, "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(SEQS),
                         "--max-waiting-requests", str(WAITING), "--max-num-batched-tokens", "32", device=device)


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def served(target):
    """The shared server and its baseline, taken before any test sends a request: the greedy output
    hash and the idle device memory."""
    with _serve(target) as s:
        digest = _greedy_hash(_client(s))
        _wait_idle(s)
        yield s, {"hash": digest, "memory": _device_memory(s)}


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def baseline(served):
    return served[1]


@pytest.fixture(scope="module")
def oai(server):
    return _client(server)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _greedy_hash(oai) -> str:
    out = oai.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    return _digest(out.choices[0].text)


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _wait_idle(server, within: float = IDLE_WITHIN_S) -> float:
    """Seconds until nothing runs or waits and every KV block and state slot is free again."""
    t0 = time.monotonic()
    while True:
        m = _metrics(server)
        if (metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0
                and metric(m, "qwen35:kv_blocks_free") == metric(m, "qwen35:kv_blocks_total")
                and metric(m, "qwen35:state_slots_free") == metric(m, "qwen35:state_slots_total")):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"not idle after {within} s:\n{m[:800]}"
        time.sleep(0.02)


def _aborts(server) -> float:
    return metric(_metrics(server), "vllm:request_success_total", finished_reason="abort")


def _stream_body(**kw) -> dict:
    return {**BASE, "stream": True, "max_tokens": 1000, **kw}


def _device_memory(server) -> float:
    return metric(_metrics(server), "qwen35:device_memory_used_bytes")


def test_1_baseline(oai, server, baseline):
    assert _greedy_hash(oai) == baseline["hash"]  # deterministic
    _wait_idle(server)
    assert _device_memory(server) == baseline["memory"] > 0  # weights and cache: the memory check is not vacuous


def test_2_over_context_then_normal(oai, baseline):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x" * (MAX_LEN + 10), max_tokens=4)
    assert str(MAX_LEN) in str(e.value) and str(MAX_LEN + 14) in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * MAX_LEN}])
    assert _greedy_hash(oai) == baseline["hash"]


@pytest.mark.parametrize("body,needle", [
    ({**BASE, "max_tokens": -1}, "max_tokens"),
    ({**BASE, "temperature": -1}, "temperature"),
    ({**BASE, "top_p": 0}, "top_p"),
    ({**BASE, "top_p": 1.01}, "top_p"),
    ({**BASE, "n": 10 ** 6}, "n must be"),
    ({**BASE, "max_tokens": "8"}, "'max_tokens' must be integer"),
    ({**BASE, "prompt": {"text": "x"}}, "'prompt' must be"),
    ({**BASE, "stop": 3}, "'stop' must be"),
])
def test_3_invalid_params(server, body, needle):
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=10)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_3_invalid_requests(oai, server, baseline):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={**BASE, "model": "other"}, timeout=10)
    assert r.status_code == 404 and "`other` does not exist" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="tiny", prompt="x", temperature=-2)
    assert _greedy_hash(oai) == baseline["hash"]


def test_4_cancel_after_first_token(oai, server):
    before = _aborts(server)
    stream = oai.completions.create(model="tiny", prompt="Hello", max_tokens=1000, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    stream.close()
    _wait_idle(server)
    assert _aborts(server) == before + 1


def test_4_chat_cancel_after_first_token(oai, server):
    before = _aborts(server)
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_completion_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    assert next(it).choices[0].delta.role == "assistant"
    next(it)
    stream.close()
    _wait_idle(server)
    assert _aborts(server) == before + 1


@pytest.mark.parametrize("stage", ["after_headers", "prefill", "decode"])
def test_5_disconnect(server, stage):
    before = _aborts(server)
    body = _stream_body(prompt="x" * LONG, max_tokens=8) if stage == "prefill" else _stream_body()
    neighbour: dict = {}

    def run_neighbour():
        neighbour["r"] = httpx.post(server.url + "/v1/completions", json={**BASE, "max_tokens": 40}, timeout=60)

    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            t = threading.Thread(target=run_neighbour)
            t.start()
            if stage == "decode":
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                assert next(lines) == ""
                assert next(lines).startswith("data: {")
            elif stage == "prefill":
                time.sleep(0.3)  # well inside the chunked prefill of the long prompt
    t.join(60)
    n = neighbour["r"]
    assert n.status_code == 200 and n.json()["usage"]["completion_tokens"] == 40
    _wait_idle(server)
    assert _aborts(server) == before + 1


def test_5_disconnect_non_streaming(server):
    before, logged = _aborts(server), len(server.log())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**BASE, "max_tokens": 1000}, timeout=0.5)
    _wait_idle(server)
    assert _aborts(server) == before + 1
    new = server.log()[logged:]
    assert "Traceback" not in new and "Exception" not in new and "Error" not in new, new  # aborted quietly


def test_6_overload(server):
    total = SEQS + WAITING + 8

    async def one(c: httpx.AsyncClient, i: int):
        r = await c.post("/v1/completions", json={**BASE, "max_tokens": 30, "stream": i % 2 == 1})
        return r

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=total)) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(total))), 90)

    results = asyncio.run(main())
    assert len(results) == total
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 503} and 503 in codes and codes.count(200) >= SEQS, codes
    for i, r in enumerate(results):
        if r.status_code == 503:
            assert r.headers["retry-after"] and "queue is full" in r.json()["error"]["message"]
        elif i % 2:
            events = sse_events(r.content)
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        else:
            assert r.json()["usage"]["completion_tokens"] == 30
    _wait_idle(server)


def test_7_healthy_after_everything(oai, server, baseline):
    assert _greedy_hash(oai) == baseline["hash"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert oai.models.list().data[0].id == "tiny"
    _wait_idle(server, within=0.5)
    assert _device_memory(server) == baseline["memory"]


def test_8_sigint_aborts_streams_and_exits_cleanly(target):
    with _serve(target) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=_stream_body(max_tokens=3000)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            server.proc.send_signal(signal.SIGINT)
            rest = "\n".join(lines)
        assert '"finish_reason":"abort"' in rest and rest.rstrip().endswith("data: [DONE]")
        assert server.stop(timeout=20) == 0
