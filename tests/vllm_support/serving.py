"""A ``vllm-moe-fixes serve`` server for a test, a client that asks it for greedy tokens, and the
one-rank reference they are compared with (``greedy.check_all``).

    completions, log = serve_and_complete(model, vllm_args, env, log_path, START_TIMEOUT_S)
    reference = one_rank_reference(model, out_path, env)

``serve_and_complete`` starts ``python -m vllm_moe_fixes serve MODEL`` (the package's command:
vLLM's CLI with the plugin on) with ENGINE_SIZES, no tokenizer, bf16 and then ``vllm_args`` (any
vLLM serve options: ``--enable-eplb``, ``--data-parallel-size=2``, ...), waits for /health, posts
engine_run.PROMPTS (token ids: the tiny checkpoints have no tokenizer) at once, so that a
data-parallel server spreads them over its ranks, stops the server and returns per prompt the
generated token ids and, per step, the top-2 log-probs {token id: logprob} (the OpenAI API's
``logprobs: 2``), with the server's log. ``one_rank_reference`` runs vLLM's offline engine on one
rank, eager, in a child process (engine_run.py): the same fields. Both take the caller's env
(VLLM_CPU_KVCACHE_SPACE and the like); the serve command sets VLLM_MOE_FIXES=1 unless env has it.
"""

from __future__ import annotations

import contextlib
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

from engine_run import ENGINE_SIZES, MAX_TOKENS, PROMPTS
from greedy import check_all, largest_gap_move

ENGINE_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_run.py")
# A server's start on 2 busy cores: 60-180 s eager, longer compiled or with several ranks.
START_TIMEOUT_S = 420


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


def wait_until_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
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


@contextlib.contextmanager
def served(command: list[str], env: dict, log_path: str, port: int, timeout_s: float):
    """Run ``command`` (a server listening on ``port``) with its output in ``log_path`` until
    /health answers; yields the process, stops it (its whole process group) on exit."""
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        try:
            wait_until_ready(port, server, timeout_s)
            yield server
        finally:
            stop_server(server)


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion of token-id ``prompt``: {"tokens": [...], "top_logprobs": [{id: lp}
    per step]}."""
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
    """Every prompt posted at once; per prompt what ``complete`` returns."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(port, model, p, max_tokens), prompts))


def serve_command(model: str, port: int, vllm_args: list[str]) -> list[str]:
    """``python -m vllm_moe_fixes serve model`` on ``port`` with ENGINE_SIZES, no tokenizer, bf16
    and then ``vllm_args``."""
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_SIZES.items()]
    return [sys.executable, "-m", "vllm_moe_fixes", "serve", model, f"--port={port}",
            "--skip-tokenizer-init", "--dtype=bfloat16", *sizes, *vllm_args]


def serve_and_complete(model: str, vllm_args: list[str], env: dict, log_path: str,
                       timeout_s: float = START_TIMEOUT_S) -> tuple[list[dict], str]:
    """Serve ``model`` (``serve_command``) with env, ask it for PROMPTS' greedy completions, stop
    it; returns the completions and the server's log."""
    port = free_port()
    with served(serve_command(model, port, vllm_args), env, log_path, port, timeout_s):
        got = greedy_completions(port, model, PROMPTS, MAX_TOKENS)
    with open(log_path) as f:
        return got, f.read()


def one_rank_reference(model: str, out_path: str, env: dict) -> list[dict]:
    """vLLM's offline engine on one rank, eager (engine_run.py in a child process with env): per
    prompt {"tokens", "top_logprobs", "prompt_logprobs"}."""
    one = subprocess.run([sys.executable, ENGINE_RUN, out_path, model], capture_output=True,
                         text=True, timeout=300, env=dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert one.returncode == 0, (one.stdout + one.stderr)[-5000:]
    with open(out_path) as f:
        result = json.load(f)[model]
    return [dict(zip(result, values)) for values in zip(*result.values())]


def check_against(got: list[dict], reference: list[dict]) -> list[str]:
    """``greedy.check_all`` of served completions against a reference, labelled by prompt; also
    prints the largest move of a top-2 gap between the two (``greedy.largest_gap_move``)."""
    move = max(largest_gap_move(g["tokens"], g["top_logprobs"], r["tokens"], r["top_logprobs"])
               for g, r in zip(got, reference))
    print(f"largest top-2 log-prob gap move against the reference: {move:.4f}")
    return check_all([g["tokens"] for g in got], [r["tokens"] for r in reference],
                     [r["top_logprobs"] for r in reference],
                     [f"prompt {p}" for p in PROMPTS])
