#!/bin/bash
# A next device call (written in session 31, not run), for an H200: issue 15's retained matrix at today's tree
# (every cell, 3 repetitions, serving-4b-h200.md's half-size cells), then the bare decode steps and the prefill
# times if time is left. carry [".wheels"], LIMIT = the seconds the call may take (560).
. tools/device_call.sh
case "$GPU" in *H200*) ;; *) echo "not an H200: the retained matrix is an H200's"; exit 0;; esac
python3 -m server.cli serve /tmp/m4b --port 8011 --max-num-seqs 64 --max-model-len 8464 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 150); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 1; done
echo "server up t=$SECONDS"
timeout $((LIMIT - SECONDS - 90)) python3 tools/bench_matrix.py --base-url http://127.0.0.1:8011 --tokenizer /tmp/m4b \
  --ignore-eos --num-prompts-scale 0.5 --qps-seconds 6 --repetitions 3 --out-dir $OUT/matrix \
  --label "qwen35 4b-random H200" 2>&1 | grep -E "^\|" | head -20
kill $SP; wait $SP 2>/dev/null
echo "matrix done t=$SECONDS"
[ $SECONDS -lt $((LIMIT - 60)) ] && timeout $((LIMIT - SECONDS - 30)) python3 tools/bench_decode.py --batches 1,16,64 \
  --ctx 1024 --max-model-len 8464 --json $OUT/decode.json 2>&1 | tail -5
[ $SECONDS -lt $((LIMIT - 25)) ] && timeout $((LIMIT - SECONDS - 5)) python3 -c "import sys, json, os; sys.path.insert(0, 'tools'); import bench_kernels as bk; r = bk.prefill_times([1024, 8192], reps=3); print(r); json.dump(r, open(os.environ['OUT'] + '/prefill.json', 'w'), default=str)" 2>&1 | tail -3
(cd $OUT && tar -czf texts.tgz server.log 2>/dev/null && rm -f server.log)
echo t=$SECONDS
