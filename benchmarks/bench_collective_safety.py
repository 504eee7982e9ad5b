"""Host cost per eager layer call of keeping an expert-parallel group in step (issue 29).

What the compared revisions differ in (default: before = f0e6ed0^, after = 52849af, the safety
commits f0e6ed0, 2e107ca, 52849af on that same base; --now adds the working tree): the pass-count
all-reduce carries a fourth integer (each rank's verdict), every torch-buffer dispatch sends a
PassStamp beside its counts in the count exchange, the prepare/finalize plans its passes
(PassStamp) and stamps each dispatch, the kernel's checks sit in a try, and num_chunks refuses
more than 2**16 passes.

How: each revision's package is a copy renamed vmf_<label> (imports and the custom op's namespace
rewritten), so that all revisions live in ONE process per rank and are timed in interleaved rounds
(the order rotating round by round): what the machine does at one moment it does to all of them.
Each timing is the mean of `calls` back-to-back calls (a synchronisation at the end on CUDA); a
revision's figure is its best round, and "added" is that minus before's best round (also the
median over rounds of the same round's difference). The before revision is carried twice
("before" and "before_again": its own copy, its own layer objects): their difference is the
run's noise floor, printed beside every row. The anchor is the before revision, in the same run.

The layer: DeepEPHTPrepareAndFinalize over TorchAll2AllBuffer + TritonExperts (E=4, K=128, I=128,
top-2: small, so that the host work dominates) at M=1 and M=128, and at one rank on CUDA also
DeepEPLLPrepareAndFinalize over a TorchAll2AllBuffer in low-latency mode + BatchedTritonExperts
(K=2048, DeepEP's smallest low-latency hidden; N=128). Cases:
  - one rank (--device cpu or cuda): what each rank's Python does more per call, no collective
    agreeing anything (the count exchange and the stamp still run). Besides the layer call, the
    changed steps alone: the pass plan and stamp (num_chunks, _stamp_pass), the count exchange
    (TorchAll2AllBuffer._agree_counts), and its host part (the all-to-all of one rank replaced by
    a copy: what the stamp adds around the collective, without the collective's own jitter);
  - two gloo ranks (--ranks 2, CPU), each process pinned to cores of its own (--cores 4,5 6,7: a
    rank's main thread and gloo's worker thread each get one; on one core they take turns, and a
    collective then costs milliseconds, all noise): rank 0's time per call, without
    max_tokens_across_ranks (the pass-count all-reduce runs, carrying the verdict) and with it
    (no all-reduce; the stamp compared in the count exchange).
The layer's difference is the sum of the steps' differences, but its own noise (tens of us, see
noise_us) is larger than they are: the steps alone are what decides.

    python -m benchmarks.bench_collective_safety                # CPU, 1 and 2 ranks: ~1.5 min
    python -m benchmarks.bench_collective_safety --prepare --trees DIR   # the copies only
    python -m benchmarks.bench_collective_safety --trees DIR --now --device cuda --ranks 1

Revisions are copied with git archive into --trees, or taken from there when a copy of the same
revision name is there already (a machine without the history runs copies made by --prepare).
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
E, I, TOPK, LL_N = 4, 128, 2, 128
HIDDEN = {"HT": 128, "LL": 2048}  # K per path; DeepEP's low-latency sizes start at 2048
TOKENS = (1, 128)


# ----------------------------------------------------------------- the trees (one per revision)
def _rename(tree: Path, package: str) -> None:
    """Rewrite every module of tree so that the package imports itself as `package`."""
    for path in tree.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bvllm_moe_fixes\b", package, text))


def _materialise(rev: str | None, label: str, trees: Path) -> str:
    """trees/vmf_<label>: the package of rev (None: the working tree), renamed; its name. A tree
    of the same rev written earlier (its REVISION file) is kept: a machine without the
    repository's history runs copies prepared elsewhere (--prepare)."""
    package, into = f"vmf_{label}", trees / f"vmf_{label}"
    marker = into / "REVISION"
    if rev is not None and marker.is_file() and marker.read_text() == rev:
        return package
    shutil.rmtree(into, ignore_errors=True)
    trees.mkdir(parents=True, exist_ok=True)
    if rev is None:
        shutil.copytree(REPO / "vllm_moe_fixes", into,
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        with tempfile.TemporaryDirectory(dir=trees) as tmp:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "vllm_moe_fixes"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            shutil.move(os.path.join(tmp, "vllm_moe_fixes"), into)
        marker.write_text(rev)
    _rename(into, package)
    return package


# ----------------------------------------------------------------- one rank
def _layers(package: str, rank: int, world: int, device: str) -> dict:
    """name -> (kernel, weights, expert_map) of one revision, built with its own classes."""
    import importlib

    import torch
    import torch.distributed as dist

    fm = importlib.import_module(f"{package}.fused_moe")
    TorchAll2AllBuffer = importlib.import_module(f"{package}.distributed").TorchAll2AllBuffer
    random_weights = importlib.import_module(f"{package}.testing").random_fp8_moe_weights
    e_l = E // world

    def local(k: int) -> tuple:
        weights = random_weights(E, k, I, generator=torch.Generator(device=device).manual_seed(0),
                                 device=device)
        return tuple(t[rank * e_l:(rank + 1) * e_l].contiguous() for t in weights)

    expert_map = fm.local_expert_map(dist.group.WORLD, E, device) if world > 1 else None
    ht = fm.DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                       rank_expert_offset=rank * e_l)
    layers = {"HT": (fm.FusedMoEModularKernel(ht, fm.TritonExperts()), local(HIDDEN["HT"]),
                     expert_map)}
    if world == 1 and device == "cuda":  # on CPU the low-latency layer is compute-bound
        buffer = TorchAll2AllBuffer(None, low_latency_mode=True,
                                    num_max_dispatch_tokens_per_rank=LL_N, hidden=HIDDEN["LL"],
                                    num_experts=E)
        ll = fm.DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=LL_N)
        layers["LL"] = (fm.FusedMoEModularKernel(ll, fm.BatchedTritonExperts()),
                        local(HIDDEN["LL"]), None)
    return layers


