"""Host cost per eager layer call of keeping an expert-parallel group in step (issue 29), on CPU.

Two source trees, each a `git archive` of one revision (--before, --after), run the same layer
(DeepEP high-throughput prepare/finalize over TorchAll2AllBuffer, TritonExperts' torch references
on CPU; E=8, K=256, I=256, top-2) in fresh processes, alternating revision round by round so that
both see the same machine state. Each process times `calls` layer calls back to back per round
(timeit, best of `repeat`) at M=1 and M=128 on one gloo rank and on two gloo ranks (rank 0's
time; without max_tokens_across_ranks, so the pass count all-reduce runs, and with it). The
anchor is the before revision itself: the table's "added" column is after - before, the same run.

    python -m benchmarks.bench_collective_safety --before REV --after REV
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
E, K, I, TOPK = 8, 256, 256, 2


def _extract(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "vllm_moe_fixes"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _rank(rank, world, calls, repeat):
    """One rank's best time per layer call (us) for each (M, max_tokens given)."""
    import torch

    from vllm_moe_fixes.distributed import TorchAll2AllBuffer
    from vllm_moe_fixes.fused_moe import (
        DeepEPHTPrepareAndFinalize,
        FusedMoEModularKernel,
        TritonExperts,
        local_expert_map,
    )
    from vllm_moe_fixes.testing import random_fp8_moe_weights

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = random_fp8_moe_weights(E, K, I, generator=g)
    e_l = E // world
    rows = slice(rank * e_l, (rank + 1) * e_l)
    w1, s1, w2, s2 = (t[rows].contiguous() for t in full)
    expert_map = local_expert_map(torch.distributed.group.WORLD, E) if world > 1 else None
    pf = DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                    rank_expert_offset=rank * e_l)
    kernel = FusedMoEModularKernel(pf, TritonExperts())
    out = {}
    for m in (1, 128):
        x = torch.randn(m, K, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(m)])
        w = torch.rand(m, TOPK, generator=g)
        for given in (None, m) if world > 1 else (None,):
            def call():
                kernel(x, w1, w2, w, ids, w1_scale=s1, w2_scale=s2, global_num_experts=E,
                       expert_map=expert_map, max_tokens_across_ranks=given)
            call()
            best = min(timeit.repeat(call, number=calls, repeat=repeat)) / calls * 1e6
            out[f"M={m}" + (" max given" if given else "")] = best
    return out


def _worker(args) -> None:
    sys.path.insert(0, args.tree)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm_moe_fixes.distributed.launch import run_distributed
    got = run_distributed(_rank, args.world, args.calls, args.repeat)
    print(json.dumps(got[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    revs = {"before": args.before, "after": args.after}
    best: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: _extract(rev, Path(tmp) / name) for name, rev in revs.items()}
        for _ in range(args.rounds):
            for world in (1, 2):
                for name, tree in trees.items():
                    cmd = [sys.executable, "-m", "benchmarks.bench_collective_safety", "--worker",
                           "--before", "-", "--tree", str(tree), "--world", str(world),
                           "--calls", str(args.calls), "--repeat", str(args.repeat)]
                    got = json.loads(subprocess.run(cmd, cwd=tmp, check=True, capture_output=True,
                                                    text=True, env={**os.environ, "PYTHONPATH":
                                                                    f"{tree}:{REPO}"}
                                                    ).stdout.strip().splitlines()[-1])
                    for case, us in got.items():
                        key = (world, case)
                        best.setdefault(key, {}).setdefault(name, us)
                        best[key][name] = min(best[key][name], us)
    rows = [{"ranks": w, "case": c, "before_us": round(v["before"], 1),
             "after_us": round(v["after"], 1), "added_us": round(v["after"] - v["before"], 1)}
            for (w, c), v in sorted(best.items())]
    print(f"{'ranks':>5} {'case':<16} {'before us':>10} {'after us':>10} {'added us':>9}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['case']:<16} {r['before_us']:>10} {r['after_us']:>10} "
              f"{r['added_us']:>9}")
    sys.path.insert(0, str(REPO))
    from benchmarks._common import write_json
    print(write_json("collective_safety", {"revisions": revs, "rows": rows}))


if __name__ == "__main__":
    main()
