#!/bin/bash
# The next session's first device call (written in session 26, not run). Before it: copy the GPU wheels to
# .wheels/, `git archive 48aa1f3 > .scratch/old.tar` (the replay before its prefetch), and run this with
# carry [".wheels", ".scratch"] and LIMIT = the seconds the call may take. Order: the GPU tests the landed
# code has not run (session26-h100.md), then the prefetch's A/B (section a, new vs 48aa1f3), then #19's cell
# on an H200 (3 reps).
LIMIT=${LIMIT:-540}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
ROOT=$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
(mkdir -p .scratch/old && cd .scratch/old && tar -xf $ROOT/.scratch/old.tar && PYTHONPATH=$ROOT/.gpu-site:$PWD QWEN35_KERNEL_CACHE=/tmp/kco python3 tools/build_kernels.py --dir /tmp/kco --jobs 4 >/dev/null 2>&1) &
python3 tools/build_kernels.py --dir /tmp/kc --jobs 12 > /dev/null || echo BUILD FAILED
(python3 -m server.cli make-model /tmp/m4b --preset 4b > /dev/null 2>&1) &
t() {  # name, pytest args...: the summary line, and the failures (tracebacks stay in $OUT/t-name.txt)
  local n=$1; shift
  local left=$((LIMIT - SECONDS - 5)); [ $left -gt 20 ] || { echo "$n: skipped (time)"; return; }
  timeout $left python3 -m pytest -q -m gpu "$@" --tb=short > $OUT/t-$n.txt 2>&1
  echo "$n: $(grep -E '[0-9]+ (passed|failed)' $OUT/t-$n.txt | tail -1) (t=$SECONDS)"
  grep -E "^(FAILED|ERROR)" $OUT/t-$n.txt | head -5
}
wait
t mtp tests/test_spec_mtp.py tests/test_spec_dflash.py
t prefix tests/test_prefix_engine.py tests/test_prefix_server.py
t engine tests/test_engine.py
t hf tests/test_gpu_hf_gate.py
t rest tests/ --ignore tests/test_gpu_kernels.py --ignore tests/test_gpu_decode_graph.py --ignore tests/test_spec_decode.py \
  --ignore tests/test_spec_mtp.py --ignore tests/test_spec_dflash.py --ignore tests/test_prefix_engine.py \
  --ignore tests/test_prefix_server.py --ignore tests/test_engine.py --ignore tests/test_gpu_hf_gate.py
for tree in new old new old; do
  [ $SECONDS -lt $((LIMIT - 40)) ] || break
  if [ $tree = new ]; then D=$ROOT; KC=/tmp/kc; else D=$ROOT/.scratch/old; KC=/tmp/kco; fi
  (cd $D && PYTHONPATH=$ROOT/.gpu-site:$D QWEN35_KERNEL_CACHE=$KC timeout 35 python3 tools/bench_spec.py /tmp/m4b --sections a --verify-ks 3 --batches 1,4,16 --json $OUT/a-$tree-$SECONDS.json 2>&1 | grep "^(a)" | sed "s/^/$tree /")
done
case "$GPU" in *H200*)
  for rep in 1 2 3; do
    [ $SECONDS -lt $((LIMIT - 40)) ] || break
    timeout 40 python3 tools/bench_spec.py /tmp/m4b --sections b --concurrency 1 --oracle-p 1,0.8 --k 3 --json $OUT/c1-h200-$rep.json 2>&1 | grep "^(b/c)\|Target"
  done;;
esac
echo t=$SECONDS
