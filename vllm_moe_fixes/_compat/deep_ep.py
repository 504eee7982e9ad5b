"""The one place that imports DeepEP (``deep_ep``), an optional dependency built from source.

Two generations exist, and each backend needs its own:

- v1 (tag v1.2.1, the last release with only ``deep_ep.Buffer``, NVSHMEM): the backends
  ``deepep_high_throughput`` and ``deepep_low_latency``, sized by ``deepep_sizing``, which mirrors
  v1.2.1's tuned configs exactly.
- V2 (DeepEP main at dd758ca, ``deep_ep.__version__ == "2.1.0"``, NCCL Gin, kernels built by a
  JIT at first use): ``deep_ep.ElasticBuffer``, the backend ``deepep_v2``, sized by
  ``deepep_v2_sizing``. V2 still ships a legacy ``Buffer``, but with other tuned configs than
  v1.2.1's (its ``deep_ep/buffers/legacy.py`` tables differ at 24, 32, 64 and 128 ranks and add
  48 and 96), so the v1 backends refuse it rather than size against the wrong tables.

``installed_version()`` says which one imports (1, 2 or None); ``describe()`` says it in words;
``require(backend)`` returns the module, or raises a ``MissingLibraryError`` (an ``ImportError``)
that names ``VLLM_ALL2ALL_BACKEND`` and DeepEP when none imports, and its subclass
``DeepEPVersionError`` naming the generation the backend needs and the one installed when it is
the other one, so that an engine configured for a DeepEP backend fails with what to change.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from vllm_moe_fixes._compat import MissingLibraryError

V1_BACKENDS = ("deepep_high_throughput", "deepep_low_latency")
V2_BACKENDS = ("deepep_v2",)
_NEEDS = {1: "DeepEP v1.2.1 (deep_ep.Buffer; build the v1.2.1 tag from source)",
          2: "DeepEP V2 (deep_ep.ElasticBuffer; build DeepEP main from source, with NCCL "
             ">= 2.30.4, e.g. the nvidia-nccl-cu13 wheel)"}


class DeepEPVersionError(MissingLibraryError):
    """The backend asked for needs another DeepEP generation than the one installed (or none is)."""


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    """(the module, None), or (None, why it did not import: None when it is not installed). V2
    checks NCCL and starts its JIT at import, which raise more than ImportError on a broken
    install."""
    try:
        return importlib.import_module("deep_ep"), None
    except ImportError:
        return None, None
    except Exception as exc:  # noqa: BLE001 (V2's import-time asserts)
        return None, f"{type(exc).__name__}: {exc}"


def _import() -> ModuleType | None:
    return _load()[0]


def _import_error() -> str | None:
    return _load()[1]


def installed_version() -> int | None:
    """2 where ``deep_ep`` has ``ElasticBuffer`` (V2), 1 where it has only ``Buffer`` (v1), None
    where it does not import."""
    module = _import()
    if module is None:
        return None
    return 2 if hasattr(module, "ElasticBuffer") else 1


def is_available() -> bool:
    """Return True when ``import deep_ep`` succeeds (either generation)."""
    return installed_version() is not None


def describe() -> str:
    """Which DeepEP is installed, in words (for ``vllm-moe-fixes check``)."""
    module, why = _import(), _import_error()
    if module is None:
        return f"not importable ({why})" if why else "not installed"
    version = installed_version()
    tag = getattr(module, "__version__", None)
    api = "deep_ep.ElasticBuffer" if version == 2 else "deep_ep.Buffer"
    return f"DeepEP {'V2' if version == 2 else 'v1'}{f' {tag}' if tag else ''} ({api})"


def require(backend: str) -> ModuleType:
    """Return the ``deep_ep`` module for ``backend``, or raise ``MissingLibraryError`` (none
    imports) or ``DeepEPVersionError`` (the other generation is installed).

    Arguments:
        backend: the all-to-all backend that needs DeepEP: ``"deepep_high_throughput"`` or
            ``"deepep_low_latency"`` (v1.2.1) or ``"deepep_v2"`` (V2); quoted in the message.
    """
    if backend in V2_BACKENDS:
        needed, others = 2, ", ".join(V1_BACKENDS)
    elif backend in V1_BACKENDS:
        needed, others = 1, V2_BACKENDS[0]
    else:
        raise ValueError(f"backend={backend!r} is not a DeepEP backend; allowed: "
                         f"{', '.join(V1_BACKENDS + V2_BACKENDS)}")
    module, why = _import(), _import_error()
    if module is None:
        broken = f" (deep_ep is installed but does not import: {why})" if why else ""
        raise MissingLibraryError(
            f"VLLM_ALL2ALL_BACKEND={backend} needs {_NEEDS[needed]}, which is not "
            f"installed{broken}; or set VLLM_ALL2ALL_BACKEND=naive to use the torch.distributed "
            "all-to-all instead", name="deep_ep")
    installed = installed_version()
    if installed != needed:
        raise DeepEPVersionError(
            f"VLLM_ALL2ALL_BACKEND={backend} needs {_NEEDS[needed]}, but the installed deep_ep is "
            f"{describe()}: set VLLM_ALL2ALL_BACKEND to {others} (what this DeepEP serves), or "
            f"install {'V2' if needed == 2 else 'v1.2.1'}", name="deep_ep")
    return module


def is_deep_ep_buffer(buffer) -> bool:
    """Whether ``buffer`` is DeepEP's own (a class of the deep_ep package), not a torch stand-in."""
    return type(buffer).__module__.split(".")[0] == "deep_ep"
