#!/bin/bash
# Session 29: where the serving cells of issue 15 stand today (not the retained matrix: 2 repetitions, bench_matrix's
# default request counts), the bare decode steps and the prefill times. carry [".wheels"], LIMIT = seconds.
. tools/device_call.sh
python3 -m server.cli serve /tmp/m4b --port 8011 --max-num-seqs 64 --max-model-len 8464 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 150); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 1; done
echo "server up t=$SECONDS"
timeout $((LIMIT - SECONDS - 100)) python3 tools/bench_matrix.py --base-url http://127.0.0.1:8011 --tokenizer /tmp/m4b \
  --ignore-eos --cells 1024x256-c1,1024x256-c4,1024x256-c16,1024x256-c64,8192x256-c1 --repetitions 2 --num-warmups 2 \
  --out-dir $OUT/matrix --label "qwen35 4b-random s29" 2>&1 | grep -E "^\|" | head -12
kill $SP; wait $SP 2>/dev/null
echo "matrix done t=$SECONDS"
[ $SECONDS -lt $((LIMIT - 60)) ] && timeout $((LIMIT - SECONDS - 30)) python3 tools/bench_decode.py --batches 1,16,64 --ctx 1024 \
  --max-model-len 8464 --json $OUT/decode.json 2>&1 | tail -5
[ $SECONDS -lt $((LIMIT - 40)) ] && timeout $((LIMIT - SECONDS - 5)) python3 -c "import sys, json, os; sys.path.insert(0, 'tools'); import bench_kernels as bk; r = bk.prefill_times([1024, 8192], reps=3); print(r); json.dump(r, open(os.environ['OUT'] + '/prefill.json', 'w'), default=str)" 2>&1 | tail -3
(cd $OUT && tar -czf texts.tgz server.log 2>/dev/null && rm -f server.log)
echo t=$SECONDS
