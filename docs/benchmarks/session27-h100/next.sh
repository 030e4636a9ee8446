#!/bin/bash
# The next session's first device call (written in session 27, not run). Copy the GPU wheels to .wheels/ and
# run with carry [".wheels"] and LIMIT = the seconds the call may take. Order: the GPU tests that 943a4b3 (PDL on
# every launch) has not run, then issue 19's cell if an H200 came, then the mixed step's host time with and
# without the new launch, then the mixed-load gate at a 256-token cap, then the decode graphs against
# session 27's numbers (3.54 / 3.77 / 4.58 ms at b1 / b4 / b16, H100).
LIMIT=${LIMIT:-540}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
python3 tools/build_kernels.py --dir /tmp/kc --jobs 14 > /dev/null || echo BUILD FAILED
(python3 -m server.cli make-model /tmp/m4b --preset 4b > /dev/null 2>&1) &
t() {  # name, pytest args...: the summary line, and the failures (tracebacks stay in $OUT/t-name.txt)
  local n=$1; shift
  local left=$((LIMIT - SECONDS - 5)); [ $left -gt 20 ] || { echo "$n: skipped (time)"; return; }
  timeout $left python3 -m pytest -q -m gpu "$@" --tb=short > $OUT/t-$n.txt 2>&1
  echo "$n: $(grep -E '[0-9]+ (passed|failed)' $OUT/t-$n.txt | tail -1) (t=$SECONDS)"
  grep -E "^(FAILED|ERROR)" $OUT/t-$n.txt | head -5
}
t spec tests/test_spec_decode.py tests/test_spec_mtp.py tests/test_spec_dflash.py
t prefix tests/test_prefix_engine.py tests/test_prefix_server.py
t hf tests/test_gpu_hf_gate.py
t rest tests/ --ignore tests/test_gpu_kernels.py --ignore tests/test_gpu_decode_graph.py --ignore tests/test_engine.py \
  --ignore tests/test_spec_decode.py --ignore tests/test_spec_mtp.py --ignore tests/test_spec_dflash.py \
  --ignore tests/test_prefix_engine.py --ignore tests/test_prefix_server.py --ignore tests/test_gpu_hf_gate.py
wait
case "$GPU" in *H200*)
  for rep in 1 2 3; do
    [ $SECONDS -lt $((LIMIT - 40)) ] || break
    timeout 40 python3 tools/bench_spec.py /tmp/m4b --sections b --concurrency 1 --oracle-p 1,0.8 --k 3 --json $OUT/c1-h200-$rep.json 2>&1 | grep "^(b/c)\|Target"
  done;;
esac
for pdl in 1 0; do
  [ $SECONDS -lt $((LIMIT - 60)) ] || break
  QWEN35_PDL=$pdl timeout 100 python3 tools/mixed_step.py /tmp/m4b --cap 256 --inject-len 8192 --profile \
    --json $OUT/mixed-step-pdl$pdl.json > $OUT/mixed-step-pdl$pdl.txt 2>&1
  grep -E "^(mixed|decode)" $OUT/mixed-step-pdl$pdl.txt | sed "s/^/pdl=$pdl /"
done
# a 512-token cap: twice the prompt tokens a step for ~1 ms more device time, if the step stays host-bound
[ $SECONDS -lt $((LIMIT - 150)) ] && timeout 60 python3 tools/mixed_step.py /tmp/m4b --cap 512 --inject-len 8192 \
  --json $OUT/mixed-step-cap512.json 2>&1 | grep -E "^(mixed|decode)" | sed "s/^/cap512 /"
[ $SECONDS -lt $((LIMIT - 120)) ] && timeout 110 python3 tools/bench_mixed.py --launch /tmp/m4b --label cap256 \
  --inject-lens 4096,8192,16384 --qps 0.5,1 --duration 6 --baseline-s 2 --cooldown 1 --out-dir $OUT \
  --server-args "--max-model-len 16400 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-budget-with-decodes 256" \
  2>&1 | grep -E "^\||gate:|FAIL"
[ $SECONDS -lt $((LIMIT - 40)) ] && timeout 35 python3 tools/bench_spec.py /tmp/m4b --sections a --verify-ks 3 --batches 1,4,16 \
  --json $OUT/a-$SECONDS.json 2>&1 | grep "^(a)"
# fewer, larger files come back: the texts, traces and logs in one archive, the JSONs beside it
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
