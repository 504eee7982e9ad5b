#!/usr/bin/env bash
# The Gluon grouped FP8 GEMM on one H200, in one device call (about 2 minutes):
#
#     bash benchmarks/device_gluon_gemm.sh
#
# 1. every variant of benchmarks/bench_gluon_gemm.VARIANTS alone, in its own process (60 s
#    limit), on a small padded problem against the torch reference: a variant that fails to
#    compile, hangs or faults costs only itself;
# 2. the variants that passed, timed on the bench shapes beside the Triton kernel and DeepGEMM
#    (when deep_gemm imports), each checked against the Triton kernel; JSON in
#    benchmarks/results/gluon_gemm.json, copied with the logs to $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-$PWD/.deps/dg_jit_cache}"
export PYTHONPATH="$PWD/.deps/DeepEP:$PWD/.deps/DeepGEMM${PYTHONPATH:+:$PYTHONPATH}"
BENCH_LIMIT="${BENCH_LIMIT:-110}"

nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__)" 2>&1 | tail -n 1

count=$(python3 -m benchmarks.bench_gluon_gemm --count) || { echo "bench_gluon_gemm does not import" >&2; exit 1; }
pids=()
for ((i = 0; i < count; i++)); do
    timeout 60 python3 -m benchmarks.bench_gluon_gemm --smoke "$i" >"$OUT/gluon_smoke_$i.log" 2>&1 &
    pids+=($!)
done
passed=()
for ((i = 0; i < count; i++)); do
    wait "${pids[$i]}"
    status=$?
    echo "--- smoke [$i]: exit status $status$( ((status == 124)) && echo ' (timed out: a hang?)')"
    tail -n 25 "$OUT/gluon_smoke_$i.log"
    ((status == 0)) && passed+=("$i")
done
variants=$(IFS=,; echo "${passed[*]:-}")
echo "--- variants that passed the smoke test: ${variants:-none}"

timeout "$BENCH_LIMIT" python3 -m benchmarks.bench_gluon_gemm --variants "$variants" 2>&1 | tee "$OUT/gluon_gemm.log"
echo "--- timing exit status ${PIPESTATUS[0]}"
cp benchmarks/results/gluon_gemm.json "$OUT/" 2>/dev/null || echo "no gluon_gemm.json written"
