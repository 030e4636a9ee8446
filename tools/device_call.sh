# Sourced by a device call's script (docs/benchmarks/*/call*.sh), run in the repository root on the GPU machine
# with carry [".wheels"] (../shared/gpu-wheels copied there) and LIMIT = the seconds the call may take. Installs
# the wheels the machine lacks into .gpu-site, builds every kernel into /tmp/kc, writes the random 4B checkpoint
# to /tmp/m4b, and defines t (a pytest run against the call's remaining time) and c1_cell (issue 19's cell).
LIMIT=${LIMIT:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1 QWEN35_KERNEL_CACHE=/tmp/kc
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
[ -d /tmp/m4b ] || (python3 -m server.cli make-model /tmp/m4b --preset 4b > /dev/null 2>&1) &
python3 tools/build_kernels.py --dir /tmp/kc --jobs 14 > /dev/null || echo BUILD FAILED
wait

t() {  # name, pytest args...: the GPU tests' summary line and failures (the whole output in $OUT/t-name.txt)
  local n=$1; shift
  local left=$((LIMIT - SECONDS - 5)); [ $left -gt 20 ] || { echo "$n: skipped (time)"; return; }
  timeout $left python3 -m pytest -q -m gpu "$@" --tb=short > $OUT/t-$n.txt 2>&1
  echo "$n: $(grep -E '[0-9]+ (passed|failed)' $OUT/t-$n.txt | tail -1) (t=$SECONDS)"
  grep -E "^(FAILED|ERROR)" $OUT/t-$n.txt | head -5
}

c1_cell() {  # issue 19's c1 cell (speculation with an oracle drafter, K = 3), 3 repetitions, on an H200 only
  case "$GPU" in *H200*) ;; *) echo "c1 cell: skipped ($GPU)"; return;; esac
  for rep in 1 2 3; do
    [ $SECONDS -lt $((LIMIT - 75)) ] || break
    timeout 75 python3 tools/bench_spec.py /tmp/m4b --sections b --concurrency 1 --oracle-p 1,0.8 --k 3 \
      --json $OUT/c1-h200-$rep.json > $OUT/c1-$rep.txt 2>&1; grep "^(b/c)\|Target\|rror" $OUT/c1-$rep.txt | tail -6
  done
}
