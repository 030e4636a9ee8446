"""Serving benchmark client with the exact metric definitions of `vllm bench serve`.

Drives any OpenAI-compatible server (ours or vLLM) over HTTP with streaming /v1/completions and
reports TTFT, TPOT, ITL and E2EL (mean/median/std/percentiles), request and token throughput,
as shared/serving-conventions.md §9 defines them. Usage:

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR \
        --random-input-len 1024 --random-output-len 256 --num-prompts 64 --max-concurrency 16 --ignore-eos
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np


@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


# ---- dataset (§9.3) --------------------------------------------------------------------------
def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   range_ratio: float = 0.0) -> list[RequestInput]:
    """vLLM's RandomDataset: token windows over the non-special vocabulary, decoded to text and
    re-encoded until the length is exact (same RNG consumption order as vLLM)."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.get_vocab_size(with_added_tokens=False)
    r = range_ratio
    in_lens = rng.integers(int(np.floor(input_len * (1 - r))), int(np.ceil(input_len * (1 + r))) + 1, size=num_prompts)
    out_lens = rng.integers(max(int(np.floor(output_len * (1 - r))), 1), max(int(np.ceil(output_len * (1 + r))), 1) + 1,
                            size=num_prompts)
    offsets = rng.integers(0, vocab, size=num_prompts)
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    allowed = np.array(sorted(set(range(vocab)) - special))
    out = []
    for i in range(num_prompts):
        ids = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
        target = int(in_lens[i])
        for attempt in range(11):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if attempt == 10 or len(ids) == target:
                break
            ids = ids[:target] if len(ids) > target else ids + rng.integers(0, vocab, size=target - len(ids)).tolist()
        out.append(RequestInput(text, len(ids), int(out_lens[i])))
    return out


# ---- one request (§9.7) -------------------------------------------------------------------------
async def send_completion(client, url: str, model: str, req: RequestInput, extra: dict, request_id: str,
                          headers: dict, res: RequestResult | None = None) -> RequestResult:
    """One streamed request. `res` (optional) is filled in as events arrive, so a caller that
    cancels the task still has the timings received so far."""
    body = {"model": model, "prompt": req.prompt, "repetition_penalty": 1.0, "max_tokens": req.output_len,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}} | extra
    res = res if res is not None else RequestResult()
    res.prompt_len = req.prompt_len
    st = time.perf_counter()
    res.start_time = st
    last = st
    try:
        async with client.stream("POST", url, json=body, headers=headers | {"x-request-id": request_id}) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            buf = ""
            async for piece in resp.aiter_text():
                buf += piece
                while "\n\n" in buf:
                    event, buf = buf.split("\n\n", 1)
                    if not event.startswith("data: "):
                        continue  # ':' comments (keep-alives)
                    payload = event[len("data: "):]
                    if payload == "[DONE]":
                        continue
                    now = time.perf_counter()
                    data = json.loads(payload)
                    if "error" in data:
                        res.error = str(data["error"].get("message", data["error"]))
                        return res
                    if data.get("choices"):
                        if res.ttft == 0.0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.generated_text += data["choices"][0].get("text") or ""
                    elif data.get("usage"):
                        res.output_tokens = data["usage"].get("completion_tokens") or 0
                        res.prompt_len = data["usage"].get("prompt_tokens") or res.prompt_len
        if res.ttft == 0.0:
            res.error = "Never received a valid chunk to calculate TTFT."
            return res
        res.latency = last - st
        res.success = True
    except Exception as e:  # noqa: BLE001 — a failed request is recorded, never raised
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---- aggregates (§9.8) --------------------------------------------------------------------------
def _stats(name: str, values, percentiles) -> dict:
    v = np.asarray(values, dtype=np.float64) * 1000.0
    empty = v.size == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(np.mean(v)),
           f"median_{name}_ms": 0.0 if empty else float(np.median(v)),
           f"std_{name}_ms": 0.0 if empty else float(np.std(v))}
    for p in percentiles:
        out[f"p{_pstr(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(v, p))
    return out


def _pstr(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(results: list[RequestResult], duration: float, percentiles=(50, 90, 95, 99),
                      tokenizer=None) -> dict:
    ok = [r for r in results if r.success]
    for r in ok:
        if not r.output_tokens:  # no usage chunk: count the text (may inflate), as vLLM does
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False).ids) if tokenizer else 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    m = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "request_goodput": None,
         "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
         "max_output_tokens_per_s": _peak_output_rate(ok), "max_concurrent_requests": _peak_concurrency(ok)}
    for name, vals in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", itls),
                       ("e2el", [r.latency for r in ok])):
        m |= _stats(name, vals, percentiles)
    return m


def event_times(r: RequestResult) -> np.ndarray:
    """perf_counter times of a request's `choices` events: start + TTFT, then + cumsum(ITL)."""
    return r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])


def _peak_output_rate(ok: list[RequestResult]) -> float:
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    times = [t for r in ok for t in event_times(r)]
    return float(np.bincount(((np.asarray(times) - t0)).astype(np.int64)).max())


def _peak_concurrency(ok: list[RequestResult]) -> float:
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return float(peak)


