#!/bin/bash
# A next device call (session 30's, not run there or in session 31), for an H200 only. carry [".wheels"], LIMIT =
# the seconds the call may take: issue 19's c1 cell (3 repetitions), the mixed-load gate's six cells at cap 256
# with the split prefill attention (session 28's table is an H200's), then bench_gdn_state on the H200.
. tools/device_call.sh
c1_cell
case "$GPU" in *H200*)
  [ $SECONDS -lt $((LIMIT - 200)) ] && timeout 190 python3 tools/bench_mixed.py --launch /tmp/m4b --label cap256-split-h200 \
    --inject-lens 4096,8192,16384 --qps 0.5,1 --duration 6 --baseline-s 2 --cooldown 1 --out-dir $OUT \
    --server-args "--max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-budget-with-decodes 256" \
    2>&1 | grep -E "^\| cap|gate:|FAIL" | tail -8;;
esac
[ $SECONDS -lt $((LIMIT - 60)) ] && timeout 50 python3 tools/bench_gdn_state.py --json $OUT/gdn-state-h200.json 2>&1 | tail -19  # session 31 rule on an H200
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") 2>/dev/null && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
