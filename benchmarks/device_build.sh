#!/usr/bin/env bash
# Build DeepEP v1.2.1 and DeepGEMM v2.6.1 from the unpacked sources in .deps/ (in parallel), for the
# real-library tests and benchmarks on a GPU machine.
#
# Usage (from the repository root, on the GPU machine):
#     bash benchmarks/device_build.sh            # builds both, prints the exports to use
#     eval "$(bash benchmarks/device_build.sh | grep '^export ')"
#
# Expects .deps/DeepEP (the v1.2.1 tree) and .deps/DeepGEMM (v2.6.1, with third-party/cutlass/include
# and third-party/fmt/include); DEPS=<dir> points elsewhere. Needs torch with CUDA, nvcc, ninja, and
# the nvidia-nvshmem-cu13 wheel (DeepEP's setup.py finds NVSHMEM through the nvidia.nvshmem
# package; without it DeepEP would build silently without its low-latency kernels, so that is an
# error here). Uses the system compilers (/usr/bin/gcc, /usr/bin/g++): DeepGEMM's JIT built with
# another g++ has been seen to crash. Fails (exit 1) with the tail of the failing build's log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS="$(cd "${DEPS:-$ROOT/.deps}" && pwd)"
DEEP_EP="$DEPS/DeepEP"
DEEP_GEMM="$DEPS/DeepGEMM"
LOGS="$DEPS/build-logs"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
JOBS="${MAX_JOBS:-$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))}"

export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDA_HOME MAX_JOBS="$JOBS"
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-$DEPS/dg_jit_cache}"
mkdir -p "$LOGS" "$DG_JIT_CACHE_DIR"

fail() { echo "device_build.sh: $*" >&2; exit 1; }

for d in "$DEEP_EP/csrc" "$DEEP_GEMM/csrc" "$DEEP_GEMM/third-party/cutlass/include/cute" \
         "$DEEP_GEMM/third-party/cutlass/include/cutlass" "$DEEP_GEMM/third-party/fmt/include"; do
    [[ -d "$d" ]] || fail "missing $d (unpack DeepEP v1.2.1 and DeepGEMM v2.6.1 with its third-party includes into $DEPS)"
done
[[ -x /usr/bin/gcc && -x /usr/bin/g++ ]] || fail "the system compilers /usr/bin/gcc and /usr/bin/g++ are needed"
[[ -d "$CUDA_HOME/include/cccl" ]] || fail "$CUDA_HOME/include/cccl (CUDA 13's CCCL headers) not found"
"$PYTHON" - <<'EOF' || fail "the nvidia-nvshmem wheel (nvidia.nvshmem with lib/libnvshmem_host.so.*) is needed for DeepEP's low-latency kernels"
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia.nvshmem")
root = pathlib.Path(spec.submodule_search_locations[0])
assert any(root.joinpath("lib").glob("libnvshmem_host.so.*")), root
print(f"NVSHMEM from {root}")
EOF

build_deep_gemm() {
    # DeepGEMM's develop.sh steps: CUTLASS/CuTe headers linked into deep_gemm/include (its JIT
    # compiles against them at run time), `setup.py build`, the built extension linked into the
    # package so that the source tree imports.
    cd "$DEEP_GEMM"
    ln -sfn ../../third-party/cutlass/include/cutlass deep_gemm/include/cutlass
    ln -sfn ../../third-party/cutlass/include/cute deep_gemm/include/cute
    rm -rf build dist ./*.egg-info
    "$PYTHON" setup.py build
    local so
    so="$(find build -name '_C*.so' -type f | head -n 1)"
    [[ -n "$so" ]] || { echo "no _C*.so under $DEEP_GEMM/build" >&2; return 1; }
    ln -sfn "../$so" deep_gemm/
}

build_deep_ep() {
    # CUDA 13 moved CCCL (cub, thrust, libcu++) under include/cccl: add it for g++ (CPATH) and
    # nvcc (NVCC_APPEND_FLAGS).
    cd "$DEEP_EP"
    rm -rf build ./deep_ep_cpp*.so
    CPATH="$CUDA_HOME/include/cccl${CPATH:+:$CPATH}" \
    NVCC_APPEND_FLAGS="-I$CUDA_HOME/include/cccl${NVCC_APPEND_FLAGS:+ $NVCC_APPEND_FLAGS}" \
        "$PYTHON" setup.py build_ext --inplace
    if grep -q "low-latency features are disabled" "$LOGS/deep_ep.log"; then
        echo "DeepEP was configured without NVSHMEM" >&2
        return 1
    fi
    ls deep_ep_cpp*.so >/dev/null
}

launch() {  # name function: run function in the background (errexit on), log to $LOGS/name.log,
            # and write its run time in ms to $LOGS/name.ms when it ends, failed or not
    local name=$1 fn=$2
    (
        start=$(date +%s%N)
        trap 'echo $(( ($(date +%s%N) - start) / 1000000 )) >"$LOGS/'"$name"'.ms"' EXIT
        "$fn"
    ) >"$LOGS/$name.log" 2>&1 &
}

echo "building DeepGEMM and DeepEP in parallel (MAX_JOBS=$JOBS each; logs in $LOGS)"
start_all=$(date +%s%N)
launch deep_gemm build_deep_gemm
pid_gemm=$!
launch deep_ep build_deep_ep
pid_ep=$!
status_gemm=0; wait "$pid_gemm" || status_gemm=$?
status_ep=0; wait "$pid_ep" || status_ep=$?

failed=0
for name in deep_gemm deep_ep; do
    status_var="status_${name#deep_}"
    status=${!status_var}
    ms=$(cat "$LOGS/$name.ms" 2>/dev/null || echo 0)
    printf '%-10s %s in %d.%d s\n' "$name" "$([[ $status == 0 ]] && echo built || echo "FAILED (exit $status)")" \
        $((ms / 1000)) $((ms % 1000 / 100))
    if [[ $status != 0 ]]; then
        failed=1
        echo "---- last 40 lines of $LOGS/$name.log ----" >&2
        tail -n 40 "$LOGS/$name.log" >&2
    fi
done
ms=$(( ($(date +%s%N) - start_all) / 1000000 ))
printf 'both: %d.%d s wall\n' $((ms / 1000)) $((ms % 1000 / 100))
[[ $failed == 0 ]] || fail "a build failed (logs in $LOGS)"

export PYTHONPATH="$DEEP_EP:$DEEP_GEMM${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import deep_ep, deep_gemm; print('deep_ep', deep_ep.__file__); print('deep_gemm', deep_gemm.__version__, deep_gemm.__file__)" \
    || fail "the built libraries do not import"

echo "export PYTHONPATH=$DEEP_EP:$DEEP_GEMM\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export DG_JIT_CACHE_DIR=$DG_JIT_CACHE_DIR"
echo "export CC=/usr/bin/gcc CXX=/usr/bin/g++"
