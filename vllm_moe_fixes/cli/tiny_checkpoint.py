"""``vllm-moe-fixes tiny-checkpoint DIR [--family mixtral|qwen3_moe] [--seed N]``: a tiny random
MoE checkpoint in Hugging Face's layout (config.json + model.safetensors, no tokenizer) whose
experts are block-FP8 (128x128, float32 ``weight_scale_inv``, the format of vLLM's Fp8Config;
attention and router left in bf16): one line to try ``vllm-moe-fixes serve`` on, with
``--skip-tokenizer-init`` and token-id prompts.

    write_checkpoint(path, family, seed) -> path          the block-FP8 checkpoint
    write_pair(root, family, seed) -> (fp8_dir, bf16_dir)  and the same model with those experts
                                                           dequantised to bf16 (no quantisation)

Families: ``mixtral`` (MixtralForCausalLM: block_sparse_moe.experts.E.w1 / w3 / w2) and
``qwen3_moe`` (Qwen3MoeForCausalLM: mlp.experts.E.gate_proj / up_proj / down_proj, q/k norms).
Sizes are multiples of 128 where the kernels need it (hidden 256, expert intermediate 128).
Logits are scaled up (lm_head std 0.4, so about 6 across tokens) to keep most greedy choices
clear of near-ties, which the activations' FP8 rounding could otherwise flip.
"""

from __future__ import annotations

import argparse
import json
import os

from vllm_moe_fixes.cli._common import SEED, UsageError, import_torch

HELP = "write a tiny random block-FP8 MoE checkpoint (no tokenizer) to serve"

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 128, 2, 4, 2, 64
EXPERTS, TOPK, VOCAB = 8, 2, 64
# w2's std: the experts add about a third of the residual stream's size per layer, enough that a
# wrong expert output changes the greedy tokens, small enough that FP8 rounding does not.
EXPERT_OUT_STD = 0.5 * INTERMEDIATE ** -0.5

FAMILIES = {
    # architecture, model_type, MoE module name, (gate, up, down) expert weight names
    "mixtral": ("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe", "mlp",
                  ("gate_proj", "up_proj", "down_proj")),
}


def _config(family: str, quantized: bool) -> dict:
    arch, model_type, moe, _ = FAMILIES[family]
    config = dict(
        architectures=[arch], model_type=model_type, hidden_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
        bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        config.update(intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                      num_experts_per_tok=TOPK, sliding_window=None)
    else:
        config.update(intermediate_size=4 * INTERMEDIATE, moe_intermediate_size=INTERMEDIATE,
                      num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
    if quantized:
        attention = [f"model.layers.{layer}.self_attn.{p}" for layer in range(LAYERS)
                     for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        config["quantization_config"] = dict(
            quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128],
            ignored_layers=attention + [f"model.layers.{layer}.{moe}.gate"
                                        for layer in range(LAYERS)])
    return config


def _random_tensors(family: str, g: torch.Generator) -> tuple[dict, dict]:
    """(bf16 tensors of everything but the experts, {name: float32 expert weight})."""
    import torch

    _, _, moe, (gate, up, down) = FAMILIES[family]

    def randn(*shape, std):
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    dense = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN, std=1.0),
             "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
             "lm_head.weight": randn(VOCAB, HIDDEN, std=0.4)}
    experts = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            dense[f"{p}{name}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for name, rows in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV_HEADS * HEAD_DIM),
                           ("v_proj", KV_HEADS * HEAD_DIM)):
            dense[f"{p}self_attn.{name}.weight"] = randn(rows, HIDDEN, std=HIDDEN ** -0.5)
        dense[f"{p}self_attn.o_proj.weight"] = randn(HIDDEN, HEADS * HEAD_DIM,
                                                     std=(HEADS * HEAD_DIM) ** -0.5)
        if family == "qwen3_moe":
            for name in ("q_norm", "k_norm"):
                dense[f"{p}self_attn.{name}.weight"] = torch.ones(HEAD_DIM, dtype=torch.bfloat16)
        dense[f"{p}{moe}.gate.weight"] = randn(EXPERTS, HIDDEN, std=HIDDEN ** -0.5)
        for e in range(EXPERTS):
            q = f"{p}{moe}.experts.{e}."
            experts[f"{q}{gate}.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=g) \
                * HIDDEN ** -0.5
            experts[f"{q}{up}.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=g) \
                * HIDDEN ** -0.5
            experts[f"{q}{down}.weight"] = torch.randn(HIDDEN, INTERMEDIATE, generator=g) \
                * EXPERT_OUT_STD
    return dense, experts


def _write(path: str, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def _fp8_and_bf16(family: str, seed: int) -> tuple[dict, dict]:
    """The tensors of the block-FP8 checkpoint and of its bf16 twin (experts dequantised)."""
    import torch

    from vllm_moe_fixes.ops.fp8 import dequant_block_fp8
    from vllm_moe_fixes.testing import quant_block_fp8

    dense, experts = _random_tensors(family, torch.Generator().manual_seed(seed))
    fp8, bf16 = dict(dense), dict(dense)
    for name, w in experts.items():
        q, scale = quant_block_fp8(w)
        fp8[name] = q
        fp8[name.replace(".weight", ".weight_scale_inv")] = scale
        bf16[name] = dequant_block_fp8(q, scale).bfloat16()
    return fp8, bf16


def write_checkpoint(path: str, family: str = "mixtral", seed: int = 0) -> str:
    """Write the block-FP8 checkpoint of ``family`` (FAMILIES) drawn from ``seed`` into
    ``path`` (created if missing); return ``path``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    fp8, _ = _fp8_and_bf16(family, seed)
    return _write(path, _config(family, True), fp8)


def write_pair(root: str, family: str, seed: int = 0) -> tuple[str, str]:
    """Write ``root/<family>_fp8`` (block-FP8 experts, as ``write_checkpoint``) and
    ``root/<family>_bf16`` (the same experts dequantised to bf16); return the two directories."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    fp8, bf16 = _fp8_and_bf16(family, seed)
    return (_write(os.path.join(root, f"{family}_fp8"), _config(family, True), fp8),
            _write(os.path.join(root, f"{family}_bf16"), _config(family, False), bf16))


# ---------------------------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="where to write config.json and model.safetensors (a new or "
                        "empty directory)")
    parser.add_argument("--family", choices=tuple(FAMILIES), default="mixtral",
                        help="the architecture (default mixtral)")
    parser.add_argument("--seed", type=SEED, default=0, help="the weights' random seed")


def run(args: argparse.Namespace) -> int:
    if os.path.exists(args.dir) and (not os.path.isdir(args.dir) or os.listdir(args.dir)):
        raise UsageError(f"tiny-checkpoint writes into a new or empty directory; {args.dir!r} "
                         "is a file or not empty")
    import_torch("tiny-checkpoint")
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise UsageError("tiny-checkpoint needs safetensors (vLLM installs it): "
                         "pip install safetensors") from None
    path = write_checkpoint(args.dir, args.family, args.seed)
    print(f"wrote a tiny block-FP8 {FAMILIES[args.family][0]} ({EXPERTS} experts, top-{TOPK}, "
          f"{LAYERS} layers, vocabulary {VOCAB}, no tokenizer) to {path}")
    print("serve it on CPU (token-id prompts, no tokenizer):")
    print(f"  VLLM_CPU_KVCACHE_SPACE=1 vllm-moe-fixes serve {path} --skip-tokenizer-init "
          "--enforce-eager --max-model-len 64")
    return 0
