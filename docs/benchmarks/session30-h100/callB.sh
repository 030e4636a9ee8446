#!/bin/bash
# Session 30's second device call (after callA): issue 19's c1 cell on an H200 (3 repetitions), the GPU tests
# callA leaves out, the wgmma state pass's one-pass experiment (gdn-wg-one-pass.patch; criterion: the HF gate),
# and ncu on gdn_chunk_prep at 8192 tokens (the next GDN lead). carry [".wheels"], LIMIT = seconds.
. tools/device_call.sh
case "$GPU" in *H200*)
  for rep in 1 2 3; do
    [ $SECONDS -lt $((LIMIT - 75)) ] || break
    timeout 75 python3 tools/bench_spec.py /tmp/m4b --sections b --concurrency 1 --oracle-p 1,0.8 --k 3 \
      --json $OUT/c1-h200-$rep.json > $OUT/c1-$rep.txt 2>&1; grep "^(b/c)\|Target\|rror" $OUT/c1-$rep.txt | tail -6
  done;;
esac
t spec tests/test_spec_decode.py tests/test_spec_mtp.py tests/test_spec_dflash.py
t prefix tests/test_prefix_engine.py tests/test_prefix_server.py
t engine tests/test_engine.py
pf() {  # label, tree: prefill times of 1024 and 8192 tokens, 3 repetitions
  [ $SECONDS -lt $((LIMIT - 90)) ] || { echo "$1: skipped (time)"; return; }
  (cd $2 && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 120 python3 -c "import sys, json; sys.path.insert(0, 'tools')
import bench_kernels as bk; r = bk.prefill_times([1024, 8192], reps=3); print('prefill', r)
json.dump(r, open('$OUT/prefill-$1.json', 'w'), default=str)") 2>&1 | grep -E "^prefill|rror" | sed "s/^/$1 /"
}
rm -rf /tmp/one && mkdir /tmp/one && tar --exclude=./.git --exclude=./.wheels -cf - . | tar -xf - -C /tmp/one
(cd /tmp/one && patch -p1 -s < docs/benchmarks/session29/gdn-wg-one-pass.patch) || echo PATCH FAILED
pf onepass /tmp/one; pf twopass .
(cd /tmp/one && export PYTHONPATH=$PWD/.gpu-site:$PWD QWEN35_KERNEL_CACHE=/tmp/kc-one && t hf-onepass tests/test_gpu_hf_gate.py)
[ $SECONDS -lt $((LIMIT - 60)) ] && timeout $((LIMIT - SECONDS - 10)) ncu --clock-control none -k regex:gdn_chunk_prep \
  --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 -c "import sys; sys.path.insert(0, 'tools'); import bench_kernels as bk
bk.prefill_times([8192], reps=1)" > $OUT/ncu-prep-8192.txt 2>&1; grep -E "Duration|Issued Warp|Eligible Warps|DRAM Throughput" $OUT/ncu-prep-8192.txt | head -6
(cd $OUT && tar -czf textsB.tgz $(ls | grep -v "\.json$") 2>/dev/null && find . -type f ! -name "*.json" ! -name textsB.tgz -delete)
echo t=$SECONDS
