"""Where the time of a serving run goes, from the engine's step trace (`--trace-steps FILE`: one JSON
line per step, written by engine.py when the step's tokens are collected).

Per trace (optionally only the steps launched in a window of time.perf_counter() seconds, the clock
the engine stamps `t` with; on Linux it is the system-wide monotonic clock, so a client in another
process can take the window): steps by kind; the wall span and the device's busy fraction (forward +
sampling, device-timed); and per full-batch decode step (every running sequence decoding, the steps
TPOT is made of), the medians of the step period and of its parts: device time, host scheduling,
metadata and launch, sampling launch, waiting for the device, delivering the tokens (detokenize,
stop checks, events). Since the engine launches step n+1 before it delivers step n, host time only
lengthens a step when it exceeds the device time; `host over device` is that excess.

    python tools/trace_report.py direct.jsonl http.jsonl --labels direct,http [--window T0,T1 ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PHASES = ("gpu_ms", "schedule_ms", "launch_ms", "sample_ms", "wait_ms", "deliver_ms")


def load(path, window: tuple[float, float] | None = None) -> list[dict]:
    steps = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if window is not None:
        steps = [s for s in steps if window[0] <= s["t"] <= window[1]]
    return steps


def summary(steps: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    kinds = {k: sum(1 for s in steps if s["kind"] == k) for k in ("decode", "mixed", "prefill")}
    wall = steps[-1]["t"] + steps[-1]["step_ms"] / 1e3 - steps[0]["t"]
    full_rows = max(s["decode_rows"] for s in steps)
    full = [s for s in steps if s["kind"] == "decode" and s["decode_rows"] == full_rows]
    med = {k: float(np.median([s[k] for s in full])) for k in ("step_ms",) + PHASES} if full else {}
    host = [s["schedule_ms"] + s["launch_ms"] + s["sample_ms"] + s["deliver_ms"] for s in full]
    return {
        "steps": len(steps), **kinds, "wall_s": wall,
        "gpu_busy_frac": sum(s["gpu_ms"] for s in steps) / 1e3 / wall if wall > 0 else None,
        "prefill_step_s": sum(s["step_ms"] for s in steps if s["kind"] != "decode") / 1e3,
        "idle_s": sum(s["idle_ms"] for s in steps[1:]) / 1e3,  # the first step's idle precedes the window
        "full_batch_rows": full_rows, "full_batch_steps": len(full),
        **{f"full_median_{k}": v for k, v in med.items()},
        "full_median_host_ms": float(np.median(host)) if host else None,
        "full_median_host_over_device_ms": float(np.median([max(0.0, s["step_ms"] - s["gpu_ms"]) for s in full]))
        if full else None,
    }


def markdown(labels: list[str], sums: list[dict]) -> str:
    rows = [("steps (decode / mixed / prefill)", lambda s: f"{s['steps']} ({s['decode']} / {s['mixed']} / {s['prefill']})"),
            ("wall s", lambda s: f"{s['wall_s']:.2f}"),
            ("device busy", lambda s: f"{s['gpu_busy_frac']:.1%}"),
            ("time in steps with prefill, s", lambda s: f"{s['prefill_step_s']:.2f}"),
            ("engine idle between steps (nothing in flight), s", lambda s: f"{s['idle_s']:.2f}"),
            ("full-batch decode steps (rows)", lambda s: f"{s['full_batch_steps']} ({s['full_batch_rows']})")]
    rows += [(f"full-batch median {k[:-3]} ms", lambda s, k=k: f"{s.get('full_median_' + k, float('nan')):.3f}")
             for k in ("step_ms",) + PHASES]
    rows += [("full-batch median host ms (all but wait)", lambda s: f"{s['full_median_host_ms'] or 0:.3f}"),
             ("full-batch median step over device ms", lambda s: f"{s['full_median_host_over_device_ms'] or 0:.3f}")]
    out = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, f in rows:
        out.append(f"| {name} | " + " | ".join(f(s) if s.get("steps") else "-" for s in sums) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--labels", default=None, help="comma-separated, one per trace")
    ap.add_argument("--window", action="append", default=None, metavar="T0,T1",
                    help="perf_counter window per trace (give it once per trace, in order)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else [Path(t).stem for t in a.traces]
    windows = [tuple(float(x) for x in w.split(",")) for w in a.window] if a.window else [None] * len(a.traces)
    if len(labels) != len(a.traces) or len(windows) != len(a.traces):
        raise SystemExit("give one label and (if any) one --window per trace")
    sums = [summary(load(t, w)) for t, w in zip(a.traces, windows)]
    print(markdown(labels, sums))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(zip(labels, sums)), indent=1))
    return sums


if __name__ == "__main__":
    main()
