#!/usr/bin/env bash
# A session's closing GPU check in one device call on one H200 (about 8 minutes):
#
#     bash benchmarks/device_session.sh      # carry .deps/deps_src.tar.xz, .deps/*.so.gz, .vllm_carry
#                                            # and .deps/dg_jit_cache.tgz where an earlier call left one
#
# In parallel: (a) the GPU suite with the real DeepEP v1.2.1 and DeepGEMM v2.6.1 (device_run.sh
# tests), (b) vLLM 0.33's harness on our single-GPU cases, our adapters inside vLLM's kernel on the
# GPU and their host cost (tests/vllm_support/device_run.sh ours). Then, alone on the GPU so that
# nothing else runs beside the timings, (c) the decode layer and the contiguous layer against
# vLLM's own paths (decode twice). Logs and JUnit files of (a) and (b) go to $OUT/tests.tgz, the
# benchmarks' logs and JSON to $OUT itself (a call brings back at most 8 files). Limits in seconds:
# SUITE_S, VLLM_S, DECODE_RUNS x DECODE_S, EXPERTS_S.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FINAL="${OUT:-/tmp/out}"
export OUT="$FINAL/session"
mkdir -p "$OUT"
[[ -d .deps/DeepGEMM/csrc ]] || tar xJf .deps/deps_src.tar.xz -C .deps
# DeepGEMM compiles each kernel with NVCC at its first use (most of a minute per fresh machine):
# a cache carried back from an earlier call (.deps/dg_jit_cache.tgz) is unpacked first.
[[ -f .deps/dg_jit_cache.tgz && ! -d .deps/dg_jit_cache ]] && tar xzf .deps/dg_jit_cache.tgz -C .deps
BENCHES=" " bash benchmarks/device_run.sh bench >"$OUT/libraries.log" 2>&1
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR="$PWD/.deps/dg_jit_cache"
export PYTHONPATH="$PWD/.deps/DeepEP:$PWD/.deps/DeepGEMM${PYTHONPATH:+:$PYTHONPATH}"

TEST_TIMEOUT=${SUITE_S:-310} bash benchmarks/device_run.sh tests >"$OUT/suite.log" 2>&1 &
suite=$!
timeout -k 5 ${VLLM_S:-330} bash tests/vllm_support/device_run.sh .vllm_carry "$OUT/vllm" ours \
    >"$OUT/vllm.log" 2>&1 &
vllm=$!
wait $suite; echo "GPU suite: status $?"; tail -n 6 "$OUT/suite.log"
wait $vllm; echo "vLLM checks: status $?"; grep -E "passed|failed|error" "$OUT/vllm.log" | tail -n 8
tar czf "$FINAL/tests.tgz" -C "$FINAL" session && rm -rf "$OUT" && mkdir -p "$OUT"

# Nothing of (a) or (b) may run on beside the timings: ranks or harness processes that outlive
# their timeout would load the CPUs under the host timings. Kill what is left, show the load.
pkill -9 -f "pytest" 2>/dev/null; pkill -9 -f "multiprocessing" 2>/dev/null
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    kill -9 "$pid" 2>/dev/null
done
sleep 2; echo "load before the benchmarks: $(cut -d' ' -f1-3 /proc/loadavg)"

# (c) vLLM's Python tree (unpacked by (b)) serves as the anchor of both layer benchmarks. Each
# file lands in $FINAL as soon as it exists: a call stopped at its limit keeps what was measured.
export PYTHONPATH="/tmp/v033_site:$PYTHONPATH"
for run in $(seq "${DECODE_RUNS:-2}"); do
    timeout -k 5 "${DECODE_S:-60}" python3 -m benchmarks.bench_decode --calls 100 --rounds 3 \
        >"$FINAL/decode_$run.log" 2>&1
    cp benchmarks/results/decode.json "$FINAL/decode_$run.json" 2>/dev/null
    tail -n 16 "$FINAL/decode_$run.log"
done
timeout -k 5 "${EXPERTS_S:-150}" python3 -m benchmarks.bench_experts --skip-chunks --skip-batched \
    >"$FINAL/experts.log" 2>&1
tail -n 24 "$FINAL/experts.log"
cp benchmarks/results/experts.json "$FINAL/" 2>/dev/null
rm -rf "$OUT"
# The JIT cache for the next call (carry it as .deps/dg_jit_cache.tgz), if it fits a returned file.
tar czf "$FINAL/dg_jit_cache.tgz" -C .deps dg_jit_cache 2>/dev/null
[[ $(stat -c %s "$FINAL/dg_jit_cache.tgz" 2>/dev/null || echo 0) -le 16000000 ]] \
    || rm -f "$FINAL/dg_jit_cache.tgz"
