"""Prometheus text exposition with vLLM's metric names and buckets, written by hand.

The server records request-level timings (it sees arrival, every token and the end); load
gauges and token/request counters come from the engine when /metrics is scraped.
"""
from __future__ import annotations

from bisect import bisect_left

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # last: above every bound
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1  # le is inclusive
        self.sum += v

    def lines(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, c in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += c
            out.append(f'{self.name}_bucket{{{labels},le="{le}"}} {total}')
        out += [f"{self.name}_sum{{{labels}}} {self.sum!r}", f"{self.name}_count{{{labels}}} {total}"]
        return out


class Metrics:
    """Handlers observe, /metrics renders; all on the event loop, so no locking."""

    def __init__(self, model_name: str):
        # Prometheus label-value escaping
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'model_name="{escaped}",engine="0"'
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive output tokens.",
                             ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to last token.", E2E_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting for admission (KV blocks and a slot).",
                               E2E_BUCKETS)

    def render(self, gauges: dict[str, tuple[str, float]], counters: dict) -> str:
        """gauges: name -> (help, value); counters: engine totals; both read at scrape time."""
        lab = self.labels
        out: list[str] = []
        for name, (help_, value) in gauges.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {float(value)!r}"]
        for name, help_, value in (
                ("vllm:prompt_tokens_total", "Prefill tokens processed.", counters["prompt_tokens"]),
                ("vllm:generation_tokens_total", "Generated tokens.", counters["generation_tokens"]),
                ("vllm:num_preemptions_total", "Preemptions.", counters["preemptions"]),
                ("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                 counters["prefix_cache_queries"]),
                ("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                 counters["prefix_cache_hits"]),
                ("vllm:spec_decode_num_drafts_total", "Verifies of drafted tokens (speculative decoding).",
                 counters["spec_decode_num_drafts"]),
                ("vllm:spec_decode_num_draft_tokens_total", "Drafted tokens verified.",
                 counters["spec_decode_num_draft_tokens"]),
                ("vllm:spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.",
                 counters["spec_decode_num_accepted_tokens"])):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}{{{lab}}} {value}"]
        name, finished = "vllm:request_success_total", counters["finished"]
        out += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        out += [f'{name}{{{lab},finished_reason="{r}"}} {finished.get(r, 0)}' for r in FINISHED_REASONS]
        for h in (self.ttft, self.itl, self.e2e, self.queue):
            out += h.lines(lab)
        return "\n".join(out) + "\n"