def _inputs(m: int, k: int, device: str, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(m)])
    w = torch.rand(m, TOPK, generator=g)
    return x.to(device), w.to(device), ids.to(device)


def _without_collective(module, fn):
    """fn with module's run_collective replaced by a copy for its duration (one rank: the
    all-to-all of a group of one is a copy), so that only the host work around it is timed."""

    def copy(collective, out, inp, **kwargs):
        out.copy_(inp)

    def call():
        real, module.run_collective = module.run_collective, copy
        try:
            fn()
        finally:
            module.run_collective = real
    return call


def _cases(layers: dict, labels: list[str], ranks: int, device: str):
    """(case, {label: fn}) in one order on every rank: the changed steps alone (the count
    exchange, the pass plan and stamp), then the whole layer call."""
    import importlib

    for m in TOKENS:
        for path in layers[labels[0]]:
            x, w, ids = _inputs(m, HIDDEN[path], device, seed=m)
            for given in ((None, m) if ranks > 1 else (None,)):
                tail = f"M={m}" + (" max given" if given else "")
                plan, counts, host, layer = {}, {}, {}, {}
                for label in labels:
                    kernel, (w1, s1, w2, s2), expert_map = layers[label][path]
                    pf = kernel.prepare_finalize
                    package = label.removesuffix("_again")
                    chunk = importlib.import_module(f"vmf_{package}.envs") \
                        .VLLM_FUSED_MOE_CHUNK_SIZE
                    stamp = getattr(pf, "_stamp_pass", None)  # absent before the stamps

                    def plan_call(pf=pf, chunk=chunk, stamp=stamp):
                        pf.num_chunks(m, chunk, given)
                        if stamp is not None:
                            stamp()
                    plan[label] = plan_call
                    if path == "HT" and given is None:
                        buf = pf.buffer
                        per_rank, _, per_expert, _, _ = buf.get_dispatch_layout(ids.long(), E)
                        counts[label] = (lambda buf=buf, a=per_rank, b=per_expert:
                                         buf._agree_counts(a, b, 1))
                        if ranks == 1:
                            host[label] = _without_collective(
                                importlib.import_module(f"vmf_{package}.distributed.torch_buffer"),
                                counts[label])

                    def call(kernel=kernel, w1=w1, s1=s1, w2=w2, s2=s2, expert_map=expert_map):
                        kernel(x, w1, w2, w, ids, w1_scale=s1, w2_scale=s2, global_num_experts=E,
                               expert_map=expert_map, max_tokens_across_ranks=given)
                    layer[label] = call
                yield f"{path} plan+stamp {tail}", plan
                if counts:
                    yield f"{path} count exchange {tail}", counts
                if host:
                    yield f"{path} count exchange, host part {tail}", host
                yield f"{path} layer {tail}", layer


