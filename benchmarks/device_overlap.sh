#!/usr/bin/env bash
# The two-batch overlap on one H200 against a simulated all-to-all, in one device call (about a
# minute with the DeepGEMM JIT cache, under 120 s budgeted):
#
#     OUT=/tmp/out bash benchmarks/device_overlap.sh    # PYTHONPATH names deep_gemm (the caller's,
#                                                       # as benchmarks/device_run.sh sets it)
#
# Runs benchmarks.bench_overlap --gpu-delayed (world 1, NCCL; DeepGemmExperts where deep_gemm
# imports, else TritonExperts). Back in $OUT: overlap_gpu.log and overlap_gpu.json. The JIT cache
# is the one device_run.sh uses (.deps/dg_jit_cache, unpacked from .deps/dg_jit_cache.tgz where
# carried and not yet unpacked).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
if [[ -f .deps/dg_jit_cache.tgz && ! -d .deps/dg_jit_cache ]]; then
    tar xzf .deps/dg_jit_cache.tgz -C .deps
fi
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-$PWD/.deps/dg_jit_cache}"
timeout -k 5 "${BENCH_S:-115}" python3 -m benchmarks.bench_overlap --gpu-delayed \
    --reps "${REPS:-10}" ${BENCH_ARGS:-} >"$OUT/overlap_gpu.log" 2>&1
status=$?
echo "bench_overlap --gpu-delayed: status $status"
tail -n 20 "$OUT/overlap_gpu.log"
cp benchmarks/results/overlap_gpu.json "$OUT/" 2>/dev/null
exit "$status"
