#!/usr/bin/env bash
# The vLLM plugin's GPU checks, on one H200, against vLLM 0.33's Python tree (no compiled .so).
#
#   bash tests/vllm_support/device_run.sh CARRY RESULTS_DIR [harness|ours|all]
#
# CARRY: a folder holding vLLM 0.33.0's .py tree (vllm-*-python-only.tar.xz), the tests of its
# sdist (vllm-*-tests.tar.xz) and the pure-Python wheels the image lacks (whl/); it is unpacked
# into /tmp/v033_site and /tmp/v033_src. vLLM's compiled .so files are too large to carry: the
# stand-ins of tests/vllm_support/stand_ins take their place for the ops these checks reach.
# `harness` runs step 1 alone; `all` (the default) also steps 2 and 3, `ours` the same with our
# cases alone in step 1; steps 2 and 3 need DeepEP and DeepGEMM from
# benchmarks/device_build.sh. Writes RESULTS_DIR/vllm_*.log, vllm_harness_singlegpu_*.xml (JUnit,
# one entry per case) and vllm_host_cost_*.json: copy what is kept into benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
CARRY=$(realpath "$1")
OUT=$(realpath -m "$2")
STEPS=${3:-all}
SITE=/tmp/v033_site VSRC=/tmp/v033_src  # no "vllm" in the path: -k would match it
mkdir -p "$OUT" "$SITE" "$VSRC"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/whl/*.whl \
    || exit 1
tar xJf "$CARRY"/vllm-*-python-only.tar.xz -C "$SITE" || exit 1
tar xJf "$CARRY"/vllm-*-tests.tar.xz -C "$VSRC" || exit 1
python3 tests/vllm_support/install_stand_ins.py "$SITE/vllm" || exit 1
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

# 1. vLLM's own harness with our classes registered (every single-GPU case: ours first, then
#    vLLM's own pairs as the control), in this process and in the process it spawns for each case
#    (sitecustomize.py in tests/vllm_support registers there). Run from vLLM's source tree with
#    --confcutdir: its top conftest imports half of vLLM's test dependencies; mk_registration
#    defines the one fixture the harness takes from it. Case ids name the classes
#    (...-<PrepareFinalize>-<Experts>-1); -k matches without case, hence the full class names.
OURS="VllmNoEPPrepareAndFinalize or VllmTritonExperts or VllmDeepGemmExperts or VllmBatched"
PARTS="ours vllms"
[ "$STEPS" = ours ] && PARTS=ours
for part in $PARTS; do
    select="singlegpu and ($OURS)"
    [ $part = vllms ] && select="singlegpu and not ($OURS)"
    (cd "$VSRC" && PYTHONPATH="$REPO/tests/vllm_support:$PYTHONPATH" python3 -m pytest -v -rA \
        -p mk_registration --confcutdir=tests/kernels -k "$select" \
        --junitxml="$OUT/vllm_harness_singlegpu_$part.xml" \
        tests/kernels/moe/test_modular_kernel_combinations.py) \
        2>&1 | tee "$OUT/vllm_harness_singlegpu_$part.log" || status=1
done
[ "$STEPS" = harness ] && exit $status

# 2. Our adapters inside vLLM's kernel on the GPU (Triton and real DeepGEMM experts), the
#    low-latency adapter over a real deep_ep.Buffer at world size 1.
python3 -m pytest -q tests/test_vllm_gpu.py tests/test_vllm_adapters.py \
    2>&1 | tee "$OUT/vllm_gpu_tests.log" || status=1

# 3. Host cost per layer call: vLLM's kernel + our classes against our FusedMoEModularKernel.
for experts in triton deep_gemm; do
    python3 tests/vllm_support/host_cost.py "$OUT/vllm_host_cost_$experts.json" \
        --experts "$experts" 2>&1 | tee "$OUT/vllm_host_cost_$experts.log" || status=1
done
exit $status