def _rank_main(args) -> None:
    """One rank: join the group, build every revision's layers, time each case's revisions in
    interleaved rounds; rank 0 prints {case: {revision: [per-call us of each round]}} as JSON."""
    import datetime

    import torch
    import torch.distributed as dist

    if args.core is not None:  # cores this process may use (on a smaller machine: wrapped)
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {allowed[int(c) % len(allowed)] for c in args.core.split(",")})
    torch.set_num_threads(1)
    sys.path.insert(0, args.trees)
    backend = "nccl" if args.device == "cuda" else "gloo"
    extra = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=60),
                            **extra)
    labels = args.labels.split(",")
    # "before_again": the before revision's package once more, as its own layer objects
    layers = {label: _layers(f"vmf_{label.removesuffix('_again')}", args.rank, args.ranks,
                             args.device) for label in labels}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict = {}
    for case, fns in _cases(layers, labels, args.ranks, args.device):
        calls = args.calls * (1 if " layer " in case else 5)  # the steps alone are short
        try:
            for fn in fns.values():  # compile, JIT and allocate outside the timings
                for _ in range(5):
                    fn()
            sync()
        except Exception as e:  # noqa: BLE001 (a revision that cannot run a case: say why)
            times[case] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{case}: {times[case]['error']}", file=sys.stderr, flush=True)
            continue
        per_round = {label: [] for label in labels}
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                fn = fns[label]
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync()
                per_round[label].append((time.perf_counter() - t0) / calls * 1e6)
        times[case] = per_round
        if args.partial and args.rank == 0:  # what a run cut short by a time limit has done
            Path(args.partial).write_text(json.dumps({"ranks": args.ranks, "device": args.device,
                                                      "labels": labels, "times": times}))
    dist.barrier()
    dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps(times))


