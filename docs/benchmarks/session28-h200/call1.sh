#!/bin/bash
# Session 28's first device call: the small mixed steps' CUDA graphs (decode_graph.py + mixed_layout.py) tested
# and timed against eager, then the GPU tests session 27's PDL change had not run. Run with carry [".wheels"]
# and LIMIT = the seconds the call may take.
LIMIT=${LIMIT:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU commit $(git rev-parse --short HEAD)"
python3 tools/build_kernels.py --dir /tmp/kc --jobs 14 > /dev/null || echo BUILD FAILED
(python3 -m server.cli make-model /tmp/m4b --preset 4b > /dev/null 2>&1) &
t() {  # name, pytest args...: the summary line, and the failures (tracebacks stay in $OUT/t-name.txt)
  local n=$1; shift
  local left=$((LIMIT - SECONDS - 5)); [ $left -gt 20 ] || { echo "$n: skipped (time)"; return; }
  timeout $left python3 -m pytest -q -m gpu "$@" --tb=short > $OUT/t-$n.txt 2>&1
  echo "$n: $(grep -E '[0-9]+ (passed|failed)' $OUT/t-$n.txt | tail -1) (t=$SECONDS)"
  grep -E "^(FAILED|ERROR)" $OUT/t-$n.txt | head -5
}
t graph tests/test_gpu_decode_graph.py
t pf tests/test_gpu_attention_prefill.py
wait
t chunked tests/test_engine.py -k chunked_prefill_matches
m() {  # label, mixed_step args...
  local n=$1; shift
  [ $SECONDS -lt $((LIMIT - 70)) ] || { echo "$n: skipped (time)"; return; }
  timeout 90 python3 tools/mixed_step.py /tmp/m4b --inject-len 8192 --json $OUT/ms-$n.json "$@" > $OUT/ms-$n.txt 2>&1
  grep -E "^(mixed|decode)" $OUT/ms-$n.txt | sed "s/^/$n /"; grep -E "Error|error" $OUT/ms-$n.txt | tail -2
}
m g256 --cap 256
m e256 --cap 256 --enforce-eager
m g512 --cap 512
m e512 --cap 512 --enforce-eager
[ $SECONDS -lt $((LIMIT - 120)) ] && timeout 110 python3 tools/bench_mixed.py --launch /tmp/m4b --label cap256-graph \
  --inject-lens 4096,8192,16384 --qps 0.5,1 --duration 6 --baseline-s 2 --cooldown 1 --out-dir $OUT \
  --server-args "--max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-budget-with-decodes 256" \
  2>&1 | grep -E "^\||gate:|FAIL|PASS" | tail -12
t spec tests/test_spec_decode.py tests/test_spec_mtp.py tests/test_spec_dflash.py
t prefix tests/test_prefix_engine.py tests/test_prefix_server.py
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
