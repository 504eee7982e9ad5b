"""The one place that imports DeepEP (``deep_ep``), an optional dependency built from source.

``is_available()`` says whether it imports; ``require(backend)`` returns the module or raises a
``MissingLibraryError`` (an ``ImportError``) that names ``VLLM_ALL2ALL_BACKEND`` and DeepEP, so
that an engine configured for a DeepEP backend on a machine without it fails with a message saying
what to change.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from vllm_moe_fixes._compat import MissingLibraryError


@functools.cache
def _import() -> ModuleType | None:
    try:
        return importlib.import_module("deep_ep")
    except ImportError:
        return None


def is_available() -> bool:
    """Return True when ``import deep_ep`` succeeds."""
    return _import() is not None


def require(backend: str) -> ModuleType:
    """Return the ``deep_ep`` module, or raise ``MissingLibraryError`` explaining the choices.

    Arguments:
        backend: the all-to-all backend that needs DeepEP (e.g. ``"deepep_low_latency"``), quoted
            in the message.
    """
    module = _import()
    if module is None:
        raise MissingLibraryError(
            f"VLLM_ALL2ALL_BACKEND={backend} needs DeepEP (the deep_ep package), which is not "
            "installed: build DeepEP v1.2.1 from source (github.com/deepseek-ai/DeepEP), or set "
            "VLLM_ALL2ALL_BACKEND=naive to use the torch.distributed all-to-all instead",
            name="deep_ep")
    return module
