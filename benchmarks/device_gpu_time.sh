#!/usr/bin/env bash
# Our contiguous layer's GPU time against vLLM 0.33's DeepGEMM layer, in one device call on one
# H200 (about 5 minutes with a build, 3 with carried extensions and JIT cache):
#
#     bash benchmarks/device_gpu_time.sh     # carry .deps/deps_src.tar.xz and .vllm_carry, and
#                                            # .deps/*.so.gz + .deps/dg_jit_cache.tgz where kept
#
# Steps: DeepGEMM (and DeepEP) built or unpacked (device_run.sh's libraries), vLLM's Python tree
# with the stand-ins of tests/vllm_support, the GPU tests of the SiLU step, the contiguous experts
# and the DeepGEMM wrapper, then benchmarks.bench_gpu_time alone on the GPU. Back in $OUT: the
# built extensions (first call), gpu_time.json, the logs (logs.tgz) and the JIT cache.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FINAL="${OUT:-/tmp/out}"
mkdir -p "$FINAL/logs"
[[ -d .deps/DeepGEMM/csrc ]] || tar xJf .deps/deps_src.tar.xz -C .deps
[[ -f .deps/dg_jit_cache.tgz && ! -d .deps/dg_jit_cache ]] && tar xzf .deps/dg_jit_cache.tgz -C .deps
OUT="$FINAL" BENCHES=" " bash benchmarks/device_run.sh bench >"$FINAL/logs/libraries.log" 2>&1
tail -n 3 "$FINAL/logs/libraries.log"
rm -f "$FINAL/results.tgz"

SITE=/tmp/v033_site
if [[ ! -f $SITE/vllm/_moe_C_stable_libtorch.py ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .vllm_carry/whl/*.whl
    tar xJf .vllm_carry/vllm-*-python-only.tar.xz -C "$SITE"
    python3 tests/vllm_support/install_stand_ins.py "$SITE/vllm" >"$FINAL/logs/stand_ins.log" 2>&1
fi
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR="$PWD/.deps/dg_jit_cache"
export PYTHONPATH="$PWD/.deps/DeepEP:$PWD/.deps/DeepGEMM:$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

timeout -k 5 "${TESTS_S:-150}" python3 -m pytest -q -rfEs -p no:cacheprovider \
    -m "gpu or deep_gemm" tests/test_silu_mul_quant.py tests/test_fp8_quant.py \
    tests/test_contiguous_experts.py tests/test_batched_experts.py \
    tests/test_deep_gemm_compat.py >"$FINAL/logs/tests.log" 2>&1
echo "GPU tests: status $?"; tail -n 4 "$FINAL/logs/tests.log"

timeout -k 5 "${BENCH_S:-330}" python3 -m benchmarks.bench_gpu_time ${BENCH_ARGS:-} \
    >"$FINAL/logs/bench_gpu_time.log" 2>&1
echo "bench_gpu_time: status $?"; tail -n 30 "$FINAL/logs/bench_gpu_time.log"
cp benchmarks/results/gpu_time.json "$FINAL/" 2>/dev/null
tar czf "$FINAL/logs.tgz" -C "$FINAL" logs && rm -rf "$FINAL/logs"
tar czf "$FINAL/dg_jit_cache.tgz" -C .deps dg_jit_cache 2>/dev/null
[[ $(stat -c %s "$FINAL/dg_jit_cache.tgz" 2>/dev/null || echo 0) -le 16000000 ]] \
    || rm -f "$FINAL/dg_jit_cache.tgz"
