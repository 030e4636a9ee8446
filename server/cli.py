"""The `qwen35` command: serve, generate, make-model, bench serve.

It lives above both the engine and the server (and the benchmark clients in tools/), so every
import goes down. A mistake in the arguments or the machine (no such directory, a port in use, no
CuPy, a request that can never fit) ends in one line and exit status 2, not a traceback.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from engine import EngineArgs
from engine.config import SpeculativeConfig


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where it has none (None) or is a switch (off)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _speculative_config(text: str) -> dict:
    """--speculative-config: vLLM's JSON, checked now (a mistake is one line, before the model loads)."""
    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    d = EngineArgs
    ap.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the built-in tiny demo)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default=d.device,
                    help="cuda (needs CuPy), cpu (the NumPy backend), or cuda when available")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + output tokens per request (default: min(model window, 8192))")
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                    help="running requests (one GDN state slot each); also the cap on n")
    ap.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                    help="tokens per engine step (the prefill chunk)")
    ap.add_argument("--prefill-budget-with-decodes", type=int, default=d.prefill_budget_with_decodes, metavar="N",
                    help="prompt tokens in a step that also decodes: bounds the running requests' inter-token "
                         "latency while prompts are prefilled (0: only --max-num-batched-tokens; 5..512 on the GPU: such "
                         "steps replay CUDA graphs)")
    ap.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                    help="waiting queue bound; beyond it requests get 503")
    ap.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="the most logprobs a request may ask for")
    ap.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                    help="fraction of GPU memory for the weights, state slots and KV")
    ap.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs (decode, verify and small mixed steps)")
    ap.add_argument("--batch-invariant", action="store_true", default=None,
                    help="a request's output independent of its batch neighbours (CUDA: slower prefill)")
    ap.add_argument("--trace-steps", default=None, metavar="FILE", help="append one JSON line per engine step")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the KV and GDN state of cached prompt prefixes (default: off)")
    ap.add_argument("--num-state-snapshots", type=int, default=None, metavar="N",
                    help="GDN state snapshots kept for prefix caching (default: 4 per sequence, at most half the "
                         "memory the running sequences' KV leaves)")
    ap.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                    help='speculative decoding, vLLM\'s keys: {"method": "ngram" | "mtp" | "dflash", '
                         '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M (ngram), '
                         '"model": DIR (dflash: the drafter)} (default: off)')


def engine_kwargs(a: argparse.Namespace) -> dict:
    keys = ("device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "prefill_budget_with_decodes",
            "max_waiting_requests",
            "max_logprobs", "gpu_memory_utilization", "enforce_eager", "batch_invariant", "trace_steps",
            "enable_prefix_caching", "num_state_snapshots", "speculative_config")
    return {k: getattr(a, k) for k in keys if getattr(a, k) is not None}


class _Usage(Exception):
    """A mistake the user can fix: printed as one line."""


def _checkpoint(a: argparse.Namespace) -> str | None:
    """The checkpoint directory given, checked; None for the demo."""
    if a.model and not Path(a.model).is_dir():
        raise _Usage(f"{a.model}: no such directory")
    if a.model and not (Path(a.model) / "config.json").is_file():
        raise _Usage(f"{a.model}: not a checkpoint directory (no config.json)")
    return a.model


def _demo() -> str:
    from engine.demo import demo_model_dir
    return str(demo_model_dir())  # written on first use


def _check_device(a: argparse.Namespace) -> None:
    if a.device == "cuda" and importlib.util.find_spec("cupy") is None:
        raise _Usage("--device cuda needs CuPy: pip install -e '.[cuda13]' (CUDA 13) or -e '.[cuda12]' (CUDA 12)")


def _generate(a: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    _check_device(a)
    llm = LLM(_checkpoint(a) or _demo(), **engine_kwargs(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, ignore_eos=a.ignore_eos,
                            seed=a.seed)
    t0 = time.perf_counter()
    out = llm.generate([a.prompt], params)[0]
    dt = time.perf_counter() - t0
    print(out.text)
    print(f"[{len(out.token_ids)} tokens in {dt:.2f} s, finish_reason={out.finish_reason}]", file=sys.stderr)


def _serve(a: argparse.Namespace) -> None:
    import logging

    from .launch import bind, serve

    _check_device(a)
    path = _checkpoint(a)
    try:
        sock = bind(a.host, a.port)  # before the model loads (or the demo is written): a port in use fails at once
    except OSError as e:
        raise _Usage(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with sock:
        serve(path or _demo(), sock, engine_args=engine_kwargs(a), served_model_name=a.served_model_name,
              log_level=a.uvicorn_log_level, api_key=a.api_key or os.environ.get("VLLM_API_KEY") or None,
              trust_request_chat_template=a.trust_request_chat_template, reasoning_parser=a.reasoning_parser,
              max_request_body_bytes=a.max_request_body_bytes)


def _bench(argv: list[str]) -> None:
    if argv[:1] != ["serve"]:
        raise SystemExit("usage: qwen35 bench serve [--help | bench_serving options]")
    from tools import bench_serving
    bench_serving.main(argv[1:])


def build_parser() -> argparse.ArgumentParser:
    from .reasoning import PARSERS
    from .app import MAX_REQUEST_BODY_BYTES

    ap = argparse.ArgumentParser(prog="qwen35", description="a small serving engine for the dense Qwen3.5 models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, no server", formatter_class=_Help)
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: generation_config.json, else 1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true", help="generate past every EOS token")
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (vLLM flag names)", formatter_class=_Help)
    _add_engine_args(s)
    s.add_argument("--host", default="0.0.0.0", help="bind address")
    s.add_argument("--port", type=int, default=8000, help="bind port")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in /v1/models (default: the checkpoint directory's base name)")
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer <key> (default: $VLLM_API_KEY, which keeps it out of ps)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (code the server runs)")
    s.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="split the chat output's reasoning (before </think>) into message.reasoning "
                        "(default: none, all output is content)")
    s.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413")
    s.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    sub.add_parser("make-model", help="write a random-weight checkpoint", add_help=False)
    sub.add_parser("bench", help="`qwen35 bench serve ...`: tools/bench_serving.py (vllm bench serve's metrics)",
                   add_help=False)
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-model"]:
        from engine.checkpoint import main as make_main
        return make_main(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "generate":
            _generate(a)
        else:
            _serve(a)
    except (_Usage, ValueError, OSError) as e:  # the engine's named refusals (config, limits, a request), files
        print(f"qwen35 {a.cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
