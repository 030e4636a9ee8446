"""No request can stall the others (#17 item 1), against a real `qwen35 serve` (tiny model, CPU).

While a stream runs, the requests that used to hold the event loop for seconds to minutes (a
runaway or a huge request chat template, a 10 MB prompt, a prompt that cannot fit, /tokenize of a
big text, a prompt list times n) each get their answer, and meanwhile the stream's inter-token
gaps and a concurrent /health stay under a second. The server takes its API key from VLLM_API_KEY.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_util import ServerProcess

MAX_GAP_S = 1.0
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]
HOSTILE = [
    ("/v1/chat/completions", {"messages": HI, "chat_template": "{% for i in range(100000) %}{% for j in "
                              "range(100000) %}{% endfor %}{% endfor %}"}, 400),   # stopped at the time limit
    ("/v1/chat/completions", {"messages": HI, "chat_template": "{{ 'ab ' * 3000000 }}"}, 400),  # output size
    ("/v1/completions", {"prompt": "x" * 10_000_000, "max_tokens": 1}, 413),      # the body limit
    ("/v1/completions", {"prompt": "x" * 4_000_000, "max_tokens": 1}, 400),       # cannot fit: not tokenized
    ("/tokenize", {"prompt": "hello " * 100_000}, 200),                           # tokenized beside the loop
    ("/v1/completions", {"prompt": ["hi"] * 64, "n": 32}, 400),                   # 2048 engine requests
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    with ServerProcess(tiny_dir, "--trust-request-chat-template", "--max-num-seqs", "32",
                       env={"VLLM_API_KEY": KEY}) as s:
        yield s


def test_no_request_stalls_the_others(server):
    stamps, health, answers = [], [], {}
    done = threading.Event()

    def stream():
        body = {"prompt": "Hello", "max_tokens": 7000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append((time.monotonic(), line))
                if done.is_set():
                    return  # closing the stream aborts the request

    def poll_health():
        while not done.is_set():
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.05)

    def send(i, path, body):
        answers[i] = httpx.post(server.url + path, json=body, headers=AUTH, timeout=120).status_code

    reader = threading.Thread(target=stream)
    reader.start()
    while len(stamps) < 5:  # the stream is decoding
        time.sleep(0.01)
    poller = threading.Thread(target=poll_health)
    poller.start()
    senders = [threading.Thread(target=send, args=(i, path, body)) for i, (path, body, _) in enumerate(HOSTILE)]
    t_start = time.monotonic()
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    t_end = time.monotonic()
    done.set()
    poller.join()
    reader.join()
    assert answers == {i: status for i, (_, _, status) in enumerate(HOSTILE)}
    during = [t for t, _ in stamps if t_start <= t]
    assert during[-1] >= t_end - MAX_GAP_S and "[DONE]" not in stamps[-1][1]  # it ran the whole time
    gaps = [b - a for a, b in zip([t_start, *during], during)]
    assert max(gaps) < MAX_GAP_S, f"the stream stalled {max(gaps):.2f} s"
    assert health and max(health) < MAX_GAP_S, f"/health took {max(health):.2f} s"


def test_api_key_from_the_environment(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    r = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
