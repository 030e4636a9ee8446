#!/bin/bash
# A next device call (written in session 30, not run), on any card. carry [".wheels"], LIMIT = the seconds the
# call may take. Patches over main, each in its own copy of the tree: gdn-wg.patch (the wgmma state pass, run in
# session 30), gdn-wg-producer.patch (the same with a producer warpgroup; compiled, never run; and with the
# one-pass products and no S lo tile, -onepass: timed only, its criterion is the HF gate), conv-prefetch.patch
# (conv1d_fwd's next rows loaded before the current rows' math; compiled, never run). The new patches' GPU tests,
# then CUPTI profiles against main: a step of 8 x 1024-token prompts (an admission wave) and single 1024 and 8192
# prompts; a mixed step's kernels (8 decodes + a 256-token chunk); ncu on gdn_chunk_prep and conv1d_fwd at 8192
# tokens (both ~2-3x over their bytes, unexplained) and on gdn_chunk_state_wg's source lines.
. tools/device_call.sh
# a53c2e1 (attn_prefill's workspace lookup refactored after the last GPU run) on the GPU first
t attn tests/test_gpu_attention_prefill.py
t graph tests/test_gpu_decode_graph.py -k "mixed or bit_exact"
for v in wg wg-producer wg-producer-onepass; do  # main + the patch, in /tmp/<v>
  rm -rf /tmp/$v && mkdir /tmp/$v && tar --exclude=./.git --exclude=./.wheels -cf - . | tar -xf - -C /tmp/$v
  (cd /tmp/$v && patch -p1 -s < docs/benchmarks/session30-h100/gdn-$v.patch) || echo PATCH FAILED $v
done
rm -rf /tmp/cv && mkdir /tmp/cv && tar --exclude=./.git --exclude=./.wheels -cf - . | tar -xf - -C /tmp/cv
(cd /tmp/cv && patch -p1 -s < docs/benchmarks/session30-h100/conv-prefetch.patch) || echo PATCH FAILED cv
(cd /tmp/wg-producer && export PYTHONPATH=$PWD/.gpu-site:$PWD && t gdn-wgp tests/test_gpu_kernels.py -k "delta or state_saves")
(cd /tmp/cv && export PYTHONPATH=$PWD/.gpu-site:$PWD && t conv tests/test_gpu_kernels.py -k conv)
prof() {  # label, tree, prompts per step, lengths
  [ $SECONDS -lt $((LIMIT - 80)) ] || { echo "$1: skipped (time)"; return; }
  (cd $2 && PYTHONPATH=$OLDPWD/.gpu-site:$PWD timeout 120 python3 tools/kernel_profile.py \
    --prefill $4 --prefill-seqs $3 --decode-batches "" --json $OUT/profile-$3x-$1.json 2>&1 \
    | grep -E "^prefill|gdn_chunk|conv1d_fwd" | sed "s/^/$1 /")
}
prof main . 8 1024; prof wg /tmp/wg 8 1024; prof wgp /tmp/wg-producer 8 1024
prof main . 1 1024,8192; prof wgp /tmp/wg-producer 1 1024,8192; prof cv /tmp/cv 1 1024,8192
prof wgp1 /tmp/wg-producer-onepass 8 1024; prof wgp1 /tmp/wg-producer-onepass 1 1024,8192
[ $SECONDS -lt $((LIMIT - 80)) ] && timeout 100 python3 tools/kernel_profile.py --prefill "" --mixed 256 --mixed-decodes 8 \
  --decode-batches 8 --json $OUT/profile-mixed256.json 2>&1 | grep -E "^(mixed|decode)|gdn|conv|attn" | head -16
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
