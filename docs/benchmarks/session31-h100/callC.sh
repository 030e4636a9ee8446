#!/bin/bash
# Session 31's first device call (carry [".wheels"], LIMIT = the seconds it may take): the chunked GDN state pass
# chosen per step (CudaBackend._gdn_state_wg: gdn_chunk_state or session 30's gdn_chunk_state_wg), timed both
# ways over steps of 1-8 prompts (bench_gdn_state.py), its kernel tests, whole-prefill profiles, mixed graphs.
. tools/device_call.sh
python3 tools/bench_gdn_state.py --json $OUT/gdn-state.json 2>&1 | tail -22
t gdnk tests/test_gpu_kernels.py -k "delta or state_saves or state_pass"
prof() {  # prompts per step, lengths
  [ $SECONDS -lt $((LIMIT - 80)) ] || { echo "profile $1: skipped (time)"; return; }
  timeout 120 python3 tools/kernel_profile.py --prefill $2 --prefill-seqs $1 --decode-batches "" \
    --json $OUT/profile-$1x.json 2>&1 | grep -E "^prefill|gdn_chunk|conv1d_fwd"
}
prof 8 1024; prof 1 1024,8192; prof 2 1024
t graph tests/test_gpu_decode_graph.py -k "mixed or bit_exact"
(cd $OUT && tar -czf texts.tgz $(ls | grep -v "\.json$") 2>/dev/null && find . -type f ! -name "*.json" ! -name texts.tgz -delete)
echo t=$SECONDS
