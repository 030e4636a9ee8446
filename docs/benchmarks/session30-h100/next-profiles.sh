#!/bin/bash
# A next device call (written in session 30, not run), on any card. carry [".wheels"], LIMIT = the seconds the
# call may take. Whether the wgmma state pass (gdn-wg.patch, not on main) wins when a step prefills several
# sequences (an admission wave: 8 x 1024 tokens), against main, by CUPTI; a mixed step's kernels (8 decodes + a
# 256-token chunk: where its ~4 ms over the decode step go); then ncu on gdn_chunk_prep and conv1d_fwd at 8192
# tokens (both ~2-3x over their bytes: what bounds them is not known), conv-prefetch.patch's conv1d_fwd against
# main's, and ncu's source counters on gdn_chunk_state_wg (where its chunk goes).
. tools/device_call.sh
rm -rf /tmp/wg && mkdir /tmp/wg && tar --exclude=./.git --exclude=./.wheels -cf - . | tar -xf - -C /tmp/wg
(cd /tmp/wg && patch -p1 -s < docs/benchmarks/session30-h100/gdn-wg.patch) || echo PATCH FAILED
prof() {  # label, tree
  [ $SECONDS -lt $((LIMIT - 80)) ] || { echo "$1: skipped (time)"; return; }
  (cd $2 && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 120 python3 tools/kernel_profile.py \
    --prefill 1024 --prefill-seqs 8 --decode-batches "" --json $OUT/profile-8x1024-$1.json 2>&1 \
    | grep -E "^prefill|gdn_chunk" | sed "s/^/$1 /")
}
prof main . ; prof wg /tmp/wg
# conv-prefetch.patch: conv1d_fwd issues the next rows' loads before this group's math (bit-identical; 123
# registers, 4 blocks an SM as before): its GPU tests, then its time against main's at 1024 and 8192 tokens
rm -rf /tmp/cv && mkdir /tmp/cv && tar --exclude=./.git --exclude=./.wheels -cf - . | tar -xf - -C /tmp/cv
(cd /tmp/cv && patch -p1 -s < docs/benchmarks/session30-h100/conv-prefetch.patch) || echo PATCH FAILED
(cd /tmp/cv && export PYTHONPATH=$PWD/.gpu-site:$PWD && t conv tests/test_gpu_kernels.py -k conv)
for tree in . /tmp/cv; do [ $SECONDS -lt $((LIMIT - 80)) ] && (cd $tree && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 90 \
  python3 tools/kernel_profile.py --prefill 1024,8192 --decode-batches "" --json $OUT/profile-conv-$(basename $tree).json \
  2>&1 | grep -E "^prefill|conv1d" | sed "s|^|$tree |"); done
[ $SECONDS -lt $((LIMIT - 80)) ] && timeout 100 python3 tools/kernel_profile.py --prefill "" --mixed 256 --mixed-decodes 8 \
  --decode-batches 8 --json $OUT/profile-mixed256.json 2>&1 | grep -E "^(mixed|decode)|gdn|conv|attn" | head -16
(cd /tmp/wg && export PYTHONPATH=$PWD/.gpu-site:$PWD && t gdn-wg tests/test_gpu_kernels.py -k "delta or state_saves")
[ $SECONDS -lt $((LIMIT - 60)) ] && timeout $((LIMIT - SECONDS - 10)) ncu --clock-control none -k regex:gdn_chunk_prep \
  --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 -c "import sys; sys.path.insert(0, 'tools'); import bench_kernels as bk
bk.prefill_times([8192], reps=1)" > $OUT/ncu-prep-8192.txt 2>&1; grep -E "Duration|Issued Warp|Eligible Warps|DRAM Throughput" $OUT/ncu-prep-8192.txt | head -6
[ $SECONDS -lt $((LIMIT - 45)) ] && timeout $((LIMIT - SECONDS - 10)) ncu --clock-control none -k regex:conv1d_fwd \
  --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 -c "import sys; sys.path.insert(0, 'tools'); import bench_kernels as bk
bk.prefill_times([8192], reps=1)" > $OUT/ncu-conv-8192.txt 2>&1; grep -E "Duration|Issued Warp|Eligible Warps|DRAM Throughput" $OUT/ncu-conv-8192.txt | head -6
[ $SECONDS -lt $((LIMIT - 60)) ] && (cd /tmp/wg && PYTHONPATH=$PWD/.gpu-site:$PWD \
  timeout $((LIMIT - SECONDS - 15)) ncu --clock-control none -k regex:gdn_chunk_state_wg --launch-count 1 \
  --section SourceCounters --section WarpStateStats --page source --print-source sass --csv python3 -c "import sys
sys.path.insert(0, 'tools'); import bench_kernels as bk; bk.prefill_times([1024], reps=1)" > $OUT/ncu-wg-src.csv 2>&1
  python3 tools/ncu_top.py $OUT/ncu-wg-src.csv --lines 30 > $OUT/ncu-wg-top.txt 2>&1; head -20 $OUT/ncu-wg-top.txt)
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") 2>/dev/null && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
