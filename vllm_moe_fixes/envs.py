"""Environment variables that select backends and sizes, read when accessed.

``vllm_moe_fixes.envs.VLLM_USE_DEEP_GEMM`` reads the environment at that moment, so a test or an
engine may change a variable between two reads. An unset (or empty) variable gives its default; a
value that does not parse raises ``ValueError`` naming the variable, the value and what is allowed,
on every path that reads it: a variable that matters on one device only is read on every device.

Every variable is one ``EnvVar`` in ``REGISTRY``; the README's table and ``vllm-moe-fixes check``
are generated from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALL2ALL_BACKENDS = ("naive", "deepep_high_throughput", "deepep_low_latency", "deepep_v2")

_TRUE = ("1", "true")
_FALSE = ("0", "false")


# Parsers take the raw text and raise ValueError with only the reason ("is not a boolean");
# EnvVar.read adds the variable, the value and what is allowed.
def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("is not a boolean (case is ignored)")


def parse_decimal(raw: str) -> int:
    """The integer ``raw`` spells in decimal digits only, surrounding whitespace allowed; ValueError
    otherwise. ``int()`` also takes signs, ``_`` separators and non-ASCII digits ("1_000", "+5",
    "\u0665"): a value written that way is more likely a typo than a size."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError("is not an integer (decimal digits only)")
    return int(text)


def _parse_positive_int(raw: str) -> int:
    value = parse_decimal(raw)
    if value <= 0:
        raise ValueError("is out of range")
    return value


def _parse_backend(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ALL2ALL_BACKENDS:
        raise ValueError("is not a known backend (case is ignored)")
    return value


_ENCODED_NAMES: dict[str, Any] = {}  # name -> os.environ's key for it


def _environ_get(name: str) -> str | None:
    """os.environ.get(name), read from os.environ's own mapping where it has one (CPython's
    os._Environ keeps its entries in ``_data`` under encoded names, and every write through
    os.environ lands there): one dict lookup, where os.environ.get of an unset variable raises
    and catches KeyError twice, a few microseconds on a slow host, and the layer reads three
    variables per call."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data is None:
        return environ.get(name)
    key = _ENCODED_NAMES.get(name)
    if key is None:
        key = _ENCODED_NAMES[name] = environ.encodekey(name)
    raw = data.get(key)
    return None if raw is None else environ.decodevalue(raw)


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, how it parses, its default, a one-line help text and
    the values it allows (shown in errors, ``check`` and the README's table)."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    allowed: str

    def read(self) -> Any:
        """The effective value; ValueError "NAME='raw' <reason>; allowed: ..." when it does not parse."""
        raw = _environ_get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r} {e}; allowed: {self.allowed}") from None


REGISTRY: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar("VLLM_ALL2ALL_BACKEND", _parse_backend, "naive",
               "all-to-all used by the expert-parallel prepare/finalize; naive = torch.distributed, "
               "deepep_* = DeepEP v1.2.1's two modes, deepep_v2 = DeepEP V2's ElasticBuffer",
               ", ".join(ALL2ALL_BACKENDS)),
        EnvVar("VLLM_USE_DEEP_GEMM", _parse_bool, False,
               "experts call DeepGEMM's grouped FP8 GEMMs (error if requested and not importable)",
               "0, 1, true, false"),
        EnvVar("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", _parse_bool, False,
               "randomise the token ids of dummy/profile runs when DP > 1 (balanced expert load)",
               "0, 1, true, false"),
        EnvVar("VLLM_MOE_DP_CHUNK_SIZE", _parse_positive_int, 256,
               "max tokens per rank per dispatch; sizes the low-latency DeepEP buffer",
               "integer > 0"),
        EnvVar("VLLM_DEEPEP_BUFFER_SIZE_MB", _parse_positive_int, 1024,
               "DeepEP NVLink buffer size in MiB (high-throughput mode)",
               "integer > 0"),
        # 8192: on an H200 (DeepSeek shapes, 8 local experts, DeepGemmExperts, M=32768) time per
        # token is flat from chunks of 2048 to 32768 tokens (677-707 ns; 8192 the fastest) while
        # the peak grows with the chunk: 1.9 GiB at 8192 against 6.1 GiB in one pass
        # (benchmarks/results/experts_chunks.json).
        EnvVar("VLLM_FUSED_MOE_CHUNK_SIZE", _parse_positive_int, 8192,
               "max tokens one pass of the experts takes: larger calls loop over chunks, and the "
               "contiguous experts take what a rank received in passes of this many tokens "
               "(bounds workspace memory whatever the routing)",
               "integer > 0"),
        EnvVar("VLLM_MOE_CHECK_IDS", _parse_bool, False,
               "check topk_ids / expert_map ranges of CUDA inputs at the layer's edge, and that "
               "grouped_topk's correction bias is finite (one host sync per call; CPU inputs are "
               "always checked)",
               "0, 1, true, false"),
        EnvVar("VLLM_MOE_CHECK_FINITE", _parse_bool, False,
               "refuse NaN / inf in hidden_states, topk_weights, w1, w2, w1_scale, w2_scale at "
               "the layer's edge (one host sync per call on CUDA; the weights and scales read "
               "once per tensor version; unchecked they come out finite or reach the output, see "
               "the layer's docstring)",
               "0, 1, true, false"),
        EnvVar("VLLM_MOE_FIXES", _parse_bool, False,
               "vLLM plugin: vLLM's block-FP8 FusedMoE layers run this library's kernels "
               "(vllm_moe_fixes.integrations.vllm)",
               "0, 1, true, false"),
    )
}


def __getattr__(name: str) -> Any:
    var = REGISTRY.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(REGISTRY))


def values_checked_on(device) -> bool:
    """Whether the value checks of layer inputs (topk_ids and expert_map ranges, a finite routing
    bias) run for tensors on ``device`` (a ``torch.device``): always on the CPU, where reading
    values costs no device synchronisation; on CUDA only with VLLM_MOE_CHECK_IDS=1. The variable
    is read, and so validated, on every device alike."""
    enabled = REGISTRY["VLLM_MOE_CHECK_IDS"].read()
    return enabled or device.type != "cuda"


def current_values() -> dict[str, Any]:
    """Return {name: effective value} for every registered variable (raises on a bad value)."""
    return {name: var.read() for name, var in REGISTRY.items()}
