"""DeepGEMM, optional: the only module that imports it.

DeepGEMM renamed its Python API on 2025-07-18 (v2.x) and renamed the 4th argument of the contiguous
GEMM (`m_indices` -> `grouped_layout`) later, so names are resolved once, here, at import:

    ours (new name first)             before 2025-07-18
    m_grouped_fp8_gemm_nt_contiguous  m_grouped_gemm_fp8_fp8_bf16_nt_contiguous
    m_grouped_fp8_gemm_nt_masked      m_grouped_gemm_fp8_fp8_bf16_nt_masked
        (v2.x also: fp8_m_grouped_gemm_nt_masked)
    get_mk_alignment_for_contiguous_layout   get_m_alignment_for_contiguous_layout

The grouped layout / m_indices is always passed positionally, and `disable_ue8m0_cast=True` is
passed where the function takes it: this library hands DeepGEMM float32 scales, which only its SM90
kernels consume. On SM100 DeepGEMM wants UE8M0 (power-of-two, packed int32) scales: with the cast
disabled it fails in every call, and with it enabled it would round every scale up to a power of two
(other numerics than the Triton experts and the reference). So a GPU other than SM90 is refused with
a RuntimeError naming its architecture and VLLM_USE_DEEP_GEMM, once per device (``require`` at the
experts' construction; the GEMM wrappers look the cached verdict up by device).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from types import SimpleNamespace
from typing import Any

from vllm_moe_fixes._compat import MissingLibraryError

_NAMES = {
    "contiguous": ("m_grouped_fp8_gemm_nt_contiguous",
                   "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"),
    "masked": ("m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
               "m_grouped_gemm_fp8_fp8_bf16_nt_masked"),
    "alignment": ("get_mk_alignment_for_contiguous_layout",
                  "get_m_alignment_for_contiguous_layout"),
    "get_pdl": ("get_pdl",),
    "set_pdl": ("set_pdl",),
}


def _takes_kwarg(fn: Any, name: str) -> bool:
    """Whether `fn` accepts keyword `name` (pybind11 functions have no signature, only a
    docstring)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return name in (getattr(fn, "__doc__", None) or "")


def resolve(module: Any) -> SimpleNamespace:
    """Pick the first name of each row of _NAMES that `module` has (None where none is found).

    Returns a namespace with contiguous, masked, alignment, get_pdl, set_pdl (callables or None) and
    contiguous_ue8m0_kwarg / masked_ue8m0_kwarg (whether to pass disable_ue8m0_cast=True).
    """
    found = {key: next((getattr(module, n) for n in names if hasattr(module, n)), None)
             for key, names in _NAMES.items()}
    for key in ("contiguous", "masked"):
        fn = found[key]
        found[f"{key}_ue8m0_kwarg"] = fn is not None and _takes_kwarg(fn, "disable_ue8m0_cast")
    return SimpleNamespace(**found)


try:  # a broken build can fail with more than ImportError (missing CUDA libraries, ...)
    import deep_gemm as _deep_gemm
    _IMPORT_ERROR: BaseException | None = None
except Exception as exc:  # noqa: BLE001
    _deep_gemm = None
    _IMPORT_ERROR = exc

_API = resolve(_deep_gemm) if _deep_gemm is not None else None


def is_available() -> bool:
    """True when deep_gemm imported and has a contiguous grouped FP8 GEMM under a known name."""
    return _API is not None and _API.contiguous is not None


def _api(what: str) -> SimpleNamespace:
    """The resolved API, or MissingLibraryError naming VLLM_USE_DEEP_GEMM and DeepGEMM."""
    if is_available():
        return _API
    why = (f"import failed: {_IMPORT_ERROR!r}" if _IMPORT_ERROR is not None
           else "deep_gemm has no known grouped FP8 GEMM function")
    raise MissingLibraryError(
        f"{what} needs DeepGEMM (VLLM_USE_DEEP_GEMM=1 asks for it), but it is not usable: {why}. "
        "Build DeepGEMM from source (github.com/deepseek-ai/DeepGEMM; the PyPI 'deep-gemm' package "
        "is a broken snapshot) or set VLLM_USE_DEEP_GEMM=0 to use the Triton experts.",
        name="deep_gemm")


@functools.cache
def _arch_refusal(device_index: int) -> str | None:
    """Why DeepGEMM with float32 scales cannot run on CUDA device ``device_index`` (None if it
    can)."""
    import torch
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor} ({torch.cuda.get_device_name(device_index)})"
    if major == 9:
        return None
    if major == 10:
        return (f"on {arch} DeepGEMM wants UE8M0-packed scales, and this library passes float32 "
                "scales (disable_ue8m0_cast=True), which only its SM90 kernels take")
    return f"DeepGEMM's FP8 grouped GEMMs run on SM90 (float32 scales) only, not on {arch}"


def check_device(what: str, device=None) -> None:
    """Raise RuntimeError (naming the GPU architecture and VLLM_USE_DEEP_GEMM) when DeepGEMM cannot
    run on ``device`` (a torch.device or CUDA index; default the current CUDA device). Nothing is
    checked for CPU devices or without CUDA; the verdict is cached per device."""
    import torch
    if device is None:
        if not torch.cuda.is_available():
            return
        device = torch.cuda.current_device()
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return
        device = device.index if device.index is not None else torch.cuda.current_device()
    why = _arch_refusal(device)
    if why is not None:
        raise RuntimeError(f"{what} cannot run on CUDA device {device}: {why}. "
                           "Set VLLM_USE_DEEP_GEMM=0 to use the Triton experts.")


