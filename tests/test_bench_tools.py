"""tools/bench_matrix.py and tools/bench_mixed.py: their metric code on synthetic timelines, and both
tools end to end against a real local server on the tiny model (scaled-down cells)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_matrix as bm  # noqa: E402
import bench_mixed as bx  # noqa: E402
import bench_serving as bs  # noqa: E402
from server_util import ServerProcess  # noqa: E402


# ---- bench_matrix units ---------------------------------------------------------------------------
def test_matrix_cells_and_their_default_sizes():
    cells = {c.name: c for c in bm.select_cells(None)}
    assert len(cells) == 16
    assert cells["1024x128-qps4-c64"] == bm.Cell("1024x128-qps4-c64", 1024, 128, 64, 4.0)
    assert cells["1024x256-c128"].rate == float("inf") and cells["1x256-c16"].input_len == 1
    assert cells["1024x256-c64"].default_num_prompts(30) == 128 and cells["1x256-c1"].default_num_prompts(30) == 8
    assert cells["1024x128-qps16-c64"].default_num_prompts(30) == 480
    assert cells["1024x128-qps1-c64"].default_num_prompts(5) == 8
    assert [c.name for c in bm.select_cells("8192x256-*, *qps1-*,1024x256-c1")] == \
        ["8192x256-c1", "8192x256-c8", "1024x128-qps1-c64", "1024x256-c1"]
    assert bm.select_cells("64x16-qps0.5-c2") == [bm.Cell("64x16-qps0.5-c2", 64, 16, 2, 0.5)]  # an extra cell
    with pytest.raises(ValueError):
        bm.select_cells("1024x256")


def test_median_over_repetitions_sums_counts():
    reps = [{"completed": 8, "failed": 0, "p99_ttft_ms": 10.0, "label": "x", "request_goodput": None},
            {"completed": 7, "failed": 1, "p99_ttft_ms": 30.0},
            {"completed": 0, "failed": 8, "errors": ["HTTP 503"]},  # a repetition that died: no metrics
            {"completed": 8, "failed": 0, "p99_ttft_ms": 20.0}]
    med = bm.median_metrics(reps)
    assert med == {"completed": 23, "failed": 9, "p99_ttft_ms": 20.0}


def _doc():
    m = {"completed": 4, "failed": 0, "request_throughput": 2.0, "output_throughput": 64.0, "mean_ttft_ms": 5.0,
         "p99_ttft_ms": 9.0, "mean_tpot_ms": 3.0, "p99_tpot_ms": 4.0, "p99_itl_ms": 6.0, "mean_e2el_ms": 99.0}
    cells = [{"name": n, "input_len": 32, "output_len": 8, "concurrency": c, "rate": r, "num_prompts": 4,
              "reps": [m | {"errors": []}], "median": dict(m)} for n, c, r in
             [("32x8-c1", 1, "inf"), ("32x8-c2", 2, "inf"), ("32x8-qps2-c4", 4, 2.0), ("32x8-qps4-c4", 4, 4.0)]]
    cells[1]["reps"][0]["errors"] = ["HTTP 500: boom"]
    return {"meta": {"base_url": "http://x", "model": "tiny", "label": None, "date": "d", "repetitions": 1,
                     "ignore_eos": True}, "cells": cells}


def test_matrix_markdown_and_plots(tmp_path):
    md = bm.markdown(_doc())
    assert "| 32x8-c2 | 4/0 | 2.00 | 64.00 | 5.00 | 9.00 | 3.00 | 4.00 | 6.00 | 99.00 |" in md
    assert "- 32x8-c2: HTTP 500: boom" in md
    assert list(bm._series(_doc(), True)) == ["32x8 c4"] and [x for x, _ in bm._series(_doc(), False)["32x8"]] == [1, 2]
    written = bm.plot(_doc(), tmp_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert written == []
    else:
        assert {p.name for p in written} == {"throughput_vs_concurrency.png", "tpot_vs_concurrency.png",
                                             "latency_vs_qps.png"}


# ---- bench_mixed units ------------------------------------------------------------------------------
def _stream(start, ttft, itl):
    return bs.RequestResult(success=True, start_time=start, ttft=ttft, itl=list(itl), latency=ttft + sum(itl))


def test_window_gaps_take_gaps_ending_inside_the_window():
    a = _stream(0.0, 1.0, [0.1, 0.1, 0.5, 0.1])     # tokens at 1.0 1.1 1.2 1.7 1.8
    b = _stream(0.5, 0.6, [0.3, 0.3])               # tokens at 1.1 1.4 1.7
    c = bs.RequestResult(start_time=0.0)            # never got a token
    gaps = bx.window_gaps([a, b, c], 1.15, 1.75)
    assert sorted(gaps) == pytest.approx([0.1, 0.3, 0.3, 0.5])


def _step(kind, decode_rows, prefill_tokens, step_ms=10.0, t=0.0):
    return {"kind": kind, "decode_rows": decode_rows, "prefill_tokens": prefill_tokens, "step_ms": step_ms,
            "gpu_ms": step_ms - 1.0, "t": t}


def test_validity_needs_a_prefill_beside_the_full_background():
    steps = [_step("decode", 4, 0, 8.0), _step("mixed", 3, 512, 50.0), _step("prefill", 0, 900, 60.0),
             _step("decode", 4, 0, 9.0)]
    s = bx.trace_summary(steps, 4)
    assert not s["valid"] and s["max_decode_rows"] == 4 and s["median_full_decode_step_ms"] == 8.5
    s = bx.trace_summary(steps + [_step("mixed", 4, 1024, 90.0)], 4)
    assert s["valid"] and s["valid_steps"] == 1 and s["max_valid_step_gpu_ms"] == 89.0
    assert not bx.trace_summary([], 4)["valid"]


def test_engine_max_period_spans_full_decode_steps_only():
    steps = [_step("decode", 4, 0, t=1.000), _step("mixed", 4, 256, t=1.004), _step("decode", 4, 0, t=1.013),
             _step("prefill", 0, 900, t=1.020), _step("decode", 4, 0, t=1.090)]  # (the prefill's 70 ms: no full pair)
    assert bx.trace_summary(steps, 4)["max_full_decode_period_ms"] == pytest.approx(9.0)
    assert bx.trace_summary(steps[3:], 4)["max_full_decode_period_ms"] is None


def test_saturation_reasons():
    assert bx.saturation(10, 10, [0.3] * 10, 0.5, 20.0, 0.014, 0.013) == []
    why = bx.saturation(10, 9, [0.3] * 9, 0.5, 20.0, 0.014, 0.013)
    assert why == ["9/10 injected requests completed"]
    assert "longer than the 20 s window" in bx.saturation(4, 4, [0.3, 25.0, 0.3, 0.3], 0.1, 20.0, 0.014, 0.013)[0]
    assert bx.saturation(10, 10, [1.2] * 10, 1.0, 20.0, 0.014, 0.013) == ["qps x mean injected TTFT = 1.20 >= 1"]
    assert "mixed ITL p50" in bx.saturation(10, 10, [0.3] * 10, 0.5, 20.0, 0.030, 0.013)[0]


# ---- end to end on the tiny model ---------------------------------------------------------------------
def test_matrix_end_to_end(tiny_dir, tmp_path):
    with ServerProcess(tiny_dir) as srv:
        doc = bm.main(["--base-url", srv.url, "--cells", "32x8-c1,32x8-c2", "--num-prompts", "3", "--repetitions",
                       "1", "--num-warmups", "0", "--ignore-eos", "--label", "tiny-cpu", "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "matrix.json").read_text())
    assert saved == json.loads(json.dumps(doc)) and saved["meta"]["tokenizer"] == str(tiny_dir)
    assert [c["name"] for c in saved["cells"]] == ["32x8-c1", "32x8-c2"]
    for c in saved["cells"]:
        (rep,) = c["reps"]
        assert (rep["completed"], rep["failed"], rep["errors"]) == (3, 0, [])
        assert rep["output_lens"] == [8, 8, 8] and rep["input_lens"] == [32, 32, 32]
        assert rep["max_concurrency"] == c["concurrency"] and rep["p99_itl_ms"] > 0
        assert c["median"]["completed"] == 3 and c["median"]["mean_tpot_ms"] == rep["mean_tpot_ms"]
    md = (tmp_path / "matrix.md").read_text()
    assert "tiny-cpu" in md and "| 32x8-c1 | 3/0 |" in md and "| 32x8-c2 | 3/0 |" in md
    (tmp_path / "matrix.md").unlink()
    bm.main(["--from-json", str(tmp_path / "matrix.json")])
    assert (tmp_path / "matrix.md").read_text() == md


MIXED = ["--background", "2", "--bg-input-len", "16", "--bg-output-len", "64", "--inject-lens", "128",
         "--qps", "2", "--duration", "1.5", "--baseline-s", "0.3", "--warmups", "0", "--cooldown", "0"]


@pytest.mark.parametrize("seqs,valid", [(4, True), (2, False)], ids=["max-seqs-4", "negative-control-max-seqs-2"])
def test_mixed_gate_validity(tiny_dir, tmp_path, seqs, valid):
    """With room beside the 2 background streams an injected prefill meets the full decode batch;
    with --max-num-seqs 2 it can only run after a background stream ended: invalid."""
    label = f"seqs{seqs}"
    (cell,) = bx.main(["--launch", str(tiny_dir), "--server-args", f"--device cpu --max-num-seqs {seqs}",
                       "--label", label, "--out-dir", str(tmp_path), *MIXED])
    assert cell["valid"] is valid and cell["trace"]["steps"] > 0
    assert (cell["injected"], cell["completed"], cell["failed"]) == (3, 3, 0)
    assert cell["itl_samples"] > 0 and cell["itl_p50_ms"] <= cell["itl_p99_ms"] <= cell["itl_max_ms"]
    assert cell["injected_metrics"]["mean_ttft_ms"] > 0 and cell["bg_failed"] == 0
    if valid:
        assert cell["trace"]["valid_steps"] >= 1
    else:
        assert cell["trace"]["max_decode_rows"] <= 2 and cell["trace"]["valid_steps"] == 0
        assert cell["gate"] == "FAIL" and "invalid" in cell["gate_why"][0]  # the negative control never passes
    saved = json.loads((tmp_path / f"mixed-{label}.json").read_text())
    assert saved["cells"][0]["valid"] is valid
    row = (tmp_path / f"mixed-{label}.md").read_text().splitlines()[2]
    assert row.startswith(f"| {label} | 2 | 128 | {'yes' if valid else 'no'} |") and row.endswith("| 3/0 |")


# ---- bench_engine + trace_report ------------------------------------------------------------------
def test_bench_engine_trace_and_report(tiny_dir, tmp_path):
    """The in-process benchmark on the CPU, its kept trace, and the report of where its time went."""
    import bench_engine as be
    import trace_report as tr
    trace = tmp_path / "steps.jsonl"
    rows = be.main([str(tiny_dir), "--device", "cpu", "--input-len", "24", "--output-len", "6",
                    "--concurrency", "1,3", "--max-num-batched-tokens", "32", "--trace-steps", str(trace)])
    assert [r["concurrency"] for r in rows] == [1, 3] and all(0 < r["gpu_busy_frac"] <= 1.0 for r in rows)
    lvl = rows[1]
    s = tr.summary(tr.load(trace, tuple(lvl["window"])))
    assert s["decode"] + s["mixed"] + s["prefill"] == s["steps"] > 0 and s["full_batch_rows"] == 3
    assert s["full_batch_steps"] >= 1 and s["full_median_step_ms"] >= s["full_median_launch_ms"]
    whole = tr.summary(tr.load(trace))
    assert whole["steps"] > s["steps"]
    md = tr.markdown(["a", "b"], [s, whole])
    assert "| full-batch median step ms |" in md and md.count("\n") == 17


def test_bench_prefix_smoke(tiny_dir, tmp_path, capsys):
    """tools/bench_prefix.py's A/B on the CPU (--quick, workload d): rows for both modes, hits only with
    caching on, the table and the JSON."""
    import bench_prefix as bp
    out = tmp_path / "prefix.json"
    rows = bp.main([str(tiny_dir), "--device", "cpu", "--quick", "--only", "d", "--max-num-seqs", "8",
                    "--max-model-len", "1024", "--json", str(out)])
    off, on = ([r for r in rows if r["mode"] == m] for m in ("off", "on"))
    assert len(off) == len(on) == 1 and off[0]["cached_tokens"] == 0 < on[0]["cached_tokens"]
    assert "(d) 70-130 tokens, shared 64, c8" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == rows


def test_trace_report_on_a_synthetic_trace():
    import trace_report as tr
    base = dict(schedule_ms=0.1, launch_ms=0.3, sample_ms=0.1, wait_ms=2.0, deliver_ms=0.2, idle_ms=0.0)
    steps = [dict(base, t=0.0, kind="prefill", decode_rows=0, prefill_tokens=100, gpu_ms=20.0, step_ms=21.0),
             dict(base, t=0.021, kind="decode", decode_rows=2, prefill_tokens=0, gpu_ms=3.0, step_ms=3.5),
             dict(base, t=0.0245, kind="decode", decode_rows=2, prefill_tokens=0, gpu_ms=3.0, step_ms=3.0),
             dict(base, t=0.0275, kind="decode", decode_rows=1, prefill_tokens=0, gpu_ms=2.5, step_ms=2.5)]
    s = tr.summary(steps)
    assert (s["decode"], s["prefill"], s["full_batch_rows"], s["full_batch_steps"]) == (3, 1, 2, 2)
    assert s["wall_s"] == pytest.approx(0.03) and s["gpu_busy_frac"] == pytest.approx(28.5e-3 / 0.03)
    assert s["full_median_step_ms"] == pytest.approx(3.25) and s["full_median_host_ms"] == pytest.approx(0.7)
    assert s["full_median_host_over_device_ms"] == pytest.approx(0.25) and s["prefill_step_s"] == pytest.approx(0.021)


def test_gate_bounds_p99_and_max_by_the_steady_step_and_needs_validity():
    assert bx.gate(True, 14.0, 23.0, 5.0) == (True, [])
    ok, why = bx.gate(True, 16.0, 23.0, 5.0)
    assert not ok and why == ["ITL p99 16.0 ms > 3 x steady 5.00 ms"]
    ok, why = bx.gate(True, 12.0, 30.0, 5.0)
    assert not ok and why == ["ITL max 30.0 ms > 5 x steady 5.00 ms"]
    assert bx.gate(True, 16.0, 30.0, 5.0, p99_factor=4, max_factor=6) == (True, [])
    # an invalid cell (the negative control) or one without a trace can never pass, however good its ITL
    assert bx.gate(False, 5.0, 5.0, 5.0)[0] is False and "invalid" in bx.gate(False, 5.0, 5.0, 5.0)[1][0]
    assert bx.gate(None, 5.0, 5.0, 5.0)[0] is False
    assert bx.gate(True, None, None, 5.0)[0] is False


@pytest.mark.parametrize("threaded", [False, True])
def test_host_breakdown_smoke(tiny_dir, capsys, threaded):
    """tools/host_breakdown.py on the tiny model, stepped by hand and by the engine's loop thread: both
    tables, the verify path's parts among the rows, the critical path of the speculative run's steps."""
    import host_breakdown as hb
    from engine.arrays import HostCopy
    from engine.engine import Engine
    before = (Engine.step, Engine._must_wait, HostCopy.result)
    hb.main([str(tiny_dir), "--device", "cpu", "--input-len", "40", "--output-len", "12", "--requests", "1"]
            + ["--threaded"] * threaded)
    out = capsys.readouterr().out
    assert "-- plain:" in out and "-- oracle p=0.8, K=3:" in out
    assert "Engine._on_verified" in out and "verify.finish" in out and "ModelRunner.forward" in out
    plain, spec = out.split("-- oracle")
    assert "critical path" not in plain and "critical path of" in spec  # plain steps run one ahead
    assert (Engine.step, Engine._must_wait, HostCopy.result) == before  # the methods are put back


def test_host_breakdown_with_the_mtp_drafting(tiny_dir, capsys):
    """--speculative-config with the MTP: its observe and propose are timed beside the oracle's drafts."""
    import host_breakdown as hb
    from engine.mtp import MtpDrafter
    before = (MtpDrafter.observe, MtpDrafter.propose)
    hb.main([str(tiny_dir), "--device", "cpu", "--input-len", "40", "--output-len", "12", "--requests", "1",
             "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
    out = capsys.readouterr().out
    assert "-- oracle p=0.8, K=2, MtpDrafter drafting:" in out
    assert "MtpDrafter.observe" in out and "MtpDrafter.propose" in out and "critical path of" in out
    assert (MtpDrafter.observe, MtpDrafter.propose) == before


def test_mixed_step_chunks_the_injected_prompt_at_the_cap(tiny_dir, tmp_path):
    """tools/mixed_step.py on the tiny model: the injected 300-token prompt runs as ceil(300 / 64) = 5 mixed
    steps beside the decoding streams (the cap), the decode baseline is traced after it, and the JSON holds
    what was printed with the run's meta."""
    import mixed_step as ms
    out = tmp_path / "ms.json"
    res = ms.main([str(tiny_dir), "--device", "cpu", "--cap", "64", "--inject-len", "300", "--background", "2",
                   "--bg-input-len", "24", "--json", str(out)])
    assert res["mixed"]["steps"] == 5 and res["prefill"]["steps"] == 0 and res["decode"]["steps"] == 20
    assert res["mixed"]["launch_ms"] > 0 and res["mixed"]["step_ms"] > 0 and res["decode"]["step_ms"] > 0
    saved = json.loads(out.read_text())
    assert saved["mixed"] == res["mixed"] and saved["meta"][0]["args"]["cap"] == 64
