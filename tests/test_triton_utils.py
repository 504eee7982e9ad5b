"""The shared Triton helpers: the host-side power of two against triton's, and the two device
roundings against torch's round-to-nearest-even casts on random, tie, subnormal and signed-zero
values (under the interpreter on CPU, compiled on a GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX
from vllm_moe_fixes.ops.triton_utils import (
    next_power_of_2,
    round_to_bf16_grid,
    round_to_e4m3_grid,
)


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in range(1, 5000)] == [
        triton.next_power_of_2(n) for n in range(1, 5000)]


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, E4M3: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    if E4M3:
        r = round_to_e4m3_grid(v)
    else:
        r = round_to_bf16_grid(v)
    tl.store(out_ptr + i, r, mask=i < n)


def _values(limit: float, n: int, seed: int) -> torch.Tensor:
    """float32: random magnitudes over many binades, both signs, +-0, and exact ties of the
    target grids (a bf16 ulp half-way point, e4m3 normal and subnormal half-way points)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n).uniform_(-14, 8.7, generator=g))
    v = mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    ties = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4, 2.0**-10,
            3 * 2.0**-10, 2.0**-7 + 2.0**-10, 0.0, -0.0, limit, -limit]
    v = torch.cat([v, torch.tensor(ties), -torch.tensor(ties)])
    return v.clamp(-limit, limit)


@pytest.mark.parametrize("e4m3", [True, False])
@pytest.mark.parametrize("n", [1, 1000])
def test_roundings_match_torch_casts(e4m3, n, kernel_device):
    v = _values(FP8_MAX if e4m3 else 3e38, n, seed=n)
    want = v.to(FP8_DTYPE if e4m3 else torch.bfloat16).float()
    out = torch.full_like(v, float("nan"), device=kernel_device)
    _round_kernel[(triton.cdiv(v.numel(), 256),)](v.to(kernel_device), out, v.numel(),
                                                 E4M3=e4m3, BLOCK=256)
    got = out.cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 keeps its sign
