#!/bin/bash
# The next session's first device call (written in session 28, not run). Copy the GPU wheels to .wheels/ and run
# with carry [".wheels"] and LIMIT = the seconds the call may take. Order: the mixed-load gate with bench_mixed's
# client fix at 256- and 128-token caps (call2.sh), issue 19's c1 cell if an H200 came, then the GPU tests that
# neither session 27's PDL launches nor session 28's mixed graphs have run (a second call finishes what is cut).
LIMIT=${LIMIT:-560}
L=$LIMIT; LIMIT=$((L / 2)) bash docs/benchmarks/session28-h200/call2.sh
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*)
  for rep in 1 2 3; do
    [ $SECONDS -lt $((L - 40)) ] || break
    timeout 40 python3 tools/bench_spec.py /tmp/m4b --sections b --concurrency 1 --oracle-p 1,0.8 --k 3 \
      --json $OUT/c1-h200-$rep.json 2>&1 | grep "^(b/c)\|Target"
  done;;
esac
t() {  # name, pytest args...: the summary line, and the failures (tracebacks stay in $OUT/t-name.txt)
  local n=$1; shift
  local left=$((L - SECONDS - 5)); [ $left -gt 20 ] || { echo "$n: skipped (time)"; return; }
  timeout $left python3 -m pytest -q -m gpu "$@" --tb=short > $OUT/t-$n.txt 2>&1
  echo "$n: $(grep -E '[0-9]+ (passed|failed)' $OUT/t-$n.txt | tail -1) (t=$SECONDS)"
  grep -E "^(FAILED|ERROR)" $OUT/t-$n.txt | head -5
}
t hf tests/test_gpu_hf_gate.py
t prefix tests/test_prefix_engine.py tests/test_prefix_server.py
t spec tests/test_spec_decode.py tests/test_spec_mtp.py tests/test_spec_dflash.py
t rest tests/ --ignore tests/test_gpu_kernels.py --ignore tests/test_gpu_decode_graph.py --ignore tests/test_gpu_attention_prefill.py \
  --ignore tests/test_spec_decode.py --ignore tests/test_spec_mtp.py --ignore tests/test_spec_dflash.py \
  --ignore tests/test_prefix_engine.py --ignore tests/test_prefix_server.py --ignore tests/test_gpu_hf_gate.py
(cd $OUT && tar -czf texts2.tgz $(ls | grep -v "\.json$" | grep -v "\.tgz$") 2>/dev/null && find . -type f ! -name "*.json" ! -name "*.tgz" -delete)
echo t=$SECONDS
