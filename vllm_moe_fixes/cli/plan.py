"""``vllm-moe-fixes plan``: expert load, memory and DeepEP buffers of a DP/EP dummy run (the
planner; no torch import)."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_moe_fixes import envs
from vllm_moe_fixes.cli._common import SEED, UsageError, int_at_least, positive_float

HELP = "expert load, memory and DeepEP buffers of a DP/EP dummy run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vllm_moe_fixes.planner import DEFAULT_GPU_MEMORY_GIB

    p.add_argument("--model", required=True, help="preset name or a JSON file of the same fields")
    p.add_argument("--dp", type=int_at_least(1), required=True, help="data-parallel ranks")
    p.add_argument("--ep", type=int_at_least(1), default=None,
                   help="ranks per EP group (default: --dp)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=None,
                   help="dummy tokens per rank (default VLLM_MOE_DP_CHUNK_SIZE)")
    p.add_argument("--backend", default=None, choices=envs.ALL2ALL_BACKENDS,
                   help="all-to-all backend (default VLLM_ALL2ALL_BACKEND)")
    p.add_argument("--gpu-memory-gib", type=positive_float, default=DEFAULT_GPU_MEMORY_GIB,
                   help="memory per GPU for the OOM flag (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=0, help="routing simulation seed")
    p.add_argument("--redundant-experts", type=int_at_least(0), default=None,
                   help="also plan EPLB with this many redundant experts (E + R divisible by "
                        "--ep): per-rank weights, DeepEP buffers and memory with and without "
                        "EPLB; exit status 1 where the EPLB placement does not fit")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from vllm_moe_fixes.config import load_model_config
    from vllm_moe_fixes.planner import eplb_refusal, format_plan, make_plan

    try:
        cfg = load_model_config(args.model)
        plan = make_plan(cfg, dp=args.dp, ep=args.ep, max_tokens=args.max_tokens,
                         backend=args.backend, gpu_memory_gib=args.gpu_memory_gib, seed=args.seed,
                         redundant_experts=args.redundant_experts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    refusal = eplb_refusal(plan)
    if refusal is not None:
        print(f"refused: the EPLB placement does not fit: {refusal}", file=sys.stderr)
        return 1
    return 0
