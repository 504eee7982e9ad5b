"""``vllm-moe-fixes``: check the install, plan a DP/EP configuration, run one MoE layer, benchmark,
serve a model with vLLM and the plugin, write a tiny checkpoint to serve.

    vllm-moe-fixes check                       versions, GPU, libraries, env, backends, vLLM
    vllm-moe-fixes plan --model deepseek-r1 --dp 32 [--ep N] [--max-tokens T] [--backend B] [--json]
    vllm-moe-fixes demo [--world-size N] [--tokens M] [--seed S]   one layer vs the reference
    vllm-moe-fixes bench [--only AREA] [--plot-only]              benchmarks/ modules + PNG plots
    vllm-moe-fixes serve MODEL [vllm serve options]   ``vllm serve`` with VLLM_MOE_FIXES=1
    vllm-moe-fixes tiny-checkpoint DIR [--family F] [--seed S]   a tiny block-FP8 MoE checkpoint

Also ``python -m vllm_moe_fixes``. Exit status: 0 success, 1 a failed demo (a wrong result, or an
error while running the layer on any rank) or benchmark, 2 a bad argument or environment value, or a
backend the environment asks for that cannot run (found before anything runs), 141 the reader of
the output went away (``plan ... | head``): what a shell reports for a command SIGPIPE ended,
without a traceback; serve, once vLLM runs, ends with vLLM's own status. Integer arguments are
decimal digits only, as environment values are. Heavy imports (torch, Triton, the kernels, vLLM)
happen inside the subcommand that needs them: without torch, plan runs, check reports it missing
(status 2) and demo, bench and tiny-checkpoint refuse (status 2).
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm_moe_fixes.cli import bench, check, demo, plan, serve, tiny_checkpoint
from vllm_moe_fixes.cli._common import UsageError

# command -> its module: HELP, add_arguments(parser) and run(args) -> exit status.
COMMANDS = {"check": check, "plan": plan, "demo": demo, "bench": bench, "serve": serve,
            "tiny-checkpoint": tiny_checkpoint}
# Exit status after the output's reader went away: 128 + SIGPIPE, as a shell reports it.
EXIT_BROKEN_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-moe-fixes", description=(
        "Check the install, plan a DP/EP configuration, run one MoE layer, benchmark, serve a "
        "model with vLLM and the plugin, write a tiny checkpoint to try it on."))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP))
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _parse(argv: list[str]) -> argparse.Namespace:
    """The parsed arguments; everything after ``serve`` is vLLM's, kept as given (argparse would
    read vLLM's options as its own or reorder them)."""
    if argv[:1] == ["serve"]:
        return argparse.Namespace(command="serve", vllm_args=argv[1:])
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default sys.argv[1:]); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parse(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad argument (2), already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        status = COMMANDS[args.command].run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return status
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say to it
        _silence_stdout()
        return EXIT_BROKEN_PIPE

