"""The benchmark client's numbers follow vllm bench serve's definitions exactly."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_serving as bs  # noqa: E402


def _req(start, ttft, itl, out_tokens, prompt_len=10):
    return bs.RequestResult(success=True, prompt_len=prompt_len, output_tokens=out_tokens, ttft=ttft, itl=list(itl),
                            latency=ttft + sum(itl), start_time=start)


def test_metrics_on_a_hand_computed_timeline():
    a = _req(0.0, 0.100, [0.010, 0.020, 0.030], 4)     # E2EL 0.160, TPOT (0.160-0.100)/3 = 0.020
    b = _req(0.5, 0.300, [0.050], 2)                   # E2EL 0.350, TPOT 0.050
    c = _req(1.0, 0.200, [], 1)                        # one token: no TPOT sample
    failed = bs.RequestResult(success=False, error="HTTP 503")
    m = bs.calculate_metrics([a, b, c, failed], duration=2.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(18.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 300, 200]))
    assert m["mean_tpot_ms"] == pytest.approx(35.0)
    assert m["mean_itl_ms"] == pytest.approx(27.5)          # pooled over chunks: 10, 20, 30, 50
    assert m["median_itl_ms"] == pytest.approx(25.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([10, 20, 30, 50], 99))
    assert m["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    assert m["max_concurrent_requests"] == 1.0                 # [0,.16) [.5,.85) [1,1.2) never overlap
    assert m["max_output_tokens_per_s"] == 6.0                 # second 0: a at .10 .11 .13 .16, b at .80 .85


def test_peak_concurrency_counts_overlaps():
    rs = [_req(0.0, 0.5, [0.5], 2), _req(0.2, 0.5, [0.5], 2), _req(0.9, 0.05, [], 1)]
    assert bs.calculate_metrics(rs, 1.0)["max_concurrent_requests"] == 3.0


def test_empty_metrics_are_zero():
    m = bs.calculate_metrics([bs.RequestResult(success=False)], 1.0, [99])
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["completed"] == 0


def test_arrivals_rescaled_to_n_over_rate():
    d = bs.arrival_delays(50, 4.0, seed=3)
    assert d[-1] == pytest.approx(50 / 4.0) and np.all(np.diff(d) >= 0)
    assert not bs.arrival_delays(5, float("inf")).any()


def test_random_dataset_lengths_are_exact(tiny_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    reqs = bs.random_dataset(tok, 8, 300, 17, seed=0)
    assert [r.prompt_len for r in reqs] == [300] * 8 and [r.output_len for r in reqs] == [17] * 8
    assert all(len(tok.encode(r.prompt, add_special_tokens=False).ids) == 300 for r in reqs)


def test_printed_block_has_vllm_layout():
    m = bs.calculate_metrics([_req(0.0, 0.1, [0.01], 2)], 1.0, [99])
    text = bs.format_result(m, 4, float("inf"), [99])
    assert text.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "Maximum request concurrency:             4" in text
    assert "P99 ITL (ms):" in text and text.splitlines()[-1] == "=" * 50
