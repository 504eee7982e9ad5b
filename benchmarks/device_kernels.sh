#!/usr/bin/env bash
# Issue 30's kernel rows on one lent H200, in one device call: the per-token-group quant and the
# Triton grouped FP8 GEMM (GPU tests, benchmarks against DeepGEMM v2.6.1, accuracy checks).
#
#     bash benchmarks/device_kernels.sh full      # + the grouped-GEMM config sweep
#     bash benchmarks/device_kernels.sh confirm   # tests and both tables again, no sweep
#     bash benchmarks/device_kernels.sh short     # small-M quant, the GEMM table once
#
# DeepEP / DeepGEMM come from device_run.sh's `libraries` (the carried .deps/*.so.gz, else a
# build whose extensions land in $OUT): the `bench` stage with no benchmark named runs only that.
# The sources travel as .deps/deps_src.tar.xz and are unpacked here first. Logs and JSON to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
[[ -d .deps/DeepGEMM/csrc ]] || tar xJf .deps/deps_src.tar.xz -C .deps
BENCHES=" " bash benchmarks/device_run.sh bench >"$OUT/libraries.log" 2>&1
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR="$PWD/.deps/dg_jit_cache"
export PYTHONPATH="$PWD/.deps/DeepEP:$PWD/.deps/DeepGEMM${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__)" || tail -n 30 "$OUT/libraries.log"

log="$OUT/kernels.log"
mkdir -p "$OUT/json"
run() { echo "### $*" | tee -a "$log"; timeout 240 "$@" 2>&1 | tee -a "$log" | tail -n 40; }
if [[ "${1:-confirm}" == short ]]; then
    run python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_quant.py -k "config or cached"
    run python3 -m benchmarks.bench_quant --only quant --ms 1,256
    cp benchmarks/results/bench_quant.json "$OUT/json/"
    run python3 -m benchmarks.bench_grouped_gemm
    cp benchmarks/results/grouped_gemm.json "$OUT/json/"
    tar czf "$OUT/kernels_json.tgz" -C "$OUT" json && rm -rf "$OUT/json" "$OUT/results.tgz"
    exit 0
fi
run python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_quant.py tests/test_grouped_gemm.py
run python3 -m benchmarks.bench_quant --only quant
cp benchmarks/results/bench_quant.json "$OUT/json/bench_quant_run1.json"
run python3 -m benchmarks.bench_quant --only quant
cp benchmarks/results/bench_quant.json "$OUT/json/bench_quant_run2.json"
run python3 -m benchmarks.bench_grouped_gemm --accuracy
cp benchmarks/results/grouped_gemm_accuracy.json "$OUT/json/"
if [[ "${1:-confirm}" == full ]]; then
    run python3 -m benchmarks.bench_grouped_gemm --sweep
else
    run python3 -m benchmarks.bench_grouped_gemm
    cp benchmarks/results/grouped_gemm.json "$OUT/json/grouped_gemm_run1.json"
    run python3 -m benchmarks.bench_grouped_gemm
fi
cp benchmarks/results/grouped_gemm.json "$OUT/json/grouped_gemm_run2.json"
# At most 8 files come back: the JSON as one tarball (device_run.sh's results.tgz predates it).
tar czf "$OUT/kernels_json.tgz" -C "$OUT" json && rm -rf "$OUT/json" "$OUT/results.tgz"
