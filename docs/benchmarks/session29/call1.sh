#!/bin/bash
# Session 29's first device call. carry [".wheels", ".scratch/old"] (.scratch/old: `git archive` of the commit
# before the split-key prefill attention), LIMIT = the seconds the call may take. On an H200: issue 19's c1 cell
# (3 repetitions) first. Then the split keys' GPU tests, a mixed step old vs new at a 16k prompt, the mixed-load
# gate (cap 256), then the GPU tests not run since session 27.
. tools/device_call.sh
case "$GPU" in *H200*)
  for rep in 1 2 3; do
    [ $SECONDS -lt $((LIMIT - 75)) ] || break
    timeout 75 python3 tools/bench_spec.py /tmp/m4b --sections b --concurrency 1 --oracle-p 1,0.8 --k 3 \
      --json $OUT/c1-h200-$rep.json > $OUT/c1-$rep.txt 2>&1; grep "^(b/c)\|Target\|rror" $OUT/c1-$rep.txt | tail -6
  done;;
esac
t pf tests/test_gpu_attention_prefill.py
t graph tests/test_gpu_decode_graph.py -k "mixed or bit_exact"
m() {  # label, tree, mixed_step args...
  local n=$1 tree=$2; shift 2
  [ $SECONDS -lt $((LIMIT - 70)) ] || { echo "$n: skipped (time)"; return; }
  (cd $tree && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 90 python3 tools/mixed_step.py /tmp/m4b --json $OUT/ms-$n.json "$@") \
    > $OUT/ms-$n.txt 2>&1
  grep -E "^(mixed|decode)" $OUT/ms-$n.txt | sed "s/^/$n /"; grep -E "Error|error" $OUT/ms-$n.txt | tail -2
}
m new-16k . --cap 256 --inject-len 16384
m old-16k .scratch/old --cap 256 --inject-len 16384
[ $SECONDS -lt $((LIMIT - 110)) ] && timeout 100 python3 tools/bench_mixed.py --launch /tmp/m4b --label cap256-split \
  --inject-lens 4096,16384 --qps 1 --duration 6 --baseline-s 2 --cooldown 1 --out-dir $OUT \
  --server-args "--max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-budget-with-decodes 256" \
  2>&1 | grep -E "^\| cap|gate:|FAIL" | tail -6
t spec tests/test_spec_decode.py tests/test_spec_mtp.py tests/test_spec_dflash.py
t hf tests/test_gpu_hf_gate.py
t prefix tests/test_prefix_engine.py tests/test_prefix_server.py
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") 2>/dev/null && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
