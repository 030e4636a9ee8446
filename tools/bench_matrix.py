"""The retained serving matrix against one server (ours or vLLM), with bench_serving's client in-process.

Cells are named INxOUT-cC (request rate inf, at most C requests in flight) or INxOUT-qpsR-cC (Poisson
arrivals at R req/s, at most C in flight):

    1024x256-c1 -c4 -c8 -c16 -c32 -c64       concurrency sweep
    1x256-c1, 1x256-c16                      decode only
    8192x256-c1, 8192x256-c8                 long prompts
    1024x128-qps1 -qps2 -qps4 -qps8 -qps16 (all -c64)   latency under a request rate
    1024x256-c128                            overload: twice the server's 64 sequences, rate inf

Requests per cell (default): rate-inf cells max(2*C, 8); QPS cells max(round(R * --qps-seconds), 8),
so each lasts about --qps-seconds (30 s); both times --num-prompts-scale, or --num-prompts N for every
cell. Repetition k of a cell uses prompts drawn with seed crc32(cell name) + k: the same prompts on
every server and every run, but no prompt repeats across cells or repetitions (a prefix cache cannot
turn a repetition into hits). --num-warmups requests (not measured) go before the first repetition.

--cells takes comma-separated names or shell patterns over the matrix ('1024x256-*', '*qps*'); a name
that matches nothing in the matrix but follows the grammar is run as an extra cell (e.g. 64x16-c2).

Writes to --out-dir: matrix.json (every repetition of every cell with vllm bench serve's key names,
completed/failed counts and the failure messages, plus the median of each metric over repetitions),
matrix.md (the summary table: medians; completed/failed summed over repetitions) and, when matplotlib
is importable (`pip install -e '.[bench]'`), PNG plots. --from-json FILE re-renders matrix.md and
the plots from a saved matrix.json.

    python tools/bench_matrix.py --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR --ignore-eos --out-dir D
"""
from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import math
import re
import sys
import zlib
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402

INF = float("inf")
PERCENTILES = (50, 90, 95, 99)
MATRIX = ([f"1024x256-c{c}" for c in (1, 4, 8, 16, 32, 64)] + ["1x256-c1", "1x256-c16", "8192x256-c1", "8192x256-c8"]
          + [f"1024x128-qps{q}-c64" for q in (1, 2, 4, 8, 16)] + ["1024x256-c128"])
_NAME = re.compile(r"(\d+)x(\d+)(?:-qps([0-9.]+))?-c(\d+)")


@dataclass
class Cell:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    rate: float = INF

    @classmethod
    def parse(cls, name: str) -> "Cell":
        m = _NAME.fullmatch(name)
        if not m:
            raise ValueError(f"bad cell name {name!r} (want INxOUT-cC or INxOUT-qpsR-cC)")
        return cls(name, int(m[1]), int(m[2]), int(m[4]), float(m[3]) if m[3] else INF)

    def default_num_prompts(self, qps_seconds: float) -> int:
        return max(8, round(self.rate * qps_seconds)) if self.rate != INF else max(2 * self.concurrency, 8)


def select_cells(spec: str | None) -> list[Cell]:
    if not spec:
        return [Cell.parse(n) for n in MATRIX]
    names: list[str] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        hits = [n for n in MATRIX if fnmatch.fnmatchcase(n, item)] or [Cell.parse(item).name]
        names += [n for n in hits if n not in names]
    return [Cell.parse(n) for n in names]