def _run_ranks(args, labels: list[str], cores: list[str | None]) -> dict:
    """Start args.ranks rank processes, each pinned to its cores; rank 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(args.ranks):
            cmd = [sys.executable, "-m", "benchmarks.bench_collective_safety", "--rank-of",
                   str(rank), "--ranks", str(args.ranks), "--store", f"{tmp}/store",
                   "--trees", str(args.trees), "--labels", ",".join(labels), "--device",
                   args.device, "--calls", str(args.calls), "--rounds", str(args.rounds)]
            if args.out and rank == 0:
                cmd += ["--partial", f"{args.out}.{args.ranks}ranks.partial"]
            if cores[rank] is not None:
                cmd += ["--core", cores[rank]]
            procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                                          env={**os.environ, "TRITON_INTERPRET": "0"
                                               if args.device == "cuda" else "1"}))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def _rows(times: dict, labels: list[str], ranks: int, device: str) -> list[dict]:
    rows = []
    for case, per_round in times.items():
        if "error" in per_round:
            rows.append({"ranks": ranks, "device": device, "case": case,
                         "error": per_round["error"]})
            continue
        best = {label: min(v) for label, v in per_round.items()}
        row = {"ranks": ranks, "device": device, "case": case}
        row.update({f"{label}_us": round(us, 2) for label, us in best.items()})
        for label in labels:
            if label not in ("before", "before_again"):
                row[f"{label}_added_us"] = round(best[label] - best["before"], 2)
        row["noise_us"] = round(best["before_again"] - best["before"], 2)
        if "after" in per_round:  # the median over rounds of (after - before) in the same round
            diffs = sorted(a - b for a, b in zip(per_round["after"], per_round["before"]))
            row["after_added_paired_us"] = round(diffs[len(diffs) // 2], 2)
        # the spread of one revision's rounds, as a share of its best
        row["spread_pct"] = round(100 * (sorted(per_round["before"])[len(per_round["before"])
                                                                     // 2] / best["before"] - 1), 1)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="f0e6ed0^")
    parser.add_argument("--after", default="52849af")
    parser.add_argument("--now", action="store_true", help="also time the working tree")
    parser.add_argument("--trees", default=os.path.join(tempfile.gettempdir(),
                                                        "bench_collective_safety_trees"))
    parser.add_argument("--prepare", action="store_true", help="write the trees and stop")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cores", nargs="*", default=[],
                        help="cores to pin the ranks to, a comma-separated set per rank "
                             "(default: not pinned)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="write the run's JSON there (default: stored as --name "
                                      "among the runs of benchmarks/results/"
                                      "collective_safety.json)")
    parser.add_argument("--name", help="the run's name in the results (default: host_device)")
    parser.add_argument("--merge", nargs="+", metavar="NAME=PATH",
                        help="store runs written with --out (or the .partial dump of one cut "
                             "short) in the results under NAME, and stop")
    parser.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--labels", help=argparse.SUPPRESS)
    parser.add_argument("--core", help=argparse.SUPPRESS)
    parser.add_argument("--partial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge:
        return _store_runs({name: _read_run(path) for name, path in
                            (item.split("=", 1) for item in args.merge)})
    if args.rank_of is not None:
        args.rank, args.ranks = args.rank_of, args.ranks[0]
        return _rank_main(args)
    trees = Path(args.trees).resolve()
    args.trees = str(trees)
    revisions = {"before": args.before, "after": args.after}
    for label, rev in revisions.items():
        _materialise(rev, label, trees)
    labels = ["before", "before_again", "after"]
    if args.now:
        _materialise(None, "now", trees)
        labels.append("now")
        revisions["now"] = "working tree"
    if args.prepare:
        return print(f"trees in {trees}")
    rows = []
    all_ranks = args.ranks
    for ranks in all_ranks:
        cores = (args.cores + [None] * ranks)[:ranks]
        t0 = time.perf_counter()
        one = argparse.Namespace(**{**vars(args), "ranks": ranks})
        rows += _rows(_run_ranks(one, labels, cores), labels, ranks, args.device)
        print(f"{ranks} rank(s) on {args.device}: {time.perf_counter() - t0:.0f} s", flush=True)
    columns = ["ranks", "device", "case"] + [f"{label}_us" for label in labels] + [
        f"{label}_added_us" for label in labels if label not in ("before", "before_again")] + [
        "after_added_paired_us", "noise_us", "spread_pct"]
    if any("error" in row for row in rows):
        columns.append("error")
    from benchmarks._common import environment, print_table
    print_table(rows, columns)
    payload = {"revisions": revisions, "calls": args.calls, "rounds": args.rounds,
               "cores": args.cores, "problem": dict(E=E, K=HIDDEN, I=I, topk=TOPK, ll_n=LL_N),
               "rows": rows}
    payload = {"environment": environment(), **payload}
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
        for ranks in all_ranks:  # the complete JSON supersedes the per-case dumps
            Path(f"{args.out}.{ranks}ranks.partial").unlink(missing_ok=True)
    else:
        _store_runs({args.name or f"{platform.node()}_{args.device}": payload})


def _read_run(path: str) -> dict:
    """A run's JSON (--out), or the rows of a .partial dump (a run cut short)."""
    data = json.loads(Path(path).read_text())
    if "times" not in data:
        return data
    rows = _rows(data["times"], data["labels"], data["ranks"], data["device"])
    return {"cut_short": "the cases finished before the run's time limit", "rows": rows}


def _store_runs(runs: dict) -> None:
    """Add runs to benchmarks/results/collective_safety.json, keeping the others there."""
    from benchmarks._common import RESULTS_DIR, write_json
    path = RESULTS_DIR / "collective_safety.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored.pop("environment", None)  # write_json's: the writer's, each run carries its own
    stored.setdefault("runs", {}).update(runs)
    write_json("collective_safety", stored)


if __name__ == "__main__":
    main()
