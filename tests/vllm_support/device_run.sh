#!/usr/bin/env bash
# The vLLM plugin's GPU checks, on one H200, against vLLM 0.33's Python tree (no compiled .so).
#
#   bash tests/vllm_support/device_run.sh CARRY RESULTS_DIR [harness|ours|all] [K_EXPR]
#
# CARRY: a folder holding vLLM 0.33.0's .py tree (vllm-*-python-only.tar.xz), the tests of its
# sdist (vllm-*-tests.tar.xz) and the pure-Python wheels the image lacks (whl/); it is unpacked
# into /tmp/v033_site and /tmp/v033_src (skipped where an earlier run left both there). vLLM's
# compiled .so files are too large to carry: the stand-ins of tests/vllm_support/stand_ins take
# their place for the ops these checks reach.
# Steps: (A) host cost per layer call, alone on the GPU; then at once (B) our adapters' GPU tests
# and (C) vLLM's own harness, which alone can take minutes (each case spawns a process).
# `harness` runs (C) alone; `ours` runs A, B and C with our cases alone in C; `all` (the default)
# A, B and C with our cases and then vLLM's own pairs. K_EXPR narrows C's cases further (pytest
# -k, e.g. "VllmNoEPPrepareAndFinalize and VllmDeepGemmExperts"). A and B need DeepEP and DeepGEMM
# (benchmarks/device_build.sh or the carried extensions). Limits: HOST_COST_S, GPU_TESTS_S,
# HARNESS_S seconds (70, 210, 210; each step under timeout -k 5, `ours` ends within ~300 s);
# HARNESS_WORKERS (4) pytest-xdist workers for C where xdist is installed (each case is its own
# process). Writes RESULTS_DIR/vllm_*.log, vllm_gpu_tests.xml and vllm_harness_singlegpu_*.xml
# (JUnit) and vllm_host_cost.json: copy what is kept into benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
CARRY=$(realpath "$1")
OUT=$(realpath -m "$2")
STEPS=${3:-all}
K_EXPR=${4:-}
SITE=/tmp/v033_site VSRC=/tmp/v033_src  # no "vllm" in the path: -k would match it
mkdir -p "$OUT" "$SITE" "$VSRC"
if [[ ! -f $SITE/vllm/_moe_C_stable_libtorch.py || ! -d $VSRC/tests/kernels ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        "$CARRY"/whl/*.whl || exit 1
    tar xJf "$CARRY"/vllm-*-python-only.tar.xz -C "$SITE" || exit 1
    tar xJf "$CARRY"/vllm-*-tests.tar.xz -C "$VSRC" || exit 1
    python3 tests/vllm_support/install_stand_ins.py "$SITE/vllm" || exit 1
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
t0=$(date +%s)
stamp() { echo "[+$(( $(date +%s) - t0 )) s] $*"; }

# (C) vLLM's own harness with our classes registered (every single-GPU case: ours, then for `all`
#    vLLM's own pairs as the control), in this process and in the process it spawns for each case
#    (sitecustomize.py in tests/vllm_support registers there). Run from vLLM's source tree with
#    --confcutdir: its top conftest imports half of vLLM's test dependencies; mk_registration
#    defines the one fixture the harness takes from it. Case ids name the classes
#    (...-<PrepareFinalize>-<Experts>-1); -k matches without case, hence the full class names.
harness() {
    local ours="VllmNoEPPrepareAndFinalize or VllmTritonExperts or VllmDeepGemmExperts"
    ours="$ours or VllmBatched"
    local parts="ours vllms" part select workers="" failed=0
    [[ $STEPS = ours ]] && parts=ours
    if [[ ${HARNESS_WORKERS:-4} -gt 1 ]] && python3 -c "import xdist" 2>/dev/null; then
        workers="-n ${HARNESS_WORKERS:-4}"
    fi
    for part in $parts; do
        select="singlegpu and ($ours)"
        [[ $part = vllms ]] && select="singlegpu and not ($ours)"
        [[ -n $K_EXPR ]] && select="$select and ($K_EXPR)"
        # shellcheck disable=SC2086  # $workers: no option, or -n and a count
        (cd "$VSRC" && PYTHONPATH="$REPO/tests/vllm_support:$PYTHONPATH" \
            timeout -k 5 "${HARNESS_S:-210}" python3 -m pytest -v -rA --durations=0 $workers \
            -p mk_registration --confcutdir=tests/kernels -k "$select" \
            --junitxml="$OUT/vllm_harness_singlegpu_$part.xml" \
            tests/kernels/moe/test_modular_kernel_combinations.py) \
            >"$OUT/vllm_harness_singlegpu_$part.log" 2>&1 || failed=1
    done
    return $failed
}
if [[ $STEPS = harness ]]; then
    harness; status=$?
    tail -n 30 "$OUT"/vllm_harness_singlegpu_*.log
    exit $status
fi

# (A) Host cost per layer call: vLLM's kernel + our classes against our FusedMoEModularKernel,
#     both experts kinds in one process, nothing else on the GPU.
stamp "host cost"
timeout -k 5 "${HOST_COST_S:-70}" python3 tests/vllm_support/host_cost.py \
    "$OUT/vllm_host_cost.json" --experts triton,deep_gemm 2>&1 \
    | tee "$OUT/vllm_host_cost.log" || status=1

# (C) in the background, beside (B): our adapters inside vLLM's kernel on the GPU (Triton and
#     real DeepGEMM experts; the low-latency adapter over a real deep_ep.Buffer at world size 1).
stamp "GPU tests beside the harness"
harness &
harness_pid=$!
timeout -k 5 "${GPU_TESTS_S:-210}" python3 -m pytest -v -rs --durations=0 -p no:cacheprovider \
    --junitxml="$OUT/vllm_gpu_tests.xml" tests/test_vllm_adapters.py tests/test_vllm_gpu.py \
    2>&1 | tee "$OUT/vllm_gpu_tests.log" || status=1
stamp "GPU tests done"
wait $harness_pid || status=1
stamp "harness done"
grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT"/vllm_harness_singlegpu_*.log | tail -n 20
exit $status
