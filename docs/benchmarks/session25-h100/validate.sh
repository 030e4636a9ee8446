#!/bin/bash
# Session 25's validation of replay-rollback.patch (not run: no device time was left). Before: on cceba63-or-later
# main, `git archive HEAD > .scratch/old.tar`, then `git apply docs/benchmarks/session25-h100/replay-rollback.patch`,
# copy the GPU wheels to .wheels/, and run this with carry [".wheels", ".scratch"]. GPU tests first, then
# bench_spec section (a) for the patched tree and the old one.
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $NAME"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
ROOT=$PWD
(mkdir -p .scratch/old && cd .scratch/old && tar -xf $ROOT/.scratch/old.tar && PYTHONPATH=$ROOT/.gpu-site:$PWD QWEN35_KERNEL_CACHE=/tmp/kco python3 tools/build_kernels.py --dir /tmp/kco --jobs 6 >/dev/null 2>&1) &
python3 tools/build_kernels.py --dir /tmp/kc --jobs 10 > /dev/null || echo BUILD FAILED
(python3 -m server.cli make-model /tmp/m4b --preset 4b > /dev/null 2>&1) &
timeout 90 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -k "verify or replay or recurrence or saves or conv" --tb=line 2>&1 | grep -v "^  " | tail -8 | tee $OUT/tests.txt
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu_decode_graph.py -k "verify or decode_bit" --tb=line 2>&1 | grep -v "^  " | tail -6 | tee -a $OUT/tests.txt
timeout 120 python3 -m pytest -q -m gpu tests/test_spec_decode.py --tb=line 2>&1 | grep -v "^  " | tail -8 | tee -a $OUT/tests.txt
echo "t=$SECONDS"
grep -q "failed\|[0-9] error" $OUT/tests.txt && exit 1
wait
for tree in new old; do
  [ $SECONDS -lt 270 ] || break
  if [ $tree = new ]; then D=$ROOT; KC=/tmp/kc; else D=$ROOT/.scratch/old; KC=/tmp/kco; fi
  echo "== $tree"
  (cd $D && PYTHONPATH=$ROOT/.gpu-site:$D QWEN35_KERNEL_CACHE=$KC timeout 60 python3 tools/bench_spec.py /tmp/m4b --sections a --verify-ks 3 --batches 1,4,16 --json $OUT/a-$tree.json 2>&1 | grep "^(a)")
done
