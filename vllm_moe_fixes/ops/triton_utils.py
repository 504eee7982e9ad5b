"""Helpers every Triton kernel of the package shares: the interpreter flag, a cheap host-side
power of two, and the device roundings the interpreter gets wrong. Nothing here quantises.
"""

import os

import triton
import triton.language as tl

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
