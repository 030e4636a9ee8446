#!/bin/bash
# Session 28's second device call: the mixed-load gate with the small mixed steps' graphs, bench_mixed's client
# made before its windows (it had made one inside the injection window: a ~40 ms stall of its own loop), at a
# 256- and a 128-token cap. carry [".wheels"], LIMIT = the seconds the call may take.
LIMIT=${LIMIT:-200}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
(python3 -m server.cli make-model /tmp/m4b --preset 4b > /dev/null 2>&1) &
python3 tools/build_kernels.py --dir /tmp/kc --jobs 14 > /dev/null || echo BUILD FAILED
wait
for cap in 256 128; do
  [ $SECONDS -lt $((LIMIT - 60)) ] || { echo "cap $cap: skipped (time)"; continue; }
  timeout $((LIMIT - SECONDS - 5)) python3 tools/bench_mixed.py --launch /tmp/m4b --label cap$cap-graph \
    --inject-lens 4096,16384 --qps 1 --duration 6 --baseline-s 2 --cooldown 1 --out-dir $OUT \
    --server-args "--max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-budget-with-decodes $cap" \
    2>&1 | grep -E "^\| cap|gate:|FAIL" | tail -6
done
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
