"""Helpers every Triton kernel of the package shares: the interpreter flag, a cheap host-side
power of two, the device roundings the interpreter gets wrong, and a launch that skips Triton's
per-call argument binding (`KernelLauncher`, one per kernel; `launch` for a one-off call site).
Nothing here quantises.
"""

import operator
import os

import torch
import triton
import triton.language as tl
from triton import knobs

# Triton chooses between compiling and interpreting when a kernel is decorated (at import), so the
# launchers read the same decision once, here, instead of the environment on every call.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1). Plain Python on purpose: triton.next_power_of_2 and
    triton.cdiv are ConstexprFunction objects in triton 3.6 and 3.9 and cost ~2 us per host call."""
    return 1 << (n - 1).bit_length()


@triton.jit
def round_to_bf16_grid(v):
    """Round float32 v to the nearest bfloat16 value (ties to even), still in float32.

    Triton 3.9's interpreter truncates float32 -> bfloat16 casts (round toward zero); the GPU
    rounds to nearest even. Kernels that store bfloat16 call this first under the interpreter
    (a constexpr flag), so the cast that follows is exact. Integer-only: add half a bf16 ulp minus
    one plus the kept lowest bit (round-to-nearest-even on the bit pattern), clear 16 bits.
    """
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3_grid(v):
    """Round float32 v (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, in float32.

    Works on the magnitude's bits and ORs the sign bit back at the end, so every result, -0.0
    included, has v's sign on any backend (a negation `-t` may compile to `0.0 - t`, which turns
    -0.0 into +0.0). Normals (|v| >= 2**-6) keep 3 of float32's 23 mantissa bits: add half an e4m3
    ulp minus one plus the kept lowest bit (round-to-nearest-even on the bit pattern), then clear
    the 20 dropped bits; a carry moves into the exponent as it should. Subnormals (|v| < 2**-6)
    sit on a fixed 2**-9 grid: |v| + 1.5 * 2**14 has a float32 ulp of exactly 2**-9, so the IEEE
    add rounds |v| to that grid (ties to even) and the subtraction is exact.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576
    a = mag.to(tl.float32, bitcast=True)
    tiny = ((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    return (tl.where(a < 0.015625, tiny, normal) | sign).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- launch without Triton's binder
# `kernel[grid](*args)` re-derives the specialisation of every argument, hashes a cache key,
# reads Triton's option knobs and builds launch metadata on each call: tens of microseconds of
# host time, the whole cost of a small-M launch. A KernelLauncher sends the first launch of each
# specialisation through it and keeps the CompiledKernel that launch returns; later launches call
# that kernel's launcher directly, as Triton itself does after its cache lookup (triton 3.6, 3.9).
#
# Two caches, both per launcher and per device:
#   by value: (num_warps, tensor dtypes, the low 4 bits of each data pointer, the scalars as
#       given) -> launch entry. Hashing a tuple is one C call, so a hit costs one lookup; the key
#       is finer than Triton's specialisation (never too coarse). It holds one entry per shape
#       and stride combination seen and is emptied when it passes _MAX_BY_VALUE entries.
#   by class: what Triton specialises on (_arg_class: dtypes and 16-byte alignment, `_int_class`
#       of each runtime integer, float; the value of every constexpr parameter, read from the
#       kernel's signature: BLOCK 128 and 1024 share an int class but not a kernel) -> the same
#       entry; consulted on a by-value miss, so a new M reuses the compiled kernel without
#       Triton's binder.
# The launch passes each tensor as its data pointer (an int, which Triton's launcher takes as
# is): Triton would call data_ptr() and ask the driver about the pointer again. The caller
# guarantees CUDA tensors on the current device (the public ops check the device). It calls
# Triton's C launch function itself (`_direct_launch`), skipping the Python wrapper around it.
# Option knobs read from the environment (TRITON_DEBUG, ...) are those of the first launch of each
# specialisation. While a launch hook is installed (a profiler), every launch goes through Triton
# so that the hook sees it.

_MAX_BY_VALUE = 4096
_TRITON_VERSION = tuple(int(v) for v in triton.__version__.split(".")[:2])
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_LOW_BITS = (15).__and__  # p & 15: the part of a pointer Triton's alignment check reads


def _int_class(v: int) -> int:
    """What Triton's specialisation reads of an integer argument: equal to 1 (then a compile-time
    constant), a multiple of 16 (a divisibility hint), or its type (int32, int64, uint64)."""
    return (v == 1) + 2 * (v % 16 == 0) + 4 * (v >= 2**31) + 8 * (v < -2**31) + 16 * (v >= 2**63)


def _arg_class(a):
    """One runtime argument's share of a by-class key (what Triton specialises on, see above)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:  # noqa: E721 (a bool is a constexpr or an i1, keyed by its value)
        return _int_class(a)
    if type(a) is float:  # noqa: E721 (every float is an fp32 argument)
        return float
    return type(a), a  # bool, None, ...: by value


def _constexpr_flags(kernel) -> tuple:
    """Which of the kernel's parameters are constexprs, in signature order; () where the kernel
    does not say (then every scalar is keyed by value)."""
    return tuple(bool(p.is_constexpr) for p in getattr(kernel, "params", ()))


def _hooked() -> bool:
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def _direct_launch(compiled):
    """f(gx, gy, gz, stream, *args) launching `compiled` (a CompiledKernel) with Triton's C launch
    function, without the Python wrapper around it (CudaLauncher.__call__, which allocates scratch
    memory, none for kernels that need none, and forwards). Done for the wrapper layouts known
    here, triton 3.6 (the arguments flat) and 3.9 (a tuple, with annotations saying which are
    constexprs), and only for kernels without scratch memory; otherwise f calls the wrapper."""
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    launch = getattr(run, "launch", None)
    plain = (launch is not None and getattr(run, "global_scratch_size", 1) == 0
             and getattr(run, "profile_scratch_size", 1) == 0
             and not getattr(run, "gsan_enabled", False))
    if plain and _TRITON_VERSION == (3, 6):
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl

        def flat(gx, gy, gz, stream, *args):  # scratch x2, metadata, launch metadata, hooks x2
            launch(gx, gy, gz, stream, function, coop, pdl, None, None, metadata, None, None, None,
                   *args)
        return flat
    elif plain and _TRITON_VERSION == (3, 9):
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        annotations, signature = run.arg_annotations, run.kernel_signature

        def as_tuple(gx, gy, gz, stream, *args):  # metadata, launch metadata, hooks x2, scratch x2
            launch(gx, gy, gz, stream, function, coop, pdl, metadata, None, None, None, None, None,
                   annotations, signature, args)
        return as_tuple

    def through_wrapper(gx, gy, gz, stream, *args):
        run(gx, gy, gz, stream, function, metadata, None, None, None, *args)
    return through_wrapper


class KernelLauncher:
    """Launches one @triton.jit kernel at the host cost of a dict lookup (see above).

    The kernel's parameters must be its tensors first, then its other arguments (ints, floats,
    bools, None; constexprs included), the layout of every kernel in ops/. options
    (enable_fp_fusion=False, ...) go to Triton's compile; they are fixed per launcher.
    """

    def __init__(self, kernel, **options):
        self.kernel = kernel
        self.options = options
        self._by_value: dict = {}  # by-value key -> _direct_launch of the compiled kernel
        self._by_class: dict = {}
        self._constexpr = _constexpr_flags(kernel)

    def __call__(self, grid: tuple, num_warps: int, tensors: tuple, scalars: tuple) -> None:
        """kernel[grid](*tensors, *scalars, num_warps=num_warps, **options) on the current CUDA
        stream (through Triton under the interpreter).

        grid: 3 ints; tensors: CUDA tensors on the current device (no None: an unused optional
        pointer gets a stand-in tensor and a constexpr flag); scalars: the remaining parameters in
        signature order, each slot always of one type (the by-value key compares 1 == True).
        """
        if INTERPRETING:
            self.kernel[grid](*tensors, *scalars, num_warps=num_warps, **self.options)
            return
        device = torch._C._cuda_getDevice()
        ptrs = tuple(map(_DATA_PTR, tensors))
        key = (device, num_warps, *map(_DTYPE, tensors), *map(_LOW_BITS, ptrs), *scalars)
        entry = self._by_value.get(key)
        if entry is None or _hooked():
            entry = self._first_launch(key, grid, num_warps, tensors, scalars)
            if entry is None:
                return
        entry(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), *ptrs,
              *scalars)

    def _class_key(self, device, num_warps, tensors, scalars) -> tuple:
        """What Triton specialises on (see above): constexpr parameters by value."""
        flags = self._constexpr[len(tensors):]
        if len(flags) != len(scalars):  # the kernel does not say: every scalar by value
            flags = (True,) * len(scalars)
        return (device, num_warps, *map(_arg_class, tensors),
                *((type(s), s) if const else _arg_class(s) for s, const in zip(scalars, flags)))

    def _first_launch(self, key, grid, num_warps, tensors, scalars):
        """The launch entry of a by-value miss: from the by-class cache, or from a launch through
        Triton (then None is returned: that launch ran). Every launch under a hook goes here."""
        for s in scalars:
            if isinstance(s, torch.Tensor):
                raise ValueError(f"{self.kernel.__name__}: a tensor among the scalar arguments "
                                 f"(tensors come first in the kernel's signature)")
        class_key = self._class_key(key[0], num_warps, tensors, scalars)
        entry = self._by_class.get(class_key)
        if entry is None or _hooked():
            compiled = self.kernel[grid](*tensors, *scalars, num_warps=num_warps, **self.options)
            entry = self._by_class[class_key] = _direct_launch(compiled)
            launched = True
        else:
            launched = False
        if len(self._by_value) >= _MAX_BY_VALUE:
            self._by_value.clear()
        self._by_value[key] = entry
        return None if launched else entry


# (kernel, options) -> its KernelLauncher, for `launch`
_LAUNCHERS: dict = {}


def launch(kernel, grid: tuple, args: tuple, num_warps: int, **options) -> None:
    """kernel[grid](*args, num_warps=num_warps, **options) through the kernel's KernelLauncher
    (one per kernel and options). args: every parameter of the kernel in signature order,
    constexprs included, tensors first; grid: 1 to 3 ints. KernelLauncher's call skips the
    search for where the tensors end; the per-layer kernels of ops/ use it directly."""
    launcher_key = (kernel, *options.items())
    launcher = _LAUNCHERS.get(launcher_key)
    if launcher is None:
        launcher = _LAUNCHERS[launcher_key] = KernelLauncher(kernel, **options)
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    launcher((*grid, 1, 1)[:3], num_warps, args[:n], args[n:])
