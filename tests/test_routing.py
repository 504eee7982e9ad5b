"""fused_topk: softmax top-k routing against torch's softmax and gather."""

import pytest
import torch

from vllm_moe_fixes.fused_moe.routing import fused_topk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_topk(dtype, renormalize):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 16, generator=g).to(dtype)
    w, ids = fused_topk(logits, 6, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (37, 6)
    probs = torch.softmax(logits.float(), -1)
    expected = torch.gather(probs, 1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(w.sum(-1), torch.ones(37))
    torch.testing.assert_close(w, expected)
    assert (w[:, :-1] >= w[:, 1:]).all()
    assert torch.equal(ids[:, 0], probs.argmax(-1))


def test_fused_topk_errors():
    with pytest.raises(ValueError, match="topk"):
        fused_topk(torch.randn(3, 4), 5, False)
    with pytest.raises(ValueError, match="topk"):
        fused_topk(torch.randn(3, 4), 0, False)
    with pytest.raises(ValueError, match="gating_output"):
        fused_topk(torch.randn(3, 4, 2), 1, False)
    with pytest.raises(ValueError, match="gating_output"):
        fused_topk(torch.ones(3, 4, dtype=torch.int64), 1, False)
