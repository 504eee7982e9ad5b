#!/usr/bin/env bash
# One GPU session's work on a lent H200, in stages that each fit one device call:
#
#     bash benchmarks/device_run.sh tests     # DeepEP + DeepGEMM (built or reused), the GPU suite
#     bash benchmarks/device_run.sh bench     # the benchmarks, JSON tarred for the trip back
#     BENCHES="bench_experts bench_all2all" bash benchmarks/device_run.sh bench   # some of them
#
# Logs and a tarball of benchmarks/results/ go to $OUT (default /tmp/out). The libraries come from
# benchmarks/device_build.sh, unless .deps already holds their built extensions (carried back from
# an earlier session as .deps/*.so.gz): then they are unpacked in place and nothing is compiled.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ DG_JIT_CACHE_DIR="$PWD/.deps/dg_jit_cache"
export PYTHONPATH="$PWD/.deps/DeepEP:$PWD/.deps/DeepGEMM${PYTHONPATH:+:$PYTHONPATH}"

libraries() {
    # Reuse extensions built by an earlier call on this machine or carried as .deps/<name>.so.gz;
    # otherwise build both from source.
    if compgen -G ".deps/DeepEP/deep_ep_cpp*.so" >/dev/null && compgen -G ".deps/DeepGEMM/deep_gemm/_C*.so" >/dev/null; then
        echo "reused the DeepEP / DeepGEMM extensions built on this machine"
    elif [[ -f .deps/deep_ep_cpp.so.gz && -f .deps/deep_gemm_C.so.gz ]]; then
        gunzip -c .deps/deep_ep_cpp.so.gz >.deps/DeepEP/deep_ep_cpp.cpython-312-x86_64-linux-gnu.so
        gunzip -c .deps/deep_gemm_C.so.gz >.deps/DeepGEMM/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so
        ln -sfn ../../third-party/cutlass/include/cutlass .deps/DeepGEMM/deep_gemm/include/cutlass
        ln -sfn ../../third-party/cutlass/include/cute .deps/DeepGEMM/deep_gemm/include/cute
        echo "reused the carried DeepEP / DeepGEMM extensions"
    else
        bash benchmarks/device_build.sh || return 1
        gzip -c .deps/DeepEP/deep_ep_cpp*.so >"$OUT/deep_ep_cpp.so.gz"
        gzip -c "$(readlink -f .deps/DeepGEMM/deep_gemm/_C*.so)" >"$OUT/deep_gemm_C.so.gz"
    fi
    python3 -c "import deep_ep, deep_gemm; print('deep_ep and deep_gemm', deep_gemm.__version__, 'import')"
}

# Fails (status 1) when the libraries did not build or import, or when no GPU test passed (all
# skipped: a machine without a visible GPU, say), after running the tests either way for the log.
stage_tests() {
    local built=0 tested=0
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    libraries 2>&1 | tee "$OUT/build.log" | tail -n 8 || built=$?
    # Three pytest processes share the GPU (test i in process i mod 3): the suite is bound by
    # Triton compiles and spawned ranks' start-up, not the GPU (about 210 s instead of 425+).
    local select="(gpu or multi_gpu or deep_ep or deep_gemm) and not gpu_alone" i pids=()
    rm -f "$OUT"/gpu_tests*.log
    python3 -m pytest --collect-only -q -m "$select" -p no:cacheprovider tests 2>/dev/null \
        | grep "::" >"$OUT/gpu_test_ids.txt"
    if [[ ! -s $OUT/gpu_test_ids.txt ]]; then
        echo "device_run.sh tests: FAILED: no GPU test collected" >&2
        return 1
    fi
    for i in 0 1 2; do
        # shellcheck disable=SC2046  # test ids hold no spaces
        timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfEs -p no:cacheprovider \
            $(awk -v i=$i 'NR % 3 == i' "$OUT/gpu_test_ids.txt") >"$OUT/gpu_tests_$i.log" 2>&1 &
        pids+=($!)
    done
    for i in 0 1 2; do
        wait "${pids[$i]}" || tested=$?
        tail -n 12 "$OUT/gpu_tests_$i.log" >>"$OUT/gpu_tests.log"
    done
    # Tests that read the device's free memory run last, alone on the GPU (status 5: none
    # collected, as where deep_ep is missing).
    local alone=0
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu_alone \
        tests >"$OUT/gpu_tests_alone.log" 2>&1 || alone=$?
    (( alone == 0 || alone == 5 )) || tested=$alone
    tail -n 12 "$OUT/gpu_tests_alone.log" >>"$OUT/gpu_tests.log"
    cat "$OUT/gpu_tests.log"
    if (( built != 0 )); then
        echo "device_run.sh tests: FAILED: the DeepEP / DeepGEMM build failed" \
            "(status $built, $OUT/build.log)" >&2
        return 1
    fi
    if (( tested != 0 )); then
        return "$tested"
    fi
    if ! grep -Eq "(^|[^0-9])[0-9]+ passed" "$OUT"/gpu_tests_*.log; then
        echo "device_run.sh tests: FAILED: no GPU test ran (every test skipped or none" \
            "selected, $OUT/gpu_tests.log)" >&2
        return 1
    fi
}

stage_bench() {
    local b
    local benches="${BENCHES:-bench_experts bench_quant bench_grouped_topk bench_all2all deepep_footprint bench_moe_sum}"
    for b in $benches; do
        echo "### python -m benchmarks.$b"
        timeout "${BENCH_TIMEOUT:-150}" python3 -m benchmarks.$b 2>&1 | tail -n 60
    done 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -n 150
    tar czf "$OUT/results.tgz" benchmarks/results
}

case "${1:-}" in
    tests) stage_tests ;;
    bench) libraries >/dev/null 2>&1; stage_bench ;;
    *) echo "usage: bash benchmarks/device_run.sh tests|bench" >&2; exit 2 ;;
esac
