"""The shared integer roundings (sizes.cdiv, align_up) and the MN-major scale helpers (ops.fp8)."""

import math

import pytest
import torch

from vllm_moe_fixes.ops.fp8 import empty_mn_major_scales, mn_major_scales_view
from vllm_moe_fixes.sizes import align_up, cdiv


@pytest.mark.parametrize("b", [1, 3, 4, 128, 2**21])
def test_cdiv_and_align_up_match_math_ceil(b):
    for a in [0, 1, 2, 3, 4, 5, 127, 128, 129, 2**21 - 1, 2**21 + 1, 10**18 + 7]:
        want = math.ceil(a / b) if a < 2**52 else (a + b - 1) // b  # exact past float range
        assert cdiv(a, b) == want
        assert align_up(a, b) == want * b
        assert align_up(a, b) % b == 0 and a <= align_up(a, b) < a + b


def test_align_up_on_an_integer_tensor():
    counts = torch.tensor([0, 1, 127, 128, 129, 300])
    assert align_up(counts, 128).tolist() == [0, 128, 128, 128, 256, 384]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 130])
def test_empty_mn_major_scales_strides(rows):
    s = empty_mn_major_scales((rows, 7), "cpu")
    assert s.shape == (rows, 7) and s.dtype == torch.float32
    assert s.stride() == (1, (rows + 3) // 4 * 4)
    s = empty_mn_major_scales((2, rows, 7), "cpu", tma_aligned=False)
    assert s.shape == (2, rows, 7) and s.stride() == (7 * rows, 1, rows)


def test_mn_major_scales_view_lays_scales_over_the_workspace_bytes():
    ws = torch.randn(64, 16, dtype=torch.bfloat16)  # 2048 bytes
    before = ws.clone()
    s = mn_major_scales_view(ws, 48, (2, 5, 3))  # [E, rows, groups] from byte 48 on
    assert s.shape == (2, 5, 3) and s.stride() == (15, 1, 5)
    values = torch.randn(2, 5, 3)
    s.copy_(values)
    raw = ws.view(-1).view(torch.uint8)
    # element (e, r, g) lives at float32 index e*15 + g*5 + r after byte 48
    got = raw[48:48 + 4 * 30].view(torch.float32).view(2, 3, 5).transpose(1, 2)
    assert torch.equal(got, values)
    untouched = torch.ones(2048, dtype=torch.bool)
    untouched[48:48 + 120] = False
    assert torch.equal(raw[untouched], before.view(-1).view(torch.uint8)[untouched])
