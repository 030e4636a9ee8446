"""The `qwen35` command: serve, generate, make-model, bench serve."""
from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the built-in tiny demo)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-waiting-requests", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs for decode steps")
    ap.add_argument("--batch-invariant", action="store_true", default=None,
                    help="a request's output independent of its batch neighbours (CUDA: slower prefill)")
    ap.add_argument("--trace-steps", default=None, metavar="FILE", help="append one JSON line per engine step")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the KV and GDN state of cached prompt prefixes (default: off)")
    ap.add_argument("--num-state-snapshots", type=int, default=None, metavar="N",
                    help="GDN state snapshots kept for prefix caching (default: 4 per sequence, at most half the "
                         "memory the running sequences' KV leaves)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    keys = ("device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
            "gpu_memory_utilization", "enforce_eager", "batch_invariant", "trace_steps", "enable_prefix_caching",
            "num_state_snapshots")
    return {k: getattr(a, k) for k in keys if getattr(a, k) is not None}


def model_dir(a: argparse.Namespace) -> str:
    if a.model:
        return a.model
    from .demo import demo_model_dir
    return str(demo_model_dir())


def _generate(a: argparse.Namespace) -> None:
    from . import LLM, SamplingParams

    llm = LLM(model_dir(a), **engine_kwargs(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, ignore_eos=a.ignore_eos,
                            seed=a.seed)
    t0 = time.perf_counter()
    out = llm.generate([a.prompt], params)[0]
    dt = time.perf_counter() - t0
    print(out.text)
    print(f"[{len(out.token_ids)} tokens in {dt:.2f} s, finish_reason={out.finish_reason}]", file=sys.stderr)


def _serve(a: argparse.Namespace) -> None:
    import logging
    from server.launch import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    serve(model_dir(a), host=a.host, port=a.port, served_model_name=a.served_model_name, api_key=a.api_key,
          engine_args=engine_kwargs(a), log_level=a.uvicorn_log_level)


def _bench(argv: list[str]):
    """The benchmark clients live in the source tree's tools/ (not a package): `pip install -e .` keeps it."""
    from pathlib import Path
    if argv[:1] != ["serve"]:
        raise SystemExit("usage: qwen35 bench serve [--help | bench_serving options]")
    tools = Path(__file__).resolve().parents[1] / "tools"
    if not (tools / "bench_serving.py").is_file():
        raise SystemExit(f"qwen35 bench needs the source tree's tools/ ({tools} not found): install with pip install -e")
    sys.path.insert(0, str(tools))
    import bench_serving
    bench_serving.main(argv[1:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="qwen35", description="a small serving engine for the dense Qwen3.5 models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, no server")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (vLLM flag names)")
    _add_engine_args(s)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the model path)")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    s.add_argument("--uvicorn-log-level", default="info")
    sub.add_parser("make-model", help="write a random-weight checkpoint", add_help=False)
    sub.add_parser("bench", help="`qwen35 bench serve ...`: tools/bench_serving.py (vllm bench serve's metrics)",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-model"]:
        from .checkpoint import main as make_main
        return make_main(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    a = ap.parse_args(argv)
    if a.cmd == "generate":
        _generate(a)
    elif a.cmd == "serve":
        _serve(a)


if __name__ == "__main__":
    main()