# ---- printing (§9.9) ----------------------------------------------------------------------------
def format_result(m: dict, max_concurrency, request_rate, percentiles=(50, 90, 95, 99)) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    row = lambda k, v: lines.append("{:<40} {:<10}".format(k, v))  # noqa: E731
    rowf = lambda k, v: lines.append("{:<40} {:<10.2f}".format(k, v))  # noqa: E731
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        rowf("Request rate configured (RPS):", request_rate)
    rowf("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    rowf("Request throughput (req/s):", m["request_throughput"])
    rowf("Output token throughput (tok/s):", m["output_throughput"])
    rowf("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    rowf("Peak concurrent requests:", m["max_concurrent_requests"])
    rowf("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, title, header in (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                                ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        rowf(f"Mean {title} (ms):", m[f"mean_{name}_ms"])
        rowf(f"Median {title} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            rowf(f"P{_pstr(p)} {title} (ms):", m[f"p{_pstr(p)}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


# ---- the run -------------------------------------------------------------------------------------
def arrival_delays(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gamma inter-arrival gaps (Poisson at burstiness 1), rescaled so the last is n/rate (§9.5)."""
    if rate == float("inf"):
        return np.zeros(n)
    np.random.seed(seed)
    gaps = np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    delays = np.cumsum(gaps)
    return delays * (n / rate) / delays[-1]


async def run_benchmark(base_url: str, model: str, requests: list[RequestInput], *, max_concurrency=None,
                        request_rate=float("inf"), burstiness=1.0, seed=0, extra=None, num_warmups=0,
                        api_key=None, progress=True, client=None) -> tuple[list[RequestResult], float]:
    """client: an httpx.AsyncClient to send with (default: one made here, with max_concurrency connections).
    Making one costs ~50 ms of this event loop's CPU (its TLS context): a caller that reads other streams
    on the loop while this runs passes one made beforehand."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=max_concurrency or None)
    prefix = f"bench-{hashlib.sha1(str(time.time()).encode()).hexdigest()[:8]}-"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits))
        async def one(i, req, rid):
            nonlocal done
            if sem is None:
                r = await send_completion(client, url, model, req, extra or {}, rid, headers)
            else:
                async with sem:
                    r = await send_completion(client, url, model, req, extra or {}, rid, headers)
            done += 1
            if progress:
                print(f"\r{done}/{len(requests)} requests", end="", file=sys.stderr, flush=True)
            return r

        warm = await asyncio.gather(*[one(-1, requests[0], f"{prefix}warmup-{k}") for k in range(num_warmups)])
        if any(not w.success for w in warm):
            raise RuntimeError(f"warm-up request failed: {next(w.error for w in warm if not w.success)}")
        done = 0
        delays = arrival_delays(len(requests), request_rate, burstiness, seed)
        t0 = time.perf_counter()
        start = time.time()
        tasks = []
        for i, req in enumerate(requests):
            wait = start + delays[i] - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, req, f"{prefix}{i}")))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if progress:
        print(file=sys.stderr)
    return list(results), duration


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="qwen35 bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model id to send (default: GET /v1/models data[0].id)")
    ap.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-warmups", type=int, default=0)
    ap.add_argument("--metric-percentiles", default="50,90,95,99")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--label", default=None)
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.tokenizer)
    reqs = random_dataset(tok, a.num_prompts, a.random_input_len, a.random_output_len, a.seed, a.random_range_ratio)
    bad = [r.prompt_len for r in reqs if r.prompt_len != a.random_input_len] if a.random_range_ratio == 0 else []
    if bad:
        print(f"WARNING: {len(bad)} prompts do not have exactly {a.random_input_len} tokens", file=sys.stderr)
    model = a.model or _first_model(a.base_url, a.api_key)
    extra = {"temperature": a.temperature} | ({"ignore_eos": True} if a.ignore_eos else {})
    results, duration = asyncio.run(run_benchmark(a.base_url, model, reqs, max_concurrency=a.max_concurrency,
                                                  request_rate=a.request_rate, burstiness=a.burstiness, seed=a.seed,
                                                  extra=extra, num_warmups=a.num_warmups, api_key=a.api_key))
    pcts = [float(p) for p in a.metric_percentiles.split(",")]
    m = calculate_metrics(results, duration, pcts, tok)
    print(format_result(m, a.max_concurrency, a.request_rate, pcts))
    for e in [r.error for r in results if not r.success][:10]:
        print("failed:", e, file=sys.stderr)
    m |= result_fields(results, label=a.label, model=model, tokenizer_id=a.tokenizer, num_prompts=a.num_prompts,
                       request_rate=a.request_rate, burstiness=a.burstiness, max_concurrency=a.max_concurrency,
                       input_len=a.random_input_len, output_len=a.random_output_len, ignore_eos=a.ignore_eos)
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(m, indent=1))
    return m


def result_fields(results: list[RequestResult], *, label, model, tokenizer_id, num_prompts, request_rate, burstiness,
                  max_concurrency, input_len, output_len, ignore_eos) -> dict:
    """The run description and per-request keys of a saved result (§9.10), beside calculate_metrics'."""
    out_lens = [r.output_tokens for r in results if r.success]
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai", "backend": "openai",
            "label": label, "model_id": model, "tokenizer_id": tokenizer_id, "num_prompts": num_prompts,
            "request_rate": "inf" if request_rate == float("inf") else request_rate, "burstiness": burstiness,
            "max_concurrency": max_concurrency, "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results], "errors": [r.error for r in results if not r.success],
            "requested_input_len": input_len, "requested_output_len": output_len,
            "output_len_mismatches": sum(1 for n in out_lens if n != output_len) if ignore_eos else None,
            "output_hashes": [hashlib.sha1(r.generated_text.encode()).hexdigest()[:12] for r in results],
            "metric_rules": "vllm bench serve (newer: usage.prompt_tokens as input length, last choices event as end)"}


def load_tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def server_model(base_url: str, api_key=None) -> dict:
    """GET /v1/models data[0] (its `id` is the model to send, `root` where a tokenizer may be)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers).json()["data"][0]


def _first_model(base_url: str, api_key) -> str:
    return server_model(base_url, api_key)["id"]


if __name__ == "__main__":
    main()
