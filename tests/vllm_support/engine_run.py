"""Run vLLM's offline ``LLM`` engine on each model directory given, one after the other in this
process, and write what it produced as JSON:

    python tests/vllm_support/engine_run.py OUT.json [compiled:]MODEL_DIR [[compiled:]MODEL_DIR ...]

    {argument: {"tokens": [[int, ...] per prompt],
                "top_logprobs": [[{token id: logprob} of the top 2, per step] per prompt],
                "prompt_logprobs": [[float, ...] per prompt]}}

Greedy decoding (temperature 0) of PROMPTS (token ids: the tiny checkpoints have no tokenizer),
ENGINE_SIZES (one small KV cache; every prompt fits one batch). The top-2 log-probs of each step
are what the near-tie rule (greedy.py) reads. A plain MODEL_DIR runs in eager mode
(``enforce_eager=True``, which also skips the start-up profile run); ``compiled:MODEL_DIR`` in
vLLM's default compiled mode, whose profile (dummy) run and forward passes torch dynamo traces.
The prompt log-probs are those of the prompt's own tokens (the first has none). VLLM_MOE_FIXES
and the other variables come from the caller's environment; the plugin loads through its entry
point in every vLLM process.
"""

from __future__ import annotations

import gc
import json
import sys

PROMPTS = [[1, 17, 54, 9, 30, 41, 7], [1, 50, 3, 3, 28], [1, 44, 45, 46, 47, 48, 49, 60, 61]]
MAX_TOKENS = 8
ENGINE_SIZES = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)


def run(argument: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    model = argument.removeprefix("compiled:")
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=model == argument, seed=0, distributed_executor_backend="uni",
              **ENGINE_SIZES)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=0,
                            detokenize=False, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    result = {"tokens": [], "top_logprobs": [], "prompt_logprobs": []}
    for prompt, out in zip(PROMPTS, outputs):
        result["tokens"].append(list(out.outputs[0].token_ids))
        result["top_logprobs"].append([{t: lp.logprob for t, lp in step.items()}
                                       for step in out.outputs[0].logprobs])
        result["prompt_logprobs"].append([entry[token].logprob for token, entry in
                                          zip(prompt[1:], out.prompt_logprobs[1:])])
    del llm
    cleanup_dist_env_and_memory()
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    out_path, models = argv[0], argv[1:]
    results = {argument: run(argument) for argument in models}
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
