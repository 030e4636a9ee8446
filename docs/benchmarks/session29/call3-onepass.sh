#!/bin/bash
# Session 29 (written, not run: no device was lent): gdn_chunk_state with single-pass bf16 products (the lo halves
# of W, P, S and v_new dropped: gdn-one-pass.patch) against the tree as it is: prefill times and the GDN kernel
# tests on both, the HF bf16 gate on the patched tree. gdn_precision.py (CPU) puts the one-pass core output at
# 1.24x HF bf16's distance from f32, under the gate's ROW_RATIO of 2. carry [".wheels"], LIMIT = seconds.
. tools/device_call.sh
rm -rf /tmp/one && mkdir /tmp/one && tar --exclude=./.git --exclude=./.wheels -cf - . | tar -xf - -C /tmp/one
(cd /tmp/one && patch -p1 -s < docs/benchmarks/session29/gdn-one-pass.patch) || echo PATCH FAILED
pf() {  # label, tree: prefill times of 1024 and 8192 tokens, 3 repetitions
  (cd $2 && PYTHONPATH=$PWD/.gpu-site:$PWD timeout 150 python3 -c "import sys, json; sys.path.insert(0, 'tools')
import bench_kernels as bk; r = bk.prefill_times([1024, 8192], reps=3); print('$1', r)
json.dump(r, open('$OUT/prefill-$1.json', 'w'), default=str)") 2>&1 | tail -2
}
pf main . ; pf onepass /tmp/one ; pf main2 . ; pf onepass2 /tmp/one
t gdn-main tests/test_gpu_kernels.py -k "gdn or delta"
(cd /tmp/one && export PYTHONPATH=$PWD/.gpu-site:$PWD && t gdn-onepass tests/test_gpu_kernels.py -k "gdn or delta")
(cd /tmp/one && export PYTHONPATH=$PWD/.gpu-site:$PWD && t hf-onepass tests/test_gpu_hf_gate.py)
(cd $OUT && tar -czf texts3.tgz t-*.txt 2>/dev/null && rm -f t-*.txt)
echo t=$SECONDS
