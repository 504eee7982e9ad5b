#!/usr/bin/env bash
# The vLLM plugin's GPU checks, on one H200. NOT YET RUN (written while no device was lent).
#
#   bash tests/vllm_support/device_run.sh VLLM_SRC RESULTS_DIR
#
# VLLM_SRC: an unpacked vLLM 0.33.0 source tree (its sdist: vllm/ and tests/), with the pure-Python
# wheels it needs already installed (pip install --no-deps) and without vLLM's compiled .so files,
# which are too large to carry to the device; the stand-ins of tests/vllm_support/stand_ins take
# their place for the few ops these checks reach. DeepEP and DeepGEMM come from
# benchmarks/device_build.sh. Writes RESULTS_DIR/vllm_*.log and vllm_host_cost_*.json: copy them
# into benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
VLLM_SRC=$(realpath "$1")
OUT=$(realpath -m "$2")
mkdir -p "$OUT"
python3 tests/vllm_support/install_stand_ins.py "$VLLM_SRC/vllm"
export PYTHONPATH="$PWD:$VLLM_SRC${PYTHONPATH:+:$PYTHONPATH}"
status=0

# 1. vLLM's own harness with our pairs registered (single GPU cases), in this process and in the
#    rank it spawns for each case (sitecustomize.py in tests/vllm_support registers there). Its
#    case ids number the classes instead of naming them, so every single-GPU case runs, vLLM's
#    pairs too; -v prints each case's classes (PF=..., FE=...).
PYTHONPATH="$PWD/tests/vllm_support:$PYTHONPATH" python3 -m pytest -v -p mk_registration \
    "$VLLM_SRC/tests/kernels/moe/test_modular_kernel_combinations.py" -k singlegpu \
    2>&1 | tee "$OUT/vllm_harness_singlegpu.log" || status=1

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
