"""The step trace (`--trace-steps FILE`): one JSON line per engine step, for tools/trace_report.py.

A line holds the step's kind and sizes, its host phases (schedule, launch, sample, waiting for the
device, delivering), its device time (gpu_ms, from backend marks around the forward and the
sampling) and step_ms, the period from its launch to the next one's. The device runs one step
ahead of the host, so a long step's wall time shows in the period of the step after it; gpu_ms is
its own. A step's line is written when the next step begins (its tokens are collected then).
"""
from __future__ import annotations

import json


class StepTrace:
    def __init__(self, path: str, ops):
        self.file = open(path, "a", buffering=1)
        self.ops = ops

    @staticmethod
    def begin(batch, t0: float, t1: float, idle_ms: float) -> dict:
        """A step's line so far, from its batch before advance() moves num_computed."""
        decode_rows = sum(1 for req, _ in batch if req.num_computed >= len(req.prompt_ids))
        prefill_tokens = sum(n for req, n in batch if req.num_computed < len(req.prompt_ids))
        kind = "decode" if not prefill_tokens else ("prefill" if not decode_rows else "mixed")
        return {"t": t0, "kind": kind, "batch": len(batch), "decode_rows": decode_rows,
                "prefill_tokens": prefill_tokens, "schedule_ms": (t1 - t0) * 1e3, "idle_ms": idle_ms}

    def write(self, info: dict, forward_marks: tuple, wait_ms: float, deliver_ms: float, sample_marks: tuple,
              next_start: float) -> None:
        ops = self.ops
        gpu = (ops.elapsed_ms(*forward_marks) if forward_marks else 0.0) + (
            ops.elapsed_ms(*sample_marks) if sample_marks else 0.0)
        info.update(wait_ms=wait_ms, deliver_ms=deliver_ms, gpu_ms=gpu, step_ms=(next_start - info["t"]) * 1e3)
        self.file.write(json.dumps(info) + "\n")
