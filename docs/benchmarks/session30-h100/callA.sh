#!/bin/bash
# Session 30's first device call, on branch s30 (s29-pf-split + s29-gdn-wg merged). carry [".wheels",
# ".scratch/old"] with .scratch/old = `git archive 51aa702` (main before both). LIMIT = the seconds the call
# may take. Both changes' kernel tests first, then their timings against the old tree, then the HF gate.
. tools/device_call.sh
t gdn tests/test_gpu_kernels.py -k "delta or state_saves"
t pf tests/test_gpu_attention_prefill.py
pf() {  # label, tree, lengths: prefill times, 3 repetitions
  [ $SECONDS -lt $((LIMIT - 90)) ] || { echo "$1: skipped (time)"; return; }
  (cd $2 && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 120 python3 -c "import sys, json; sys.path.insert(0, 'tools')
import bench_kernels as bk; r = bk.prefill_times([$3], reps=3); print('prefill', r)
json.dump(r, open('$OUT/prefill-$1.json', 'w'), default=str)") 2>&1 | grep -E "^prefill|rror" | sed "s/^/$1 /"
}
pf new . 1024,8192; pf old .scratch/old 1024,8192
m() {  # label, tree, mixed_step args...
  local n=$1 tree=$2; shift 2
  [ $SECONDS -lt $((LIMIT - 70)) ] || { echo "$n: skipped (time)"; return; }
  (cd $tree && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 90 python3 tools/mixed_step.py /tmp/m4b --json $OUT/ms-$n.json "$@") \
    > $OUT/ms-$n.txt 2>&1
  grep -E "^(mixed|decode)" $OUT/ms-$n.txt | sed "s/^/$n /"; grep -E "Error|error" $OUT/ms-$n.txt | tail -2
}
m new-16k . --cap 256 --inject-len 16384
m old-16k .scratch/old --cap 256 --inject-len 16384
t hf tests/test_gpu_hf_gate.py
t graph tests/test_gpu_decode_graph.py -k "mixed or bit_exact"
pf new2 . 1024,8192; pf old2 .scratch/old 1024,8192
[ $SECONDS -lt $((LIMIT - 110)) ] && timeout 100 python3 tools/bench_mixed.py --launch /tmp/m4b --label cap256-split \
  --inject-lens 4096,16384 --qps 1 --duration 6 --baseline-s 2 --cooldown 1 --out-dir $OUT \
  --server-args "--max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-budget-with-decodes 256" \
  2>&1 | grep -E "^\| cap|gate:|FAIL" | tail -6
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") 2>/dev/null && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
