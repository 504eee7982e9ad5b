"""The shared Triton helpers: the host-side power of two against triton's, and the two device
roundings against torch's round-to-nearest-even casts on random, tie, subnormal and signed-zero
values (under the interpreter on CPU, compiled on a GPU), and the cached launch's keys."""

import pytest
import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops import triton_utils as tu
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


def test_launch_keys_separate_what_triton_specialises():
    """Arguments that Triton compiles differently get different key entries: integers equal to
    1, multiples of 16, 64-bit and negative 64-bit; tensor dtypes and 16-byte alignment; a bool
    from the int of the same value; constexpr values. Equal specialisations share an entry."""
    ints = [1, 2, 16, 32, 2**31, -2**31 - 1, 2**63]
    assert len({tu._arg_class(v) for v in ints}) == len(ints) - 1  # 16 and 32 alike
    assert tu._arg_class(7) == tu._arg_class(9) and tu._arg_class(0) == tu._arg_class(48)
    assert tu._arg_class(True) != tu._arg_class(1) and tu._arg_class(False) != tu._arg_class(0)
    assert tu._arg_class(None) != tu._arg_class(False) and tu._arg_class(1.0) == tu._arg_class(0.5)
    buf = torch.empty(64, dtype=torch.uint8)
    aligned = buf[16 - buf.data_ptr() % 16:]
    assert tu._arg_class(aligned) != tu._arg_class(aligned[1:])
    assert tu._arg_class(aligned) != tu._arg_class(aligned.view(torch.int8))
    assert tu._arg_class(aligned[16:]) == tu._arg_class(aligned)


def test_launch_goes_through_triton_once_per_key(monkeypatch):
    """Compiled (not interpreting): the first launch of a key goes through kernel[grid], later
    ones of the same key through the CompiledKernel with a 3-d grid and every argument; another
    specialisation of an argument goes through Triton again."""
    jit, runs = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            runs.append(args)

    class Kernel:
        def __getitem__(self, grid):
            def first(*args, num_warps, **options):
                jit.append((grid, args, num_warps, options))
                return Compiled()
            return first

    monkeypatch.setattr(tu, "INTERPRETING", False)
    monkeypatch.setattr(tu, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device,
                        raising=False)
    kernel, x = Kernel(), torch.empty(4)
    tu.launch(kernel, (2,), (x, 5, True), 4, enable_fp_fusion=False)
    assert jit == [((2, 1, 1), (x, 5, True), 4, {"enable_fp_fusion": False})] and not runs
    tu.launch(kernel, (3, 2), (x, 7, True), 4, enable_fp_fusion=False)
    assert len(jit) == 1 and runs == [(3, 2, 1, 1000, "fn", "meta", None, None, None, x, 7, True)]
    for args, warps, opts in (((x, 16, True), 4, {"enable_fp_fusion": False}),
                              ((x, 7, False), 4, {"enable_fp_fusion": False}),
                              ((x, 7, True), 8, {"enable_fp_fusion": False}),
                              ((x, 7, True), 4, {}),
                              ((x.int(), 7, True), 4, {"enable_fp_fusion": False})):
        tu.launch(kernel, (1,), args, warps, **opts)
    assert len(jit) == 6 and len(runs) == 1
