"""tools/bench_spec.py: the projection formula by hand, the target gate, and the whole tool on the CPU with
the tiny model at tiny sizes (every section in the JSON, oracle acceptance as constructed, the renderer)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_spec as bsp  # noqa: E402


def test_tau_and_projection_by_hand():
    # MTP at K = 3: 1 + .96 + .96 * .8 + .96 * .8 * .64
    assert bsp.tau([0.96, 0.80, 0.64], 3) == pytest.approx(3.21952)
    assert bsp.tau([0.96, 0.80, 0.64], 1) == pytest.approx(1.96)
    # longer K holds the last value: K = 5 adds .49152 * .64 and then * .64 again
    assert bsp.tau([0.96, 0.80, 0.64], 5) == pytest.approx(3.21952 + 0.3145728 + 0.201326592)
    assert bsp.tau([1.0], 15) == 16.0 and bsp.tau([0.0], 4) == 1.0
    (row,) = bsp.projection([{"k": 3, "batch": 4, "verify_ms": 6.0, "plain_ms": 3.0}], {"MTP": [0.96, 0.80, 0.64]})
    assert row["projected_tpot_ms"] == pytest.approx(6.0 / 3.21952)
    assert row["speedup"] == pytest.approx(3.0 / (6.0 / 3.21952)) and row["tau"] == pytest.approx(3.21952)


def test_target_row():
    rows = [{"label": "oracle p=0.8", "k": 3, "concurrency": 4, "median_tpot_ms": 1.0, "mean_tpot_ms": 1.0},
            {"label": "oracle p=0.8", "k": 3, "concurrency": 1, "median_tpot_ms": 1.25, "mean_tpot_ms": 1.4},
            {"label": "oracle p=0.8", "k": 2, "concurrency": 1, "median_tpot_ms": 0.5, "mean_tpot_ms": 0.5}]
    t = bsp.target(rows)
    assert (t["median_tpot_ms"], t["pass"]) == (1.25, True)
    rows[1]["median_tpot_ms"] = 1.31
    assert bsp.target(rows)["pass"] is False
    assert bsp.target(rows[:1]) is None


def test_end_to_end_on_cpu(tiny_dir, tmp_path, capsys):
    """Every section on the NumPy backend: (a) one K at two batch sizes, (b) plain, accept-all and a 0.6
    oracle at K = 2, (c) the n-gram drafter, the MTP alone and with accept-all oracle drafts instead of its
    own, and a drafter the engine refuses; then --from-json."""
    out, md = tmp_path / "spec.json", tmp_path / "spec.md"
    ngram = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'
    mtp = '{"method": "mtp", "num_speculative_tokens": 2}'
    doc = bsp.main([str(tiny_dir), "--device", "cpu", "--max-model-len", "96", "--verify-ks", "2", "--batches", "1,2",
                    "--ctx", "8", "--steps", "1", "--input-len", "8", "--output-len", "16", "--concurrency", "1",
                    "--k", "2", "--oracle-p", "1,0.6", "--speculative-config", ngram, "--speculative-config", mtp,
                    "--drafter-oracle-p", "1",
                    "--speculative-config", '{"method": "nope", "num_speculative_tokens": 1}',
                    "--commit", "abc123", "--json", str(out), "--md", str(md)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(doc))
    assert set(saved) == {"meta", "verify_step", "e2e", "projection", "target"}
    (meta,) = saved["meta"]
    assert (meta["commit"], meta["device"]) == ("abc123", "numpy") and meta["date"]
    assert meta["command"].startswith("python3 tools/bench_spec.py ") and "--verify-ks 2" in meta["command"]

    # (a): plain and verify steps through the runner, at each batch size
    assert [(r["k"], r["batch"]) for r in saved["verify_step"]] == [(2, 1), (2, 2)]
    assert all(r["plain_ms"] > 0 and r["verify_ms"] > 0 and r["runner_graphs"] == [] for r in saved["verify_step"])

    # (b), (c): greedy tokens equal the plain run's (CPU), acceptance as the oracles are built
    by = {r["label"]: r for r in saved["e2e"]}
    mtp_oracle = f"{mtp}, accept-all drafts"  # the n-gram drafter has no weights: no such row
    assert set(by) == {"plain", "accept-all", "oracle p=0.6", ngram, mtp, mtp_oracle,
                       '{"method": "nope", "num_speculative_tokens": 1}'}
    assert "not supported" in by['{"method": "nope", "num_speculative_tokens": 1}']["error"]
    for label in ("plain", "accept-all", "oracle p=0.6", ngram, mtp, mtp_oracle):
        r = by[label]
        assert (r["requests"], r["failed"], r["concurrency"]) == (4, 0, 1)
        assert r["median_tpot_ms"] > 0 and r["median_itl_ms"] >= 0 and r["output_throughput"] > 0
        assert r["diverged"] == (None if label == "plain" else 0)
    assert by["plain"]["drafts"] == 0 and by["plain"]["acceptance"] is None
    allr = by["accept-all"]
    assert allr["acceptance"] == 1.0 and allr["per_position_acceptance"] == [1.0, 1.0] and allr["draft_tokens"] > 0
    p6 = by["oracle p=0.6"]
    reached, acc = p6["per_position_reached"], p6["per_position_acceptance"]
    assert len(reached) == 2 and reached[0] >= 20  # verifies
    for n, a in zip(reached, acc):  # each position's draws are independent Bernoulli(0.6): loose bounds
        assert abs(a - 0.6) < 0.3
    accepted = sum(n * a for n, a in zip(reached, acc))
    assert abs(accepted / sum(reached) - 0.6) < 0.15
    # the engine's counters agree with the per-position tally
    assert p6["accepted_tokens"] == round(accepted) and p6["draft_tokens"] >= sum(reached)
    assert by[ngram]["k"] == 2 and by[ngram]["drafts"] >= 0
    assert by[mtp_oracle]["acceptance"] == 1.0 and by[mtp_oracle]["per_position_acceptance"] == [1.0, 1.0]

    # (d) from (a)'s times, and the report
    proj = saved["projection"]
    assert {(r["vector"], r["k"], r["batch"]) for r in proj["rows"]} == {(v, 2, b) for v in ("MTP", "DFlash")
                                                                        for b in (1, 2)}
    assert saved["target"] is None  # no c1 / K = 3 cell measured
    text = md.read_text()
    assert "| accept-all | 2 | 1 |" in text and "## (d) projected TPOT" in text
    assert "| MTP 0.96/0.80/0.64 | 2 | 2.728 |" in text
    capsys.readouterr()
    md.unlink()
    bsp.main(["--from-json", str(out), "--md", str(md)])
    assert md.read_text() == text