def require(what: str = "DeepGemmExperts") -> SimpleNamespace:
    """Return the resolved API, or raise MissingLibraryError naming VLLM_USE_DEEP_GEMM and
    DeepGEMM when DeepGEMM is not usable, or RuntimeError when the current CUDA device is not SM90
    (``check_device``)."""
    api = _api(what)
    check_device(what)
    return api


@functools.cache
def _takes_psum_layout(contiguous: Any) -> bool:
    """Whether this build's contiguous GEMM takes use_psum_layout (DeepGEMM v2.x, 2025-10 on)."""
    return _takes_kwarg(contiguous, "use_psum_layout")


@functools.cache
def _takes_expected_m(contiguous: Any) -> bool:
    """Whether this build's contiguous GEMM takes expected_m_for_psum_layout (v2.6 on)."""
    return _takes_kwarg(contiguous, "expected_m_for_psum_layout")


def contiguous_layout_form() -> str:
    """Which form of the contiguous layout m_grouped_fp8_gemm_nt_contiguous hands DeepGEMM when it
    is given expert_ends: "psum" (the build takes use_psum_layout) or "m_indices"."""
    return "psum" if _takes_psum_layout(_api("DeepGemmExperts").contiguous) else "m_indices"


def m_grouped_fp8_gemm_nt_contiguous(a, b, out, m_indices, expert_ends=None, *,
                                     expected_m: int | None = None) -> None:
    """DeepGEMM's contiguous grouped FP8 GEMM: out[i] = a[i] @ b[m_indices[i]]^T.

    a: (float8_e4m3fn [M_sum, K], float32 [M_sum, K/128] MN-major TMA-aligned scales);
    b: (float8_e4m3fn [E, N, K], float32 [E, N/128, K/128]); out: bf16 [M_sum, N] (written);
    m_indices: int32 [M_sum], -1 on padding rows (undefined output there).
    expert_ends: optional int32 [E], the same layout as psum ends (expert e's rows are
    [align128(expert_ends[e-1]), expert_ends[e])). Given, and where the build takes
    use_psum_layout, DeepGEMM gets that form: it then schedules only the 128-row blocks that hold
    rows, where with m_indices it loads A and B for every block of M_sum (padding blocks
    included). Output rows outside the experts' rows are undefined either way.
    expected_m: rows per expert the caller expects, for DeepGEMM's choice of tiles in the psum
    form (where the build takes it): without it DeepGEMM sizes its tiles for one group of M_sum
    rows, padding included. Ignored in the m_indices form.
    """
    api = _api("DeepGemmExperts")
    check_device("DeepGemmExperts", a[0].device)
    kwargs = {"disable_ue8m0_cast": True} if api.contiguous_ue8m0_kwarg else {}
    if expert_ends is not None and _takes_psum_layout(api.contiguous):
        if expected_m is not None and _takes_expected_m(api.contiguous):
            kwargs["expected_m_for_psum_layout"] = max(1, int(expected_m))
        api.contiguous(a, b, out, expert_ends, use_psum_layout=True, **kwargs)
    else:
        api.contiguous(a, b, out, m_indices, **kwargs)


def get_pdl() -> bool | None:
    """DeepGEMM's programmatic-dependent-launch setting (process-wide), None where the build has
    none or DeepGEMM is not usable."""
    get = _API.get_pdl if is_available() else None
    return None if get is None else bool(get())


@contextlib.contextmanager
def pdl_set_to(enabled: bool | None):
    """DeepGEMM's PDL setting `enabled` for the launches inside, the process's setting restored
    after (another library in the process, vLLM for one, sets it for its own calls). None, or a
    build without the setting: nothing changes."""
    before = None if enabled is None else get_pdl()
    if before is None or before == enabled or _API.set_pdl is None:
        yield
        return
    _API.set_pdl(enabled)
    try:
        yield
    finally:
        _API.set_pdl(before)


# device -> (the resolved API, the keywords to pass) where the masked GEMM's checks
# (_masked_call_on) have passed for that API: a decode step calls the GEMM twice per layer, and
# the checks cost host time; the API and a device's architecture do not change in a process.
_MASKED_READY: dict = {}


def _masked_call_on(device) -> tuple:
    """(the resolved API, the keywords of its masked GEMM call) for operands on `device` (a
    torch.device), after the checks of m_grouped_fp8_gemm_nt_masked."""
    api = _api("BatchedDeepGemmExperts")
    if api.masked is None:
        raise RuntimeError("this DeepGEMM build has no masked grouped FP8 GEMM under a known name")
    check_device("BatchedDeepGemmExperts", device)
    ready = _MASKED_READY[device] = (
        api, {"disable_ue8m0_cast": True} if api.masked_ue8m0_kwarg else {})
    return ready


def m_grouped_fp8_gemm_nt_masked(a, b, out, masked_m, expected_m: int) -> None:
    """DeepGEMM's masked grouped FP8 GEMM over [E, T, K]; rows >= masked_m[e] of out[e] untouched.

    a: (float8_e4m3fn [E, T, K], float32 [E, T, K/128] MN-major per expert); b as above;
    out: bf16 [E, T, N]; masked_m: int32 [E]; expected_m: typical rows per expert (tiling hint).

    MissingLibraryError without DeepGEMM, RuntimeError without a masked GEMM in the build or on a
    GPU other than SM90 (checked at the first call on each device).
    """
    device = a[0].device
    ready = _MASKED_READY.get(device)
    if ready is None or ready[0] is not _API:
        ready = _masked_call_on(device)
    ready[0].masked(a, b, out, masked_m, expected_m, **ready[1])


def get_m_alignment_for_contiguous_layout() -> int:
    """Row alignment of each expert segment in the contiguous layout (128 in every release)."""
    api = _api("DeepGemmExperts")
    return int(api.alignment()) if api.alignment is not None else 128
