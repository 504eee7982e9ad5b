"""Helpers every Triton kernel of the package shares: the interpreter flag, a cheap host-side
power of two, the device roundings the interpreter gets wrong, and a launch that skips Triton's
per-call argument binding (`launch`). Nothing here quantises.
"""

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
# host time, the whole cost of a small-M launch. The first launch of a specialisation goes through
# it and returns the CompiledKernel; later launches with the same specialisation call that
# kernel's launcher directly, as Triton itself does after its cache lookup (triton 3.6 and 3.9).
# The key holds what Triton's specialisation reads of the arguments: tensor dtypes and 16-byte
# alignment, `_int_class` of each integer, the constexprs, num_warps, the options and the device.
# Option knobs read from the environment (TRITON_DEBUG, ...) are those of the first launch of each
# key. While a launch hook is installed (a profiler), every launch goes through Triton so that the
# hook sees it.

def _int_class(v: int) -> int:
    """What Triton's specialisation reads of an integer argument: equal to 1 (then a compile-time
    constant), a multiple of 16 (a divisibility hint), or its type (int32, int64, uint64)."""
    return (v == 1) + 2 * (v % 16 == 0) + 4 * (v >= 2**31) + 8 * (v < -2**31) + 16 * (v >= 2**63)


def _hooked() -> bool:
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)


def _launch_compiled(kernel, cache: dict, key: tuple, grid: tuple, args: tuple,
                     num_warps: int, **options) -> None:
    """Launch `kernel` on `grid` (3 ints) with `args` (every parameter, in signature order,
    constexprs included) on the current CUDA stream: through Triton the first time `key` is
    seen, then through the CompiledKernel that launch returned. key[0] is the current device's
    index. options (enable_fp_fusion=False, ...) go to Triton's first launch; the key must hold
    them."""
    compiled = cache.get(key)
    if compiled is None or _hooked():
        cache[key] = kernel[grid](*args, num_warps=num_warps, **options)
        return
    compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(key[0]),
                 compiled.function, compiled.packed_metadata, None, None, None, *args)


def _arg_class(a):
    """One argument's share of a launch key (what Triton specialises on, see above)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:  # noqa: E721 (a bool is a constexpr or an i1, keyed by its value)
        return _int_class(a)
    if type(a) is float:  # noqa: E721 (every float is an fp32 argument)
        return float
    return type(a), a  # constexprs (bool, None, ...): by value


# launch key -> CompiledKernel; a key starts with the device index and the kernel's id (kernels
# are module-level objects that live as long as the process)
_COMPILED: dict = {}


def launch(kernel, grid: tuple, args: tuple, num_warps: int, **options) -> None:
    """kernel[grid](*args, num_warps=num_warps, **options) with the host cost of a cached
    launch (`_launch_compiled`) on CUDA; through Triton under the interpreter. args: every
    parameter of the kernel in signature order, constexprs included, as positional values
    (tensors, ints, floats, bools, None); grid: 1 to 3 ints."""
    grid = (*grid, 1, 1)[:3]
    if INTERPRETING:
        kernel[grid](*args, num_warps=num_warps, **options)
        return
    key = (torch.cuda.current_device(), id(kernel), num_warps, *options.items(),
           *map(_arg_class, args))
    _launch_compiled(kernel, _COMPILED, key, grid, args, num_warps, **options)