def median_metrics(reps: list[dict]) -> dict:
    """Median over repetitions of every numeric metric; completed and failed are summed."""
    out = {}
    for k in dict.fromkeys(k for r in reps for k in r):
        vals = [r[k] for r in reps if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals:
            out[k] = sum(vals) if k in ("completed", "failed") else float(np.median(vals))
    return out


# ---- running --------------------------------------------------------------------------------------
def run_cell(cell: Cell, a, tok, model: str) -> dict:
    n = a.num_prompts or max(1, math.ceil(cell.default_num_prompts(a.qps_seconds) * a.num_prompts_scale))
    extra = {"temperature": 0.0} | ({"ignore_eos": True} if a.ignore_eos else {})
    rec = asdict(cell) | {"rate": "inf" if cell.rate == INF else cell.rate, "num_prompts": n, "reps": []}
    for rep in range(a.repetitions):
        reqs = bs.random_dataset(tok, n, cell.input_len, cell.output_len, seed=zlib.crc32(cell.name.encode()) + rep)
        print(f"[{cell.name}] repetition {rep + 1}/{a.repetitions}: {n} requests", file=sys.stderr, flush=True)
        try:
            results, duration = asyncio.run(bs.run_benchmark(
                a.base_url, model, reqs, max_concurrency=cell.concurrency, request_rate=cell.rate, seed=rep,
                extra=extra, num_warmups=a.num_warmups if rep == 0 else 0, api_key=a.api_key))
            m = bs.calculate_metrics(results, duration, PERCENTILES, tok)
            m |= bs.result_fields(results, label=a.label, model=model, tokenizer_id=a.tokenizer, num_prompts=n,
                                  request_rate=cell.rate, burstiness=1.0, max_concurrency=cell.concurrency,
                                  input_len=cell.input_len, output_len=cell.output_len, ignore_eos=a.ignore_eos)
        except Exception as e:  # noqa: BLE001 - a failed warm-up or a dead server fails the cell, not the matrix
            m = {"completed": 0, "failed": n, "errors": [f"{type(e).__name__}: {e}"]}
        rec["reps"].append(m | {"repetition": rep})
        print(f"[{cell.name}] completed {m['completed']} failed {m['failed']}"
              + (f", {m['output_throughput']:.1f} output tok/s" if "output_throughput" in m else ""), file=sys.stderr)
    rec["median"] = median_metrics(rec["reps"])
    return rec


# ---- rendering ------------------------------------------------------------------------------------
COLUMNS = [("req/s", "request_throughput"), ("output tok/s", "output_throughput"), ("TTFT mean ms", "mean_ttft_ms"),
           ("TTFT p99 ms", "p99_ttft_ms"), ("TPOT mean ms", "mean_tpot_ms"), ("TPOT p99 ms", "p99_tpot_ms"),
           ("ITL p99 ms", "p99_itl_ms"), ("E2EL mean ms", "mean_e2el_ms")]


def markdown(doc: dict) -> str:
    meta = doc["meta"]
    lines = [f"# Serving matrix: {meta.get('label') or meta['model']} at {meta['base_url']}", "",
             f"{meta['date']}; model `{meta['model']}`; {meta['repetitions']} repetition(s): median of each metric, "
             f"completed/failed summed over repetitions; ignore_eos={meta['ignore_eos']}; "
             f"rules: vllm bench serve (`tools/bench_serving.py`).", "",
             "| cell | completed/failed | " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for c in doc["cells"]:
        med = c["median"]
        vals = [f"{med[k]:.2f}" if k in med else "-" for _, k in COLUMNS]
        lines.append(f"| {c['name']} | {med.get('completed', 0)}/{med.get('failed', 0)} | " + " | ".join(vals) + " |")
    errors = [(c["name"], e) for c in doc["cells"] for r in c["reps"] for e in r.get("errors", [])]
    if errors:
        lines += ["", "Failures (first 20):", ""] + [f"- {n}: {e}" for n, e in errors[:20]]
    return "\n".join(lines) + "\n"


def _series(doc: dict, qps: bool) -> dict[str, list[tuple[float, dict]]]:
    """Plot series: rate-inf cells by INxOUT over concurrency, or QPS cells by INxOUT-cC over rate."""
    out: dict[str, list] = {}
    for c in doc["cells"]:
        if (c["rate"] != "inf") == qps and c["median"].get("completed"):
            key = f"{c['input_len']}x{c['output_len']}" + (f" c{c['concurrency']}" if qps else "")
            out.setdefault(key, []).append((c["rate"] if qps else c["concurrency"], c["median"]))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def plot(doc: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    title = doc["meta"].get("label") or doc["meta"]["model"]
    written = []

    def figure(name, panels, series, xlabel, logx):
        if not series:
            return
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, (ylabel, keys) in zip(axes[0], panels):
            for label, pts in series.items():
                for key, style in keys:  # key is e.g. "p99_tpot_ms": its first word names the line
                    ax.plot([x for x, _ in pts], [m.get(key, np.nan) for _, m in pts], style, marker="o",
                            label=f"{label} {key.split('_')[0]}" if len(keys) > 1 else label)
            ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
            if logx:
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)

    conc, qps = _series(doc, False), _series(doc, True)
    figure("throughput_vs_concurrency.png", [("output tok/s", [("output_throughput", "-")])], conc, "concurrency", True)
    figure("tpot_vs_concurrency.png", [("TPOT ms", [("mean_tpot_ms", "-"), ("p99_tpot_ms", "--")])], conc,
           "concurrency", True)
    figure("latency_vs_qps.png", [("TTFT p99 ms", [("p99_ttft_ms", "-")]), ("ITL p99 ms", [("p99_itl_ms", "-")])],
           qps, "request rate (req/s)", True)
    return written


def render(doc: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "matrix.md").write_text(markdown(doc))
    for p in [out_dir / "matrix.md", *plot(doc, out_dir)]:
        print("wrote", p, file=sys.stderr)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model id to send (default: GET /v1/models data[0].id)")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: /v1/models root)")
    ap.add_argument("--cells", default=None, help="comma-separated names or patterns (default: the whole matrix)")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None, help="requests in every cell (overrides the defaults)")
    ap.add_argument("--num-prompts-scale", type=float, default=1.0, help="multiplies each cell's default count")
    ap.add_argument("--qps-seconds", type=float, default=30.0, help="QPS cells get rate x this many requests")
    ap.add_argument("--num-warmups", type=int, default=1)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--label", default=None, help="name of the server configuration, for titles")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out-dir", default=None, help="default: bench-matrix-DATE (or the --from-json file's folder)")
    ap.add_argument("--from-json", default=None, metavar="FILE", help="only re-render a saved matrix.json")
    a = ap.parse_args(argv)
    if a.from_json:
        doc = json.loads(Path(a.from_json).read_text())
        render(doc, Path(a.out_dir) if a.out_dir else Path(a.from_json).parent)
        return doc
    cells = select_cells(a.cells)
    info = bs.server_model(a.base_url, a.api_key)
    model = a.model or info["id"]
    if a.tokenizer is None:
        if not (Path(str(info.get("root"))) / "tokenizer.json").is_file():
            ap.error("--tokenizer is needed: the server's /v1/models root is not a local tokenizer directory")
        a.tokenizer = info["root"]
    tok = bs.load_tokenizer(a.tokenizer)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out_dir or f"bench-matrix-{date}")
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {"base_url": a.base_url, "model": model, "tokenizer": a.tokenizer, "label": a.label, "date": date,
                    "repetitions": a.repetitions, "ignore_eos": a.ignore_eos, "percentiles": list(PERCENTILES),
                    "server_model": info, "argv": sys.argv[1:] if argv is None else list(argv)}, "cells": []}
    for cell in cells:
        doc["cells"].append(run_cell(cell, a, tok, model))
        (out_dir / "matrix.json").write_text(json.dumps(doc, indent=1))  # after every cell: a crash keeps the rest
    render(doc, out_dir)
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
